"""The mergeable fingerprint ``detfp-mlh128`` (docs/digest.md, "Mergeable fingerprints"): a logical
tensor's fingerprint computed from the parts its shards hold, without moving their bytes.

Over the logical tensor's global byte stream (row-major, as a digest reads it) cut into 1024-byte
rows r, version 2's level-0 sums a_r, b_r (``tlh2``, keys of level 0) are weighted by odd 64-bit
row keys and summed: ``ma = sum_r Ra(r) * a_r``, ``mb = sum_r Rb(r) * b_r`` (mod 2^64). Both are
linear in the words, so a shard computes its *part* from its own bytes placed at their global
offsets (``Box``: where the shard lies in the whole), the parts of all shards add up modulo 2^64
to the whole tensor's (``combine``), and the finalizer (version 2's, with the whole's dtype and
global shape in the metadata) makes the 128-bit fingerprint (``finalize``). Two runs with
different layouts (TP=1 and TP=2) thus compare a logical tensor bitwise from fingerprints alone.

Routes (the same integers): the native kernel (``_lanes.mlh``: version 2's row function on the
full rows where they lie, a zeroed 1 KiB row for a row a run covers in part) on CPU, and torch
(tensor ops, every device, no host sync: the runs padded to whole rows, version 2's GEMM route,
the row keys by splitmix64 on int64 tensors).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from detfp_capture._digest import native, tlh2
from detfp_capture._digest.core import GAMMA, MASK64, K, mix_int, mix_t, s64

__all__ = [
    "ALGORITHM",
    "MOMENTS",
    "SEED_A",
    "SEED_B",
    "VERSION",
    "Box",
    "combine",
    "combine_moments",
    "finalize",
    "moments",
    "part",
    "part_t",
    "row_key",
    "whole",
]

#: The name and version in the metadata text: never equal to a digest of ``detfp-tlh128``.
ALGORITHM = "detfp-mlh128"
VERSION = 1
#: splitmix64 seeds of the row keys: the ASCII bytes "detfpmla" / "detfpmlb" read big-endian.
SEED_A = int.from_bytes(b"detfpmla", "big")
SEED_B = int.from_bytes(b"detfpmlb", "big")


def row_key(seed: int, r: int) -> int:
    """Row ``r``'s key: the (r + 1)-th splitmix64 output from ``seed``, made odd (a unit mod 2^64)."""
    return mix_int((seed + (r + 1) * GAMMA) & MASK64) | 1


@dataclass(frozen=True)
class Box:
    """Where a shard's elements lie in the logical tensor: the box ``offset[d] <= i_d <
    offset[d] + shape[d]`` of a tensor of ``global_shape``; the shard holds them in row-major
    order of the box. A whole tensor is the box at offset 0 of its own shape."""

    #: The logical tensor's shape.
    global_shape: tuple[int, ...]
    #: The box's first index along each dimension.
    offset: tuple[int, ...]
    #: The box's extent along each dimension (the shard's shape).
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        g, o, s = self.global_shape, self.offset, self.shape
        if not (len(g) == len(o) == len(s)):
            raise ValueError(f"box: global shape {g}, offset {o} and shape {s} differ in rank")
        for d, (gd, od, sd) in enumerate(zip(g, o, s, strict=True)):
            if gd < 0 or od < 0 or sd < 0 or od + sd > gd:
                raise ValueError(f"box: dimension {d} spans [{od}, {od + sd}) outside [0, {gd})")

    @classmethod
    def whole(cls, shape: Sequence[int]) -> Box:
        s = tuple(int(v) for v in shape)
        return cls(s, (0,) * len(s), s)

    def runs(self, itemsize: int) -> tuple[tuple[int, ...], tuple[int, ...], int, int]:
        """(sizes, global byte strides, run bytes, base): the box's elements as runs contiguous
        in the global order, one per row-major index over ``sizes``, run j at global byte offset
        ``base + sum_d i_d * strides[d]``. The trailing dimensions the box covers whole merge into
        one run with the first partial one above them."""
        g, o, s = self.global_shape, self.offset, self.shape
        n = len(g)
        gstride = [0] * n
        acc = itemsize
        for d in range(n - 1, -1, -1):
            gstride[d] = acc
            acc *= g[d]
        k = n  # the dimensions k.. are one run
        while k > 0 and (k == n or (s[k] == g[k] and o[k] == 0)):
            k -= 1
        run = itemsize * math.prod(s[k:]) if n else itemsize
        base = sum(od * st for od, st in zip(o, gstride, strict=True))
        return tuple(s[:k]), tuple(gstride[:k]), run, base


