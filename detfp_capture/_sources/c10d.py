"""What ``torch.distributed`` communicates through, by construction: the ProcessGroup's methods.

Every Python entry point of ``torch.distributed`` (``dist.all_reduce``, ``all_gather_single``,
``reduce_scatter_tensor``, ``isend``, the coalescing manager's exit...), and any alias of one a
library bound at import (Megatron-Core's ``reduce_scatter_tensor``), ends in a method of the
pybind class ``torch._C._distributed_c10d.ProcessGroup`` looked up at call time
(``group.allreduce``, ``_reduce_scatter_base``, ``allreduce_coalesced``...). So the collective
tracer wraps those methods (``METHODS``), not a list of Python names that lags torch.

What a method call is named: the public function the program called, read from the
``distributed_c10d`` frames above the method call (``entry``): the outermost one
(``all_gather_into_tensor``, which calls ``all_gather_single``), ``batch_<isend|irecv>`` inside
``batch_isend_irecv``, the method's own public name for a coalesced block's single call (the
coalescing manager's exit) or for a method called directly. Its non-tensor arguments are those of
the innermost public frame (what the method call was made for). ``ENTRIES`` classifies every
function of ``distributed_c10d`` that communicates (a test walks torch's source and fails on one
it does not name): object collectives (pickles, which may legitimately differ between runs) and
barriers are never records, nor is the set-up of groups.

Functional collectives (``torch.ops._c10d_functional``: C++ calls into the process group, never
these methods) are ``funcol``'s; DDP's C++ reducer is ``ddp``'s comm hook.

Groups are named stably across runs (``group_name``): the user's ``group_names``, ``world`` for
the default group, the dimension of a ``DeviceMesh`` a group was made for (``mesh_dp`` ->
``dp``) or Megatron-Core's description of it (``TENSOR_MODEL_PARALLEL_GROUP`` -> ``tp``), else
``ranks:<sorted ranks>``.
"""

from __future__ import annotations

import enum
import sys
from collections.abc import Mapping
from types import FrameType
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

__all__ = [
    "ENTRIES",
    "METHODS",
    "NOT_COMMUNICATING",
    "OBJECT_COLLECTIVES",
    "Entry",
    "Method",
    "Named",
    "entry",
    "group_name",
    "method_tensors",
    "parameters",
]


class Entry(enum.Enum):
    """What a function of ``torch.distributed.distributed_c10d`` that communicates is to capture."""

    #: A collective over tensors: one record per call, named after it.
    COLLECTIVE = "collective"
    #: A point-to-point send or receive.
    P2P = "p2p"
    #: Groups the calls made inside it: ``batch_isend_irecv`` (records ``batch_isend``/``batch_irecv``)
    #: and the coalescing manager (one record for the block, named after the method its exit calls).
    BATCH = "batch"
    #: Exchanges pickled Python objects: not recorded, nor are its own ops (their bytes are a pickle).
    OBJECT = "object"
    #: A barrier: no tensor of the program.
    SYNC = "sync"
    #: Creates process groups (their barriers are set-up, not the program's exchanges).
    SETUP = "setup"


_COLLECTIVES = (
    "all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_coalesced", "all_gather_into_tensor",
    "all_gather_single", "_all_gather_base", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single",
    "_reduce_scatter_base", "all_to_all", "all_to_all_single", "broadcast", "reduce", "gather", "scatter",
)  # fmt: skip
_OBJECTS = (
    "all_gather_object", "gather_object", "broadcast_object_list", "scatter_object_list", "send_object_list",
    "recv_object_list",
)  # fmt: skip
_SETUP = (
    "init_process_group", "new_group", "_new_group_with_tag", "new_subgroups", "new_subgroups_by_enumeration",
    "_find_or_create_pg_by_ranks_and_tag",
)  # fmt: skip

