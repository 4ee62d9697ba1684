"""Digests waiting for a batch: the deferred op-level digests and the staged snapshots.

Mixed into ``Recorder`` (see _state): the state lives on the recorder (``deferred*``,
``staging``); these methods start the waiting digests as batches (``_batchdigest``). Also the
``Slot`` that every record's digest goes through.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from typing import Any

import torch

from detfp_capture import digest
from detfp_capture._digest.batched import BATCHED, start_many
from detfp_capture._digest.staging import Staging

__all__ = ["Batching", "Slot", "dtype_str", "gc_paused"]

_DTYPE_STR: dict[torch.dtype, str] = {}


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector around a bulk step of the tracer's own work.

    The objects such a step allocates are freed by reference counting when it ends; a
    collection that runs in the middle finds them alive, and a generation-1 one promotes them
    to the oldest generation, whose growth is what triggers full collections (each traverses
    the whole heap). Collection is enabled again right after, if it was enabled before."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def dtype_str(dt: torch.dtype) -> str:
    s = _DTYPE_STR.get(dt)
    if s is None:
        s = _DTYPE_STR[dt] = str(dt)
    return s


class Slot:
    """One digest: device-side state until the flush resolves it (``fp``, a ``resolve_raw`` tuple).

    ``pending`` is a ``digest.Pending``, or ``BATCHED`` when the digest is a row of a batch
    (``arena``/``row``, filled by ``_batchdigest.fill``): then the slot itself stands for the
    pending (it has the attributes ``digest.resolve`` reads), one object per digest instead of two.
    Also the version cache's entry for the tensor it digests (weak reference, version, options).
    See _records on why the object count matters.
    """

    __slots__ = (
        "arena",
        "arena_pointer",
        "device",
        "dtype",
        "fp",
        "numel",
        "opt_moments",
        "opt_rows",
        "pending",
        "ref",
        "row",
        "shape",
        "version",
    )

    # What digest.resolve reads from a pending and a batched row never has.
    lanes = rows_lanes = moments = pointer = components = error = None
    rows_meta: tuple = ()
    arena_moments = False
    type_name = ""

    def __init__(self, pending: Any) -> None:
        self.pending = pending
        self.fp: Any = None
        self.ref: Any = None
        self.version: int | None = None
        self.opt_rows: bool | int = False
        self.opt_moments = False

    def matches(self, t: torch.Tensor, version: int, rows: bool | int, moments: bool) -> bool:
        return self.version == version and self.ref() is t and self.opt_rows == rows and self.opt_moments == moments

    def started(self) -> Any:
        """What to hand to ``digest.resolve``."""
        return self if self.pending is BATCHED else self.pending


def _modified(t: torch.Tensor, why: str = "modified in place") -> digest.Pending:
    """The digest of a deferred tensor written before its batch ran: an error, never a guess."""
    p = digest.Pending(t.dtype, tuple(t.shape), t.numel(), t.device)
    p.error = f"{why} before its deferred digest ran"
    return p


_MOVED = "storage freed or reallocated"


def storage_ptrs(t: torch.Tensor) -> list[int] | None:
    """Data pointers of the storages that hold ``t``'s bytes: its own, or for a wrapper subclass
    without one (DTensor, ...) its inner tensors' through ``__tensor_flatten__``; None when
    unknown (sparse, an opaque subclass)."""
    try:
        return [t.untyped_storage().data_ptr()]
    except Exception:
        pass
    flatten = getattr(t, "__tensor_flatten__", None)
    if flatten is None:
        return None
    try:
        names, _ = flatten()
    except Exception:
        return None
    out: list[int] = []
    for name in names:
        inner = getattr(t, name, None)
        if not isinstance(inner, torch.Tensor):
            continue  # a non-tensor component (DTensor's device mesh) holds no data
        ptrs = storage_ptrs(inner)
        if ptrs is None:
            return None
        out += ptrs
    return out or None


class Batching:
    """Recorder methods that run waiting digests (the recorder holds the state)."""

    deferred: list[torch.Tensor | None]
    deferred_slots: list[Slot]
    deferred_versions: list[int | None]
    deferred_addrs: list[int]
    deferred_bytes: int
    deferred_storages: dict[int, Any]
    staging: dict[torch.device, Staging]

    # Also used from the recorder: enter()/leave() (the tracer's busy guard).

    def run_deferred(self, staging: bool = True) -> None:
        """Start every deferred digest as one batch (caller holds the mode off, i.e. is busy).

        ``staging``: also digest the staged snapshots. Only a flush needs that: a snapshot is a
        copy, so a write cannot change it, and before a write (the frequent trigger at level ops)
        the staged batch is left to grow (one GEMM per 64 MiB or flush, not per write)."""
        if staging:
            self.run_staging()
        tensors, slots, versions, addrs = (
            self.deferred,
            self.deferred_slots,
            self.deferred_versions,
            self.deferred_addrs,
        )
        if not tensors:
            return
        self._reset_deferred()
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
                start_many(live_t, live_s)

    def _reset_deferred(self) -> None:
        self.deferred, self.deferred_slots, self.deferred_versions, self.deferred_addrs = [], [], [], []
        self.deferred_bytes = 0
        self.deferred_storages = {}

    def evict_deferred(self, ptrs: list[int]) -> None:
        """Before an op writes into these storages: snapshot the deferred tensors that live in
        them (a copy into the staging buffer; the rest of the batch keeps waiting). Cheaper than
        running the whole batch at every write, which at level ops is dozens of times a step."""
        ts: list[torch.Tensor] = []
        ss: list[Slot] = []
        dstor = self.deferred_storages
        deferred = self.deferred
        for ptr in ptrs:
            idx = dstor.pop(ptr, None)
            if idx is None:
                continue
            for i in (idx,) if idx.__class__ is int else idx:
                t = deferred[i]
                if t is None:
                    continue
                deferred[i] = None
                s, v = self.deferred_slots[i], self.deferred_versions[i]
                if v is not None and t._version != v:
                    s.pending = _modified(t)
                elif t.data_ptr() != self.deferred_addrs[i]:
                    s.pending = _modified(t, _MOVED)
                elif Staging.fits(t):
                    ts.append(t)
                    ss.append(s)
                else:
                    s.pending = digest.start(t)
        if ts:
            self._stage_many(ts, ss)

    def storage_changing(self, ptr: int) -> None:
        """A storage is about to be freed or reallocated outside the dispatcher: what waits for a
        batch in it is snapshotted now, and cached digests over it are dropped."""
        self.enter()
        try:
            if ptr in self.deferred_storages:
                self.evict_deferred([ptr])
            vstor = self.vstor
            ids = vstor.pop(ptr, None) if vstor else None
            if ids is not None:
                vc = self.vcache
                for k in ids:
                    vc.pop(k, None)
        finally:
            self.leave()

    def _stage_many(self, ts: list[torch.Tensor], slots: list[Slot]) -> None:
        """Snapshot a call's tensors together; any that cannot be staged are digested now."""
        dev = ts[0].device
        if len(ts) > 1 and any(t.device != dev for t in ts):
            for t, s in zip(ts, slots, strict=True):
                self._stage_many([t], [s])
            return
        st = self.staging.get(dev)
        if st is None:
            st = self.staging[dev] = Staging(dev)
        try:
            if st.put_many(ts, slots):
                return
            self.run_staging()
            if st.put_many(ts, slots):
                return
        except Exception:
            pass
        for t, s in zip(ts, slots, strict=True):
            s.pending = digest.start(t, pointer_check=t.dtype is torch.int64)

    def run_staging(self) -> None:
        with gc_paused():
            for st in self.staging.values():
                st.run_into()

    def settle(self) -> None:
        """Run deferred digests now (before a write the dispatch mode cannot see)."""
        if self.deferred:
            self.enter()
            try:
                self.run_deferred(staging=False)
            finally:
                self.leave()
