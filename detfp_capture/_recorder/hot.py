"""The hot path: the records of one call's tensors when nothing is asked per record.

Every op at level ``ops`` comes through here (thousands of calls per step), so the work per
tensor is spelled out with the lookups bound to locals: the version cache (reuse the digest of
an unchanged tensor), else a new ``Slot`` that is deferred to a batch (level ops: the dispatch
mode sees every write, so the digest can wait), staged as a snapshot (the boundaries, where
writes are unseen) or started now (tensors too big to stage), then one row of the column buffer.
``append_batch`` is the same for a step boundary's hundreds of single-tensor records, whose
missing digests are started together (``_digest.batched.start_many``); ``append_copy`` the
record of an exact copy (``aten::clone``), which shares its input's digest. ``record_op`` and
``append_fast`` are the dispatch mode's entries (``Recorder.record_call``/``append_records``
for the case of every plain op, with positional arguments: on this path a keyword call and
its argument binding cost more than the work).

Each of these is the Python implementation of the record path; the native ones are their C
twins (``_hostpath``), and which run is the Recorder's ``seam.RecordPath``, never a rebinding here.
"""

from __future__ import annotations

from typing import Any

import torch

from detfp_capture import digest
from detfp_capture._digest.awaited import PLAIN
from detfp_capture._digest.staging import Staging
from detfp_capture._recorder import hostconfig
from detfp_capture._recorder.call import NAME, Call, DumpRow, RecordSpec, TensorArg, make_call
from detfp_capture._recorder.deferred import DEFER_BYTES, DEFER_MAX
from detfp_capture._recorder.roots import start_digests
from detfp_capture._recorder.slot import (
    COPY,
    DTYPE_STR,
    SHAPES,
    Slot,
    _hostpath,
    dtype_str,
    gc_paused,
    shape_tuple,
)
from detfp_capture._recorder.subclass import has_subclass

__all__ = [
    "append_batch_native",
    "append_batch_py",
    "append_copy",
    "append_counted",
    "append_fast_py",
    "append_general",
    "append_plain_native",
    "append_plain_py",
    "record_op_py",
    "record_plain_py",
]

_NO_HAZARDS = hostconfig.NO_HAZARDS
_INT64 = hostconfig.INT64
_TENSOR = hostconfig.TENSOR


def append_plain_py(rec: Any, call: Call, tensors: list[TensorArg], fresh: bool, defer: bool) -> None:
    """Append the records of ``tensors`` to ``call`` on ``rec`` (a ``Recorder``): no hazards,
    rows, moments or dumps. ``fresh``: do not reuse cached digests; ``defer``: the digests may
    wait for a batch (level ops, outside a backward)."""
    vcache = rec.vcache
    cache_get = vcache.get
    cache_put = vcache.put
    start = digest.start
    waiting = rec.waiting
    deferred = waiting.tensors
    dstor = waiting.storages
    fits = Staging.fits
    stage_t: list | None = None
    stage_s: list = []
    ext = rec.records.rows.extend
    shapes = SHAPES
    seq = rec.seq
    inflight = rec.inflight
    for role, arg, t in tensors:
        try:
            version = t._version
        except Exception:  # inference tensors have no version counter
            version = None
        s = cache_get(t, version) if version is not None and not fresh else None
        dt = t.dtype
        numel = t.numel()
        if s is None and (inflight or t.__class__ not in PLAIN):
            # Its producer (an asynchronous collective) may still be writing it: started then.
            s = Slot(None)
            if inflight.after(t, _late(rec, t, s)):
                if version is not None:
                    cache_put(t, s, version)
            else:
                s = None
        if s is None:
            ptr = None  # the storage's data pointer, where it is looked up anyway
            if defer and version is not None and dt is not _INT64 and type(t) is _TENSOR:
                # Level ops sees every write, so the digest can wait for a batch (run before the
                # next writing op, collective or flush): one GEMM for many. The version check is
                # a safety net; a just-written tensor's version is bumped after we return (above
                # the dispatcher), so it is not checked.
                s = Slot(None)
                ptr = t.untyped_storage().data_ptr()
                same = dstor.get(ptr)
                if same is None:
                    dstor[ptr] = len(deferred)
                elif same.__class__ is int:
                    dstor[ptr] = [same, len(deferred)]
                else:
                    same.append(len(deferred))
                deferred.append(t)
                waiting.slots.append(s)
                waiting.versions.append(None if fresh else version)
                waiting.addrs.append(t.data_ptr())
                waiting.nbytes += numel * dt.itemsize
            elif fits(t):
                # Boundaries (no dispatch mode sees writes): a snapshot copy, digested in a batch;
                # the call's tensors are snapshotted together below.
                s = Slot(None)
                if stage_t is None:
                    stage_t, stage_s = [t], [s]
                else:
                    stage_t.append(t)
                    stage_s.append(s)
            else:
                s = Slot(start(t, pointer_check=dt is _INT64))
            if version is not None:
                cache_put(t, s, version, ptr=ptr)
        shape = t.shape
        ext(
            (
                call,
                seq,
                role,
                arg,
                DTYPE_STR.get(dt) or dtype_str(dt),
                shapes.get(shape) or shape_tuple(shape),
                numel,
                s,
                _NO_HAZARDS,
            )
        )
        seq += 1
    rec.seq = seq
    if stage_t is not None:
        waiting.stage(stage_t, stage_s)


