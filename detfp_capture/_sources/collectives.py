"""torch.distributed calls at the boundaries level: every collective, however the program calls it.

While a session is open the ProcessGroup's communicating methods (``c10d.METHODS``: every Python
entry point of ``torch.distributed`` ends in one, looked up at call time) are replaced by
recording ones (restored at close). A call records its input tensors before the launch (kind
``collective`` or ``p2p``, name ``<function>@<group>``: the public function the program called,
``c10d.entry``), runs the method, and returns the program a ``Work`` of our own (a subclass,
so ``isinstance(work, Work)`` holds) whose ``wait()`` records the outputs: c10d waits at once for
a synchronous call, the program waits for an async one (``async_op=True``, ``isend``, a
coalescing manager's ``cm.wait()``), and one never waited is an event at the step end. So:

* an alias bound before capture started (Megatron-Core's ``reduce_scatter_tensor``) and a new
  torch entry point (``all_gather_single``, ``reduce_scatter_single``: FSDP2) are recorded;
* a coalesced block (``_coalescing_manager``: Megatron-Core's DDP bucket reductions) is the one
  call its exit makes, its inputs at the exit and its outputs when the block completes; inside
  the block ``all_reduce`` only queues, and nothing reads its tensor early. A backend's own
  coalescing (``_start_coalescing``/``_end_coalescing``, NCCL's batched p2p) completes its calls
  with the work ``_end_coalescing`` returns;
* what the backend does on the caller's thread while a method runs (gloo's ``split``/``copy_``
  of a reduce-scatter) is the library's work, not the program's: no op records inside;
* object collectives (pickles), barriers and the set-up of groups are never records; at level
  ops the object collectives' own ops (pickling, sizes) run unrecorded too.

Group names are stable across runs: the user's ``group_names``, ``world`` for the default group,
the dimension of a ``DeviceMesh`` a group was made for (``mesh_dp`` -> ``dp``) or Megatron-Core's
description of it (``TENSOR_MODEL_PARALLEL_GROUP`` -> ``tp``), else ``ranks:<sorted ranks>``.

DDP's bucket all-reduce is issued from C++ (its comm hook's own all-reduce runs as the hook's
work): ``ddp`` records it. The tracer counts the gradient reductions it sees per group, so a
data-parallel step whose reduction capture did not see says so (``reduction_not_captured``).
Capture issues no collective of its own.
"""

from __future__ import annotations

import functools
import types
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from detfp_capture._recorder.call import MODULE, NAME, STEP, Call
from detfp_capture._recorder.slot import storage_ptrs
from detfp_capture._sources import c10d
from detfp_capture._sources.context import CaptureContext
from detfp_capture._sources.patches import unrecorded

__all__ = ["REDUCTIONS", "CollectiveTracer", "Wrapper", "group_name"]

#: Public names of the collectives that reduce (``funcol``'s records, by name).
REDUCTIONS = frozenset(
    {
        "all_reduce",
        "all_reduce_coalesced",
        "reduce",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "reduce_scatter_single",
        "_reduce_scatter_base",
        "reduce_scatter_tensor_coalesced",
    }
)

#: ``ProcessGroup.group_desc`` of the groups Megatron-Core's ``parallel_state`` makes -> the
#: short name a report says (the layout's usual name).
_DESCRIBED = {
    "TENSOR_MODEL_PARALLEL_GROUP": "tp",
    "PIPELINE_MODEL_PARALLEL_GROUP": "pp",
    "DATA_PARALLEL_GROUP": "dp",
    "DATA_PARALLEL_GROUP_WITH_CP": "dp_cp",
    "CONTEXT_PARALLEL_GROUP": "cp",
    "EXPERT_MODEL_PARALLEL_GROUP": "ep",
    "EXPERT_DATA_PARALLEL_GROUP": "edp",
    "EXPERT_TENSOR_PARALLEL_GROUP": "etp",
    "TENSOR_AND_DATA_PARALLEL_GROUP": "tp_dp",
    "TENSOR_AND_CONTEXT_PARALLEL_GROUP": "tp_cp",
    "MODEL_PARALLEL_GROUP": "mp",
    "EMBEDDING_GROUP": "embd",
    "POSITION_EMBEDDING_GROUP": "pos_embd",
    "INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP": "dp_cp",
}


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
    desc = str(getattr(group, "group_desc", "") or "")
    if desc.startswith("mesh_") and len(desc) > 5:
        return desc[5:], ranks
    if desc in _DESCRIBED:
        return _DESCRIBED[desc], ranks
    return "ranks:" + ",".join(map(str, ranks)), ranks