#: Every function of ``distributed_c10d`` that reaches a ProcessGroup method (directly or
#: through another), classified. ``tests/unit/test_c10d_entries.py`` walks torch's source.
ENTRIES: dict[str, Entry] = {
    **dict.fromkeys(_COLLECTIVES, Entry.COLLECTIVE),
    **dict.fromkeys(("send", "recv", "isend", "irecv"), Entry.P2P),
    **dict.fromkeys(("batch_isend_irecv", "_coalescing_manager"), Entry.BATCH),
    **dict.fromkeys(_OBJECTS, Entry.OBJECT),
    **dict.fromkeys(("barrier", "monitored_barrier"), Entry.SYNC),
    **dict.fromkeys(_SETUP, Entry.SETUP),
}

#: The object collectives, whose calls run as the library's own work (``collectives``).
OBJECT_COLLECTIVES = tuple(sorted(n for n, e in ENTRIES.items() if e is Entry.OBJECT))


class Method(NamedTuple):
    """How one ProcessGroup method's call becomes a record."""

    #: ``collective`` or ``p2p``.
    kind: str
    #: The public name of a call made outside any ``distributed_c10d`` function it is named after.
    name: str
    #: (position, parameter name) of what it reads, and of what it writes, after ``self``.
    reads: tuple[tuple[int, str], ...]
    writes: tuple[tuple[int, str], ...]
    #: It reduces (a gradient reduction is one of these in backward or the optimizer).
    reduces: bool = False


def _m(kind: str, name: str, reads: tuple, writes: tuple, reduces: bool = False) -> Method:
    return Method(kind, name, reads, writes, reduces)


_T, _O, _I = ((0, "tensors"),), ((0, "outputs"),), ((1, "inputs"),)

#: ProcessGroup method -> its record. Every overload takes its tensors first: (tensors) for the
#: in-place ones, (outputs, inputs) for the rest.
METHODS: dict[str, Method] = {
    "allreduce": _m("collective", "all_reduce", _T, _T, True),
    "allreduce_coalesced": _m("collective", "all_reduce_coalesced", _T, _T, True),
    "broadcast": _m("collective", "broadcast", _T, _T),
    "reduce": _m("collective", "reduce", _T, _T, True),
    "allgather": _m("collective", "all_gather", _I, _O),
    "allgather_coalesced": _m("collective", "all_gather_coalesced", _I, _O),
    "_allgather_base": _m("collective", "all_gather_into_tensor", _I, _O),
    "all_gather_single": _m("collective", "all_gather_single", _I, _O),
    "allgather_into_tensor_coalesced": _m("collective", "all_gather_into_tensor_coalesced", _I, _O),
    "all_gather_single_coalesced": _m("collective", "all_gather_single_coalesced", _I, _O),
    "reduce_scatter": _m("collective", "reduce_scatter", _I, _O, True),
    "_reduce_scatter_base": _m("collective", "reduce_scatter_tensor", _I, _O, True),
    "reduce_scatter_single": _m("collective", "reduce_scatter_single", _I, _O, True),
    "reduce_scatter_tensor_coalesced": _m("collective", "reduce_scatter_tensor_coalesced", _I, _O, True),
    "reduce_scatter_single_coalesced": _m("collective", "reduce_scatter_single_coalesced", _I, _O, True),
    "alltoall": _m("collective", "all_to_all", _I, _O),
    "alltoall_base": _m("collective", "all_to_all_single", _I, _O),
    "all_to_all_single": _m("collective", "all_to_all_single", _I, _O),
    "gather": _m("collective", "gather", _I, _O),
    "scatter": _m("collective", "scatter", _I, _O),
    "send": _m("p2p", "send", _T, ()),
    "recv": _m("p2p", "recv", (), _T),
    "recv_anysource": _m("p2p", "recv", (), _T),
}