def append_plain_native(rec: Any, call: Call, tensors: list[TensorArg], fresh: bool, defer: bool) -> None:
    """``append_plain_py`` in C (``_recorder/_hostpath.c``: the same statements, the same
    trace); the calls only Python handles (a collective may still be writing a tensor, a
    tensor that is not plain) go to ``append_plain_py``. Needs ``seam.configure_native``."""
    if _hostpath.append_plain(rec, call, tensors, fresh, defer) is NotImplemented:
        append_plain_py(rec, call, tensors, fresh, defer)


def _record_call_py(
    rec: Any, kind: str, name: str, module: str, phase: str, tensors: list[TensorArg], args_src: tuple | None,
    compiled: bool, digest_it: bool, fresh: bool, defer: bool,
) -> Call:  # fmt: skip
    """``Recorder.record_call``'s body with the occurrence inlined (the C twin: ``record_call_c``):
    the call tuple, its tensors through ``append_fast_py``. ``record_op_py`` and
    ``record_plain_py`` are its two entries."""
    mb = rec.microbatch
    key = (mb, phase, module, kind, name)
    occ = rec.occ
    n = occ.get(key, 0)
    occ[key] = n + 1
    call = (rec.step, mb, phase, module, kind, name, n, args_src, compiled)
    if tensors:
        append_fast_py(rec, call, tensors, digest_it, fresh, defer)
    return call


def record_op_py(
    rec: Any, name: str, module: str, phase: str, tensors: list[TensorArg], args_src: tuple | None, digest_it: bool,
    defer: bool,
) -> Call:  # fmt: skip
    """``rec.record_call("op", name, module, phase, tensors, args_src=..., digest_it=..., defer=...)``
    (``rec``: a ``Recorder``)."""
    return _record_call_py(rec, "op", name, module, phase, tensors, args_src, False, digest_it, False, defer)


def record_plain_py(
    rec: Any, kind: str, name: str, module: str, phase: str, tensors: list[TensorArg], compiled: bool, fresh: bool
) -> Call:
    """``rec.record_call(kind, name, module, phase, tensors, compiled=..., fresh=...)`` with nothing
    asked per record (no arguments, hazards, rows or deferred digest: the module, gradient and
    step hooks' calls)."""
    return _record_call_py(rec, kind, name, module, phase, tensors, None, compiled, True, fresh, False)


def append_fast_py(rec: Any, call: Call, tensors: list[TensorArg], digest_it: bool, fresh: bool, defer: bool) -> None:
    """``rec.append_records(call, tensors, digest_it=..., fresh=..., defer=...)`` without hazards
    or per-call rows; the hot path's case (``append_plain_py``) tested first, the rest handed on."""
    if digest_it and not rec._tensor_opts and not has_subclass(tensors):
        append_plain_py(rec, call, tensors, fresh, defer)
        waiting = rec.waiting
        if len(waiting.tensors) >= DEFER_MAX or waiting.nbytes >= DEFER_BYTES:
            waiting.run(staging=False)
        rec.records_in_step += len(tensors)
        if len(rec.records.rows) >= rec._flush_rows:
            rec.need_flush = True
    else:
        rec.append_records(call, tensors, digest_it=digest_it, fresh=fresh, defer=defer)


def append_counted(rec: Any, call: Call, tensors: list[TensorArg]) -> None:
    """Records counted, not digested (views and metadata ops, write-only arguments; never dumped)."""
    ext = rec.records.rows.extend
    seq = rec.seq
    for role, arg, t in tensors:
        dt = t.dtype
        ext((call, seq, role, arg, DTYPE_STR.get(dt) or dtype_str(dt), SHAPES.get(t.shape) or shape_tuple(t.shape),
             t.numel(), None, _NO_HAZARDS))  # fmt: skip
        seq += 1
    rec.seq = seq


def append_general(
    rec: Any,
    call: Call,
    tensors: list[TensorArg],
    hazards: dict[int, tuple[str, ...]] | None,
    digest_it: bool,
    rows: bool | int | None,
    fresh: bool,
) -> None:
    """Records with hazards or per-record options (rows, moments, dumps): one slot and row each."""
    cfg = rec.cfg
    name, module = call[NAME], call[3]
    if rows is None:
        rows = cfg.rows.arg if cfg.rows.enabled and cfg.rows.wants(name, module) else False
    mom = cfg.moments.enabled and cfg.moments.wants(name, module)
    dump = cfg.dumps.enabled and cfg.dumps.wants(name, module)
    out = rec.records
    for i, (role, arg, t) in enumerate(tensors):
        hz = hazards.get(i, _NO_HAZARDS) if hazards else _NO_HAZARDS
        s = rec.slot(t, rows, mom, fresh) if digest_it else None
        seq = rec.next_seq()
        out.add(call, seq, role, arg, dtype_str(t.dtype), tuple(t.shape), t.numel(), s, hz)
        if dump:
            rec._dump(DumpRow(call, seq, role, arg, t))