class Wrapper:
    """A wrapper that compares equal to the function it wraps (torch keys tables by op packets)
    and passes every other attribute through (an op packet's ``.default``)."""

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


class _Method:
    """A ProcessGroup method replaced while a session is open: bound to each group as the
    original is. Released at close, it calls the original (a bound method kept meanwhile)."""

    def __init__(self, attr: Any, orig: Callable, fn: Callable) -> None:
        #: The class attribute it replaces (pybind's instancemethod: what close puts back).
        self.attr = attr
        self.orig = orig
        self.fn = fn

    def __get__(self, obj: Any, cls: Any = None) -> Any:
        return self if obj is None else types.MethodType(self.fn, obj)

    def __call__(self, pg: Any, *args: Any, **kwargs: Any) -> Any:  # ProcessGroup.allreduce(pg, ...)
        return self.fn(pg, *args, **kwargs)

    def release(self) -> None:
        self.fn = self.orig


class _Work(dist.Work):
    """The program's handle on a recorded call: ``wait()`` also records what the call wrote.
    A ``Work`` itself (FSDP2 waits only for ``isinstance(work, Work)``); everything else is the
    backend's work's."""

    def __init__(self, work: Any, on_wait: Callable[[], None], scope: Any) -> None:
        super().__init__()
        self._work = work
        self._on_wait: Callable[[], None] | None = on_wait
        self._scope = scope

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        scope = self._scope
        scope.bookkeeping += 1  # the backend's own ops finishing the call (gloo's copies out) are not the program's
        try:
            result = self._work.wait(*args, **kwargs)
        finally:
            scope.bookkeeping -= 1
        cb, self._on_wait = self._on_wait, None
        if cb is not None:
            cb()
        return result

    def get_future(self, *a: Any, **k: Any) -> Any:
        return self._work.get_future(*a, **k)

    def get_future_result(self, *a: Any, **k: Any) -> Any:
        return self._work.get_future_result(*a, **k)

    def is_completed(self) -> Any:
        return self._work.is_completed()

    def is_success(self) -> Any:
        return self._work.is_success()

    def exception(self) -> Any:
        return self._work.exception()

    def result(self) -> Any:
        return self._work.result()

    def source_rank(self) -> Any:
        return self._work.source_rank()

    def _source_rank(self) -> Any:
        return self._work._source_rank()

    def synchronize(self) -> Any:
        return self._work.synchronize()

    def block_current_stream(self) -> Any:
        return self._work.block_current_stream()

    def boxed(self) -> Any:
        return self._work.boxed()

    def _get_op_type(self) -> Any:
        return self._work._get_op_type()

    def _get_duration(self) -> Any:
        return self._work._get_duration()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_work"], name)


def _holds_tensor(v: Any) -> bool:
    return isinstance(v, torch.Tensor) or (isinstance(v, (list, tuple)) and any(_holds_tensor(x) for x in v))


def _index(params: Mapping[str, Any]) -> dict[int, str]:
    """id of each tensor among a call's parameters -> its path (``tensor_list[1]``)."""
    out: dict[int, str] = {}

    def walk(v: Any, path: str, depth: int) -> None:
        if isinstance(v, torch.Tensor):
            out.setdefault(id(v), path)
        elif depth < 2 and isinstance(v, (list, tuple)):
            for i, x in enumerate(v):
                walk(x, f"{path}[{i}]", depth + 1)

    for k, v in params.items():
        walk(v, k, 0)
    return out


#: Parameters that say how, not what: never part of a call's arguments.
_HOW = frozenset({"group", "async_op", "async_ops"})


