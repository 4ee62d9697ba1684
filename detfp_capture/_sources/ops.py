"""What the op-level source knows about each ATen op overload, and the helpers around it.

``OpInfo`` holds the per-overload facts computed once from the schema (name, written arguments,
write-only arguments, view-ness, ...), which the dispatch mode's hot path reads. The tables
below name the ops whose schema does not say enough: metadata-only ops, ``empty*`` allocations,
full overwrites (a write-only destination), writes that read nothing, opaque workspace outputs,
ops that read only their input's shape, inputs an op ignores for some argument values. The
functions take a call's output records (``op_outputs``; its inputs are the record path's
``gather``, ``_recorder.args``), find the storages it writes (``written_storages``) and keep the
hazard state (``track_hazard_state``).
"""

from __future__ import annotations

from typing import Any

import torch

from detfp_capture._recorder.args import ARG_NAMES, OUT_NAMES
from detfp_capture._recorder.call import TensorArg
from detfp_capture._recorder.slot import storage_ptrs

__all__ = [
    "FULL_OVERWRITE",
    "UNREAD_WHEN",
    "WORKSPACE_OUTPUTS",
    "WRITE_NO_READ",
    "OpInfo",
    "op_outputs",
    "track_hazard_state",
    "unread_input",
    "written_storages",
]

_METADATA_ONLY = frozenset(
    {
        "aten::detach",
        "aten::alias",
        "aten::lift_fresh",
        "aten::_unsafe_view",
        "aten::size",
        "aten::stride",
        "aten::sym_size",
        "aten::sym_stride",
        "aten::sym_numel",
        "aten::sym_storage_offset",
        "aten::is_same_size",
        "aten::_has_compatible_shallow_copy_type",
        "prim::device",
        "prim::layout",
    }
)
_EMPTY = frozenset(
    {
        "aten::empty",
        "aten::empty_like",
        "aten::new_empty",
        "aten::new_empty_strided",
        "aten::empty_strided",
        "aten::empty_permuted",
    }
)
# In-place ops that overwrite every element of their destination without reading it: the
# destination's prior contents are not evidence of anything (write-only, role ``dest``).
# (resize_ is not here: it keeps the prior contents it does not cut off.)
FULL_OVERWRITE = frozenset(
    {
        "aten::copy_",
        "aten::fill_",
        "aten::zero_",
        "aten::uniform_",
        "aten::normal_",
        "aten::random_",
        "aten::exponential_",
        "aten::geometric_",
        "aten::cauchy_",
        "aten::log_normal_",
        "aten::bernoulli_",
        "aten::set_",
        "aten::_foreach_copy_",
        "aten::_foreach_zero_",
    }
)
# In-place ops that write some elements of their destination without reading any (the rest is
# kept): on a destination that is still unwritten (fresh from empty*), nothing is read, so no
# hazard is raised; whether every element got written shows in the output.
WRITE_NO_READ = frozenset(
    {
        "aten::index_put_",
        "aten::_index_put_impl_",
        "aten::index_copy_",
        "aten::index_fill_",
        "aten::masked_fill_",
        "aten::masked_scatter_",
        "aten::scatter_",
        "aten::put_",
        "aten::fill_diagonal_",
        "aten::resize_",
    }
)


# Outputs that are a kernel's opaque workspace for its own backward (reserve space), left partly
# uninitialized by the kernel's C++ allocation: recorded without a digest (never evidence).
WORKSPACE_OUTPUTS = {
    # FSDP2's all-gather buffer: this rank's slice copied in, the rest filled by the all-gather
    # that follows (its record, kind collective, digests the buffer once it completed).
    "fsdp::all_gather_copy_in": frozenset({1}),
    "aten::mkldnn_rnn_layer": frozenset({3}),
    "aten::_cudnn_rnn": frozenset({3}),
    "aten::miopen_rnn": frozenset({4}),
    "aten::cudnn_batch_norm": frozenset({3}),
}


#: Inputs an op does not read for one value of a scalar argument, as torch documents them ("if
#: beta is 0, then input will be ignored"): op (and its in-place form, ``name_``) -> (the input,
#: the argument, the value). Megatron-Core's attention hands ``baddbmm`` an uninitialized buffer
#: with ``beta=0``: the buffer is neither evidence nor an uninitialized read.
UNREAD_WHEN = {
    "aten::addmm": ("self", "beta", 0),
    "aten::_addmm_activation": ("self", "beta", 0),
    "aten::addbmm": ("self", "beta", 0),
    "aten::baddbmm": ("self", "beta", 0),
    "aten::addmv": ("self", "beta", 0),
    "aten::addr": ("self", "beta", 0),
}


