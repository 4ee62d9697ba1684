"""False-root hazards: state tracked per storage, flags on records, ``hazard`` events.

* ``uninitialized``: storages born from ``empty*``/``new_empty*``/``empty_strided`` keep a list
  of byte intervals not yet written; an op that reads an unwritten byte (through any view) is
  flagged, an op that overwrites (copy_, fill_, zero_, random fills, ``out=``) removes the
  interval it covers, and the storage is forgotten once fully written. With ``poison`` the
  fresh storage is filled with a per-run 8-byte pattern (``poison_pattern``) so any read shows up
  as a divergence.
* ``async_pending``: tensors an async collective writes, between launch and ``wait()``.
* ``nonblocking_pending``: destinations of ``non_blocking=True`` copies until the next explicit
  synchronization (``torch.cuda.synchronize``, ``Stream``/``Event.synchronize``) or step end.
* ``pointer_like``: set at resolve from the digest's on-device pointer check (see ``flush.DigestFindings``).

Entries hold a weak reference to the tensor that created them: when it dies, or its storage
is freed or moved under it (FSDP's ``resize_(0)``), so does the entry, so a reused allocation
never inherits a stale state. The dispatch mode only pays for
these checks while at least one storage is tracked (``active``).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from detfp_capture._digest.subclass import flatten
from detfp_capture._recorder.subclass import flattens

__all__ = ["HazardTracker", "poison_pattern"]


def poison_pattern(run: str) -> bytes:
    """The 8 bytes ``poison`` fills fresh storage with in the run at ``run`` (its directory):
    different in any two runs (a 64-bit hash, each byte kept in 0x40..0x7E), and garbage that
    cannot vanish: read as float32, bfloat16 or float16 every word is a large number (2 to 3e38)
    or a NaN, never a value too small to survive being added to real data (a byte pattern like
    0x0A0A0A0A, 6.6e-33 as float32, is absorbed by any sum, and two runs would then agree)."""
    import hashlib

    return bytes(0x40 + b % 0x3F for b in hashlib.blake2b(run.encode(), digest_size=8).digest())


UNINIT = "uninitialized"
ASYNC = "async_pending"
NONBLOCKING = "nonblocking_pending"
_EVENTS_PER_STEP = 64


def storage_key(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage().data_ptr() or None
    except Exception:  # sparse/meta/subclass tensors have no plain storage
        return None


def byte_span(t: torch.Tensor) -> tuple[int, int, bool]:
    """Bytes [a, b) of its storage that ``t`` touches, and whether it touches all of them."""
    item = t.element_size()
    a = int(t.storage_offset()) * item  # (int: a SymInt only under tracing, which records nothing)
    if t.numel() == 0:
        return a, a, True
    extent = 1 + sum((s - 1) * abs(st) for s, st in zip(t.shape, t.stride(), strict=True))
    b = a + int(extent) * item
    dense = extent == t.numel()
    return a, b, dense


def _holds(ref: Any, key: int) -> bool:
    """Whether the tensor an entry was made for still lives and still owns the storage at
    ``key``: a storage can be freed under a living tensor (FSDP's ``resize_(0)``) and the
    address handed to another, which must not inherit the entry."""
    t = ref()
    return t is not None and storage_key(t) == key


class _Uninit:
    __slots__ = ("holes", "ref")

    def __init__(self, ref: Any, nbytes: int) -> None:
        self.ref = ref
        self.holes = [(0, nbytes)]

    def overlaps(self, a: int, b: int) -> bool:
        return any(lo < b and a < hi for lo, hi in self.holes)

    def write(self, a: int, b: int) -> None:
        out = []
        for lo, hi in self.holes:
            if hi <= a or b <= lo:
                out.append((lo, hi))
                continue
            if lo < a:
                out.append((lo, a))
            if b < hi:
                out.append((b, hi))
        self.holes = out


class HazardTracker:
    """Per-storage hazard state of one rank (training thread only)."""

    def __init__(self, rec: Any, poison: bytes | None) -> None:
        self.rec = rec
        #: ``poison_pattern`` of the run, or None (no poison); as an int64 for the aligned bulk.
        self.poison = poison
        self._poison64 = int.from_bytes(poison, "little", signed=True) if poison else None
        self.uninit: dict[int, _Uninit] = {}
        self.async_pending: dict[int, tuple[Any, str]] = {}
        self.nb_pending: dict[int, tuple[Any, str]] = {}
        self.events_this_step: dict[str, int] = {}

    @property
    def active(self) -> bool:
        return bool(self.uninit or self.async_pending or self.nb_pending)

    # ---------------------------------------------------------------- births and writes
    def born_empty(self, t: torch.Tensor) -> None:
        key = storage_key(t)
        if key is None:
            return
        nbytes = t.untyped_storage().nbytes()
        poison, p64 = self.poison, self._poison64  # (both set, or neither)
        if poison is not None and p64 is not None and nbytes:
            u = torch.empty(0, dtype=torch.uint8, device=t.device)
            u.set_(t.untyped_storage(), 0, (nbytes,), (1,))
            n8 = nbytes // 8
            with torch.no_grad():
                if n8:  # the pattern repeats every 8 bytes from the storage's start
                    u[: n8 * 8].view(torch.int64).fill_(p64)
                for i in range(n8 * 8, nbytes):  # a storage of fewer or not a multiple of 8 bytes
                    u[i] = poison[i % 8]
        self.uninit[key] = _Uninit(weakref.ref(t), nbytes)

    def wrote(self, t: torch.Tensor) -> None:
        if not self.uninit:
            return
        key = storage_key(t)
        if key is None:
            return
        u = self.uninit.get(key)
        if u is None:
            return
        if not _holds(u.ref, key):
            del self.uninit[key]
            return
        a, b, dense = byte_span(t)
        if dense:
            u.write(a, b)
            if not u.holes:
                del self.uninit[key]

    def async_launch(self, tensors: list[torch.Tensor], name: str) -> None:
        for t in tensors:
            key = storage_key(t)
            if key is not None:
                self.async_pending[key] = (weakref.ref(t), name)

    def async_done(self, tensors: list[torch.Tensor]) -> None:
        for t in tensors:
            key = storage_key(t)
            if key is not None:
                self.async_pending.pop(key, None)

    def nonblocking_copy(self, t: torch.Tensor, name: str) -> None:
        key = storage_key(t)
        if key is not None:
            self.nb_pending[key] = (weakref.ref(t), name)

    def synchronized(self) -> None:
        self.nb_pending.clear()

    def step_end(self) -> None:
        self.nb_pending.clear()
        self.events_this_step = {}

    def unobserved(self) -> None:
        """A step that capture leaves out (``steps=``) runs without the dispatch mode: whatever
        it writes, allocates or waits for is unseen, so nothing tracked before can be trusted
        after it (a buffer allocated empty, then filled in an unselected step, is not an
        uninitialized read in the next selected one). Forget it all."""
        self.uninit.clear()
        self.async_pending.clear()
        self.nb_pending.clear()

    # ---------------------------------------------------------------- checks
    def flags(self, t: torch.Tensor, read: bool = True) -> tuple[str, ...]:
        """Hazards of the current contents of ``t`` (``read``: the op depends on them); a tensor
        subclass (no storage of its own) has every hazard of its parts."""
        key = storage_key(t)
        if key is None:
            if not flattens(t):
                return ()
            try:
                parts = flatten(t, meta=False).tensors
            except Exception:  # its record's digest says why
                return ()
            found = {h: None for _, p in parts for h in self.flags(p, read)}
            return tuple(found)
        out: list[str] = []
        u = self.uninit.get(key)
        if u is not None:
            if not _holds(u.ref, key):
                del self.uninit[key]
            else:
                a, b, _ = byte_span(t)
                if u.overlaps(a, b):
                    out.append(UNINIT)
        p = self.async_pending.get(key)
        if p is not None:
            if not _holds(p[0], key):
                del self.async_pending[key]
            else:
                out.append(ASYNC)
        p = self.nb_pending.get(key)
        if p is not None:
            if not _holds(p[0], key):
                del self.nb_pending[key]
            else:
                out.append(NONBLOCKING)
        return tuple(out)

    def flag_all(self, tensors: list[torch.Tensor]) -> dict[int, tuple[str, ...]] | None:
        out = {}
        for i, t in enumerate(tensors):
            f = self.flags(t)
            if f:
                out[i] = f
        return out or None

    def event(self, hazard: str, module: str, detail: str) -> None:
        n = self.events_this_step.get(hazard, 0)
        self.events_this_step[hazard] = n + 1
        if n < _EVENTS_PER_STEP:
            self.rec.event("hazard", hazard, module, None, detail)
        elif n == _EVENTS_PER_STEP:
            self.rec.event(
                "truncation",
                hazard,
                module,
                None,
                f"more than {_EVENTS_PER_STEP} {hazard} hazard events in this step; the rest are only flagged on records",
            )