def _late(rec: Any, t: torch.Tensor, s: Slot) -> Any:
    """The waiter that starts ``s`` (``t``'s digest) once ``t``'s producer completed."""
    return lambda: rec._start_late(t, s, False, False)


def append_copy(rec: Any, call: Call, item: TensorArg, src: torch.Tensor, source: Slot | None) -> bool:
    """Append to ``rec`` (a ``Recorder``) the record of ``item``'s tensor, an exact copy of ``src``
    (``aten::clone``: the same dtype, shape and logical bytes, so the same digest, whatever the
    memory format) whose digest is ``source``. Its Slot takes that digest at the flush
    (``COPY``, resolved by ``flush.resolve_slots``) instead of hashing the same bytes again: a
    slot of its own, since a Slot is also the version cache's entry of one tensor. False, and
    nothing appended, for a subclass, another dtype or shape, or no digest to share."""
    role, arg, t = item
    if (
        source is None
        or type(t) is not _TENSOR
        or type(src) is not _TENSOR
        or t.dtype != src.dtype
        or t.shape != src.shape
    ):
        return False
    try:
        version = t._version
    except Exception:  # inference tensors have no version counter
        return False
    root = source.source if source.pending is COPY else source
    s = Slot(COPY)
    if root.hi is not None or root.extra is not None:  # resolved at an earlier flush
        s.pending, s.hi, s.lo, s.extra = None, root.hi, root.lo, root.extra
    else:
        s.source = root
    rec.vcache.put(t, s, version)
    dt = t.dtype
    rec.records.add(
        call, rec.next_seq(), role, arg, DTYPE_STR.get(dt) or dtype_str(dt), tuple(t.shape), t.numel(), s, _NO_HAZARDS
    )
    return True


def append_batch_py(rec: Any, specs: list[RecordSpec], fresh: bool) -> list[Call]:
    """Append one single-tensor record per spec to ``rec`` (a ``Recorder``), the missing digests
    started as one batch (``start_many``: a step boundary's parameters, gradients, states); no
    hazards, rows, moments or dumps. A spec whose ``call`` is None opens a new call (next
    occurrence). Returns the call of each record."""
    vcache = rec.vcache
    slots: list[Slot | None] = [None] * len(specs)
    versions: list[int | None] = []
    missing = []
    for i, sp in enumerate(specs):
        t = sp.tensor
        try:
            version = t._version
        except Exception:
            version = None
        versions.append(version)
        if version is not None and not fresh:
            hit = vcache.get(t, version)
            if hit is not None:
                slots[i] = hit
                continue
        missing.append(i)
    if missing:
        new = [Slot(None) for _ in missing]
        with gc_paused():
            start_digests([specs[i].tensor for i in missing], new, rec.waiting.roots, reuse=True)  # repeats
        for i, s in zip(missing, new, strict=True):
            slots[i] = s
            if versions[i] is not None:
                vcache.put(specs[i].tensor, s, versions[i])
    # The records (occurrence, seq and dtype text inlined: hundreds per optimizer step).
    calls = []
    ext = rec.records.rows.extend
    occ_map = rec.occ
    step, mb = rec.step, rec.microbatch
    seq = rec.seq
    for sp, slot in zip(specs, slots, strict=True):
        call = sp.call
        if call is None:
            key = (mb, sp.phase, sp.module, sp.kind, sp.name)
            occ = occ_map.get(key, 0)
            occ_map[key] = occ + 1
            call = make_call(step, mb, sp.phase, sp.module, sp.kind, sp.name, occ)
        t = sp.tensor
        dt = t.dtype
        size = t.shape
        shape = SHAPES.get(size) or shape_tuple(size)
        ext((call, seq, sp.role, sp.arg, DTYPE_STR.get(dt) or dtype_str(dt), shape, t.numel(), slot, _NO_HAZARDS))
        seq += 1
        calls.append(call)
    rec.seq = seq
    return calls


def append_batch_native(rec: Any, specs: list[RecordSpec], fresh: bool) -> list[Call]:
    """``append_batch_py`` with its two loops in C (``_hostpath.batch_slots``/``batch_records``)."""
    slots, tensors, new = _hostpath.batch_slots(rec, specs, fresh)
    if tensors:
        with gc_paused():
            start_digests(tensors, new, rec.waiting.roots, reuse=True)  # a step boundary: repeats
    return _hostpath.batch_records(rec, specs, slots)