# Ops that read only their input's metadata (shape, dtype, device), never its contents.
_META_READ = frozenset(
    {
        "aten::empty_like",
        "aten::zeros_like",
        "aten::ones_like",
        "aten::full_like",
        "aten::rand_like",
        "aten::randn_like",
        "aten::randint_like",
        "aten::new_empty",
        "aten::new_empty_strided",
        "aten::new_zeros",
        "aten::new_ones",
        "aten::new_full",
    }
)


class OpInfo:
    """Cached facts about one op overload."""

    __slots__ = (
        "async_out",
        "batch_inputs",
        "copies_input",
        "dest_kw",
        "dest_pos",
        "empty",
        "group_arg",
        "meta_read",
        "name",
        "no_read",
        "nonblocking",
        "out_kwargs",
        "plain_in",
        "plain_out",
        "reads",
        "skip",
        "unread",
        "workspace",
        "writes",
        "writing",
    )

    def __init__(self, func: Any, views: bool) -> None:
        schema = func._schema
        base = schema.name
        self.name = f"{base}.{func._overloadname}"
        self.skip = (func.is_view or base in _METADATA_ONLY) and not views
        writes = []
        outs = []
        for i, a in enumerate(schema.arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                if a.kwarg_only:
                    outs.append(a.name)
                else:
                    writes.append(i)
        c10d = base.startswith("c10d::")
        dest_pos: list[int] = []
        if c10d:
            # c10d schemas carry no alias annotations, yet the ops write their outputs (and
            # all_reduce/broadcast their tensors in place), from another thread, after they
            # return: the written arguments come from the names.
            writes, dest_pos = _c10d_writes(base, schema)
        self.writes = tuple(writes)
        self.out_kwargs = tuple(outs)
        self.writing = bool(writes or outs)
        self.batch_inputs = not self.writing or base.startswith("aten::_foreach_")
        self.empty = base in _EMPTY
        # Write-only arguments (role ``dest``, never digested): ``out=`` arguments (the schema
        # marks them kwarg-only and written), the destinations of full overwrites, and the
        # outputs of c10d ops. Their prior contents are garbage more often than not (DDP's
        # gradient-bucket views, FSDP2's all-gather buffers, foreach out= calls).
        full = base in FULL_OVERWRITE
        self.dest_pos = frozenset(writes if full else dest_pos)
        self.dest_kw = frozenset(outs)
        self.no_read = full or bool(outs) or base in WRITE_NO_READ
        self.meta_read = base in _META_READ
        self.unread = _unread(base, schema)
        # Whether the op's input records are digested: not for views and metadata ops (unless
        # views=True), nor for ops that read only their inputs' shape (empty_like, new_zeros).
        self.reads = not self.skip and not self.meta_read
        self.workspace = WORKSPACE_OUTPUTS.get(base, frozenset())
        # A functional collective's group is named by a process-local counter (the order groups
        # were created in this process): its records name the group as every record does.
        self.group_arg = next(
            (i for i, a in enumerate(schema.arguments) if a.name == "group_name" and base.startswith(_FUNCTIONAL)),
            None,
        )
        # A collective returns before its (possibly asynchronous) write completes: its outputs
        # are counted, not digested (the collective's own record, kind collective, is taken at
        # wait(); a functional collective's result is digested where wait_tensor returns it).
        self.async_out = c10d or (base.startswith(_FUNCTIONAL) and not base.endswith("::wait_tensor"))
        self.nonblocking = base in ("aten::_to_copy", "aten::copy_", "aten::to")
        # The output is its input's exact copy (same dtype, shape and logical bytes, so the same
        # digest, whatever the memory format): it shares the input's digest (Recorder.append_copy).
        self.copies_input = self.name == "aten::clone.default"
        # The ops the native record path takes (``_hostpath.op_pre``/``op_post``; the others go
        # through CaptureMode._pre/_post in Python): inputs all read and recorded as they are,
        # not an exact copy; outputs neither workspaces, fresh allocations nor non-blocking copies.
        self.plain_in = not (
            self.dest_pos or self.dest_kw or self.unread is not None or self.copies_input or self.group_arg is not None
        )
        self.plain_out = not (self.workspace or self.empty or self.nonblocking)


def _unread(base: str, schema: Any) -> tuple[str, int, str, Any] | None:
    """(the input's record arg, the argument's position, its name, the value that leaves the
    input unread) for an op of ``UNREAD_WHEN``, else None."""
    rule = UNREAD_WHEN.get(base) or UNREAD_WHEN.get(base.removesuffix("_"))
    if rule is None:
        return None
    names = [a.name for a in schema.arguments]
    if rule[0] not in names or rule[1] not in names:
        return None
    return ARG_NAMES[names.index(rule[0])], names.index(rule[1]), rule[1], rule[2]


def unread_input(info: OpInfo, args: tuple, kwargs: dict) -> str | None:
    """The record arg (``args[i]``) of an input this call does not read (``UNREAD_WHEN``), or None."""
    arg, pos, name, value = info.unread  # type: ignore[misc]
    given = args[pos] if pos < len(args) else kwargs.get(name)
    return arg if given is not None and not isinstance(given, torch.Tensor) and given == value else None


_FUNCTIONAL = ("_c10d_functional::", "c10d_functional::")
#: c10d ops whose ``tensors`` argument is reduced or broadcast in place (read, then written).
_C10D_INPLACE = frozenset({"c10d::allreduce_", "c10d::allreduce_coalesced_", "c10d::broadcast_", "c10d::reduce_"})
#: c10d ops whose tensor is a placeholder the library allocates (``torch.empty``) and never reads
#: for its value: write-only, so its garbage is never digested.
_C10D_PLACEHOLDER = frozenset({"c10d::barrier", "c10d::monitored_barrier_"})


def _c10d_writes(base: str, schema: Any) -> tuple[list[int], list[int]]:
    """(written positions, write-only positions) of a c10d op, from its argument names."""
    writes, dest = [], []
    for i, a in enumerate(schema.arguments):
        if "Tensor" not in str(a.type):
            continue
        if base in _C10D_PLACEHOLDER:
            dest.append(i)  # neither read nor written: recorded, never digested
        elif a.name.startswith("output") or (a.name == "tensors" and base.startswith("c10d::recv")):
            writes.append(i)
            dest.append(i)
        elif a.name == "tensors" and base in _C10D_INPLACE:
            writes.append(i)
    return writes, dest


def _outputs(out: Any) -> list[TensorArg]:
    if isinstance(out, torch.Tensor):
        return [("output", "out", out)]
    if isinstance(out, (list, tuple)):
        return [
            ("output", OUT_NAMES[i] if i < 64 else f"out[{i}]", t)
            for i, t in enumerate(out)
            if isinstance(t, torch.Tensor)
        ]
    return []


def _tensors_in(v: Any) -> list[torch.Tensor]:
    """Tensors of an argument: a tensor, or (nested, as c10d's output lists) lists of them."""
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, (list, tuple)):
        return [t for x in v for t in _tensors_in(x)]
    return []


