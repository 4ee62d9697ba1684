"""Digests waiting for a batch: the deferred op-level tensors and the staged boundary snapshots.

* **deferred** (level ops, which sees every write): an op's tensor is kept, not copied, and its
  digest waits for a batch (one GEMM per level for many tensors). The batch runs before a write
  the dispatch mode cannot see (a collective, compiled code, DDP's own work), when 1024 tensors
  or 64 MiB wait, at the step end and at every flush; before an op writes into the storage of a
  waiting tensor, just that tensor is snapshotted into the staging buffer (``evict``).
* **staged** (everywhere else: module boundaries, collectives, probes): the tensor is taken when
  recorded, a copy or an in-place level-0 GEMM (``_digest.staging``), and finished with its
  batch at the flush.

The recorder appends to the deferred columns on its hot path; everything else is here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from detfp_capture import digest
from detfp_capture._digest.staging import Staging
from detfp_capture._recorder.roots import roots_first, start_digests
from detfp_capture._recorder.slot import Slot, copy_bytes, gc_paused

__all__ = ["DEFER_BYTES", "DEFER_MAX", "Waiting"]

DEFER_MAX = 1024  # deferred digests per batch
DEFER_BYTES = 64 << 20  # bytes of tensors kept alive by deferred digests before a batch runs
_MOVED = "storage freed or reallocated"


def _modified(t: torch.Tensor, why: str = "modified in place") -> digest.Pending:
    """The digest of a deferred tensor written before its batch ran: an error, never a guess."""
    p = digest.Pending(t.dtype, tuple(t.shape), t.numel(), t.device)
    p.error = f"{why} before its deferred digest ran"
    return p


class Waiting:
    """The digests waiting for a batch (the caller holds the tracer's busy state: ``Recorder.enter``).

    The deferred ones are parallel lists (no object per entry: see ``records``): the tensor (None
    once evicted), its Slot, the version it was recorded at (None: not checked) and its data
    address then (a storage freed or reallocated since, as FSDP's ``resize_(0)`` does unseen by
    the dispatcher, moves it); ``storages`` maps a storage's data pointer to the index (or
    indices) of the deferred tensors in it, so only a write into one of them takes them first.
    ``roots``: the record path's record-time digests (``seam.RecordPath.roots``; None: none).
    """

    def __init__(self, roots: Any = None) -> None:
        self.roots = roots
        self.tensors: list[torch.Tensor | None] = []
        self.slots: list[Slot] = []
        self.versions: list[int | None] = []
        self.addrs: list[int] = []
        self.nbytes = 0
        self.storages: dict[int, int | list[int]] = {}
        #: Snapshots of boundary tensors waiting for their batch digest, per device.
        self.staging: dict[torch.device, Staging] = {}

    def reset(self) -> None:
        """Forget every deferred digest (capture failed: its records are dropped)."""
        self.tensors, self.slots, self.versions, self.addrs = [], [], [], []
        self.nbytes = 0
        self.storages = {}

    def run(self, staging: bool = True) -> None:
        """Start every deferred digest as one batch.

        ``staging``: also digest the staged snapshots. Only a flush needs that: a snapshot is a
        copy, so a write cannot change it, and before a write (the frequent trigger at level ops)
        the staged batch is left to grow (one GEMM per 64 MiB or flush, not per write)."""
        if staging:
            self.run_staging()
        tensors, slots, versions, addrs = self.tensors, self.slots, self.versions, self.addrs
        if not tensors:
            return
        self.reset()
        live_s, live_t = [], []
        for s, t, v, a in zip(slots, tensors, versions, addrs, strict=True):
            if t is None:  # evicted: snapshotted before a write
                continue
            if v is not None and t._version != v:  # cannot happen when every write goes through the dispatcher
                s.pending = _modified(t)
            elif t.data_ptr() != a:  # reading it now could read freed memory
                s.pending = _modified(t, _MOVED)
            else:
                live_s.append(s)
                live_t.append(t)
        if live_t:
            with gc_paused():
                start_digests(live_t, live_s, self.roots)

    def evict(self, ptrs: list[int]) -> None:
        """Before an op writes into these storages: snapshot the deferred tensors that live in
        them (a copy into the staging buffer; the rest of the batch keeps waiting). Cheaper than
        running the whole batch at every write, which at level ops is dozens of times a step."""
        ts: list[torch.Tensor] = []
        ss: list[Slot] = []
        storages = self.storages
        tensors = self.tensors
        for ptr in ptrs:
            idx = storages.pop(ptr, None)
            if idx is None:
                continue
            for i in (idx,) if isinstance(idx, int) else idx:
                t = tensors[i]
                if t is None:
                    continue
                tensors[i] = None
                s, v = self.slots[i], self.versions[i]
                if v is not None and t._version != v:
                    s.pending = _modified(t)
                elif t.data_ptr() != self.addrs[i]:
                    s.pending = _modified(t, _MOVED)
                elif Staging.fits(t):
                    ts.append(t)
                    ss.append(s)
                else:
                    s.pending = digest.start(t)
        if ts:
            self.stage(ts, ss)

    def stage(self, ts: Sequence[torch.Tensor], slots: Sequence[Slot], roots_tried: bool = False) -> None:
        """Snapshot a call's tensors together; any that cannot be staged are digested now.

        On CPU with the native kernels at digest version 2, a snapshot is not needed: the
        tensor's digest is computed now, from the bytes the snapshot would have copied
        (``roots.start_roots``); only the others are staged. ``roots_tried``: the caller
        (``_hostpath``'s ``append_plain``) offered them to that route already."""
        if not roots_tried:
            ts, slots = roots_first(ts, slots, self.roots)
            if not ts:
                return
        dev = ts[0].device
        if len(ts) > 1 and any(t.device != dev for t in ts):
            for t, s in zip(ts, slots, strict=True):
                self.stage([t], [s])
            return
        st = self.staging.get(dev)
        if st is None:
            # The record path's byte copy, handed down: the digest floor does not import it.
            st = self.staging[dev] = Staging(dev, byte_copy=copy_bytes)
        put = st.put_many if len(ts) > 1 else None
        try:
            if put is None:  # one tensor (most calls): the lighter path
                t, s = ts[0], slots[0]
                if st.put_one(t, s):
                    return
                self.run_staging()
                if st.put_one(t, s):
                    return
            else:
                if put(ts, slots):
                    return
                self.run_staging()
                if put(ts, slots):
                    return
        except Exception:
            pass
        for t, s in zip(ts, slots, strict=True):
            s.pending = digest.start(t, pointer_check=t.dtype is torch.int64)

    def run_staging(self) -> None:
        with gc_paused():
            for st in self.staging.values():
                st.run_into()
