"""Level ``ops``: every ATen op through a TorchDispatchMode.

Per op: the inputs are recorded (and their digests started) *before* the op runs, so an
in-place op's input is the value it read; the op runs; the outputs are recorded. The hot
path is kept short: per-overload facts (name, written arguments, view-ness) are computed
once and cached in ``OpInfo``; non-tensor arguments are kept as a small tuple and hashed at
flush; key hashes are computed by the writer thread; a tensor whose (identity, version) was
already digested reuses that digest. View and metadata-only ops are counted (records with
status ``skipped``) but not digested unless ``views=True``.

Phase and module: inside a checkpoint recompute the module stack says so; otherwise an op
that runs while autograd executes a node is ``backward`` and takes its module from the node's
tag (see _hooks); otherwise the innermost module and the recorder's phase. While the tracer
does its own tensor work (``rec.busy``), inside a watched compiled module, or while dynamo
traces (``ignore_compile_internals``), ops pass straight through.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from detfp_capture._recorder.deferred import storage_ptrs
from detfp_capture._recorder.hazards import UNINIT, storage_key
from detfp_capture._recorder.records import flat_args
from detfp_capture._sources.modules import NODE_KEY

__all__ = ["CaptureMode", "OpInfo"]

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
    "aten::mkldnn_rnn_layer": frozenset({3}),
    "aten::_cudnn_rnn": frozenset({3}),
    "aten::miopen_rnn": frozenset({4}),
    "aten::cudnn_batch_norm": frozenset({3}),
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
        "dest_kw",
        "dest_pos",
        "empty",
        "meta_read",
        "name",
        "no_read",
        "nonblocking",
        "out_kwargs",
        "reads",
        "skip",
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
        # Whether the op's input records are digested: not for views and metadata ops (unless
        # views=True), nor for ops that read only their inputs' shape (empty_like, new_zeros).
        self.reads = not self.skip and not self.meta_read
        self.workspace = WORKSPACE_OUTPUTS.get(base, frozenset())
        # A collective returns before its (possibly asynchronous) write completes: its outputs
        # are counted, not digested (the collective's own record, kind collective, is taken at
        # wait(); a functional collective's result is digested where wait_tensor returns it).
        self.async_out = c10d or (base.startswith(_FUNCTIONAL) and not base.endswith("::wait_tensor"))
        self.nonblocking = base in ("aten::_to_copy", "aten::copy_", "aten::to")


_FUNCTIONAL = ("_c10d_functional::", "c10d_functional::")
#: c10d ops whose ``tensors`` argument is reduced or broadcast in place (read, then written).
_C10D_INPLACE = frozenset({"c10d::allreduce_", "c10d::allreduce_coalesced_", "c10d::broadcast_", "c10d::reduce_"})


def _c10d_writes(base: str, schema: Any) -> tuple[list[int], list[int]]:
    """(written positions, write-only positions) of a c10d op, from its argument names."""
    writes, dest = [], []
    for i, a in enumerate(schema.arguments):
        if "Tensor" not in str(a.type):
            continue
        if a.name.startswith("output") or (a.name == "tensors" and base.startswith("c10d::recv")):
            writes.append(i)
            dest.append(i)
        elif a.name == "tensors" and base in _C10D_INPLACE:
            writes.append(i)
    return writes, dest


def _gather(
    args: tuple, kwargs: dict, dest_pos: frozenset = frozenset(), dest_kw: frozenset = frozenset()
) -> tuple[list[tuple[str, str, torch.Tensor]], tuple | None]:
    """Input records (role ``dest`` for write-only arguments) and the non-tensor arguments
    (kept for args_digest; no tensor references)."""
    tensors: list[tuple[str, str, torch.Tensor]] = []
    other: list[Any] = []
    for i, a in enumerate(args):
        role = "dest" if i in dest_pos else "input"
        if isinstance(a, torch.Tensor):
            tensors.append((role, f"args[{i}]", a))
        elif isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor | None):
            for j, x in enumerate(a):
                if isinstance(x, torch.Tensor):
                    tensors.append((role, f"args[{i}][{j}]", x))
        else:
            other.append(a)
    kw: list[tuple[str, Any]] = []
    for k, v in kwargs.items():
        role = "dest" if k in dest_kw else "input"
        if isinstance(v, torch.Tensor):
            tensors.append((role, f"kwargs.{k}", v))
        elif isinstance(v, (list, tuple)) and v and isinstance(v[0], torch.Tensor):
            for j, x in enumerate(v):
                if isinstance(x, torch.Tensor):
                    tensors.append((role, f"kwargs.{k}[{j}]", x))
        else:
            kw.append((k, v))
    return tensors, flat_args(other, kw)


def _outputs(out: Any) -> list[tuple[str, str, torch.Tensor]]:
    if isinstance(out, torch.Tensor):
        return [("output", "out", out)]
    if isinstance(out, (list, tuple)):
        return [("output", f"out[{i}]", t) for i, t in enumerate(out) if isinstance(t, torch.Tensor)]
    return []


def _tensors_in(v: Any) -> list[torch.Tensor]:
    """Tensors of an argument: a tensor, or (nested, as c10d's output lists) lists of them."""
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, (list, tuple)):
        return [t for x in v for t in _tensors_in(x)]
    return []


