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
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from detfp_capture._recorder.call import MODULE, NAME, STEP, Call
from detfp_capture._recorder.slot import storage_ptrs
from detfp_capture._sources import c10d
from detfp_capture._sources.c10d import group_name
from detfp_capture._sources.context import CaptureContext
from detfp_capture._sources.handles import Method, Waited, Work
from detfp_capture._sources.patches import unrecorded
from detfp_format import contract

__all__ = ["REDUCTIONS", "CollectiveTracer"]

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


#: Phases in which a reducing collective reduces the step's gradients.
_GRADIENT_PHASES = frozenset({"backward", "step", "optimizer"})

#: Parameters that say how, not what: never part of a call's arguments.
_HOW = frozenset({"group", "async_op", "async_ops"})


class CollectiveTracer:
    """Wraps the ProcessGroup's methods while a session is open; records calls through the recorder."""

    def __init__(self, ctx: CaptureContext) -> None:
        self.ctx = ctx
        self.rec = ctx.rec
        self.scope = ctx.scope
        self.saved: dict[str, Method] = {}
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
        #: Data-parallel groups reported once for a step that reduced nothing over them.
        self.reported_groups: set[str] = set()
        #: id of each DeviceMesh whose groups are named (``mesh_groups``).
        self.meshes: set[int] = set()

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
        if attr is None or isinstance(attr, Method):  # absent in this torch, or another session's
            return
        orig = getattr(cls, name)
        m = Method(attr, orig, make(orig))
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
            if torch.compiler.is_compiling():  # first: dynamo would guard on the state read below
                return orig(pg, *args, **kwargs)
            pending = self.ctx.pending_step
            if pending.number is not None and not rec.busy:
                pending.touch()  # launcher mode: a collective of the next step begins it
            if rec.busy or not rec.live or scope.bookkeeping:
                return orig(pg, *args, **kwargs)
            named = c10d.entry(spec, 1)
            if named is None:  # inside an object collective, a barrier, a group's set-up
                # The library's own exchange: its c10d op is no op of the program either (an object
                # collective's receiving rank broadcasts into a fresh, unwritten buffer).
                scope.bookkeeping += 1
                try:
                    return orig(pg, *args, **kwargs)
                finally:
                    scope.bookkeeping -= 1
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
        gname = self.name_of(pg)
        name = f"{named.name}@{gname}"
        module, phase = self.scope.where()
        if spec.reduces:
            self.reduction(phase, gname)
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
        if not asynchronous:
            # c10d waits for it the moment this returns: waiting here is the same wait, and its
            # own wait next finds the work complete (``Waited``: still the library's work).
            waited = Waited(work, self.scope)
            waited.wait()
            self._complete(call, outs, [], None)
            return waited
        tensors = self._pending_writes(call, outs, work)
        proxy = Work(work, lambda: self._complete(call, outs, tensors, key), self.scope)
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
            proxy = Work(work, complete, self.scope)
            key = id(proxy)
            self.pending[key] = ("coalesced block", "")
            return proxy

        return end

    def reduction(self, phase: str, group: str) -> None:
        """A reducing collective over ``group`` ran in ``phase``: one of the step's gradient
        reductions when it ran in the backward, after it (FSDP2's last reduce-scatter, a hand-written
        all-reduce of the gradients before ``optimizer.step()``) or in the optimizer."""
        if phase in _GRADIENT_PHASES:
            self.reductions += 1
            self.reduced.add(group)

    def mesh_groups(self) -> None:
        """Name the groups of every ``DeviceMesh`` the watched parameters live on (FSDP2, TP: a
        2-D mesh's ``dp`` dimension), so the manifest and the reduction check know the layout
        even where no collective of the program used a group yet."""
        for model in self.ctx.models:
            for _, p in model.named_parameters():
                mesh: Any = getattr(p, "device_mesh", None)
                names = getattr(mesh, "mesh_dim_names", None)
                if names and id(mesh) not in self.meshes:
                    self.meshes.add(id(mesh))
                    for dim in names:
                        self.name_of(mesh.get_group(dim))

    # ------------------------------------------------------------------ step end
    def step_end(self, grads_seen: bool) -> None:
        """At a step end: a multi-rank step whose optimizer read gradients (``grads_seen``) that
        met no reduction capture saw is reported once, and so, once per group, is a data-parallel
        group (``contract.DATA_PARALLEL_GROUPS``) no gradient reduction ran over while others did
        (a 2-D mesh whose tp all-reduces were seen and whose dp reduction was not); async works
        never waited are an event."""
        world = self.ctx.world_size
        if world > 1 and grads_seen:
            with self.rec.guard("the layout's groups"):
                self.mesh_groups()
            step = self.rec.step
            if not self.reductions and not self.reported_unseen:
                self.reported_unseen = True
                self.not_captured(
                    f"step {step} of this {world}-rank job reduced no gradient that capture saw "
                    "(no DDP comm hook, no reduce collective in backward): if the job is data parallel, its "
                    "gradient reduction is not captured (a wrapper capture does not know, or one created by C++)"
                )
            elif self.reductions:
                for g, ranks in sorted(self.groups.items()):
                    if g in self.reduced or g in self.reported_groups or len(ranks) < 2:
                        continue
                    if g.startswith(contract.DATA_PARALLEL_GROUPS):
                        self.reported_groups.add(g)
                        self.not_captured(
                            f"step {step} reduced gradients over {', '.join(sorted(self.reduced))} but none over the "
                            f"data-parallel group {g} (ranks {','.join(map(str, ranks))}) that capture saw: its "
                            "gradient reduction is not captured (issued from C++ or compiled code, or through a "
                            "wrapper capture does not know)",
                            g,
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

    def not_captured(self, detail: str, group: str = "") -> None:
        """A gradient reduction capture cannot record (over ``group`` when it knows which): an
        event (``certify`` reports it as "gradient reduction not captured") and one warning per
        session."""
        self.rec.event("reduction_not_captured", group, "", None, detail)
        if not self.reported_unseen:
            self.reported_unseen = True
            warnings.warn(f"detfp: gradient reduction not captured on rank {self.rec.rank}: {detail}", stacklevel=3)
