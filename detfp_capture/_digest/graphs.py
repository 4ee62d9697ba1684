"""Digests recorded into a CUDA graph: a preallocated device buffer the graph writes, read after each replay.

Work issued while a stream captures a CUDA graph is recorded into the graph and only runs at
replay; a digest started then (``pending.start``) has no value yet, and its resolution (a
device-to-host copy) is not allowed inside a capture, so ``start`` refuses it. ``GraphDigests``
makes the digest part of the graph instead:

1. before the capture, ``GraphDigests(device, rows)`` allocates a zeroed ``(rows, lanes)`` int32
   buffer and runs the digest's routes once on the device (the GEMM route is chosen by timing it,
   which must not happen inside a capture);
2. during the capture, ``put(t)`` issues ``t``'s digest work up to its final lanes (the tree of
   ``core.lanes_of``: device ops only, no host sync) and a copy of the lanes into the next row,
   and returns the row (None once the buffer is full: a capture cannot reallocate it safely);
3. every replay runs that work again, rewriting each row from its tensor's bytes at that point
   of the replay;
4. after a replay, ``snapshot()`` enqueues one device copy of the rows used (on the current
   stream, so ordered after the replay; nothing waits on the host), and ``pending(snap, row)``
   is an ordinary ``Pending`` over that copy's row, which ``resolve`` finalizes with everything
   else at the next flush: the same digest ``start`` gives the tensor's bytes outside a graph.

Rows are assigned in capture order and never reused within a graph; ``meta`` keeps each row's
dtype, shape and numel (the finalizer's meta words). The buffer and its bookkeeping run on any
device; on a CPU there is no graph, and the rows are written when ``put`` runs.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from detfp_capture._digest import core, versions
from detfp_capture._digest.pending import _BYTE_DTYPES, Pending

__all__ = ["GraphDigests", "RowMeta"]

#: Rows of a graph's buffer by default: the tensors one graph digests (4096 rows of 4 int32 lanes
#: at version 2: 64 KiB of device memory).
DEFAULT_ROWS = 4096


class RowMeta(NamedTuple):
    """What the finalizer needs of a row's tensor besides its lanes."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    numel: int


class GraphDigests:
    """The digest rows of one CUDA graph (see the module docstring)."""

    def __init__(self, device: Any, rows: int = DEFAULT_ROWS, scheme: core.Scheme | None = None) -> None:
        if rows < 1:
            raise ValueError(f"GraphDigests: rows must be >= 1, got {rows}")
        self.scheme = scheme if scheme is not None else versions.active()
        self.device = torch.device(device)
        self.buf = torch.zeros((rows, self.scheme.lanes), dtype=torch.int32, device=self.device)
        #: Each used row's tensor: dtype, shape, numel (in row order).
        self.meta: list[RowMeta] = []
        # The routes (the GEMM's is timed once per device type) chosen now, outside any capture.
        for n in (16, core.K * 3):
            core.lanes_of(torch.zeros(n, dtype=torch.uint8, device=self.device), self.scheme)

    @property
    def rows(self) -> int:
        return int(self.buf.shape[0])

    @property
    def used(self) -> int:
        return len(self.meta)

    def put(self, t: torch.Tensor) -> int | None:
        """Issue ``t``'s digest into the next row; the row, or None when the buffer is full or
        ``t`` is not a plain strided tensor of this device (its record says so instead)."""
        if self.used >= self.rows or t.device != self.device or t.layout is not torch.strided or t.is_nested:
            return None
        x = t.detach()
        if x.is_conj() or x.is_neg():
            x = x.resolve_conj().resolve_neg()
        if x.dtype in _BYTE_DTYPES:
            x = x.view(torch.int8)
        row = self.used
        lanes = core.lanes_of(x, self.scheme)
        self.buf[row : row + 1].copy_(lanes)
        self.meta.append(RowMeta(t.dtype, tuple(t.shape), t.numel()))
        return row

    def snapshot(self) -> torch.Tensor:
        """A device copy of the rows used, as the last replay left them (call after the replay)."""
        return self.buf[: self.used].clone()

    def pending(self, snap: torch.Tensor, row: int) -> Pending:
        """The ``Pending`` of ``row`` in ``snap`` (a ``snapshot()``), for ``resolve``."""
        m = self.meta[row]
        p = Pending(m.dtype, m.shape, m.numel, snap.device)
        p.scheme = self.scheme
        p.lanes = snap[row : row + 1]
        return p