def _written_storages(info: OpInfo, args: tuple, kwargs: dict) -> list[int] | None:
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


def before_write(rec: Any, info: OpInfo, args: tuple, kwargs: dict) -> None:
    """What any op that writes must do first, recorded or not (an op of a module left out by
    ``modules=`` writes all the same); the caller holds ``rec.busy``.

    - Digests waiting for a batch must see the values from before this write: those in the
      written storages are snapshotted now (all of them when a storage is unknown).
    - Cached digests of other tensors over the written storages are dropped. A view shares its
      base's version counter, but a ``.data`` alias has its own: a write through it (weight
      clipping with ``p.data.clamp_``, an EMA through ``.data``) moves no counter of the
      tensor it aliases, whose next read would reuse the digest of its old bytes.
    """
    ptrs = _written_storages(info, args, kwargs)
    if rec.deferred:
        if ptrs is None:
            rec.run_deferred(staging=False)
        else:
            hit = [p for p in ptrs if p in rec.deferred_storages]
            if hit:
                rec.evict_deferred(hit)
    if ptrs is None:
        rec.clear_vcache()
        return
    vstor = rec.vstor
    if vstor:
        vc = rec.vcache
        for p in ptrs:
            ids = vstor.pop(p, None)
            if ids is not None:
                for k in ids:
                    vc.pop(k, None)


def _on_accelerator(args: tuple, outs: list[tuple[str, str, torch.Tensor]]) -> bool:
    """Whether a copy touches a non-CPU device: a non_blocking copy between CPU tensors is
    synchronous, so its destination is never pending."""
    tensors = [*args[:2], *(t for _, _, t in outs)]
    return any(isinstance(t, torch.Tensor) and t.device.type != "cpu" for t in tensors)


def _op_outputs(info: OpInfo, args: tuple, out: Any) -> list[tuple[str, str, torch.Tensor]]:
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


def _track_hazard_state(hz: Any, info: OpInfo, args: tuple, kwargs: dict, outs: list) -> None:
    """What an op changes in the hazard state: tensors born empty, written, or the destination
    of a non-blocking copy (recorded or not: see CaptureMode._pre)."""
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


def _note_written(rec: Any, outs: list[tuple[str, str, torch.Tensor]]) -> None:
    """Remember the Slots just cached for the tensors a writing op wrote, with the version they
    were cached at (the one from before the write: see ``promote``)."""
    vc = rec.vcache
    written = rec.written
    for _, _, t in outs:
        s = vc.get(id(t))
        if s is not None:
            written.append((t, s, s.version))


