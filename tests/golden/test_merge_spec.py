"""detfp-mlh128 (docs/digest.md, "Mergeable fingerprints") against an independent reimplementation.

The reference below is written from the document alone (numpy and plain Python; it shares no code
with ``detfp_capture``). Golden values pin the output across processes and releases: a change is a
new version of the mergeable fingerprint.
"""

from __future__ import annotations

import functools
import hashlib
import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from detfp_capture._digest import merge
from tests import native_half

M64 = (1 << 64) - 1
GAMMA = 0x9E3779B97F4A7C15


def _mix(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


@functools.cache
def _level0() -> tuple[np.ndarray, np.ndarray]:
    """V2.1's keys of level 0: the low and high halves of splitmix64 from "detfptl2"."""
    state, a, b = 0x6465746670746C32, [], []
    for _ in range(256):
        state = (state + GAMMA) & M64
        z = _mix(state)
        a.append(z & 0xFFFFFFFF)
        b.append(z >> 32)
    return np.array(a, dtype=np.uint64), np.array(b, dtype=np.uint64)


def _row_key(seed_text: bytes, r: int) -> int:
    return _mix((int.from_bytes(seed_text, "big") + (r + 1) * GAMMA) & M64) | 1


def ref_sums(data: bytes) -> tuple[int, int]:
    """(ma, mb) of a byte stream (M.1)."""
    rows = max(1, -(-len(data) // 1024))
    padded = np.frombuffer(data + bytes(rows * 1024 - len(data)), dtype=np.int8).astype(np.int64).reshape(-1, 4)
    words = (padded * np.array([1, 256, 65536, 16777216], dtype=np.int64)).sum(1).reshape(rows, 256)
    a_keys, b_keys = _level0()
    ma = mb = 0
    with np.errstate(over="ignore"):
        u = words.astype(np.uint64)  # two's complement: the sums are taken modulo 2^64
        for r in range(rows):
            a = int((u[r] * a_keys).sum(dtype=np.uint64))
            b = int((u[r] * b_keys).sum(dtype=np.uint64))
            ma = (ma + _row_key(b"detfpmla", r) * a) & M64
            mb = (mb + _row_key(b"detfpmlb", r) * b) & M64
    return ma, mb


def ref_fingerprint(data: bytes, dtype: str, shape: tuple[int, ...]) -> tuple[int, int]:
    """M.1's fingerprint: V2.4's finalizer with the detfp-mlh128 meta words."""
    ma, mb = ref_sums(data)
    numel = int(np.prod(shape)) if shape else 1
    text = "\x1f".join(["detfp-mlh128", "1", dtype, str(len(data)), str(numel), ",".join(map(str, shape))])
    h = hashlib.blake2b(text.encode(), digest_size=16).digest()
    m0, m1 = int.from_bytes(h[:8], "little"), int.from_bytes(h[8:], "little")
    x = _mix(ma ^ m0)
    y = _mix(mb ^ m1 ^ x)
    hi = _mix((x + y) & M64)
    return hi, _mix(y ^ hi)


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _route(t: torch.Tensor, box: merge.Box | None, route: str) -> tuple[int, int]:
    if route == "native":
        return merge.part(t, box)
    return tuple(int(v) & M64 for v in merge.part_t(t, box).tolist())  # type: ignore[return-value]


ROUTES = ["native", "torch"]


@pytest.mark.parametrize(
    "shape,dtype",
    [((), torch.float32), ((3,), torch.float32), ((5, 300), torch.float32), ((7, 333), torch.bfloat16),
     ((2, 3, 517), torch.int8), ((1000,), torch.float64), ((0, 4), torch.float32), ((300, 5), torch.complex64),
     ((4097,), torch.uint8)],
)  # fmt: skip
@pytest.mark.parametrize("route", ROUTES)
def test_whole_tensors_match_the_reference(shape, dtype, route):
    g = torch.Generator().manual_seed(sum(shape) + 7)
    t = (torch.randn(shape, generator=g) * 100).to(dtype) if not dtype.is_complex else torch.randn(shape, dtype=dtype)
    want = ref_sums(_bytes(t))
    assert _route(t, None, route) == want
    assert merge.whole(t) == ref_fingerprint(_bytes(t), str(dtype), tuple(shape))


def _shards(shape: tuple[int, ...], cuts: list[list[int]]):
    """Every box of the grid that ``cuts`` (sorted bounds per dimension) make of ``shape``."""
    for idx in itertools.product(*[range(len(c) - 1) for c in cuts]):
        off = tuple(cuts[d][i] for d, i in enumerate(idx))
        end = tuple(cuts[d][i + 1] for d, i in enumerate(idx))
        yield off, end


@settings(max_examples=25, deadline=None)
@given(
    st.lists(st.integers(1, 40), min_size=1, max_size=3),
    st.sampled_from([torch.float32, torch.bfloat16, torch.int8, torch.float64]),
    st.data(),
)
def test_the_parts_of_any_sharding_add_up_to_the_whole(shape, dtype, data):
    """Uneven boxes cut anywhere (a bfloat16 shard starting inside a word), both routes equal."""
    shape = tuple(shape)
    g = torch.Generator().manual_seed(len(shape) * 1000 + sum(shape))
    t = (torch.randn(shape, generator=g) * 50).to(dtype)
    cuts = [sorted({0, data.draw(st.integers(0, n)), data.draw(st.integers(0, n)), n}) for n in shape]
    parts = []
    for off, end in _shards(shape, cuts):
        shard = t[tuple(slice(o, e) for o, e in zip(off, end, strict=True))]
        box = merge.Box(shape, off, tuple(shard.shape))
        got = merge.part(shard, box)
        assert got == _route(shard, box, "torch")
        parts.append(got)
    assert merge.combine(parts) == ref_sums(_bytes(t))


def test_a_column_shard_of_a_wide_matrix_runs_row_by_row():
    """Tensor parallelism's column shard: one run per row, each starting mid-row."""
    t = torch.randn(64, 700, dtype=torch.bfloat16)
    halves = [(0, 351), (351, 700)]
    parts = [merge.part(t[:, a:b], merge.Box((64, 700), (0, a), (64, b - a))) for a, b in halves]
    assert merge.combine(parts) == merge.part(t)
    assert merge.Box((64, 700), (0, 351), (64, 349)).runs(2) == ((64,), (1400,), 698, 702)


@pytest.mark.parametrize(
    ("shape", "cut_dims"),
    [
        ((6, 4096), (1,)),  # 4 column shards of 4 KiB: every run whole rows, one per tensor row
        ((3, 4, 2048), (0, 2)),  # runs of 2 KiB over a 2-D odometer
        ((5, 2, 256), (1,)),  # runs of exactly one row
    ],
)
def test_shards_made_of_whole_rows_take_the_row_aligned_kernel(shape, cut_dims):
    """Runs that start a global row and span whole rows go through the kernel across run
    boundaries (lanes_c/mlh.c, mlh_box_aligned): the same sums as the reference and torch."""
    t = torch.randn(shape, generator=torch.Generator().manual_seed(7))
    cuts = [[0, n // 2, n] if d in cut_dims else [0, n] for d, n in enumerate(shape)]
    parts = []
    for off, end in _shards(shape, cuts):
        shard = t[tuple(slice(o, e) for o, e in zip(off, end, strict=True))]
        box = merge.Box(shape, off, tuple(shard.shape))
        _sizes, strides, run, base = box.runs(4)
        assert run % 1024 == 0 and base % 1024 == 0 and all(st % 1024 == 0 for st in strides)
        got = merge.part(shard, box)
        assert got == _route(shard, box, "torch")
        parts.append(got)
    assert merge.combine(parts) == ref_sums(_bytes(t)) == merge.part(t)


def test_a_row_shard_is_one_run():
    assert merge.Box((8, 16, 4), (2, 0, 0), (3, 16, 4)).runs(4) == ((), (), 3 * 16 * 4 * 4, 2 * 16 * 4 * 4)


def test_certain_changes_inside_one_row_are_seen():
    """A one-word change, a sign flip (the worst word difference) and a swap inside one row."""
    t = torch.randn(4096)
    base = merge.part(t)
    flipped = t.clone()
    flipped[1000] = -flipped[1000]
    swapped = t.clone()
    swapped[[3, 4]] = swapped[[4, 3]]
    nudged = t.clone()
    nudged.view(torch.int32)[77] += 1
    for other in (flipped, swapped, nudged):
        assert merge.part(other) != base


def test_boxes_outside_the_tensor_and_mismatched_shards_are_refused():
    with pytest.raises(ValueError, match="outside"):
        merge.Box((4, 4), (3, 0), (2, 4))
    with pytest.raises(ValueError, match="rank"):
        merge.Box((4, 4), (0,), (4, 4))
    with pytest.raises(ValueError, match="cannot lie"):
        merge.part(torch.zeros(3, 4), merge.Box((4, 4), (0, 0), (4, 4)))


def test_golden_fingerprints():
    """Pinned values: a change here is a new version of detfp-mlh128 (docs/digest.md, M.1)."""
    t = torch.arange(1000, dtype=torch.float32).reshape(10, 100)
    hex32 = "{:016x}{:016x}".format
    assert hex32(*merge.whole(t)) == hex32(*ref_fingerprint(_bytes(t), "torch.float32", (10, 100)))
    assert hex32(*merge.whole(t)) == GOLDEN_ARANGE


GOLDEN_ARANGE = "ff1d052a335b21c00ae4783e83c4f22f"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32, torch.complex64, torch.bool])
def test_moments_of_any_sharding_merge_to_the_whole(dtype):
    g = torch.Generator().manual_seed(3)
    t = torch.randn(37, 19, generator=g)
    t[3, 4] = float("nan")
    t[5, 6] = float("inf")
    t = (t * 10).to(dtype) if not dtype.is_complex else torch.complex(t, t.flip(0))
    whole = merge.moments(t).tolist()
    parts = [merge.moments(p).tolist() for p in (t[:10], t[10:11], t[11:], t[:0])]
    got = merge.combine_moments(parts)
    for name, w, m in zip(merge.MOMENTS, whole, got, strict=True):
        if name in ("sum", "sumsq"):
            assert m == pytest.approx(w, rel=1e-12, abs=1e-9), name
        else:
            assert m == w, name
    if dtype.is_floating_point:
        assert (whole[6], whole[7]) == (1.0, 1.0)
        finite = t.to(torch.float64)[torch.isfinite(t.to(torch.float64))]
        assert whole[3] == float(finite.min()) or whole[3] == float("-inf")


def test_moments_of_nothing_are_the_identity_of_merging():
    empty = merge.moments(torch.zeros(0))
    assert merge.combine_moments([empty.tolist()]) == tuple(empty.tolist())
    assert empty.tolist() == [0.0, 0.0, 0.0, float("inf"), float("-inf"), 0.0, 0.0, 0.0]


@pytest.mark.parametrize("n", [0, 5, 1024, 1025, 70_000, 64 * 64 * 1024 + 77])
def test_the_tree_and_the_mergeable_sums_in_one_pass_equal_each_apart(n):
    """``native.root2_mlh``: version 2's root and the whole tensor's (ma, mb) from one read."""
    from detfp_capture._digest import native, tlh2

    native_half.check(native.AVAILABLE, native_half.DIGEST)
    b = torch.randint(-128, 128, (n,), dtype=torch.int8, generator=torch.Generator().manual_seed(n))
    keys = tlh2.pack_all_keys()
    root, sums = native.root2_mlh(b, keys, merge.SEED_A, merge.SEED_B)
    assert torch.equal(root, native.root2(b, keys))
    assert sums == merge.part(b) == ref_sums(b.numpy().tobytes())
