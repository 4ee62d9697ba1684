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

DDP's bucket all-reduce is issued from C++ and never reaches these wrappers: ``ddp`` records it.
The tracer also counts the gradient reductions it sees, so a data-parallel step whose reduction
capture did not see says so (``reduction_not_captured``).

Capture issues no collective of its own.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from detfp_capture._recorder.call import MODULE, NAME, STEP, Call
from detfp_capture._sources.context import CaptureContext

__all__ = ["COLLECTIVES", "REDUCTIONS", "CollectiveTracer", "Wrapper", "group_name"]

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
REDUCTIONS = frozenset(
    {"all_reduce", "all_reduce_coalesced", "reduce", "reduce_scatter", "reduce_scatter_tensor", "_reduce_scatter_base"}
)


def _tensors(value: Any, prefix: str, out: list[tuple[str, torch.Tensor]]) -> None:
    if isinstance(value, torch.Tensor):
        out.append((prefix, value))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _tensors(v, f"{prefix}[{i}]", out)


def group_name(group: Any, names: Mapping[str, Any]) -> tuple[str, list[int]]:
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


class Wrapper:
    """A collective wrapper that compares equal to the function it wraps (P2POp checks ``op in
    [isend, irecv]``; torch keys tables by op packets) and passes every other attribute through
    (an op packet's ``.default``)."""

    def __init__(self, orig: Callable, fn: Callable) -> None:
        self.__wrapped__ = orig
        self._fn = fn
        self.__name__ = getattr(orig, "__name__", "collective")
        self.__qualname__ = getattr(orig, "__qualname__", self.__name__)
        self.__doc__ = getattr(orig, "__doc__", None)
        self.__module__ = getattr(orig, "__module__", "torch.distributed")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._fn(*args, **kwargs)

    def release(self) -> None:
        """At the session's close (``Patches.restore``): call the original from now on, and drop
        the recording function (and, through its closure, the session)."""
        self._fn = self.__wrapped__

    def __eq__(self, other: object) -> bool:
        return other is self or other is self.__wrapped__

    def __hash__(self) -> int:
        return hash(self.__wrapped__)

    def __getattr__(self, name: str) -> Any:
        if name == "__wrapped__":  # not set yet
            raise AttributeError(name)
        return getattr(self.__wrapped__, name)


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


class _AllWorks:
    """The works of one ``batch_isend_irecv``, waited for together."""

    def __init__(self, works: list) -> None:
        self.works = works

    def wait(self) -> None:
        for w in self.works:
            w.wait()