def promote(rec: Any) -> None:
    """Re-key the digests of the last op's written tensors to the version they have now.

    A writing op's outputs are cached at the version seen inside the dispatcher; the op's own
    bump (once per written tensor, in ADInplaceOrView) comes after it returns. Without this,
    the next op reading such a tensor (``param.addcdiv_`` after ``param.mul_``, an optimizer
    state read right after its update) would miss the cache and copy and hash the same bytes
    again. This runs at the start of the next op, before it or anything seen by the mode can
    write: exactly one bump since then is the op's own, and any other count (no bump, a
    second write) leaves the entry unmatched, so the digest is simply taken again."""
    vc = rec.vcache
    for t, s, v in rec.written:
        if s.version == v and vc.get(id(t)) is s and t._version == v + 1:
            s.version = v + 1
    rec.written.clear()


#: Autocast dispatch keys of the device types this build has (see CaptureMode._run).
_AUTOCAST_KEYS = tuple(
    getattr(torch._C.DispatchKey, n)
    for n in ("AutocastCPU", "AutocastCUDA", "AutocastXPU", "AutocastMPS")
    if hasattr(torch._C.DispatchKey, n)
)


class CaptureMode(TorchDispatchMode):
    """The op-level tracer; one per Session, entered for selected steps only."""

    def __init__(self, session: Any) -> None:
        super().__init__()
        self.s = session
        self.rec = session._rec
        self.hooks = session._hooks
        self.info: dict[Any, OpInfo] = {}
        self.autocast_keys: dict[Any, tuple] = {}  # op -> autocast keys it has no kernel for
        # Storage -> weak reference of a workspace output (see WORKSPACE_OUTPUTS): its readers
        # do not digest it either, while the tensor lives.
        self.workspaces: dict[int, Any] = {}
        self.views = session._cfg.views

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # Let torch.compile trace and run its compiled artifacts; regions are recorded at their boundaries.
        return True

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if kwargs is None:
            kwargs = {}
        rec = self.rec
        if rec.busy or not rec.selected or rec.failed or self.s._compiled_depth or self.s._bookkeeping:
            return self._call(func, args, kwargs)
        try:
            pre = self._pre(func, args, kwargs)
        except Exception as exc:
            rec.busy = False
            rec.fail(exc, f"dispatch of {func}")
            return self._call(func, args, kwargs)
        if pre is None:
            return self._call(func, args, kwargs)
        kr = self.s._kernel_range
        if kr is not None and pre[0] is not None:
            with kr(pre[0]):
                out = self._call(func, args, kwargs)
        else:
            out = self._call(func, args, kwargs)
        try:
            self._post(pre, args, kwargs, out)
        except Exception as exc:
            rec.busy = False
            rec.fail(exc, f"dispatch of {func}")
        if rec.need_flush:
            self.s._flush_safely()
        return out

    def _call(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """Run ``func`` as it would run without the mode, where autocast is concerned.

        A dispatch mode's handler runs with every key above the Python key excluded, autocast
        included. An op whose autocast kernel is a fallthrough (custom ops, ops without an
        autocast rule) normally runs with autocast still on, so whatever its kernel dispatches
        (a custom op's Python body, a composite kernel's inner matmul) is autocast; called from
        the handler it would not be, and the numbers would change. So the autocast keys that
        were on when the op entered the dispatcher, and that have no kernel of their own for
        this op, are turned back on for the call (only once the session has seen autocast)."""
        if not self.s._autocast_seen:
            return func(*args, **kwargs)
        keys = self.autocast_keys.get(func)
        if keys is None:
            name = func.name()
            keys = self.autocast_keys[func] = tuple(
                k for k in _AUTOCAST_KEYS if not torch._C._dispatch_has_kernel_for_dispatch_key(name, k)
            )
        if keys:
            with torch._C._RestorePythonTLSSnapshot():
                on_entry = torch._C._dispatch_tls_local_exclude_set()
            now = exclude = torch._C._dispatch_tls_local_exclude_set()
            for k in keys:
                if now.has(k) and not on_entry.has(k):
                    exclude = exclude.remove(k)
            if exclude is not now:
                with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude):
                    return func(*args, **kwargs)
        return func(*args, **kwargs)

    def _where(self) -> tuple[str, str] | None:
        stack = self.hooks.stack
        if stack and stack[-1][2] == "recompute":
            return stack[-1][1], "recompute"
        node = torch._C._current_autograd_node()
        if node is not None:
            if self.s._saw_compiled and "CompiledFunction" in node.name():
                return None  # the backward of a compiled region: recorded at its boundary only
            if not self.s._bwd_queued:
                self.s._note_backward()
            return node.metadata.get(NODE_KEY, ""), "backward"
        if stack:
            return stack[-1][1], stack[-1][2]
        return "", self.rec.phase

    def _pre(self, func: Any, args: tuple, kwargs: dict) -> tuple | None:
        if self.rec.written:
            promote(self.rec)
        info = self.info.get(func)
        if info is None:
            info = self.info[func] = OpInfo(func, self.views)
        where = self._where()
        if where is None:
            return None
        module, phase = where
        rec = self.rec
        if rec.cfg.modules is not None and not self.hooks.module_selected(module):
            # Not recorded, but its writes still count: waiting and cached digests of what it
            # overwrites, and the hazard state (a buffer it fills is no longer uninitialized).
            if info.writing:
                rec.busy = True
                before_write(rec, info, args, kwargs)
                rec.busy = False
            # Only an allocation, a write or a copy changes the hazard state: other ops pay nothing.
            hz = self.s._hazard
            if hz is not None and (info.empty or info.writing or info.nonblocking):
                return None, info, None, False
            return None
        rec.busy = True
        tensors, other = _gather(args, kwargs, info.dest_pos, info.dest_kw)
        # No digest waits for a batch during a backward: a waiting digest holds its tensor, and
        # autograd's AccumulateGrad copies a gradient instead of stealing it when anything else
        # holds it (new_empty_strided + copy_ instead of detach): capture would change the
        # program's own ops, and whether it does would depend on when the batch last ran.
        defer = info.batch_inputs and phase != "backward"
        hz = self.s._hazard
        flags = None
        taint = False  # a read-modify-write of unwritten memory: its output is flagged too
        blind: set[int] = set()  # inputs read while unwritten, or workspaces: recorded, not digested
        ws = self.workspaces
        if ws and tensors:
            for i, (_, _, t) in enumerate(tensors):
                k = storage_key(t)
                ref = ws.get(k) if k is not None else None
                if ref is not None:
                    if ref() is None:
                        del ws[k]  # its tensor died: the storage may hold anything now
                    else:
                        blind.add(i)
        if hz is not None and hz.active and tensors:
            flags = {}
            written = {f"args[{i}]" for i in info.writes} if info.writes else ()
            for i, (role, arg, t) in enumerate(tensors):
                if info.meta_read:
                    break  # only the shape is read
                f = hz.flags(t)
                if not f:
                    continue
                if UNINIT in f and (role == "dest" or arg in written or arg.partition("]")[0] + "]" in written):
                    # A destination still (partly) unwritten: its bytes are garbage that differs
                    # between runs. It is recorded write-only (no digest); only an op that reads
                    # its destination (add_ into empty memory) reads garbage: an event, and the
                    # output inherits the flag.
                    if role != "dest":
                        tensors[i] = ("dest", arg, t)
                    if not info.no_read and not info.skip:
                        hz.event(UNINIT, module, f"{info.name} {arg} read while {UNINIT}")
                        taint = True
                    f = tuple(h for h in f if h != UNINIT)
                    if not f:
                        continue
                flags[i] = f
                if UNINIT in f:
                    # Read while (partly) unwritten: garbage that differs between processes, so
                    # not digested (no evidence); what the op computes from it inherits the flag.
                    # (An op without alias annotations may only be filling it: FSDP's copy-in.)
                    blind.add(i)
                    taint = taint or not info.skip
                # Views and metadata ops do not read contents; a write-only argument is not read
                # either (an async or non-blocking hazard on it is still flagged): no event.
                if not info.skip and tensors[i][0] != "dest":
                    for h in f:
                        hz.event(h, module, f"{info.name} {arg} read while {h}")
            flags = flags or None
        if flags is None and not blind and (info.dest_pos or info.dest_kw or any(r == "dest" for r, _, _ in tensors)):
            # Write-only arguments are counted, never digested: inputs first, then destinations.
            ins = [x for x in tensors if x[0] == "input"]
            dests = [x for x in tensors if x[0] == "dest"]
            call = rec.record_call(
                "op", info.name, module, phase, ins, args_src=other, digest_it=info.reads, defer=defer
            )
            if dests:
                rec.append_records(call, dests, digest_it=False)
        elif flags is not None or blind:
            call = rec.record_call("op", info.name, module, phase, [], args_src=other)
            for i, item in enumerate(tensors):
                f = flags.get(i) if flags else None
                rec.append_records(
                    call,
                    [item],
                    hazards={0: f} if f else None,
                    digest_it=info.reads and item[0] != "dest" and i not in blind,
                    defer=defer,
                )
        else:
            call = rec.record_call(
                "op",
                info.name,
                module,
                phase,
                tensors,
                args_src=other,
                digest_it=info.reads,
                # A writing op runs the batch right below, before the write: worth it for the many
                # tensors of a _foreach_ op, not for a single in-place tensor.
                defer=defer,
            )
        if info.writing:
            before_write(rec, info, args, kwargs)
        rec.busy = False
        return call, info, phase, taint

    def _post(self, pre: tuple, args: tuple, kwargs: dict, out: Any) -> None:
        call, info, phase, taint = pre
        rec = self.rec
        rec.busy = True
        outs = _op_outputs(info, args, out)
        hz = self.s._hazard
        flags = None
        if hz is not None:
            _track_hazard_state(hz, info, args, kwargs, outs)
            if call is None:  # an op of a module left out by modules=: state only
                rec.busy = False
                return
            if (hz.active or taint) and outs and not info.empty:
                # A fresh empty* output is not a read of uninitialized memory (its readers are).
                flags = {}
                for i, (_, _, t) in enumerate(outs):
                    f = hz.flags(t)
                    if taint and UNINIT not in f:
                        f = (*f, UNINIT)  # computed from unwritten bytes it read
                    if f:
                        flags[i] = f
                flags = flags or None
        # Inside the dispatcher an in-place op has not bumped the version counter yet (that happens
        # above us, in ADInplaceOrView): outputs of writing ops are digested afresh, never reused.
        # What was cached over the storages they write went in _pre (before_write), so the entries
        # made now for them are new ones (_note_written relies on that).
        fresh = info.writing
        if outs and info.workspace:
            for i in info.workspace:
                if i < len(outs):  # its readers (the op's backward) do not digest it either
                    t = outs[i][2]
                    k = storage_key(t)
                    if k is not None:
                        self.workspaces[k] = weakref.ref(t)
            # Split off the workspace outputs (not digested), keeping each record's hazards.
            for i, item in enumerate(outs):
                f = flags.get(i) if flags else None
                rec.append_records(
                    call,
                    [item],
                    hazards={0: f} if f else None,
                    digest_it=i not in info.workspace and not (info.skip or info.empty or info.async_out),
                    fresh=fresh,
                    defer=phase != "backward",
                )
        elif outs:
            rec.append_records(
                call,
                outs,
                hazards=flags,
                digest_it=not (info.skip or info.empty or info.async_out),
                fresh=fresh,
                defer=phase != "backward",
            )
            if fresh:
                _note_written(rec, outs)
        rec.busy = False
