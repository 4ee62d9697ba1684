"""Digests computed at record time on CPU: each tensor's whole tree, where it lies.

The digest of a small tensor was taken in a batch: at level ops its record waits for one
(``deferred``), at the boundaries it is copied into the staging buffer (a snapshot) and hashed
at the flush. Both pay Python for every tensor (a layout, copies, a level plan), which at a
few hundred bytes per tensor costs far more than the hashing. On CPU, with the native digest
kernel and the record path's helpers built, version 2 takes another route for the plain,
contiguous tensors: ``_hostpath.roots_fill`` computes each one's tree root in one native call
per batch (``_lanes``' tree, through its ``TREE`` capsule), straight from the tensor's bytes, and
fills its Slot as a row of a pooled ``BatchLanes``. The digest is the same (a tensor's tree does
not depend on what it is hashed with; ``tests/golden/test_capture_routes.py`` holds the routes
to each other); a staged tensor is digested at once from the bytes its snapshot would have
copied. Anything else (GPU tensors, version 1, non-contiguous or special tensors) takes the
batch or staging path as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from detfp_capture._digest import native, tlh2, versions
from detfp_capture._digest.batched import BATCHED, SPECIAL, STRIDED, BatchLanes, start_many
from detfp_capture._digest.core import Scheme
from detfp_capture._digest.versions import active
from detfp_capture._recorder.slot import _hostpath

__all__ = ["configure_roots", "roots_first", "start_digests", "start_roots"]

_CPU = torch.device("cpu")


def configure_roots() -> Any:
    """Configure the native record path's ``roots_fill`` (the version-2 keys, the pool, the
    active version's list: what ``root_now`` reads too) and return it, where the digest kernel
    is built and on; else None. Part of the native path's one configuration
    (``seam.configure_native``), after ``hostconfig.configure``, whose objects it uses."""
    lanes = native._lanes
    if not (native.AVAILABLE and native.KEYS2_BYTES > 0 and hasattr(lanes, "TREE")):
        return None
    keys = tlh2.pack_all_keys()
    _hostpath.configure_roots(
        lanes.TREE, SPECIAL, STRIDED, BATCHED, _POOL, versions._STATE, tlh2.SCHEME, keys,
        keys.numel() // native.KEYS2_BYTES, _CPU,
    )  # fmt: skip
    return _hostpath.roots_fill


def start_roots(tensors: Sequence[torch.Tensor], slots: Sequence[Any], sch: Scheme, fill_roots: Any) -> list[int]:
    """Version 2 on CPU: the plain, contiguous tensors' digests as their trees' roots, computed
    now where the tensors lie (one native call for all of them: no layout, copy or per-level
    GEMMs; a tensor's tree does not depend on the batch it is hashed in), each slot a row of a
    shared ``BatchLanes`` (``fill``). Returns the indices of the tensors left for the other
    paths (all of them if the native call fails: those paths refill every slot)."""
    n = len(tensors)
    held, first = _POOL.take(n, sch)
    try:
        return fill_roots(list(tensors), list(slots), held, held.lanes.data_ptr(), first)
    except Exception:
        return list(range(n))


class _RootPool:
    """Rows for roots computed at record time (``start_roots``; ``_hostpath``'s ``root_now``
    takes its rows through ``used``, ``cap`` and ``addr`` itself): one (ROWS, lanes) tensor filled
    in order, a new one when full (the slots keep theirs alive until their flush), instead of a
    tensor per call (a call records one to a few tensors)."""

    ROWS = 4096

    def __init__(self) -> None:
        self.held: BatchLanes | None = None
        self.used = 0
        #: The held lanes' address and rows (what ``root_now`` writes into).
        self.addr = 0
        self.cap = 0

    def room(self, n: int, sch: Scheme) -> tuple[BatchLanes, int]:
        """The lanes to write ``n`` rows into, and the first of them (not taken yet)."""
        held = self.held
        if held is None or held.scheme is not sch or self.used + n > self.cap:
            with torch.inference_mode(False):  # reused in and out of inference mode
                lanes = torch.empty(max(n, self.ROWS), sch.lanes, dtype=torch.int32)
            held = self.held = BatchLanes(lanes, sch)
            self.used, self.addr, self.cap = 0, lanes.data_ptr(), lanes.shape[0]
        return held, self.used

    def take(self, n: int, sch: Scheme) -> tuple[BatchLanes, int]:
        """``room``, the rows taken: the native call lets the interpreter go while it hashes a
        large tensor, and another thread recording meanwhile must get other rows (the rows of
        tensors left to the other paths stay unused)."""
        held, first = self.room(n, sch)
        self.used = first + n
        return held, first


_POOL = _RootPool()


def roots_first(
    tensors: Sequence[torch.Tensor], slots: Sequence[Any], fill_roots: Any
) -> tuple[Sequence[torch.Tensor], Sequence[Any]]:
    """Digest now what ``start_roots`` takes (version 2, ``fill_roots``: the record path's
    ``roots``, None on the Python path); the tensors and slots left for the other paths."""
    if fill_roots is None or not tensors:
        return tensors, slots
    sch = active()
    if sch.version != 2:
        return tensors, slots
    roots = fill_roots
    rest = start_roots(tensors, slots, sch, roots)
    if len(rest) == len(tensors):
        return tensors, slots
    return [tensors[i] for i in rest], [slots[i] for i in rest]


def start_digests(
    tensors: Sequence[torch.Tensor], slots: Sequence[Any], fill_roots: Any, *, reuse: bool = False
) -> None:
    """``batched.start_many(tensors, slots, reuse=reuse)``, the tensors ``start_roots`` takes
    digested by it first (``fill_roots``: the record path's ``roots``)."""
    tensors, slots = roots_first(tensors, slots, fill_roots)
    if tensors:
        start_many(tensors, slots, reuse=reuse)
