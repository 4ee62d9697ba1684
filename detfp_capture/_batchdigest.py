"""Start the digests of many tensors at once (parameters, gradients, optimizer states).

``digest.start`` costs a handful of small device ops per tensor; at a step boundary capture
digests every parameter, gradient and optimizer state (hundreds of tensors), so this module
runs the same tree-linear-hash levels (docs/digest.md) for a whole batch: level 0 is one
concatenation of every tensor's bytes, each zero-padded to whole 1024-byte rows, and one
GEMM; each further level does the same for the tensors that still have more than one row.
The result per tensor is the final (1, 16) lanes row, handed to ``digest.resolve`` in an
ordinary ``Pending``, so the digests are identical to ``digest.start``'s (a test checks it).
Tensors the batch path does not cover (small ones, which go to the digest arena anyway,
subclasses, int64 pointer checks, byte-viewed dtypes, conjugate views) use ``digest.start``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from detfp_capture import _digest_core as core
from detfp_capture import digest

__all__ = ["Staging", "start_many"]

_K = core.K
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_SPECIAL = digest._BYTE_DTYPES


def _batchable(t: torch.Tensor) -> bool:
    return (
        type(t) in _PLAIN
        and t.layout is torch.strided
        and not t.is_nested
        and not t.is_meta
        and t.dtype is not torch.int64
        and t.dtype not in _SPECIAL
        and t.numel() * t.element_size() > _K
        and not t.is_conj()
        and not t.is_neg()
        and not (t.device.type == "cuda" and torch.cuda.is_current_stream_capturing())
    )


def start_many(tensors: Sequence[torch.Tensor]) -> list[digest.Pending]:
    """``digest.start(t, pointer_check=...)`` for every tensor, batched where possible."""
    out: list[digest.Pending | None] = [None] * len(tensors)
    groups: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        try:
            ok = _batchable(t)
        except Exception:
            ok = False
        if ok:
            groups.setdefault(t.device, []).append(i)
        else:
            out[i] = digest.start(t, pointer_check=t.dtype is torch.int64)
    for dev, idx in groups.items():
        try:
            lanes = _lanes_batch([tensors[i] for i in idx], dev)
        except Exception:
            for i in idx:
                out[i] = digest.start(tensors[i])
            continue
        for i, row in zip(idx, lanes, strict=True):
            t = tensors[i]
            p = digest.Pending(t.dtype, t.shape, t.numel(), dev)
            p.lanes = row
            out[i] = p
    return out  # type: ignore[return-value]


def _lanes_batch(ts: list[torch.Tensor], dev: torch.device) -> list[torch.Tensor]:
    with torch.no_grad():
        pieces: list[torch.Tensor] = []
        rows: list[int] = []
        zero = _zeros(dev)
        for t in ts:
            b = t.detach().contiguous().reshape(-1).view(torch.int8)
            n = b.numel()
            m = max(1, -(-n // _K))
            pieces.append(b)
            if m * _K != n:
                pieces.append(zero[: m * _K - n])
            rows.append(m)
        lanes = core.mm(torch.cat(pieces).view(-1, _K), 0)
        return _finish(lanes, rows, dev)


_ZEROS: dict[torch.device, torch.Tensor] = {}


def _zeros(dev: torch.device) -> torch.Tensor:
    z = _ZEROS.get(dev)
    if z is None:
        z = _ZEROS[dev] = torch.zeros(_K, dtype=torch.int8, device=dev)
    return z


def _finish(lanes: torch.Tensor, rows: list[int], dev: torch.device) -> list[torch.Tensor]:
    """Level-0 lanes of consecutive tensors (``rows[i]`` rows each) -> each tensor's final (1, 16) row."""
    zero = _zeros(dev)
    final: list[torch.Tensor | None] = [None] * len(rows)
    rows = list(rows)
    offsets = _offsets(rows)
    live = list(range(len(rows)))
    level = 1
    while True:
        nxt = []
        pieces = []
        new_rows = []
        for j in live:
            off, m = offsets[j], rows[j]
            if m == 1:
                final[j] = lanes[off : off + 1]
                continue
            b = lanes[off : off + m].reshape(-1).view(torch.int8)
            n = m * core.LANES * 4
            m2 = -(-n // _K)
            pieces.append(b)
            if m2 * _K != n:
                pieces.append(zero[: m2 * _K - n])
            nxt.append(j)
            new_rows.append(m2)
        if not nxt:
            return final  # type: ignore[return-value]
        lanes = core.mm(torch.cat(pieces).view(-1, _K), level)
        offs = _offsets(new_rows)
        for k, j in enumerate(nxt):
            offsets[j] = offs[k]
            rows[j] = new_rows[k]
        live = nxt
        level += 1


def _offsets(rows: list[int]) -> list[int]:
    out = []
    acc = 0
    for m in rows:
        out.append(acc)
        acc += m
    return out


class Staging:
    """Snapshots of tensors, copied into whole 1024-byte rows of one device buffer, digested later
    as a batch (one GEMM for level 0 of all of them).

    The copy preserves the values at record time whatever happens to the tensor afterwards, so
    this is safe where capture cannot see writes (module boundaries, collectives); it costs one
    copy per tensor instead of the handful of small ops of ``digest.start``.
    """

    #: Tensors up to this many bytes are staged (bigger ones are digested directly).
    MAX_TENSOR = 16 << 20

    def __init__(self, dev: torch.device, cap_bytes: int = 64 << 20) -> None:
        self.dev = dev
        self.cap_rows = cap_bytes // _K
        self.buf: torch.Tensor | None = None
        self.used = 0
        self.items: list[tuple[object, torch.Tensor, int]] = []  # (slot, template tensor meta, rows)

    @staticmethod
    def fits(t: torch.Tensor) -> bool:
        nb = t.numel() * t.element_size()
        return (
            _K < nb <= Staging.MAX_TENSOR
            and type(t) in _PLAIN
            and t.layout is torch.strided
            and not t.is_nested
            and not t.is_meta
            and t.dtype is not torch.int64
            and not (t.device.type == "cuda" and torch.cuda.is_current_stream_capturing())
        )

    def put(self, t: torch.Tensor, slot: object) -> bool:
        """Copy ``t`` in; False when the buffer is full (run() first)."""
        nb = t.numel() * t.element_size()
        m = -(-nb // _K)
        if self.used + m > self.cap_rows:
            return False
        if self.buf is None:
            self.buf = torch.zeros(self.cap_rows * _K, dtype=torch.int8, device=self.dev)
        start = self.used * _K
        dst = self.buf[start : start + nb].view(t.dtype).view(t.shape)
        with torch.no_grad():
            dst.copy_(t)  # resolves conjugate/negative views: the logical values, as digest.start
        self.items.append((slot, t.dtype, tuple(t.shape), t.numel(), m))
        self.used += m
        return True

    def run(self) -> list[tuple[object, digest.Pending]]:
        """Digest everything staged; returns (slot, Pending) pairs and empties the buffer."""
        if not self.items:
            return []
        with torch.no_grad():
            lanes = core.mm(self.buf[: self.used * _K].view(-1, _K), 0)
            finals = _finish(lanes, [it[4] for it in self.items], self.dev)
            out = []
            for (slot, dtype, shape, numel, _), row in zip(self.items, finals, strict=True):
                p = digest.Pending(dtype, shape, numel, self.dev)
                p.lanes = row  # a row of the lanes tensor, not of the (reused) buffer
                out.append((slot, p))
            self.buf[: self.used * _K].zero_()  # padding tails must be zero next time
        self.items = []
        self.used = 0
        return out