class CollectiveTracer:
    """Patches ``torch.distributed`` while a session is open; records calls through the recorder."""

    def __init__(self, ctx: CaptureContext) -> None:
        self.ctx = ctx
        self.rec = ctx.rec
        self.scope = ctx.scope
        self.saved: dict[str, Any] = {}
        #: Logical group name -> its global ranks, for the manifest.
        self.groups: dict[str, list[int]] = {}
        #: A group was named for the first time since the manifest was last written.
        self.groups_changed = False
        self.group_cache: dict[int, str] = {}
        #: Collectives not yet waited: id(work proxy), or ("functional", storage pointer) of a
        #: functional collective's output (``funcol``) -> (name, module).
        self.pending: dict[int | tuple[str, int], tuple[str, str]] = {}
        self.in_batch = False
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
            if orig is None or isinstance(orig, Wrapper):
                continue
            fn = self._make_batch(orig) if name == "batch_isend_irecv" else self._make(name, orig)
            w = Wrapper(orig, fn)
            self.saved[name] = (orig, w)
            setattr(dist, name, w)

    def uninstall(self) -> None:
        for name, (orig, w) in self.saved.items():
            if getattr(dist, name, None) is w:
                setattr(dist, name, orig)
            w.release()  # a reference taken meanwhile (``from torch.distributed import ...``)
        self.saved.clear()

    def name_of(self, group: Any) -> str:
        key = id(group)
        n = self.group_cache.get(key)
        if n is None:
            n, ranks = group_name(group, self.ctx.group_names)
            self.group_cache[key] = n
            if n not in self.groups:
                self.groups[n] = ranks
                self.groups_changed = True
        return n

    # ------------------------------------------------------------------ wrappers
    def _make(self, fname: str, orig: Callable) -> Callable:
        kind, in_params, out_params = COLLECTIVES[fname]
        sig = inspect.signature(orig)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if torch.compiler.is_compiling():  # first: dynamo would guard on the state read below
                return orig(*args, **kwargs)
            rec = self.rec
            pending = self.ctx.pending_step
            if pending.number is not None and not rec.busy:
                pending.touch()  # launcher mode: a collective of the next step begins it
            if rec.busy or not rec.selected or rec.failed or self.in_batch:
                return orig(*args, **kwargs)
            call = None
            outs: list[tuple[str, torch.Tensor]] = []
            ins: list[tuple[str, torch.Tensor]] = []
            async_op = False
            guard = rec.guard("torch.distributed.{} wrapper", fname)
            with guard:
                bound = sig.bind(*args, **kwargs)
                bound.apply_defaults()
                a = bound.arguments
                async_op = bool(a.get("async_op", False)) or fname in ("isend", "irecv")
                name = f"{fname}@{self.name_of(a.get('group'))}"
                for p in in_params:
                    _tensors(a.get(p), p, ins)
                for p in out_params:
                    _tensors(a.get(p), p, outs)
                module, phase = self.scope.where()
                if phase in ("backward", "optimizer") and fname in REDUCTIONS:
                    self.reductions += 1
                other = {
                    k: v
                    for k, v in a.items()
                    if k not in in_params and k not in out_params and k not in ("group", "async_op")
                }
                hz = self.ctx.hazards
                flags = hz.flag_all([t for _, t in ins]) if hz is not None and hz.active else None
                call = rec.record_call(
                    kind, name, module, phase, [("input", p, t) for p, t in ins], args_src=((), other), hazards=flags
                )
            if guard.failed:
                call = None
            rec.settle()  # c10d writes outputs from C++, unseen by the dispatch mode
            result = orig(*args, **kwargs)
            if call is None:
                return result
            if async_op and result is not None:
                # Pending until wait(): what the collective writes (its outputs, an all-reduce's
                # tensor). What it only reads (an isend's tensor, a gather's input) stays valid
                # to read meanwhile: a pipeline stage's backward reads the activation it sends.
                tensors = [t for _, t in outs]
                hz = self.ctx.hazards
                if hz is not None:
                    hz.async_launch(tensors, call[NAME])
                # What reads an output before the wait is digested at the wait (``inflight``).
                self._in_flight([t for _, t in outs], result, call[NAME])
                proxy = _WorkProxy(result, lambda: self._complete(call, outs, tensors, id(proxy)))
                self.pending[id(proxy)] = (call[NAME], call[MODULE])
                return proxy
            self._complete(call, outs, [], None)
            return result

        return wrapper

    def _complete(
        self, call: Call, outs: list[tuple[str, torch.Tensor]], tensors: list[torch.Tensor], key: int | None
    ) -> None:
        rec = self.rec
        if key is not None:
            self.pending.pop(key, None)
            rec.complete([t for _, t in outs])
        hz = self.ctx.hazards
        if hz is not None and tensors:
            hz.async_done(tensors)
        if rec.failed or not outs or call[STEP] != rec.step:
            return
        with rec.guard("{} completion", call[NAME]):
            # c10d writes outputs from C++ without moving version counters: always digest afresh.
            rec.append_records(call, [("output", p, t) for p, t in outs], fresh=True)

    def _in_flight(self, buffers: list[torch.Tensor], work: Any, name: str) -> None:
        """``buffers`` are written by the async ``work`` until the program waits for it."""
        if buffers:
            with self.rec.guard("{} launch", name):
                self.rec.inflight.launch(buffers, lambda _b: work.wait(), self.rec.step)

    def _make_batch(self, orig: Callable) -> Callable:
        def wrapper(p2p_op_list: list) -> Any:
            rec = self.rec
            restore = []
            # c10d compares P2POp.op by identity with its own isend/irecv: hand it the originals.
            for p in p2p_op_list:
                if isinstance(getattr(p, "op", None), Wrapper):
                    restore.append((p, p.op))
                    p.op = p.op.__wrapped__
            calls = []
            try:
                if not (rec.busy or not rec.selected or rec.failed):
                    guard = rec.guard("torch.distributed.batch_isend_irecv wrapper")
                    with guard:
                        module, phase = self.scope.where()
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
                    if guard.failed:
                        calls = []
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
            if outs:
                self._in_flight([t for _, t in outs], _AllWorks(works), "batch_isend_irecv")

            def done() -> None:
                state["left"] -= 1
                if state["left"] == 0:
                    rec.complete([t for _, t in outs])
                    for c, t in outs:
                        self._complete(c, [("tensor", t)], [], None)

            return [_WorkProxy(w, done) for w in works]

        return wrapper

    def step_end(self, grads_seen: bool) -> None:
        """At a step end: a multi-rank step whose optimizer read gradients (``grads_seen``) that
        met no reduction capture saw is reported once; async works never waited are an event."""
        world = self.ctx.world_size
        if world > 1 and grads_seen and not self.reductions and not self.reported_unseen:
            self.reported_unseen = True
            self.not_captured(
                f"step {self.rec.step} of this {world}-rank job reduced no gradient that capture saw "
                "(no DDP comm hook, no reduce collective in backward): if the job is data parallel, its "
                "gradient reduction is not captured (a wrapper capture does not know, or one created by C++)"
            )
        self.reductions = 0
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

    def not_captured(self, detail: str) -> None:
        """A gradient reduction capture cannot record: an event (``certify`` reports it as
        "gradient reduction not captured") and one warning per session."""
        self.rec.event("reduction_not_captured", "", "", None, detail)
        if not self.reported_unseen:
            self.reported_unseen = True
            warnings.warn(f"detfp: gradient reduction not captured on rank {self.rec.rank}: {detail}", stacklevel=3)
