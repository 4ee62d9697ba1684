"""torch.distributed calls at the boundaries level: wrappers, async works, DDP's bucket all-reduce.

While a session is open, the collective and point-to-point functions in the ``torch.distributed``
namespace are replaced by wrappers (restored at close). A wrapper records the input tensors
before the launch (kind ``collective`` or ``p2p``, name ``<function>@<group>``), calls the
original, and records the outputs at completion: on return for synchronous calls, at
``wait()`` for async ones (the returned Work is wrapped). ``distributed_c10d``'s own globals
are never touched, so c10d's internal identity checks (P2POp, the coalescing manager) see the
real functions; wrappers compare equal to the function they wrap for ``P2POp``'s check.

Group names are stable across runs: the user's ``group_names``, ``world`` for the default
group, else ``ranks:<sorted ranks>``; every group used is reported for the manifest.

DDP's bucket all-reduce is issued from C++ and never reaches these wrappers, so ``watch`` on a
DistributedDataParallel model registers a comm hook that does what the built-in path does
(scale by 1/world size, sum all-reduce) and records each bucket's input and output
(``all_reduce@<group>``, kind ``collective``) and the reduced gradient of every parameter
(kind ``reduced_grad``). The completion callback may run on a backend thread: it only starts
digests and queues the records, which the training thread appends at its next record.

Capture issues no collective of its own.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["COLLECTIVES", "CollectiveTracer", "group_name"]

# name -> (kind, input parameters, output parameters)
COLLECTIVES: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    "all_reduce": ("collective", ("tensor",), ("tensor",)),
    "all_reduce_coalesced": ("collective", ("tensors",), ("tensors",)),
    "reduce": ("collective", ("tensor",), ("tensor",)),
    "broadcast": ("collective", ("tensor",), ("tensor",)),
    "all_gather": ("collective", ("tensor",), ("tensor_list",)),
    "all_gather_into_tensor": ("collective", ("input_tensor",), ("output_tensor",)),
    "all_gather_coalesced": ("collective", ("input_tensor_list",), ("output_tensor_lists",)),
    "_all_gather_base": ("collective", ("input_tensor",), ("output_tensor",)),
    "reduce_scatter": ("collective", ("input_list",), ("output",)),
    "reduce_scatter_tensor": ("collective", ("input",), ("output",)),
    "_reduce_scatter_base": ("collective", ("input",), ("output",)),
    "all_to_all": ("collective", ("input_tensor_list",), ("output_tensor_list",)),
    "all_to_all_single": ("collective", ("input",), ("output",)),
    "gather": ("collective", ("tensor",), ("gather_list",)),
    "scatter": ("collective", ("scatter_list",), ("tensor",)),
    "send": ("p2p", ("tensor",), ()),
    "recv": ("p2p", (), ("tensor",)),
    "isend": ("p2p", ("tensor",), ()),
    "irecv": ("p2p", (), ("tensor",)),
}


#: Collectives that reduce (a gradient reduction is one of these in backward or the optimizer).
_REDUCTIONS = frozenset(
    {"all_reduce", "all_reduce_coalesced", "reduce", "reduce_scatter", "reduce_scatter_tensor", "_reduce_scatter_base"}
)


def _tensors(value: Any, prefix: str, out: list[tuple[str, torch.Tensor]]) -> None:
    if isinstance(value, torch.Tensor):
        out.append((prefix, value))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _tensors(v, f"{prefix}[{i}]", out)


def group_name(group: Any, names: dict[str, Any]) -> tuple[str, list[int]]:
    """Stable logical name of a process group and its global ranks."""
    world = dist.group.WORLD
    if group is None:
        group = world
    ranks = sorted(int(r) for r in dist.get_process_group_ranks(group))
    for name, g in names.items():
        if g is group:
            return name, ranks
    if group is world:
        return "world", ranks
    return "ranks:" + ",".join(map(str, ranks)), ranks


class _Wrapper:
    """A collective wrapper that compares equal to the function it wraps (P2POp checks ``op in [isend, irecv]``)."""

    def __init__(self, orig: Callable, fn: Callable) -> None:
        self.__wrapped__ = orig
        self._fn = fn
        self.__name__ = getattr(orig, "__name__", "collective")
        self.__qualname__ = getattr(orig, "__qualname__", self.__name__)
        self.__doc__ = getattr(orig, "__doc__", None)
        self.__module__ = getattr(orig, "__module__", "torch.distributed")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._fn(*args, **kwargs)

    def __eq__(self, other: object) -> bool:
        return other is self or other is self.__wrapped__

    def __hash__(self) -> int:
        return hash(self.__wrapped__)


class _WorkProxy:
    """An async Work whose ``wait()`` also records the outputs (and clears the hazard)."""

    def __init__(self, work: Any, on_wait: Callable[[], None]) -> None:
        self._work = work
        self._on_wait: Callable[[], None] | None = on_wait

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        result = self._work.wait(*args, **kwargs)
        cb, self._on_wait = self._on_wait, None
        if cb is not None:
            cb()
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


class CollectiveTracer:
    """Patches ``torch.distributed`` while a session is open; records calls through the session."""

    def __init__(self, session: Any) -> None:
        self.s = session
        self.rec = session._rec
        self.saved: dict[str, Any] = {}
        self.groups: dict[str, list[int]] = {}
        self.group_cache: dict[int, str] = {}
        self.pending: dict[int, tuple[str, str]] = {}  # id(proxy) -> (name, module) of works not yet waited
        self.in_batch = False
        self.ddp_hooked: set[int] = set()
        self.ddp_futures: list[Any] = []  # bucket futures of the running backward
        # Reductions recorded in backward or optimizer phases this step (DDP buckets, FSDP's
        # reduce-scatters, an explicit all-reduce of gradients), and whether a step without one
        # on a multi-rank job has been reported.
        self.reductions = 0
        self.reported_unseen = False

    # ------------------------------------------------------------------ install
    def install(self) -> None:
        if not dist.is_available():
            return
        for name in (*COLLECTIVES, "batch_isend_irecv"):
            orig = getattr(dist, name, None)
            if orig is None or isinstance(orig, _Wrapper):
                continue
            fn = self._make_batch(orig) if name == "batch_isend_irecv" else self._make(name, orig)
            w = _Wrapper(orig, fn)
            self.saved[name] = (orig, w)
            setattr(dist, name, w)

    def uninstall(self) -> None:
        for name, (orig, w) in self.saved.items():
            if getattr(dist, name, None) is w:
                setattr(dist, name, orig)
        self.saved.clear()

    def name_of(self, group: Any) -> str:
        key = id(group)
        n = self.group_cache.get(key)
        if n is None:
            n, ranks = group_name(group, self.s._group_names)
            self.group_cache[key] = n
            if n not in self.groups:
                self.groups[n] = ranks
                self.s._groups_changed = True
        return n

    # ------------------------------------------------------------------ wrappers
    def _make(self, fname: str, orig: Callable) -> Callable:
        kind, in_params, out_params = COLLECTIVES[fname]
        sig = inspect.signature(orig)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            rec = self.rec
            if self.s._auto_next is not None and not rec.busy:
                self.s._auto_touch()  # launcher mode: a collective of the next step begins it
            if rec.busy or not rec.selected or rec.failed or self.in_batch or torch.compiler.is_compiling():
                return orig(*args, **kwargs)
            call = None
            outs: list[tuple[str, torch.Tensor]] = []
            async_op = False
            try:
                bound = sig.bind(*args, **kwargs)
                bound.apply_defaults()
                a = bound.arguments
                async_op = bool(a.get("async_op", False)) or fname in ("isend", "irecv")
                name = f"{fname}@{self.name_of(a.get('group'))}"
                ins: list[tuple[str, torch.Tensor]] = []
                for p in in_params:
                    _tensors(a.get(p), p, ins)
                for p in out_params:
                    _tensors(a.get(p), p, outs)
                module, phase = self.s._context()
                if phase in ("backward", "optimizer") and fname in _REDUCTIONS:
                    self.reductions += 1
                other = {
                    k: v
                    for k, v in a.items()
                    if k not in in_params and k not in out_params and k not in ("group", "async_op")
                }
                rec.enter()
                hz = self.s._hazard
                flags = hz.flag_all([t for _, t in ins]) if hz is not None and hz.active else None
                call = rec.record_call(
                    kind, name, module, phase, [("input", p, t) for p, t in ins], args_src=((), other), hazards=flags
                )
                rec.leave()
            except Exception as exc:
                rec.fail(exc, f"torch.distributed.{fname} wrapper")
                call = None
            rec.settle()  # c10d writes outputs from C++, unseen by the dispatch mode
            result = orig(*args, **kwargs)
            if call is None:
                return result
            if async_op and result is not None:
                tensors = [t for _, t in outs] + [t for _, t in ins]
                hz = self.s._hazard
                if hz is not None:
                    hz.async_launch(tensors, call[5])
                proxy = _WorkProxy(result, lambda: self._complete(call, outs, tensors, id(proxy)))
                self.pending[id(proxy)] = (call[5], call[3])
                return proxy
            self._complete(call, outs, [], None)
            return result

        return wrapper

    def _complete(
        self, call: tuple, outs: list[tuple[str, torch.Tensor]], tensors: list[torch.Tensor], key: int | None
    ) -> None:
        rec = self.rec
        if key is not None:
            self.pending.pop(key, None)
        hz = self.s._hazard
        if hz is not None and tensors:
            hz.async_done(tensors)
        if rec.failed or not outs or call[0] != rec.step:
            return
        rec.enter()
        try:
            # c10d writes outputs from C++ without moving version counters: always digest afresh.
            rec.append_records(call, [("output", p, t) for p, t in outs], fresh=True)
        except Exception as exc:
            rec.fail(exc, f"{call[5]} completion")
        finally:
            rec.leave()

    def _make_batch(self, orig: Callable) -> Callable:
        def wrapper(p2p_op_list: list) -> Any:
            rec = self.rec
            restore = []
            # c10d compares P2POp.op by identity with its own isend/irecv: hand it the originals.
            for p in p2p_op_list:
                if isinstance(getattr(p, "op", None), _Wrapper):
                    restore.append((p, p.op))
                    p.op = p.op.__wrapped__
            calls = []
            try:
                if not (rec.busy or not rec.selected or rec.failed):
                    try:
                        rec.enter()
                        module, phase = self.s._context()
                        for p in p2p_op_list:
                            fname = getattr(p.op, "__name__", "p2p")
                            name = f"batch_{fname}@{self.name_of(p.group)}"
                            peer = getattr(p, "peer", None)
                            ins = [("input", "tensor", p.tensor)] if fname == "isend" else []
                            c = rec.record_call(
                                "p2p",
                                name,
                                module,
                                phase,
                                ins,
                                args_src=((), {"peer": peer, "tag": getattr(p, "tag", 0)}),
                            )
                            calls.append((c, fname, p.tensor))
                    except Exception as exc:
                        rec.fail(exc, "torch.distributed.batch_isend_irecv wrapper")
                        calls = []
                    finally:
                        rec.leave()
                rec.settle()
                self.in_batch = True
                try:
                    works = orig(p2p_op_list)
                finally:
                    self.in_batch = False
            finally:
                for p, op in restore:
                    p.op = op
            if not calls or not works:
                return works
            outs = [(c, t) for c, fname, t in calls if fname == "irecv"]
            state = {"left": len(works)}

            def done() -> None:
                state["left"] -= 1
                if state["left"] == 0:
                    for c, t in outs:
                        self._complete(c, [("tensor", t)], [], None)

            return [_WorkProxy(w, done) for w in works]

        return wrapper

    def step_end(self) -> None:
        s = self.s
        if s.world_size > 1 and s._grads_seen and not self.reductions and not self.reported_unseen:
            self.reported_unseen = True
            self.not_captured(
                f"step {self.rec.step} of this {s.world_size}-rank job reduced no gradient that capture saw "
                "(no DDP comm hook, no reduce collective in backward): if the job is data parallel, its "
                "gradient reduction is not captured (a wrapper capture does not know, or one created by C++)"
            )
        self.reductions = 0
        s._grads_seen = False
        if self.pending:
            names = sorted({n for n, _ in self.pending.values()})
            self.rec.event(
                "pending_collective",
                names[0],
                "",
                len(self.pending),
                f"{len(self.pending)} async collective(s) not waited at step end: {', '.join(names)}",
            )
        self.pending.clear()

    # ------------------------------------------------------------------ DDP
    def hook_ddp(self, model: Any, param_names: dict[int, str]) -> bool:
        """Register the recording comm hook on a DDP model (once); False when it already has a hook."""
        if id(model) in self.ddp_hooked:
            return True
        pg = getattr(model, "process_group", None)
        from torch.distributed import distributed_c10d as c10d

        allreduce = c10d.all_reduce  # the original: recorded through its parameters, not as a collective
        tracer = self

        def hook(state: Any, bucket: Any) -> torch.futures.Future:
            group = state if state is not None else c10d._get_default_group()
            buf = bucket.buffer()
            tracer.rec.settle()
            before = tracer._bucket_before(group, bucket) if tracer.s._live() else None
            # The built-in path multiplies each gradient by 1/world_size while copying it into the
            # bucket, then sums: the same elementwise product here gives bitwise identical results.
            # These ops belong to the reduction, recorded per parameter: as ops they would follow
            # DDP's bucket layout, which a resumed run's first step packs differently.
            tracer.s._bookkeeping += 1
            try:
                buf.mul_(1.0 / group.size())
                fut = allreduce(buf, group=group, async_op=True).get_future()
            finally:
                tracer.s._bookkeeping -= 1

            def done(f: torch.futures.Future) -> torch.Tensor:
                out = f.value()[0]
                if before is not None:
                    tracer._bucket_after(before, bucket)
                return out

            chained = fut.then(done)
            if before is not None:
                tracer._bucket_pending(chained)
            return chained

        # DDP validates annotations against real types; postponed (string) annotations would fail.
        hook.__annotations__ = {}
        try:
            model.register_comm_hook(pg, hook)
        except Exception as exc:
            self.not_captured(
                f"the DDP comm hook could not be registered ({' '.join(str(exc).split())[:300]}); only module and "
                "optimizer boundaries see its gradients"
            )
            return False
        self.ddp_hooked.add(id(model))
        self._param_names = param_names
        return True

    def not_captured(self, detail: str) -> None:
        """A gradient reduction capture cannot record: an event (``certify`` reports it as
        "gradient reduction not captured") and one warning per session."""
        import warnings

        self.rec.event("reduction_not_captured", "", "", None, detail)
        if not self.reported_unseen:
            self.reported_unseen = True
            warnings.warn(f"detfp: gradient reduction not captured on rank {self.rec.rank}: {detail}", stacklevel=3)

    # A bucket is DDP's packing of gradients, and its layout is not stable: DDP rebuilds its
    # buckets after the first iteration, so a resumed run's first step packs them differently
    # from the uninterrupted run's, and a bucket becomes ready whenever its last gradient does.
    # So the reduction is recorded per parameter (kind reduced_grad: the gradient before the
    # reduction as input, after it as output), and every record joins the stream at the end of
    # the backward, in parameter-name order: the same stream whatever the packing and timing.
    def _bucket_before(self, group: Any, bucket: Any) -> list | None:
        """Start the digests of each parameter's gradient as the bucket holds it before the
        reduction (read now: the all-reduce writes the bucket next)."""
        rec = self.rec
        if rec.busy:
            return None
        self.reductions += 1
        self.name_of(group)
        try:
            with rec.on_any_thread():
                return [self._started(g) for g in bucket.gradients()]
        except Exception as exc:
            rec.fail(exc, "DDP comm hook")
            return None

    @staticmethod
    def _started(t: torch.Tensor) -> tuple:
        from detfp_capture import digest
        from detfp_capture._recorder.recorder import Slot, dtype_str

        return dtype_str(t.dtype), tuple(t.shape), t.numel(), Slot(digest.start(t))

    def _bucket_pending(self, fut: Any) -> None:
        """Track a bucket's future; at the end of the backward (an engine callback, on the thread
        that ran it) the session waits for all of them and appends their records."""
        self.ddp_futures.append(fut)
        self.s._note_backward()

    def wait_buckets(self) -> None:
        futs, self.ddp_futures = self.ddp_futures, []
        for f in futs:
            # DDP waits for the same futures right after (the values are unchanged) and
            # reports a failure itself.
            with contextlib.suppress(Exception):
                f.wait()

    def _bucket_after(self, before: list, bucket: Any) -> None:
        # May run on a backend thread, or inline on the training thread (inside the dispatch
        # mode) when the all-reduce had already finished: start the digests now (values at
        # completion) with the mode hidden, append later in parameter-name order.
        rec = self.rec
        step, mb = rec.step, rec.microbatch
        try:
            names = getattr(self, "_param_names", {})
            with rec.on_any_thread():
                # gradients() are views of the bucket buffer, which the all-reduce updated in place.
                after = [self._started(g) for g in bucket.gradients()]
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
            rec.foreign.append(((step, mb, ""), lambda e=exc: rec.fail(e, "DDP comm hook completion")))