class CollectiveTracer:
    """Wraps the ProcessGroup's methods while a session is open; records calls through the recorder."""

    def __init__(self, ctx: CaptureContext) -> None:
        self.ctx = ctx
        self.rec = ctx.rec
        self.scope = ctx.scope
        self.saved: dict[str, _Method] = {}
        #: Logical group name -> its global ranks, for the manifest.
        self.groups: dict[str, list[int]] = {}
        #: A group was named for the first time since the manifest was last written.
        self.groups_changed = False
        self.group_cache: dict[int, str] = {}
        #: Collectives not yet waited: id(work), or ("functional", storage pointer) of a
        #: functional collective's output (``funcol``) -> (name, module).
        self.pending: dict[int | tuple[str, int], tuple[str, str]] = {}
        #: id(group) -> the completions of the calls made inside a backend's coalescing block.
        self.coalescing: dict[int, list[Callable[[], None]]] = {}
        # Reductions recorded in backward or optimizer phases this step (DDP buckets, FSDP's
        # reduce-scatters, an explicit all-reduce of gradients), per group name, and whether a
        # step without one on a multi-rank job has been reported.
        self.reductions = 0
        self.reduced: set[str] = set()
        self.reported_unseen = False

    # ------------------------------------------------------------------ install
    def install(self) -> None:
        if not dist.is_available():
            return
        cls = dist.ProcessGroup
        for mname, spec in c10d.METHODS.items():
            self._replace(cls, mname, functools.partial(self._make, mname, spec))
        self._replace(cls, "_start_coalescing", self._make_start)
        self._replace(cls, "_end_coalescing", self._make_end)
        if self.ctx.caps.ops:  # their pickling and size exchanges are the library's, not the program's
            wrap = unrecorded(self.rec, self.scope)
            for mod in (dist, dist.distributed_c10d):
                for name in c10d.OBJECT_COLLECTIVES:
                    self.ctx.patches.wrap(mod, name, wrap)

    def _replace(self, cls: Any, name: str, make: Callable[[Callable], Callable]) -> None:
        attr = cls.__dict__.get(name)
        if attr is None or isinstance(attr, _Method):  # absent in this torch, or another session's
            return
        orig = getattr(cls, name)
        m = _Method(attr, orig, make(orig))
        self.saved[name] = m
        setattr(cls, name, m)

    def uninstall(self) -> None:
        cls = getattr(dist, "ProcessGroup", None)
        for name, m in self.saved.items():
            if cls is not None and cls.__dict__.get(name) is m:
                setattr(cls, name, m.attr)
            m.release()  # a bound method taken meanwhile calls the original from now on
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

    # ------------------------------------------------------------------ the methods
    def _make(self, mname: str, spec: c10d.Method, orig: Callable) -> Callable:
        rec, scope = self.rec, self.scope

        def method(pg: Any, *args: Any, **kwargs: Any) -> Any:
            pending = self.ctx.pending_step
            if pending.number is not None and not rec.busy:
                pending.touch()  # launcher mode: a collective of the next step begins it
            if rec.busy or not rec.live or scope.bookkeeping or torch.compiler.is_compiling():
                return orig(pg, *args, **kwargs)
            named = c10d.entry(spec, 1)
            if named is None:  # inside an object collective, a barrier, a group's set-up
                return orig(pg, *args, **kwargs)
            call = None
            outs: list[tuple[str, torch.Tensor]] = []
            asynchronous = True
            guard = rec.guard("ProcessGroup.{} wrapper", mname)
            with guard:
                call, outs, asynchronous = self._launch(pg, spec, named, args, kwargs)
            if guard.failed:
                call = None
            rec.settle()  # the backend writes the outputs from C++, unseen by the dispatch mode
            scope.bookkeeping += 1  # its own ops on this thread (gloo's split/copy_) are not the program's
            try:
                work = orig(pg, *args, **kwargs)
            finally:
                scope.bookkeeping -= 1
            if call is None:
                return work
            return self._launched(pg, call, outs, asynchronous, work)

        return method

    def _launch(
        self, pg: Any, spec: c10d.Method, named: c10d.Named, args: tuple, kwargs: dict
    ) -> tuple[Call, list[tuple[str, torch.Tensor]], bool]:
        """The call's input records; returns (call, its outputs, whether the program holds its work)."""
        rec = self.rec
        ins = c10d.method_tensors(spec.reads, args, kwargs)
        outs = c10d.method_tensors(spec.writes, args, kwargs)
        other: dict[str, Any] = {}
        asynchronous = True
        if named.frame is not None:
            params = c10d.parameters(named.frame)
            where = _index(params)
            ins = [(where.get(id(t), p), t) for p, t in ins]
            outs = [(where.get(id(t), p), t) for p, t in outs]
            other = {k: v for k, v in params.items() if k not in _HOW and not _holds_tensor(v)}
            asynchronous = bool(params.get("async_op", True))
        name = f"{named.name}@{self.name_of(pg)}"
        module, phase = self.scope.where()
        if spec.reduces and phase in ("backward", "optimizer"):
            self.reductions += 1
            self.reduced.add(name.rsplit("@", 1)[1])
        hz = self.ctx.hazards
        flags = hz.flag_all([t for _, t in ins]) if hz is not None and hz.active else None
        call = rec.record_call(
            spec.kind, name, module, phase, [("input", p, t) for p, t in ins], args_src=((), other), hazards=flags
        )
        return call, outs, asynchronous

    def _launched(
        self, pg: Any, call: Call, outs: list[tuple[str, torch.Tensor]], asynchronous: bool, work: Any
    ) -> Any:
        """The program's work for a launched call: its outputs are recorded when it completes."""
        block = self.coalescing.get(id(pg))
        if block is not None:  # completes with the work _end_coalescing returns
            block.append(lambda: self._complete(call, outs, [t for _, t in outs], None))
            self._pending_writes(call, outs, work)
            return work
        if work is None:
            self._complete(call, outs, [], None)
            return work
        if not asynchronous:  # c10d waits for it now
            return _Work(work, lambda: self._complete(call, outs, [], None), self.scope)
        tensors = self._pending_writes(call, outs, work)
        proxy = _Work(work, lambda: self._complete(call, outs, tensors, key), self.scope)
        key = id(proxy)
        self.pending[key] = (call[NAME], call[MODULE])
        return proxy

    def _pending_writes(self, call: Call, outs: list[tuple[str, torch.Tensor]], work: Any) -> list[torch.Tensor]:
        """What an async call writes is pending until its wait: what it only reads (an isend's
        tensor, a gather's input) stays valid to read meanwhile (a pipeline stage's backward
        reads the activation it sends); what reads an output before the wait is digested at the
        wait (``inflight``)."""
        tensors = [t for _, t in outs]
        with self.rec.guard("{} launch", call[NAME]):
            hz = self.ctx.hazards
            if hz is not None:
                hz.async_launch(tensors, call[NAME])
            if tensors and work is not None:
                self.rec.inflight.launch(tensors, lambda _b: work.wait(), self.rec.step)
        return tensors

    def _complete(
        self, call: Call, outs: list[tuple[str, torch.Tensor]], tensors: list[torch.Tensor], key: int | None
    ) -> None:
        rec = self.rec
        if key is not None:
            self.pending.pop(key, None)
        if tensors:
            rec.complete(tensors)
        hz = self.ctx.hazards
        if hz is not None:
            if tensors:
                hz.async_done(tensors)
            for _, t in outs:  # written now (from C++, or by the backend's ops, which are not recorded)
                hz.wrote(t)
        if rec.failed or not outs or call[STEP] != rec.step:
            return
        with rec.guard("{} completion", call[NAME]):
            if len(rec.vcache):  # digests cached over what it wrote (through other views) are stale
                rec.vcache.drop_storages(p for _, t in outs for p in (storage_ptrs(t) or ()))
            # c10d writes outputs from C++ without moving version counters: always digest afresh.
            rec.append_records(call, [("output", p, t) for p, t in outs], fresh=True)

    def _make_start(self, orig: Callable) -> Callable:
        def start(pg: Any, *args: Any, **kwargs: Any) -> Any:
            out = orig(pg, *args, **kwargs)
            if self.rec.live:
                self.coalescing[id(pg)] = []
            return out

        return start

    def _make_end(self, orig: Callable) -> Callable:
        def end(pg: Any, *args: Any, **kwargs: Any) -> Any:
            work = orig(pg, *args, **kwargs)
            done = self.coalescing.pop(id(pg), None)
            if not done:
                return work

            def complete() -> None:
                self.pending.pop(key, None)
                for cb in done:
                    cb()

            if work is None:
                complete()
                return work
            proxy = _Work(work, complete, self.scope)
            key = id(proxy)
            self.pending[key] = ("coalesced block", "")
            return proxy

        return end

    # ------------------------------------------------------------------ step end
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
        self.reduced = set()
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
