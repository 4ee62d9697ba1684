"""Functional collectives at the boundaries level: how DTensor, TP, SP, EP and torchtitan communicate.

torch's functional collectives (``torch.distributed._functional_collectives``, "funcol") run the
ops of ``torch.ops._c10d_functional``, called from Python: ``funcol.all_reduce`` and friends,
DTensor's redistributions (RowwiseParallel's Partial -> Replicate all-reduce, sequence
parallelism's all-gathers and reduce-scatters), and the backward formulas of those ops. While a
session is open the op packets in that namespace are replaced by wrappers (restored at close),
so every Python caller, forward and backward, goes through them; no dispatch mode is needed.

A wrapper records the call as ``torch.distributed``'s wrappers do (``collectives``): kind
``collective``, name ``<collective>@<group>`` (the in-place and ``_out`` variants under the
plain collective's name; the group from the op's group name, named like every other group),
the inputs before the launch, and the outputs right after it, their digests taken when the
collective completes (``_recorder.inflight``): at the program's own ``wait_tensor`` (an
``AsyncCollectiveTensor`` runs it at its first non-view use), or, for one the program did not
wait for within the step, by capture at the step end. Because the output records come right
after the launch, they come before any record of the result (a module output that is the
``AsyncCollectiveTensor``): a rank that only receives a difference has the collective's output
as its first differing record, and the group-wide test decides, as for DDP.

``wait_tensor`` is wrapped to see the program's waits. Nothing is recorded while dynamo or a
fake or proxy mode traces. Not covered: the functional point-to-point ops (``isend``, ``irecv``,
``batch_p2p_ops``) and DTensor's ``_dtensor.shard_dim_alltoall`` (Shard -> Shard on devices
whose backend has all-to-all; on gloo DTensor all-gathers instead, which is covered).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from detfp_capture._recorder.call import MODULE, NAME
from detfp_capture._recorder.slot import storage_ptrs
from detfp_capture._sources.collectives import REDUCTIONS, CollectiveTracer
from detfp_capture._sources.context import CaptureContext
from detfp_capture._sources.handles import Wrapper

__all__ = ["FUNCTIONAL", "FunctionalCollectives"]


class Spec(NamedTuple):
    """How one ``_c10d_functional`` op maps to a collective record."""

    #: The record's collective name (before ``@<group>``).
    name: str
    #: The schema argument holding its input tensor (or list of tensors).
    input: str
    #: Where its output is: ``""`` for the op's result, else the argument it writes.
    output: str


#: ``_c10d_functional`` op -> its record.
FUNCTIONAL: dict[str, Spec] = {
    "all_reduce": Spec("all_reduce", "input", ""),
    "all_reduce_": Spec("all_reduce", "input", "input"),
    "all_reduce_coalesced": Spec("all_reduce_coalesced", "inputs", ""),
    "all_reduce_coalesced_": Spec("all_reduce_coalesced", "inputs", "inputs"),
    "all_gather_into_tensor": Spec("all_gather_into_tensor", "input", ""),
    "all_gather_into_tensor_out": Spec("all_gather_into_tensor", "input", "out"),
    "all_gather_into_tensor_coalesced": Spec("all_gather_into_tensor_coalesced", "inputs", ""),
    "reduce_scatter_tensor": Spec("reduce_scatter_tensor", "input", ""),
    "reduce_scatter_tensor_out": Spec("reduce_scatter_tensor", "input", "out"),
    "reduce_scatter_tensor_coalesced": Spec("reduce_scatter_tensor_coalesced", "inputs", ""),
    "all_to_all_single": Spec("all_to_all_single", "input", ""),
    "broadcast": Spec("broadcast", "input", ""),
    "broadcast_": Spec("broadcast", "input", "input"),
}


def _tensors(value: Any, prefix: str) -> list[tuple[str, torch.Tensor]]:
    if isinstance(value, torch.Tensor):
        return [(prefix, value)]
    if isinstance(value, (list, tuple)):
        return [(f"{prefix}[{i}]", v) for i, v in enumerate(value) if isinstance(v, torch.Tensor)]
    return []


def _output(spec: Spec, bound: dict[str, Any], result: Any) -> list[tuple[str, torch.Tensor]]:
    """(arg, tensor) of what a call writes: its result, or the argument it writes."""
    return _tensors(bound.get(spec.output) if spec.output else result, spec.output or "output")


def _tracing() -> bool:
    """dynamo, a fake mode or a proxy mode is tracing: the tensors have no values."""
    funcol = sys.modules.get("torch.distributed._functional_collectives")
    probe = getattr(funcol, "_are_we_tracing", None)
    if probe is not None:
        return bool(probe())
    return torch.compiler.is_compiling()


class FunctionalCollectives:
    """Wraps ``torch.ops._c10d_functional`` while a session is open; records through the recorder.
    ``tracer``: the ``torch.distributed`` wrappers, whose group names, reduction count and list of
    collectives not waited for it shares."""

    def __init__(self, ctx: CaptureContext, tracer: CollectiveTracer) -> None:
        self.ctx = ctx
        self.rec = ctx.rec
        self.scope = ctx.scope
        self.tracer = tracer
        self.groups: dict[Any, str] = {}
        self.wait: Callable[..., Any] | None = None

    def install(self) -> None:
        ns = getattr(torch.ops, "_c10d_functional", None)
        if ns is None:
            return
        patches = self.ctx.patches
        for op, spec in FUNCTIONAL.items():

            def wrapped(orig: Any, op: str = op, spec: Spec = spec) -> Wrapper:
                return Wrapper(orig, self._make(op, spec, orig))

            patches.wrap(ns, op, wrapped)
        patches.wrap(ns, "wait_tensor", lambda orig: Wrapper(orig, self._make_wait(orig)))
        self.rec.inflight.tracking = True

    def _group(self, group: Any) -> str:
        name = self.groups.get(group)
        if name is None:
            pg = group
            if isinstance(group, str):
                from torch.distributed.distributed_c10d import _resolve_process_group

                pg = _resolve_process_group(group)  # type: ignore[arg-type]  # a GroupName is a str (NewType)
            name = self.groups[group] = self.tracer.name_of(pg)
        return name

    def _make(self, op: str, spec: Spec, orig: Any) -> Callable:
        names = [a.name for a in orig.default._schema.arguments]
        skip = {spec.input, spec.output, "group_name"}

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            rec = self.rec
            pending = self.ctx.pending_step
            if pending.number is not None and not rec.busy:
                pending.touch()  # launcher mode: a collective of the next step begins it
            if rec.busy or rec.failed or _tracing():
                return orig(*args, **kwargs)
            if not rec.selected:  # not recorded, but what it writes is in flight all the same
                result = orig(*args, **kwargs)
                with rec.guard("torch.ops._c10d_functional.{} launch", op):
                    out = _output(spec, dict(zip(names, args, strict=False)) | kwargs, result)
                    rec.inflight.launch([t for _, t in out], self._wait_for, rec.step)
                return result
            call = None
            guard = rec.guard("torch.ops._c10d_functional.{} wrapper", op)
            with guard:
                a = dict(zip(names, args, strict=False))
                a.update(kwargs)
                gname = self._group(a.get("group_name"))
                name = f"{spec.name}@{gname}"
                ins = _tensors(a.get(spec.input), spec.input)
                module, phase = self.scope.where()
                if spec.name in REDUCTIONS:
                    self.tracer.reduction(phase, gname)
                other = {k: v for k, v in a.items() if k not in skip}
                hz = self.ctx.hazards
                flags = hz.flag_all([t for _, t in ins]) if hz is not None and hz.active else None
                call = rec.record_call(
                    "collective",
                    name,
                    module,
                    phase,
                    [("input", p, t) for p, t in ins],
                    args_src=((), other),
                    hazards=flags,
                )
            if guard.failed:
                call = None
            if spec.output:
                rec.settle()  # it writes an argument from C++, unseen by the dispatch mode
            result = orig(*args, **kwargs)
            if call is not None:
                self._launched(call, _output(spec, a, result))
            return result

        return wrapper

    def _launched(self, call: Any, outs: list[tuple[str, torch.Tensor]]) -> None:
        """The output records, right after the launch; their digests wait for the completion."""
        rec = self.rec
        with rec.guard("{} launch", call[NAME]):
            rec.inflight.launch([t for _, t in outs], self._wait_for, rec.step)
            for _, t in outs:
                for p in storage_ptrs(t) or ():
                    self.tracer.pending[("functional", p)] = (call[NAME], call[MODULE])
            rec.append_records(call, [("output", p, t) for p, t in outs], fresh=True)

    def _wait_for(self, buffer: torch.Tensor) -> None:
        """Capture's own completion of a collective (at the step end): the original wait."""
        if self.wait is not None:
            self.wait(buffer)

    def _make_wait(self, orig: Any) -> Callable:
        self.wait = orig
        pending = self.tracer.pending

        def wait_tensor(*args: Any, **kwargs: Any) -> Any:
            out = orig(*args, **kwargs)
            rec = self.rec
            if rec.inflight and not rec.busy:
                t = args[0] if args else kwargs.get("tensor")
                if isinstance(t, torch.Tensor):
                    for p in storage_ptrs(t) or ():
                        pending.pop(("functional", p), None)
                    rec.complete([t])
            return out

        return wait_tensor
