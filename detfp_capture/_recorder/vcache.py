"""The version cache: a tensor whose version counter has not moved is not hashed again.

Entries are ``Slot``s keyed by ``id(tensor)``, each holding a weak reference to its tensor, the
version it was digested at and the per-record options (rows, moments) it was digested with; a
lookup hits only when all of them still match. The output of one op is thus hashed once, not
again as the next op's input.

Level ``ops`` sees every write (``Capabilities.sees_writes``), and uses two more things:

* an index by storage (a wrapper subclass such as DTensor by its inner tensors' storages): a
  ``.data`` alias has a version counter of its own, so a write through it (``p.data.clamp_``,
  an EMA) moves no counter of the tensor it aliases; any write drops the cached digests of every
  tensor over the written storages (``drop_storages``);
* re-keying after an in-place op (``note_written`` / ``promote``): the op's output is cached at
  the version seen inside the dispatcher, before the op's own bump (which happens above the
  dispatch mode, after the op returns); at the next op the entry moves to the new version if
  the counter moved by exactly one.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from detfp_capture._recorder.slot import Slot, held_ref, storage_ptrs

__all__ = ["VersionCache"]

#: Entries before the cache is emptied (bounds its memory; a miss only costs a digest).
LIMIT = 1 << 16


class VersionCache:
    """id(tensor) -> Slot of its digest at a version (and, at level ops, storage -> ids)."""

    __slots__ = ("by_id", "by_storage", "written")

    def __init__(self, index_storages: bool) -> None:
        self.by_id: dict[int, Slot] = {}
        #: Storage data pointer -> ids cached over it, so a write through any alias drops them.
        #: None below level ops: no mode sees writes.
        self.by_storage: dict[int, list[int]] | None = {} if index_storages else None
        #: (tensor, Slot, version) of the tensors the last op wrote, cached at the version they
        #: had inside the dispatcher (see ``promote``).
        self.written: list[tuple[torch.Tensor, Slot, int]] = []

    def __len__(self) -> int:
        return len(self.by_id)

    def get(self, t: torch.Tensor, version: int, rows: bool | int = False, moments: bool = False) -> Slot | None:
        """The cached digest of ``t`` at ``version`` with these options, or None."""
        hit = self.by_id.get(id(t))
        if (
            hit is not None
            and hit.version == version
            and hit.ref() is t
            and hit.opt_rows == rows
            and hit.opt_moments == moments
        ):
            return hit
        return None

    def put(
        self,
        t: torch.Tensor,
        s: Slot,
        version: int,
        rows: bool | int = False,
        moments: bool = False,
        ptr: int | None = None,
    ) -> None:
        """Cache ``s`` as the digest of ``t`` at ``version`` (``ptr``: its storage's data pointer
        when the caller has it). A tensor that refuses weak references (some subclasses) or
        whose storage cannot be indexed (at level ops) is not cached: nothing could drop it."""
        by_id = self.by_id
        if len(by_id) >= LIMIT:
            self.clear()
        try:
            s.ref = held_ref(t)
        except TypeError:
            return
        s.version = version
        s.opt_rows = rows
        s.opt_moments = moments
        key = id(t)
        by_id[key] = s
        by_storage = self.by_storage
        if by_storage is not None:
            ptrs = (ptr,) if ptr is not None else storage_ptrs(t)
            if ptrs is None:
                del by_id[key]
                return
            for p in ptrs:
                ids = by_storage.get(p)
                if ids is None:
                    by_storage[p] = [key]
                else:
                    ids.append(key)

    def clear(self) -> None:
        # The slots live on in the buffered records until the flush; their weak references
        # (one object each) need not.
        for s in self.by_id.values():
            s.ref = None
        self.by_id.clear()
        if self.by_storage is not None:
            self.by_storage.clear()

    def drop_storages(self, ptrs: Iterable[int] | None) -> None:
        """Forget the digests of every tensor over these storages (being written, freed or
        reallocated); None: the storages are unknown, forget everything."""
        if ptrs is None:
            self.clear()
            return
        by_storage = self.by_storage
        if by_storage:
            by_id = self.by_id
            for p in ptrs:
                ids = by_storage.pop(p, None)
                if ids is not None:
                    for k in ids:
                        by_id.pop(k, None)

    def note_written(self, tensors: Iterable[torch.Tensor]) -> None:
        """Remember the Slots just cached for the tensors a writing op wrote, with the version
        they were cached at (the one from before the write: see ``promote``)."""
        by_id = self.by_id
        written = self.written
        for t in tensors:
            s = by_id.get(id(t))
            if s is not None and s.version is not None:  # (a cached Slot always has its version)
                written.append((t, s, s.version))

    def promote(self) -> None:
        """Re-key the digests of the last op's written tensors to the version they have now.

        A writing op's outputs are cached at the version seen inside the dispatcher; the op's own
        bump (once per written tensor, in ADInplaceOrView) comes after it returns. Without this,
        the next op reading such a tensor (``param.addcdiv_`` after ``param.mul_``, an optimizer
        state read right after its update) would miss the cache and copy and hash the same bytes
        again. This runs at the start of the next op, before it or anything seen by the mode can
        write: exactly one bump since then is the op's own, and any other count (no bump, a
        second write) leaves the entry unmatched, so the digest is simply taken again."""
        by_id = self.by_id
        for t, s, v in self.written:
            if s.version == v and by_id.get(id(t)) is s and t._version == v + 1:
                s.version = v + 1
        self.written.clear()