#: The other attributes of ProcessGroup: no tensor of the program crosses them (barriers, the
#: group's identity and set-up; ``_start_coalescing``/``_end_coalescing`` bracket a block of
#: method calls, which ``collectives`` follows).
NOT_COMMUNICATING = frozenset(
    {
        "BackendType", "CUSTOM", "GLOO", "MPI", "NCCL", "UCC", "UNDEFINED", "XCCL", "_backend_id", "_device_types",
        "_enable_collectives_timing", "_start_coalescing", "_end_coalescing", "_get_backend", "_get_backend_name",
        "_get_sequence_number_for_group", "_has_hooks", "_id", "_pybind11_conduit_v1_", "_register_backend",
        "_register_on_completion_hook", "_set_default_backend", "_set_group_desc", "_set_group_name",
        "_set_sequence_number_for_group", "_wait_for_pending_works", "abort", "barrier", "bound_device_id", "boxed",
        "get_group_store", "group_desc", "group_name", "merge_remote_group", "monitored_barrier", "name", "rank",
        "set_timeout", "shutdown", "size", "split_group", "unbox", "use_pg_for_symm_mem_rendezvous",
    }
)  # fmt: skip


def _tensors(value: Any, prefix: str, out: list[tuple[str, torch.Tensor]]) -> None:
    if isinstance(value, torch.Tensor):
        out.append((prefix, value))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _tensors(v, f"{prefix}[{i}]", out)


def method_tensors(
    where: tuple[tuple[int, str], ...], args: tuple, kwargs: dict[str, Any]
) -> list[tuple[str, torch.Tensor]]:
    """(parameter path, tensor) of the method arguments at ``where`` (``Method.reads``/``writes``)."""
    out: list[tuple[str, torch.Tensor]] = []
    for pos, pname in where:
        value = args[pos] if pos < len(args) else kwargs.get(pname)
        _tensors(value, pname, out)
    return out


class Named(NamedTuple):
    """A method call as the program made it (``entry``)."""

    #: The record's collective name (before ``@<group>``).
    name: str
    #: The public function that made the call, whose parameters name the tensors, or None.
    frame: FrameType | None


_C10D = "torch.distributed.distributed_c10d"
#: Modules whose frames may sit between two ``distributed_c10d`` frames of one call: c10d's
#: logging decorators, ``typing_extensions.deprecated``'s wrapper, the coalescing manager's
#: ``contextlib`` exit.
_BETWEEN = frozenset({_C10D, "torch.distributed.c10d_logger", "typing_extensions", "contextlib"})
_NAMED = (Entry.COLLECTIVE, Entry.P2P)
#: Stack frames looked at above a method call, at most (c10d nests a few functions deep).
_DEPTH = 16


def entry(method: Method, depth: int) -> Named | None:
    """How the method call ``depth`` frames up (the wrapper's caller is 1) is named, or None when
    it is not the program's exchange (inside an object collective, a barrier or a group's set-up)."""
    try:
        f: FrameType | None = sys._getframe(depth + 1)
    except ValueError:
        return Named(method.name, None)
    names: list[tuple[str, FrameType]] = []  # distributed_c10d functions, innermost first
    n = 0
    while f is not None and n < _DEPTH:
        mod = f.f_globals.get("__name__")
        if mod not in _BETWEEN:
            break
        if mod == _C10D:
            names.append((f.f_code.co_name, f))
        f = f.f_back
        n += 1
    inner: FrameType | None = None
    first = ""
    for fname, fr in names:
        kind = ENTRIES.get(fname)
        if kind in (Entry.OBJECT, Entry.SYNC, Entry.SETUP):
            return None
        if inner is None and kind in _NAMED:
            inner, first = fr, fname
    if not names:
        return Named(method.name, None)
    outer = names[-1][0]
    kind = ENTRIES.get(outer)
    if outer == "batch_isend_irecv" and first in ENTRIES:
        return Named(f"batch_{first}", inner)
    if kind in _NAMED:
        return Named(outer, inner)
    # The coalescing manager's exit (one call for the block), or a function not classified yet.
    return Named(first or method.name, inner)


def parameters(frame: FrameType) -> dict[str, Any]:
    """A function frame's parameters and their current values (what the program passed, after
    the function's own normalization: ``group or default``, a complex tensor's real view)."""
    code = frame.f_code
    names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
    local = frame.f_locals
    return {k: local[k] for k in names if k in local}


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