def _native(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and tlh2.SCHEME.use_native(t.device)


def part(t: torch.Tensor, box: Box | None = None) -> tuple[int, int]:
    """(ma, mb) of the shard ``t`` lying at ``box`` (the whole tensor when None), as unsigned
    64-bit integers on the host."""
    if box is None:
        box = Box.whole(t.shape)
    _check(t, box)
    if _native(t):
        x = t.detach().contiguous()
        sizes, strides, run, base = box.runs(x.element_size())
        if x.numel() == 0:
            return 0, 0
        return native.mlh(x, sizes, strides, run, base, tlh2.pack_keys(0), SEED_A, SEED_B)
    got = part_t(t, box)
    a, b = (int(v) & MASK64 for v in got.tolist())
    return a, b


def part_t(t: torch.Tensor, box: Box | None = None) -> torch.Tensor:
    """``part`` as a (2,) int64 tensor on ``t``'s device, by tensor ops (no host sync)."""
    if box is None:
        box = Box.whole(t.shape)
    _check(t, box)
    x = t.detach().contiguous()
    dev = x.device
    sizes, strides, run, base = box.runs(x.element_size())
    nruns = math.prod(sizes)
    if x.numel() == 0:
        return torch.zeros(2, dtype=torch.int64, device=dev)
    # The runs' global byte offsets, on the host: they follow from the box alone.
    starts = torch.full((), base, dtype=torch.int64)
    for size, stride in zip(sizes, strides, strict=True):
        starts = (starts.unsqueeze(-1) + torch.arange(size, dtype=torch.int64) * stride).reshape(-1)
    starts = starts.reshape(nruns)
    heads = starts % K
    groups = torch.unique(heads).tolist()
    data = x.reshape(-1).view(torch.uint8).view(torch.int8).view(nruns, run)
    total = torch.zeros(2, dtype=torch.int64, device=dev)
    # Runs that start at the same place in a row are padded to whole rows together.
    for h in groups:
        pick = None if len(groups) == 1 else (heads == h).nonzero().view(-1)
        rows_of = data if pick is None else data.index_select(0, pick.to(dev))
        first = starts if pick is None else starts.index_select(0, pick)
        width = -(-(h + run) // K) * K
        padded = torch.nn.functional.pad(rows_of, (h, width - h - run))
        per = width // K
        sums = tlh2.SCHEME.mm(padded.reshape(-1, K), 0).view(torch.int64).view(-1, per, 2)  # (runs, per, 2)
        r = ((first // K).unsqueeze(1) + torch.arange(per, dtype=torch.int64)).to(dev)
        keys = torch.stack([_row_keys_t(SEED_A, r), _row_keys_t(SEED_B, r)], dim=-1)
        total = total + (keys * sums).sum(dim=(0, 1))  # int64 arithmetic wraps mod 2^64
    return total


def _row_keys_t(seed: int, r: torch.Tensor) -> torch.Tensor:
    """``row_key`` of every row index in ``r`` (int64 tensors, wrapping)."""
    return mix_t((r + 1) * s64(GAMMA) + s64(seed)) | 1


def _check(t: torch.Tensor, box: Box) -> None:
    if tuple(t.shape) != box.shape:
        raise ValueError(f"a shard of shape {tuple(t.shape)} cannot lie in a box of shape {box.shape}")


def combine(parts: Iterable[tuple[int, int]]) -> tuple[int, int]:
    """The whole tensor's (ma, mb) from its shards' parts: their sums modulo 2^64 (each shard's
    part exactly once; replicas of one shard are compared with each other, not added)."""
    a = b = 0
    for pa, pb in parts:
        a, b = (a + pa) & MASK64, (b + pb) & MASK64
    return a, b


def _meta(dtype: str, global_shape: Sequence[int], itemsize: int) -> tuple[int, int]:
    numel = math.prod(global_shape)
    text = "\x1f".join(
        (ALGORITHM, str(VERSION), dtype, str(numel * itemsize), str(numel), ",".join(map(str, global_shape)))
    )
    d = hashlib.blake2b(text.encode(), digest_size=16).digest()
    return int.from_bytes(d[:8], "little"), int.from_bytes(d[8:], "little")


def finalize(
    ma: int, mb: int, dtype: torch.dtype | str, global_shape: Sequence[int], itemsize: int | None = None
) -> tuple[int, int]:
    """The 128-bit fingerprint (hi, lo) of a logical tensor from its (ma, mb): version 2's
    finalizer with this algorithm's metadata words (dtype, global shape)."""
    if isinstance(dtype, torch.dtype):
        itemsize = dtype.itemsize
        dtype = str(dtype)
    if itemsize is None:
        raise ValueError("finalize: the itemsize of a dtype given by name")
    m0, m1 = _meta(dtype, tuple(int(v) for v in global_shape), itemsize)
    x = mix_int((ma ^ m0) & MASK64)
    y = mix_int(mb ^ m1 ^ x)
    hi = mix_int((x + y) & MASK64)
    return hi, mix_int(y ^ hi)


def whole(t: torch.Tensor) -> tuple[int, int]:
    """The fingerprint (hi, lo) of an unsharded tensor: what the shards of it combine to."""
    ma, mb = part(t)
    return finalize(ma, mb, t.dtype, t.shape)


#: The mergeable moments, in order (docs/digest.md, M.5).
MOMENTS = ("count", "sum", "sumsq", "min", "max", "absmax", "nan", "inf")
_EMPTY = (0.0, 0.0, 0.0, float("inf"), float("-inf"), 0.0, 0.0, 0.0)


def moments(t: torch.Tensor) -> torch.Tensor:
    """(8,) float64 ``MOMENTS`` of a shard, on its device (no host sync): element count, float64
    sum and sum of squares, min and max over the values that are not NaN (+inf / -inf when there
    are none), max |value| (0 when none), NaN and Inf counts. Complex: the real parts' sum, min
    and max, the moduli's sum of squares and max. Integers and bool as float64 values."""
    x = t.detach()
    dev = x.device
    if x.numel() == 0:
        return torch.tensor(_EMPTY, dtype=torch.float64, device=dev)
    if x.is_complex():
        r = torch.view_as_real(x.resolve_conj()).to(torch.float64).reshape(-1, 2)
        re, sq = r[:, 0], r.square().sum(1)
    else:
        re = x.reshape(-1).to(torch.float64)
        sq = re.square()
    nan = torch.isnan(sq)
    keep = ~nan
    finite_re = re.masked_fill(~keep, 0.0)
    lo = re.masked_fill(~keep, float("inf")).min()
    hi = re.masked_fill(~keep, float("-inf")).max()
    mag = sq.masked_fill(~keep, 0.0).sqrt().max() if x.is_complex() else re.abs().masked_fill(~keep, 0.0).max()
    count = torch.tensor(float(x.numel()), dtype=torch.float64, device=dev)
    return torch.stack(
        [count, finite_re.sum(), sq.masked_fill(~keep, 0.0).sum(), lo, hi, mag,
         nan.sum().to(torch.float64), torch.isinf(sq).sum().to(torch.float64)]
    )  # fmt: skip


def combine_moments(parts: Iterable[Sequence[float]]) -> tuple[float, ...]:
    """The whole tensor's ``MOMENTS`` from its shards': counts, sums and NaN/Inf counts added,
    min/max/absmax taken. Exact but for the float64 sums, whose merged value differs from a
    one-pass sum by at most the float64 rounding of adding the parts (M.5)."""
    count = total = sq = nan = inf = 0.0
    lo, hi, mag = float("inf"), float("-inf"), 0.0
    for p in parts:
        count += p[0]
        total += p[1]
        sq += p[2]
        lo, hi, mag = min(lo, p[3]), max(hi, p[4]), max(mag, p[5])
        nan += p[6]
        inf += p[7]
    return (count, total, sq, lo, hi, mag, nan, inf)