def written_storages(info: OpInfo, args: tuple, kwargs: dict) -> list[int] | None:
    """Data pointers of the storages the op writes into; None when a written tensor has no
    plain storage to check (a subclass, sparse: then assume it may write anything)."""
    written: list[Any] = [args[i] for i in info.writes if i < len(args)]
    written += [kwargs[k] for k in info.out_kwargs if k in kwargs]
    ptrs: list[int] = []
    for w in written:
        for t in _tensors_in(w):
            own = storage_ptrs(t)  # a wrapper subclass: its inner tensors' storages
            if own is None:
                return None
            ptrs += own
    return ptrs


def _on_accelerator(args: tuple, outs: list[TensorArg]) -> bool:
    """Whether a copy touches a non-CPU device: a non_blocking copy between CPU tensors is
    synchronous, so its destination is never pending."""
    tensors = [*args[:2], *(t for _, _, t in outs)]
    return any(isinstance(t, torch.Tensor) and t.device.type != "cpu" for t in tensors)


def op_outputs(info: OpInfo, args: tuple, out: Any) -> list[TensorArg]:
    outs = _outputs(out)
    if not outs and info.writes:
        # In-place ops that return nothing (the _foreach_*_ family): their written arguments
        # are the outputs.
        for i in info.writes:
            if i < len(args):
                a = args[i]
                if isinstance(a, torch.Tensor):
                    outs.append(("output", f"args[{i}]", a))
                elif isinstance(a, (list, tuple)):
                    outs.extend(
                        ("output", f"args[{i}][{j}]", x) for j, x in enumerate(a) if isinstance(x, torch.Tensor)
                    )
    return outs


def track_hazard_state(hz: Any, info: OpInfo, args: tuple, kwargs: dict, outs: list) -> None:
    """What an op changes in the hazard state: tensors born empty, written, or the destination
    of a non-blocking copy (recorded or not: see dispatch.CaptureMode._pre)."""
    if info.empty:
        for _, _, t in outs:
            hz.born_empty(t)
    elif hz.uninit and (info.writes or info.out_kwargs):
        for i in info.writes:
            if i < len(args):
                for t in _tensors_in(args[i]):
                    hz.wrote(t)
        for k in info.out_kwargs:
            v = kwargs.get(k)
            if isinstance(v, torch.Tensor):
                hz.wrote(v)
    if (
        info.nonblocking
        and (kwargs.get("non_blocking") or (len(args) > 2 and args[2] is True))
        and _on_accelerator(args, outs)
    ):
        for _, _, t in outs:
            hz.nonblocking_copy(t, info.name)
