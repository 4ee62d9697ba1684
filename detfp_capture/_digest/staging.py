"""Boundary tensors taken when recorded and digested later, together, per device.

Module boundaries and collectives are recorded where capture cannot see later writes, so each
tensor is taken at record time: hashed in place at level 0 (large contiguous ones) or copied
into a snapshot buffer (the rest). The batch then finishes every digest with a few GEMMs
(``levels.finish``) and fills the capture Slots.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from detfp_capture._digest import core, versions
from detfp_capture._digest import moments as _moments
from detfp_capture._digest import pending as digest
from detfp_capture._digest.batched import DIRECT, INT64, PLAIN, SPECIAL, STRIDED, BatchLanes, K, fill, in_place
from detfp_capture._digest.gemm import ANY_M_DEVICES
from detfp_capture._digest.levels import finish

__all__ = ["ByteCopy", "Staging"]

#: ``copy(dst_address, src_address, n)``: a memcpy the caller may hand ``Staging`` (the record
#: path's ``_recorder.slot.copy_bytes``): the digest floor never imports the recorder above it.
ByteCopy = Callable[[int, int, int], None]

#: Dtypes whose snapshot ``put_one`` takes as a byte copy on CPU: ``copy_`` between two
#: contiguous tensors of one of these dtypes moves the bytes unchanged, so the copy is the same.
_BYTE_COPY = frozenset(
    {torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16, torch.int8,
     torch.uint8}
)  # fmt: skip


class Staging:
    """Boundary tensors waiting to be digested together as a batch (one GEMM for level 0 of
    all of them), each taken at record time so a later in-place write cannot change what was
    recorded: safe where capture cannot see writes (module boundaries, collectives).

    Two ways in, chosen per tensor when it is put:

    - **hashed where it is**: a tensor that a step-boundary batch would hash in place too
      (``batched.in_place``: contiguous, whole 1024-byte rows, at least 256 KiB; not int64,
      whose pointer check reads the snapshot) gets its level-0 GEMM now, reading it in place, written into a second
      buffer of level-0 lanes at a fan-in boundary (16 rows in version 1, 64 in version 2; the
      gap zeroed): that buffer is level 1's
      input for all of them, hashed by one GEMM when the batch runs. Large activations are
      never copied: a copy and the later re-read of a cold snapshot cost more than a GEMM on
      bytes just written (still in cache), and per-tensor upper levels cost more (~85 us each
      at 1.5 MiB) than one GEMM over all of them;
    - **snapshot**: the others are copied into whole 1024-byte rows of one device buffer (one
      strided view and one copy per tensor, the bytes moved once; the padding tail of the last
      row is zero because the buffer's rows are zeroed in bulk, ahead of the rows taken), hashed by one GEMM when the batch runs. Small and odd-sized tensors: a copy
      is cheaper than a GEMM call each. Same bytes, same digest as ``digest.start``.
    """

    #: Tensors up to this many bytes are staged (bigger ones are digested directly).
    MAX_TENSOR = 16 << 20
    #: Rows zeroed at a time ahead of the rows taken (see ``put_many``).
    ZERO_ROWS = 1024

    def __init__(self, dev: torch.device, cap_bytes: int = 64 << 20, byte_copy: ByteCopy | None = None) -> None:
        self.dev = dev
        #: The digest version of everything staged here (the active one when the staging began).
        self.scheme = sch = versions.active()
        self._fanin = fanin = sch.fanin
        self.cap_rows = cap_bytes // K
        self.used = 0
        #: Rows [used, clean) of ``buf`` are known to be zero (see ``put_many``).
        self.clean = 0
        self.buf: torch.Tensor | None = None
        self.typed: dict[torch.dtype, torch.Tensor] = {}  # dtype views of the whole buffer
        # What is staged, in buffer order, as parallel lists (no object per tensor: the capture
        # keeps these until its flush, see _records): slot, dtype, shape, numel, rows.
        self.items: tuple[list, list, list, list, list] = ([], [], [], [], [])
        # Tensors hashed in place: the same columns, rows counted at level 1.
        self.direct: tuple[list, list, list, list, list] = ([], [], [], [], [])
        self.lanes: torch.Tensor | None = None  # their level-0 lanes: (fanin * l1_cap, lanes) int32
        self.l1_cap = max(1, self.cap_rows // fanin)  # level-1 rows (as many source bytes as buf)
        self.l1_used = 0
        # CUDA's int8 GEMM wants M >= 32 and a multiple of 8 (gemm.product pads otherwise: a copy).
        self._any_m = dev.type in ANY_M_DEVICES
        #: Snapshots on CPU may be byte copies into ``buf`` (``put_one``), at this address, with
        #: the copy the recorder hands in (None: torch's ``copy_``, the same bytes).
        self._byte_copy = byte_copy if dev.type == "cpu" else None
        self._addr = 0

    @staticmethod
    def fits(t: torch.Tensor) -> bool:
        # Cheapest tests first: this runs for every boundary tensor.
        dt = t.dtype
        return (
            type(t) in PLAIN
            and 0 < t.numel() * dt.itemsize <= Staging.MAX_TENSOR
            and t.layout is STRIDED
            and dt not in SPECIAL
            and not t.is_nested
            and not t.is_meta
            and not t.is_conj()
            and not t.is_neg()
            and not (t.is_cuda and torch.cuda.is_current_stream_capturing())
        )

    def _typed(self, dt: torch.dtype) -> torch.Tensor:
        v = self.typed.get(dt)
        if v is None:
            with torch.inference_mode(False):  # cached: must not be an inference-mode view
                if self.buf is None:
                    # Not zeroed: put_many zeroes rows as it first takes them (the buffer is
                    # reused), and filling 64 MiB up front cost ~60 ms per session, most of a small
                    # step's capture (a repeat check opens one session per call).
                    self.buf = torch.empty(self.cap_rows * K, dtype=torch.int8, device=self.dev)
                    self.typed[torch.int8] = self.buf
                v = self.typed[dt] = self.buf.view(dt)
        return v

    def put_one(self, t: torch.Tensor, slot: Any) -> bool:
        """``put_many([t], [slot])``, the common case of one small tensor, with less work per
        call (most boundary and backward records stage one tensor): a contiguous CPU tensor of
        a ``_BYTE_COPY`` dtype is taken as a byte copy (``_hostpath.copy_bytes``, no dispatcher
        call), anything else as ``put_many`` takes it. The same rows, bytes and columns."""
        dt = t.dtype
        numel = t.numel()
        nb = numel * dt.itemsize
        if nb >= DIRECT:  # may be hashed in place
            return self.put_many([t], [slot])
        m = -(-nb // K)
        row = self.used
        end = row + m
        if end > self.cap_rows:
            return False
        if end > self.clean:  # as put_many: rows zeroed ahead, in stretches
            clean = min(self.cap_rows, max(end, self.clean + self.ZERO_ROWS))
            self._typed(torch.int8)[self.clean * K : clean * K].zero_()
            self.clean = clean
        shape = tuple(t.shape)
        try:
            copy = self._byte_copy
            # (src 0: no storage to read, a zero tensor's: copy_ makes its zeros)
            if copy is not None and dt in _BYTE_COPY and t.is_contiguous() and (src := t.data_ptr()):
                if not self._addr:
                    self._addr = self._typed(torch.int8).data_ptr()
                copy(self._addr + row * K, src, nb)
            else:
                typed = self.typed.get(dt)
                if typed is None:
                    typed = self._typed(dt)
                with torch.no_grad():
                    typed.as_strided(shape, digest._contiguous_strides(shape), row * K // dt.itemsize).copy_(t)
        except BaseException:
            self.clean = self.used  # rows past it may hold part of a copy now
            raise
        i_slot, i_dtype, i_shape, i_numel, i_rows = self.items
        i_slot.append(slot)
        i_dtype.append(dt)
        i_shape.append(shape)
        i_numel.append(numel)
        i_rows.append(m)
        self.used = end
        return True

    def put_many(self, ts: Sequence[torch.Tensor], slots: Sequence[Any]) -> bool:
        """Take tensors that ``fits`` (this device), all or none; False when they do not fit now."""
        need = need1 = 0
        rows: list[int] = []  # level-0 rows of each tensor; negative: hashed in place
        any_m = self._any_m
        for t in ts:
            m = -(-(t.numel() * t.dtype.itemsize) // K)
            if in_place(t) and t.dtype is not INT64 and (any_m or (m >= 32 and m % 8 == 0)):
                rows.append(-m)
                need1 += -(-m // self._fanin)
            else:
                rows.append(m)
                need += m
        if self.used + need > self.cap_rows or self.l1_used + need1 > self.l1_cap:
            return False
        end = self.used + need
        if end > self.clean:
            # The padding tail of each tensor's last row must be zero (the copy overwrites the
            # rest of the row): rows are zeroed ahead of those taken, in stretches of ZERO_ROWS
            # (1 MiB) from the start of each batch, instead of a slice and a zero_ per tensor
            # (two dispatcher calls, several microseconds, for every small tensor of a window).
            clean = min(self.cap_rows, max(end, self.clean + self.ZERO_ROWS))
            self._typed(torch.int8)[self.clean * K : clean * K].zero_()
            self.clean = clean
        if need1 and self.lanes is None:
            with torch.inference_mode(False):  # reused in and out of inference mode
                self.lanes = torch.empty(
                    self.l1_cap * self._fanin, self.scheme.lanes, dtype=torch.int32, device=self.dev
                )
        i_slot, i_dtype, i_shape, i_numel, i_rows = self.items
        d_slot, d_dtype, d_shape, d_numel, d_rows = self.direct
        n0, d0 = len(i_slot), len(d_slot)
        row, row1 = self.used, self.l1_used
        fanin = self._fanin
        mm = self.scheme.mm
        lanes = self.lanes  # allocated above when a tensor here needs it (need1)
        prev = torch.is_grad_enabled()
        if prev:
            torch._C._set_grad_enabled(False)
        try:
            for t, slot, m in zip(ts, slots, rows, strict=True):
                dt = t.dtype
                numel = t.numel()
                shape = tuple(t.shape)  # a tuple: gc untracks it, not a Size
                if m < 0:
                    m = -m
                    m1 = -(-m // fanin)
                    a = row1 * fanin
                    assert lanes is not None
                    mm(core.bytes_view(t).view(m, K), 0, out=lanes[a : a + m])
                    if m != m1 * fanin:  # level 1 reads whole fan-in groups: the gap must be zero
                        lanes[a + m : a + m1 * fanin].zero_()
                    d_slot.append(slot)
                    d_dtype.append(dt)
                    d_shape.append(shape)
                    d_numel.append(numel)
                    d_rows.append(m1)
                    row1 += m1
                    continue
                typed = self.typed.get(dt)
                if typed is None:
                    typed = self._typed(dt)
                typed.as_strided(shape, digest._contiguous_strides(shape), row * K // dt.itemsize).copy_(t)
                i_slot.append(slot)
                i_dtype.append(dt)
                i_shape.append(shape)
                i_numel.append(numel)
                i_rows.append(m)
                row += m
        except BaseException:
            self.clean = self.used  # rows past it may hold part of a copy now
            for col in self.items:  # all or nothing: the caller digests these tensors another way
                del col[n0:]
            for col in self.direct:
                del col[d0:]
            raise
        finally:
            if prev:
                torch._C._set_grad_enabled(True)
        self.used, self.l1_used = row, row1
        return True

    def _run_rows(self) -> tuple[BatchLanes | None, tuple]:
        """Digest everything waiting and empty the batch: (final lanes, items in row order)."""
        items, used, direct, used1 = self.items, self.used, self.direct, self.l1_used
        if not items[0] and not direct[0]:
            return None, items
        self.items, self.used = ([], [], [], [], []), 0
        self.direct, self.l1_used = ([], [], [], [], []), 0
        dev = self.dev
        sch = self.scheme
        with torch.no_grad():
            # Results in new lanes tensors, never views of the (reused) buffers.
            parts = []
            buf, lanes = self.buf, self.lanes  # each allocated by the puts that used it
            if used:
                assert buf is not None
                parts.append(finish(sch.mm(buf[: used * K].view(-1, K), 0), items[4], dev, sch))
            if used1:
                assert lanes is not None
                lanes1 = sch.mm(lanes[: used1 * self._fanin].view(torch.int8).view(-1, K), 1)
                parts.append(finish(lanes1, direct[4], dev, sch, level=2))
            final = parts[0] if len(parts) == 1 else torch.cat(parts)
            held = BatchLanes(final, sch)
            if INT64 in items[1]:
                self._pointer_flags(held, items)
            self.clean = 0  # the rows are taken again from the start: put_many zeroes them again
            return held, tuple(a + b for a, b in zip(items, direct, strict=True))

    def _pointer_flags(self, held: BatchLanes, items: tuple) -> None:
        """``pointer_like`` of every staged int64 tensor, read from its snapshot, for the whole
        batch at once (a handful of ops, instead of ~6 per tensor): per tensor, the number of
        values that do not look like a device pointer, from one cumulative sum."""
        typed = self._typed(INT64)  # (a byte copy in put_one does not make the view)
        pieces, numels, rows_at = [], [], []
        row = 0
        for i, (dt, numel, m) in enumerate(zip(items[1], items[3], items[4], strict=True)):
            if dt is INT64:
                start = row * (K // 8)
                pieces.append(typed[start : start + numel])
                numels.append(numel)
                rows_at.append(i)
            row += m
        x = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        bad = (~_moments.looks_like_pointer(x)).to(torch.int64).cumsum(0)
        ends = torch.tensor(numels, dtype=torch.int64, device=x.device).cumsum(0)
        upto = bad.index_select(0, ends - 1)
        counts = torch.cat([upto[:1], upto[1:] - upto[:-1]])
        held.ptr_out = counts == 0
        held.ptr_pos = {r: k for k, r in enumerate(rows_at)}

    def run_into(self) -> None:
        """Digest everything staged, the results going straight into the staged capture Slots
        (``fill``), and empty the buffer."""
        held, (slots, dtypes, shapes, numels, _) = self._run_rows()
        if held is None:  # nothing was staged
            return
        dev = self.dev
        for row, slot in enumerate(slots):
            fill(slot, held, row, dtypes[row], shapes[row], numels[row], dev, dtypes[row] is INT64)
