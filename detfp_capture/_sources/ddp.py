"""DDP's gradient reduction, recorded per parameter through a comm hook of our own.

DistributedDataParallel's C++ reducer issues the gradient all-reduce, unseen by the collective
wrappers. So a DDP model around a watched module, whichever was created first (``watch(ddp)``,
or ``watch(model)`` with the wrapper made before or after the session: found at its first
forward), gets a comm hook that performs the built-in path's numerics (each gradient multiplied
by 1/world_size, then a sum all-reduce; bitwise identical, tested) and records, per parameter,
the gradient as the bucket held it before the reduction and after it (kind ``reduced_grad``).

A bucket is DDP's packing of gradients, and its layout is not stable: DDP rebuilds its buckets
after the first iteration, so a resumed run's first step packs them differently from the
uninterrupted run's, and a bucket becomes ready whenever its last gradient does. So neither the
bucket nor the hook's own ops are records, and every record joins the stream at the end of the
backward (the scope's engine callback waits for the bucket futures DDP waits for anyway), in
parameter-name order: the same stream whatever the packing and timing.

At level ops DDP's own work around the model's forward (``_pre_forward``/``_post_forward``:
rebuilding buckets, syncing buffers) is not the model's computation, and when it happens depends
on the process (a resumed run rebuilds one step later): its ops are not recorded.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch

from detfp_capture import digest
from detfp_capture._recorder.slot import Slot, dtype_str
from detfp_capture._sources.collectives import CollectiveTracer
from detfp_capture._sources.context import CaptureContext
from detfp_capture._sources.patches import Patches, unrecorded

__all__ = ["DDPReduction"]


def _started(t: torch.Tensor) -> tuple[str, tuple[int, ...], int, Slot]:
    """(dtype, shape, numel, Slot) of a gradient whose digest starts now (``append_started``)."""
    return dtype_str(t.dtype), tuple(t.shape), t.numel(), Slot(digest.start(t))


class DDPReduction:
    """The recording comm hook of every DDP model around a watched module."""

    def __init__(self, ctx: CaptureContext, tracer: CollectiveTracer) -> None:
        self.ctx = ctx
        self.rec = ctx.rec
        self.scope = ctx.scope
        self.tracer = tracer
        self.hooked: set[int] = set()
        self.futures: list[Any] = []  # bucket futures of the running backward

    def install(self, patches: Patches, is_watched: Callable[[object], bool]) -> None:
        """While the session is open, wrap DistributedDataParallel's forward (a DDP around a
        watched module gets the hook at its first forward, before any backward; a class patch,
        not a global module hook, which would make torch.compile warn about every module) and,
        at level ops, its bookkeeping (digests waiting for a batch are taken before it, and
        cached ones dropped after it: it writes buffers unseen)."""
        try:
            from torch.nn.parallel import DistributedDataParallel as DDP
        except Exception:
            return
        rec = self.rec
        hooked = self.hooked
        models = self.ctx.models

        def wrap_forward(orig: Any) -> Any:
            def forward(ddp: Any, *a: Any, **k: Any) -> Any:
                if (
                    not torch.compiler.is_compiling()  # first: a compiled DDP guards on what is read
                    and id(ddp) not in hooked
                    and is_watched(getattr(ddp, "module", None))
                    and not rec.closed
                ):
                    with rec.guard("hooking a DistributedDataParallel wrapper", busy=False):
                        models.name_params(ddp)
                        self.maybe_hook(ddp)
                return orig(ddp, *a, **k)

            forward.__wrapped__ = orig  # type: ignore[attr-defined]
            return forward

        patches.wrap(DDP, "forward", wrap_forward)
        if self.ctx.caps.ops:
            patches.wrap(DDP, "_pre_forward", unrecorded(rec, self.scope))  # bucket rebuilds, buffer syncs
            patches.wrap(DDP, "_post_forward", unrecorded(rec, self.scope))

    def maybe_hook(self, model: Any) -> None:
        """Register the hook if ``model`` is a DistributedDataParallel."""
        try:
            from torch.nn.parallel import DistributedDataParallel
        except Exception:
            return
        if isinstance(model, DistributedDataParallel):
            self.hook(model)

    def hook(self, model: Any) -> bool:
        """Register the recording comm hook on a DDP model (once); False when it already has a hook."""
        if id(model) in self.hooked:
            return True
        pg = getattr(model, "process_group", None)
        from torch.distributed import distributed_c10d as c10d

        allreduce = c10d.all_reduce  # the original: recorded through its parameters, not as a collective
        rec = self.rec
        scope = self.scope

        def hook(state: Any, bucket: Any) -> torch.futures.Future:
            group = state if state is not None else c10d._get_default_group()
            buf = bucket.buffer()
            rec.settle()
            before = self._before(group, bucket) if rec.live else None
            # The built-in path multiplies each gradient by 1/world_size while copying it into the
            # bucket, then sums: the same elementwise product here gives bitwise identical results.
            # These ops belong to the reduction, recorded per parameter: as ops they would follow
            # DDP's bucket layout, which a resumed run's first step packs differently.
            scope.bookkeeping += 1
            try:
                buf.mul_(1.0 / group.size())
                fut = allreduce(buf, group=group, async_op=True).get_future()
            finally:
                scope.bookkeeping -= 1

            def done(f: torch.futures.Future) -> torch.Tensor:
                out = f.value()[0]
                if before is not None:
                    self._after(before, bucket)
                return out

            chained = fut.then(done)
            if before is not None:
                # At the end of the backward (an engine callback, on the thread that ran it) the
                # scope waits for all of them (wait_buckets) and the records are appended.
                self.futures.append(chained)
                scope.note_backward()
            return chained

        # DDP validates annotations against real types; postponed (string) annotations would fail.
        hook.__annotations__ = {}
        try:
            model.register_comm_hook(pg, hook)
        except Exception as exc:
            self.tracer.not_captured(
                f"the DDP comm hook could not be registered ({' '.join(str(exc).split())[:300]}); only module and "
                "optimizer boundaries see its gradients"
            )
            return False
        self.hooked.add(id(model))
        return True

    def wait_buckets(self) -> None:
        futs, self.futures = self.futures, []
        for f in futs:
            # DDP waits for the same futures right after (the values are unchanged) and
            # reports a failure itself.
            with contextlib.suppress(Exception):
                f.wait()

    def _before(self, group: Any, bucket: Any) -> list | None:
        """Start the digests of each parameter's gradient as the bucket holds it before the
        reduction (read now: the all-reduce writes the bucket next)."""
        rec = self.rec
        if rec.busy:
            return None
        self.tracer.reduction("backward", self.tracer.name_of(group))
        with rec.guard("DDP comm hook", busy=False), rec.on_any_thread():
            return [_started(g) for g in bucket.gradients()]
        return None

    def _after(self, before: list, bucket: Any) -> None:
        # May run on a backend thread, or inline on the training thread (inside the dispatch
        # mode) when the all-reduce had already finished: start the digests now (values at
        # completion) with the mode hidden, append later in parameter-name order. A failure
        # here is reported on the training thread too, where the records would have joined.
        rec = self.rec
        step, mb = rec.step, rec.microbatch
        try:
            names = self.ctx.models.param_names
            with rec.on_any_thread():
                # gradients() are views of the bucket buffer, which the all-reduce updated in place.
                after = [_started(g) for g in bucket.gradients()]
            params = list(bucket.parameters())
            for i, (p, b, a) in enumerate(zip(params, before, after, strict=True)):
                pname = names.get(id(p), f"bucket{bucket.index()}.param{i}")

                def append(pname: str = pname, b: tuple = b, a: tuple = a) -> None:
                    if rec.failed or step != rec.step:
                        return
                    c = rec.record_call("reduced_grad", pname, "", "backward", [], occurrence=None)
                    rec.append_started(c, [("input", "grad", *b), ("output", "grad", *a)])

                rec.foreign.append(((step, mb, pname), append))
        except Exception as exc:
            rec.foreign.append(((step, mb, ""), functools.partial(rec.fail, exc, "DDP comm hook completion")))
