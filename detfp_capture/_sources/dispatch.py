"""Level ``ops``: every ATen op through a TorchDispatchMode.

Per op: the inputs are recorded (and their digests started or deferred) *before* the op runs,
so an in-place op's input is the value it read; the op runs; the outputs are recorded. The hot
path is kept short: per-overload facts are computed once (``ops.OpInfo``); non-tensor arguments
are kept as a small tuple and hashed at flush; key hashes are computed by the writer thread; a
tensor whose (identity, version) was already digested reuses that digest. View and
metadata-only ops are counted (records with status ``skipped``) but not digested unless
``views=True``.

Phase and module come from the scope (``Scope.op_where``): inside a checkpoint recompute the
module stack says so; otherwise an op that runs while autograd executes a node is ``backward``
and takes its module from the node's tag (``graph``); otherwise the innermost module and the
recorder's phase. While the tracer does its own tensor work (``rec.busy``), inside DDP's own
work, or while dynamo traces (``ignore_compile_internals``) or compiles (``_compiling``), ops pass
straight through; compiled code's own ATen calls (its GEMMs, fallbacks, custom ops) are recorded
as any op, next to its generated kernels (``inductor``). The handler is also called from C++ that
cannot pass a Python exception on (a Python-dispatched tensor's ``prim.device``): only the op
itself may raise out of it; capture's own failures take the guard's policy.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch._guards
from torch.utils._python_dispatch import TorchDispatchMode

from detfp_capture._recorder.hazards import UNINIT, storage_key
from detfp_capture._sources.c10d import group_name
from detfp_capture._sources.context import CaptureContext
from detfp_capture._sources.ops import (
    OpInfo,
    op_outputs,
    track_hazard_state,
    unread_input,
    written_storages,
)
from detfp_capture._sources.patches import Patches, watch_autocast, watch_storage_resizes, watch_syncs

__all__ = ["CaptureMode"]

#: Thread-local state of torch._guards, whose ``compile_context`` is set while dynamo compiles.
_GUARDS_TLS = torch._guards._TLS

#: Autocast dispatch keys of the device types this build has (see CaptureMode._call).
_AUTOCAST_KEYS = tuple(
    getattr(torch._C.DispatchKey, n)
    for n in ("AutocastCPU", "AutocastCUDA", "AutocastXPU", "AutocastMPS")
    if hasattr(torch._C.DispatchKey, n)
)


def _compiling() -> bool:
    """Whether torch.compile is compiling on this thread. Dynamo compiles with the dispatch modes
    taken off the stack, except where it compiles inside a DDP forward (its DDPOptimizer splits the
    graph at bucket boundaries through another path): there the mode sees the compiler's own ops
    on fake tensors, which pass through unrecorded."""
    return getattr(_GUARDS_TLS, "compile_context", None) is not None


def _in_dispatcher(func: Any) -> bool:
    """Whether the dispatcher has a schema for ``func`` (a TorchScript prim has none)."""
    schema = func._schema
    try:
        torch._C._dispatch_find_schema_or_throw(schema.name, schema.overload_name)
    except RuntimeError:
        return False
    return True


class CaptureMode(TorchDispatchMode):
    """The op-level tracer; one per Session, entered for selected steps only (``steps``)."""

    def __init__(self, ctx: CaptureContext) -> None:
        super().__init__()
        self.rec = ctx.rec
        self.scope = ctx.scope
        self.hazards = ctx.hazards
        self.views = ctx.cfg.views
        self.info: dict[Any, OpInfo] = {}
        self.autocast_keys: dict[Any, tuple] = {}  # op -> autocast keys it has no kernel for
        # Storage -> weak reference of a workspace output (see ops.WORKSPACE_OUTPUTS): its readers
        # do not digest it either, while the tensor lives.
        self.workspaces: dict[int, Any] = {}
        #: The job has entered autocast since the session opened (see ``_call``).
        self.autocast_seen = False
        #: For a step whose kernels are recorded: call -> profiler range around the op (set by
        #: the step boundaries for that step, else None).
        self.kernel_range: Any = None
        #: A functional collective's process-local group name -> its logical name.
        self.group_names: dict[Any, str] = {}
        self.ctx_group_names = ctx.group_names
        #: The recorder's record path (``_recorder.seam``): its op entries (``_pre``/``_post`` in C
        #: for the ops most steps are made of; NotImplemented, nothing done, otherwise; None on the
        #: Python path) and appends, looked up once here instead of per op.
        path = ctx.rec.path
        self.path = path
        self.op_pre = path.op_pre
        self.op_post = path.op_post

    def install(self, patches: Patches) -> None:
        """Observe what the mode cannot see (``patches``): autocast entry, explicit
        synchronizations (the ``nonblocking_pending`` hazard), storage resizes."""
        if self.hazards is not None:
            watch_syncs(patches, self.hazards.synchronized)
        watch_autocast(patches, self._saw_autocast)
        watch_storage_resizes(patches, self.rec)

    def _saw_autocast(self) -> None:
        self.autocast_seen = True

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # Let torch.compile trace and run its compiled artifacts; regions are recorded at their boundaries.
        return True

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if kwargs is None:
            kwargs = {}
        rec = self.rec
        scope = self.scope
        if rec.busy or not rec.selected or rec.failed or scope.bookkeeping or _compiling():
            return self._call(func, args, kwargs)
        # _pre and _post set rec.busy by hand (cheaper than enter/leave on this path). Their
        # failures follow the guard's policy (``guard.Guard``: capture off, training goes on),
        # spelled out here as try/except: a guard object and its two calls per op add up on
        # the busiest path of the capture.
        try:
            op_pre = self.op_pre
            pre = NotImplemented if op_pre is None else op_pre(self, func, args, kwargs)
            if pre is NotImplemented:
                pre = self._pre(func, args, kwargs)
        except Exception as exc:
            self._fail(exc, func)
            pre = None
        if pre is None:
            return self._call(func, args, kwargs)
        kr = self.kernel_range
        if kr is not None and pre[0] is not None:
            with kr(pre[0]):
                out = self._call(func, args, kwargs)
        else:
            out = self._call(func, args, kwargs)
        try:
            op_post = self.op_post
            if op_post is None or op_post(self, pre, args, kwargs, out) is NotImplemented:
                self._post(pre, args, kwargs, out)
        except Exception as exc:
            self._fail(exc, func)
        if rec.need_flush:
            rec.flush_safely()
        return out

    def _fail(self, exc: Exception, func: Any) -> None:
        """What ``rec.guard("dispatch of {}", func, busy=False)`` does with an exception."""
        rec = self.rec
        if rec.depth == 0:
            rec.busy = False  # set by hand on this path
        rec.fail(exc, f"dispatch of {func}")

    def _call(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """Run ``func`` as it would run without the mode, where autocast is concerned.

        A dispatch mode's handler runs with every key above the Python key excluded, autocast
        included. An op whose autocast kernel is a fallthrough (custom ops, ops without an
        autocast rule) normally runs with autocast still on, so whatever its kernel dispatches
        (a custom op's Python body, a composite kernel's inner matmul) is autocast; called from
        the handler it would not be, and the numbers would change. So the autocast keys that
        were on when the op entered the dispatcher, and that have no kernel of their own for
        this op, are turned back on for the call (only once the session has seen autocast).

        Only ``func`` itself may raise here: this handler is also called from C++ code that
        cannot pass a Python exception on (a tensor subclass's ``prim.device`` asked while
        autograd wraps an output: std::terminate, the job killed). So capture's own preparation
        fails by the guard's policy (``_fail``) and the op then runs plainly."""
        if not self.autocast_seen:
            return func(*args, **kwargs)
        try:
            keys = self._uncovered_autocast_keys(func)
            exclude = self._exclude_without(keys) if keys else None
        except Exception as exc:
            self._fail(exc, func)
            exclude = None
        if exclude is not None:
            with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude):
                return func(*args, **kwargs)
        return func(*args, **kwargs)

    def _uncovered_autocast_keys(self, func: Any) -> tuple:
        """The autocast keys ``func`` has no kernel for (cached per op)."""
        keys = self.autocast_keys.get(func)
        if keys is None:
            name = func.name()
            if _in_dispatcher(func):
                keys = tuple(k for k in _AUTOCAST_KEYS if not torch._C._dispatch_has_kernel_for_dispatch_key(name, k))
            else:
                # A TorchScript prim (prim::device, prim::layout: asked of a tensor subclass that
                # dispatches its metadata to Python) is no dispatcher op: no autocast kernel.
                keys = ()
            self.autocast_keys[func] = keys
        return keys

    @staticmethod
    def _exclude_without(keys: tuple) -> Any:
        """The exclude set with the autocast ``keys`` that were on when the op entered the
        dispatcher taken out; None when it is unchanged."""
        with torch._C._RestorePythonTLSSnapshot():  # type: ignore[attr-defined]  # in torch._C, not its stubs
            on_entry = torch._C._dispatch_tls_local_exclude_set()
        now = exclude = torch._C._dispatch_tls_local_exclude_set()
        for k in keys:
            if now.has(k) and not on_entry.has(k):
                exclude = exclude.remove(k)
        return None if exclude is now else exclude

    def _pre(self, func: Any, args: tuple, kwargs: dict) -> tuple | None:
        """Record the op's inputs before it runs; returns (call, info, phase, taint) for
        ``_post`` (call None: an op ``modules=`` leaves out, whose writes still count), or None
        when the op is neither recorded nor tracked."""
        rec = self.rec
        if rec.vcache.written:
            rec.vcache.promote()
        info = self.info.get(func)
        if info is None:
            info = self.info[func] = OpInfo(func, self.views)
        where = self.scope.op_where()
        if where is None:
            return None
        module, phase = where
        if rec.cfg.modules is not None and not self.scope.module_selected(module):
            # Not recorded, but its writes still count: waiting and cached digests of what it
            # overwrites, and the hazard state (a buffer it fills is no longer uninitialized).
            if info.writing:
                rec.busy = True
                rec.before_write(written_storages(info, args, kwargs))
                rec.busy = False
            # Only an allocation, a write or a copy changes the hazard state: other ops pay nothing.
            hz = self.hazards
            if hz is not None and (info.empty or info.writing or info.nonblocking):
                return None, info, None, False, None
            return None
        rec.busy = True
        if info.group_arg is not None:
            args = self._named_group(args, kwargs, info.group_arg)
        tensors, other = self.path.gather(args, kwargs, info.dest_pos, info.dest_kw)
        source = None  # an exact-copy op's input (tensor, Slot) when it was digested plainly
        # No digest waits for a batch during a backward: a waiting digest holds its tensor, and
        # autograd's AccumulateGrad copies a gradient instead of stealing it when anything else
        # holds it (new_empty_strided + copy_ instead of detach): capture would change the
        # program's own ops, and whether it does would depend on when the batch last ran.
        defer = info.batch_inputs and phase != "backward"
        flags, blind, taint, redest = self._inputs(info, module, tensors, args, kwargs)
        if flags is None and not blind and (info.dest_pos or info.dest_kw or redest):
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
            # (A writing op runs the batch right below, before the write: worth it for the many
            # tensors of a _foreach_ op, not for a single in-place tensor.)
            call = self.path.record_op(rec, info.name, module, phase, tensors, other, info.reads, defer)
            if info.copies_input and len(tensors) == 1:
                source = (tensors[0][2], rec.last_slot())
        if info.writing:
            # Digests waiting for a batch over what it writes are taken now, cached ones dropped.
            rec.before_write(written_storages(info, args, kwargs))
        rec.busy = False
        return call, info, phase, taint, source

    def _named_group(self, args: tuple, kwargs: dict, pos: int) -> tuple:
        """``args`` with a functional collective's group (a process-local name: a counter of the
        groups this process created) given as its logical name (``c10d.group_name``)."""
        given = args[pos] if pos < len(args) else kwargs.get("group_name")
        name = self.group_names.get(given)
        if name is None:
            try:
                from torch.distributed.distributed_c10d import _resolve_process_group

                name = group_name(_resolve_process_group(given), self.ctx_group_names)[0]  # type: ignore[arg-type]  # a GroupName is a str (NewType)
            except Exception:  # not a group this process knows: keep what was given
                name = str(given)
            self.group_names[given] = name
        if pos < len(args):
            return (*args[:pos], name, *args[pos + 1 :])
        kwargs["group_name"] = name
        return args

    def _inputs(
        self, info: OpInfo, module: str, tensors: list, args: tuple, kwargs: dict
    ) -> tuple[dict[int, tuple[str, ...]] | None, set[int], bool, bool]:
        """What ``_pre`` records of each input: the hazard flags by position (None: none), the
        positions recorded but not digested (``blind``: read while unwritten, workspaces, inputs
        the op ignores), whether the output inherits an uninitialized read (``taint``), and
        whether an input became a write-only destination (``redest``; ``tensors`` is updated)."""
        hz = self.hazards
        flags: dict[int, tuple[str, ...]] | None = None
        taint = False  # a read-modify-write of unwritten memory: its output is flagged too
        redest = False  # the hazard check made an input write-only (role dest)
        blind: set[int] = set()  # inputs read while unwritten, or workspaces: recorded, not digested
        ws = self.workspaces
        if ws and tensors:
            for i, (_, _, t) in enumerate(tensors):
                k = storage_key(t)
                if k is None:
                    continue
                ref = ws.get(k)
                if ref is not None:
                    if ref() is None:
                        del ws[k]  # its tensor died: the storage may hold anything now
                    else:
                        blind.add(i)
        unread = unread_input(info, args, kwargs) if info.unread is not None else None
        if unread is not None:
            # An input the op ignores for this argument value (baddbmm's with beta=0): recorded,
            # never digested (its bytes are no evidence) nor a read; in place, only written.
            for i, (_, arg, t) in enumerate(tensors):
                if arg == unread:
                    if info.writes and arg in {f"args[{w}]" for w in info.writes}:
                        tensors[i] = ("dest", arg, t)
                        redest = True
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
                dest = role == "dest" or arg in written or arg.partition("]")[0] + "]" in written
                if UNINIT in f and (dest or arg == unread):
                    # A destination still (partly) unwritten, or an input the op ignores: its
                    # bytes are garbage that differs between runs. A destination is recorded
                    # write-only (no digest); only an op that reads an input it also writes
                    # (add_ into empty memory) reads garbage: an event, and the output inherits
                    # the flag. A write-only argument (out=, a copy_ or recv destination) is not
                    # read, nor is an ignored input.
                    if role == "input" and arg != unread and not info.no_read and not info.skip:
                        hz.event(UNINIT, module, f"{info.name} {arg} read while {UNINIT}")
                        taint = True
                    if role != "dest" and dest:
                        tensors[i] = ("dest", arg, t)
                        redest = True
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
                if not info.skip and tensors[i][0] != "dest" and arg != unread:
                    for h in f:
                        hz.event(h, module, f"{info.name} {arg} read while {h}")
            flags = flags or None
        return flags, blind, taint, redest

    def _post(self, pre: tuple, args: tuple, kwargs: dict, out: Any) -> None:
        call, info, phase, taint, source = pre
        rec = self.rec
        rec.busy = True
        outs = op_outputs(info, args, out)
        hz = self.hazards
        flags: dict[int, tuple[str, ...]] | None = None
        # Outputs whose own bytes are still (partly) unwritten: recorded undigested (see below).
        holes: set[int] | None = None
        if hz is not None:
            if info.empty or info.nonblocking or (hz.uninit and (info.writes or info.out_kwargs)):
                # (the only ops that change the hazard state: a call per op saved otherwise)
                track_hazard_state(hz, info, args, kwargs, outs)
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
                    elif UNINIT in f:
                        # Not computed from garbage, but holding some: a buffer the op filled in
                        # part (FSDP's all-gather copy-in fills this rank's slot of the buffer
                        # the all-gather fills next). Those bytes differ between processes and
                        # are no evidence: flagged, not digested, as an input read unwritten.
                        holes = holes or set()
                        holes.add(i)
                    if f:
                        flags[i] = f
                flags = flags or None
        # Inside the dispatcher an in-place op has not bumped the version counter yet (that happens
        # above us, in ADInplaceOrView): outputs of writing ops are digested afresh, never reused.
        # What was cached over the storages they write went in _pre (before_write), so the entries
        # made now for them are new ones (VersionCache.note_written relies on that).
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
                fl = flags.get(i) if flags else None
                rec.append_records(
                    call,
                    [item],
                    hazards={0: fl} if fl else None,
                    digest_it=i not in info.workspace
                    and not (holes and i in holes)
                    and not (info.skip or info.empty or info.async_out),
                    fresh=fresh,
                    defer=phase != "backward",
                )
        elif source is not None and flags is None and len(outs) == 1 and rec.append_copy(call, outs[0], *source):
            pass  # the copy's record shares its input's digest: the same bytes are not hashed twice
        elif outs:
            digest_it = not (info.skip or info.empty or info.async_out)
            if flags is None:
                self.path.append_fast(rec, call, outs, digest_it, fresh, phase != "backward")
            elif holes:
                for i, item in enumerate(outs):
                    fl = flags.get(i)
                    rec.append_records(
                        call,
                        [item],
                        hazards={0: fl} if fl else None,
                        digest_it=digest_it and i not in holes,
                        fresh=fresh,
                        defer=phase != "backward",
                    )
            else:
                rec.append_records(
                    call, outs, hazards=flags, digest_it=digest_it, fresh=fresh, defer=phase != "backward"
                )
            if fresh:
                rec.vcache.note_written([t for _, _, t in outs])
        rec.busy = False
