"""The hot path: the records of one call's tensors when nothing is asked per record.

Every op at level ``ops`` comes through here (thousands of calls per step), so the work per
tensor is spelled out with the lookups bound to locals: the version cache (reuse the digest of
an unchanged tensor), else a new ``Slot`` that is deferred to a batch (level ops: the dispatch
mode sees every write, so the digest can wait), staged as a snapshot (the boundaries, where
writes are unseen) or started now (tensors too big to stage), then one row of the column buffer.
"""

from __future__ import annotations

from typing import Any

import torch

from detfp_capture import digest
from detfp_capture._digest.staging import Staging
from detfp_capture._recorder.call import Call, TensorArg
from detfp_capture._recorder.slot import DTYPE_STR, Slot, dtype_str

__all__ = ["append_plain"]

_NO_HAZARDS: tuple[str, ...] = ()
_INT64 = torch.int64
_TENSOR = torch.Tensor


def append_plain(rec: Any, call: Call, tensors: list[TensorArg], fresh: bool, defer: bool) -> None:
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
    add = rec.records.add
    seq = rec.seq
    for role, arg, t in tensors:
        try:
            version = t._version
        except Exception:  # inference tensors have no version counter
            version = None
        s = cache_get(t, version) if version is not None and not fresh else None
        dt = t.dtype
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
                waiting.nbytes += t.numel() * dt.itemsize
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
        add(call, seq, role, arg, DTYPE_STR.get(dt) or dtype_str(dt), tuple(t.shape), t.numel(), s, _NO_HAZARDS)
        seq += 1
    rec.seq = seq
    if stage_t is not None:
        waiting.stage(stage_t, stage_s)
