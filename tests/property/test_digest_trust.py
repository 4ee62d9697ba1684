"""Trust tests of digest version 2 (issue 31): exhaustive changes that must all be seen.

Each test builds every variant of a random tensor (one bit flipped at every bit position, sign
flips of every pair of elements, every adjacent swap, +-1 ULP at every element, row
permutations, trailing zeros, the same values in other dtypes, views) as the rows of one matrix
and digests them as row digests (``rows=True``: row i is the digest of ``m[i]``, docs/digest.md
section 7; ``test_rows_are_the_digests_of_the_rows`` holds that to single fingerprints), then
asks that every variant's digest differs from the original's and from every other variant's.
``test_random_pairs_never_collide_in_either_half`` draws random pairs that differ in one word
and asks that neither 64-bit half collides: 10^5 pairs here, 10^7 in its slow-marked twin (also
``benchmarks/digest_collisions.py``).

Version 2's level 0 sees any change confined to one 32-bit word with certainty (a key times a
nonzero difference below 2^32 in magnitude is never 0 mod 2^64), so a failure here means an
implementation that drops or misplaces bytes, not bad luck.
"""

from __future__ import annotations

import pytest
import torch

from detfp_capture._digest import core, versions
from detfp_capture.digest import fingerprint

V = 2
CHUNK_BYTES = 32 << 20  # variants digested per call: bounded scratch


def rows_digests(m: torch.Tensor) -> list[str]:
    f = fingerprint(m, rows=True, version=V)
    assert f.error is None, f.error
    return list(f.rows)


def assert_all_seen(base: torch.Tensor, variants) -> int:
    """Every variant (batches of tensors shaped like ``base``) has a digest of its own, none
    equal to ``base``'s; returns how many variants there were."""
    want = fingerprint(base, version=V).digest
    seen: set[str] = set()
    n = 0
    for batch in variants:
        got = rows_digests(batch)
        assert want not in got, "a variant digests like the original"
        seen.update(got)
        n += len(got)
    assert len(seen) == n, f"{n - len(seen)} variants share a digest"
    return n


def _batches(count: int, nbytes: int):
    step = max(1, CHUNK_BYTES // max(1, nbytes))
    return ((i, min(count, i + step)) for i in range(0, count, step))


def bit_flips(base: torch.Tensor):
    """``base`` with one bit flipped, for every bit position, in batches."""
    raw = base.reshape(-1).view(torch.uint8)
    nb = raw.numel()
    for a, b in _batches(nb * 8, nb):
        pos = torch.arange(a, b)
        m = raw.repeat(b - a, 1)
        m[torch.arange(b - a), pos // 8] ^= (1 << (pos % 8)).to(torch.uint8)
        yield m.view(base.dtype).view(b - a, *base.shape)


@pytest.mark.parametrize(
    ("dtype", "nbytes"),
    [(torch.float32, 1024), (torch.bfloat16, 4096 + 2), (torch.uint8, 1), (torch.uint8, 5000), (torch.int64, 2048)],
)
def test_every_single_bit_flip_is_seen(dtype, nbytes):
    g = torch.Generator().manual_seed(nbytes)
    base = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g).view(dtype)
    assert assert_all_seen(base, bit_flips(base)) == nbytes * 8


@pytest.mark.slow
@pytest.mark.parametrize("nbytes", [64 << 10, (64 << 10) - 3])
def test_every_single_bit_flip_is_seen_up_to_64_kib(nbytes):
    # 524288 variants of a 64 KiB tensor (3 levels of rows): about 32 GiB digested.
    g = torch.Generator().manual_seed(nbytes)
    base = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    assert assert_all_seen(base, bit_flips(base)) == nbytes * 8


def test_sign_flips_in_pairs_are_seen():
    g = torch.Generator().manual_seed(1)
    base = torch.randn(160, generator=g)
    base[:3] = torch.tensor([0.0, float("nan"), float("inf")])  # -0.0, a negative NaN, -inf too
    n = base.numel()
    i, j = torch.triu_indices(n, n, offset=1)
    bits = base.view(torch.int32)

    def variants():
        for a, b in _batches(i.numel(), base.numel() * 4):
            m = bits.repeat(b - a, 1)
            r = torch.arange(b - a)
            m[r, i[a:b]] ^= -(2**31)
            m[r, j[a:b]] ^= -(2**31)
            yield m.view(torch.float32)

    assert assert_all_seen(base, variants()) == n * (n - 1) // 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.int64])
def test_adjacent_swaps_are_seen(dtype):
    g = torch.Generator().manual_seed(2)
    base = torch.randint(-100, 100, (2100,), generator=g).to(dtype)
    keep = (base[:-1] != base[1:]).nonzero().flatten()  # a swap of equal values changes nothing
    m = base.repeat(keep.numel(), 1)
    r = torch.arange(keep.numel())
    m[r, keep], m[r, keep + 1] = base[keep + 1], base[keep]
    assert assert_all_seen(base, [m]) == keep.numel() > 1000


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_one_ulp_up_and_down_at_every_element_is_seen(dtype):
    g = torch.Generator().manual_seed(3)
    base = torch.randn(1500, generator=g).to(dtype)
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[dtype.itemsize]
    n = base.numel()
    m = base.view(ints).repeat(2 * n, 1)
    r = torch.arange(n)
    m[r, r] += 1  # the next representable value away from zero
    m[n + r, r] -= 1  # ... and towards it (finite, nonzero values: 1 ULP either way)
    assert assert_all_seen(base, [m.view(dtype)]) == 2 * n


def test_permutations_of_rows_are_seen_and_rows_match_as_a_multiset():
    g = torch.Generator().manual_seed(4)
    base = torch.randn(48, 40, generator=g)
    perms = [torch.randperm(48, generator=g) for _ in range(300)]
    perms += [torch.tensor([*range(k), k + 1, k, *range(k + 2, 48)]) for k in range(47)]  # adjacent row swaps
    perms = [p for p in perms if not torch.equal(p, torch.arange(48))]
    assert assert_all_seen(base, [torch.stack([base[p] for p in perms])]) == len(perms)
    want = sorted(fingerprint(base, rows=True, version=V).rows)
    for p in perms[:20]:
        assert sorted(fingerprint(base[p], rows=True, version=V).rows) == want


def test_trailing_zero_bytes_never_digest_like_the_shorter_tensor():
    # Zero padding is how rows are completed: the length in the metadata must keep them apart.
    g = torch.Generator().manual_seed(5)
    for n in (0, 1, 3, 4, 1000, 1021, 1024, 2047, 4096, 65536 + 5):
        t = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
        digests = {fingerprint(torch.cat([t, torch.zeros(k, dtype=torch.uint8)]), version=V).digest for k in range(9)}
        digests.add(fingerprint(torch.cat([t, torch.zeros(1024 - n % 1024, dtype=torch.uint8)]), version=V).digest)
        assert len(digests) == 9 + (1024 - n % 1024 >= 9), n
    zeros = {fingerprint(torch.zeros(n, dtype=torch.uint8), version=V).digest for n in range(0, 2100)}
    assert len(zeros) == 2100


def test_equal_values_in_other_dtypes_and_equal_bytes_in_other_dtypes_differ():
    values = [0.0, 1.0, -2.0, 3.5, 100.0]
    dtypes = [
        torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.int16, torch.int32,
        torch.int64, torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2, torch.complex64,
    ]  # fmt: skip
    digests = {fingerprint(torch.tensor(values).to(dt), version=V).digest for dt in dtypes}
    assert len(digests) == len(dtypes)
    raw = torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=torch.Generator().manual_seed(6))
    same_bytes = [torch.uint8, torch.int8, torch.int16, torch.bfloat16, torch.float16, torch.float32, torch.int64]
    assert len({fingerprint(raw.view(dt), version=V).digest for dt in same_bytes}) == len(same_bytes)
    # the same bytes in another shape differ too (shape is part of the metadata)
    x = raw.view(torch.float32)
    assert len({fingerprint(x.view(s), version=V).digest for s in [(1024,), (32, 32), (2, 512), (1024, 1)]}) == 4


def test_views_strides_and_offsets_digest_their_logical_contents():
    g = torch.Generator().manual_seed(7)
    base = torch.randn(64, 96, generator=g)
    img = torch.randn(2, 3, 17, 19, generator=g)
    views = [
        base.t(), base[::2], base[:, 1::3], base[5:, 7:], base[1:-1].narrow(1, 3, 50), base[:, :1].expand(64, 40),
        base.reshape(-1)[17:].as_strided((30, 20), (41, 2)), img.to(memory_format=torch.channels_last),
        img.permute(0, 2, 3, 1), base.unsqueeze(0).expand(3, 64, 96), base.reshape(-1)[1:1025],
    ]  # fmt: skip
    for v in views:
        c = v.contiguous()
        assert fingerprint(v, version=V) == fingerprint(c, version=V)
        assert fingerprint(v, rows=True, version=V).rows == fingerprint(c, rows=True, version=V).rows
    # a storage offset of one element is a different tensor (almost everywhere)
    assert fingerprint(base.reshape(-1)[1:1025], version=V) != fingerprint(base.reshape(-1)[:1024], version=V)


def test_rows_are_the_digests_of_the_rows():
    g = torch.Generator().manual_seed(8)
    for shape in [(5, 3), (7, 300), (3, 1100), (2, 70000)]:
        m = torch.randn(*shape, generator=g)
        assert fingerprint(m, rows=True, version=V).rows == tuple(fingerprint(r, version=V).digest for r in m)


def random_pairs(n: int, rowbytes: int, seed: int) -> tuple[int, int, int]:
    """(pairs where hi collided, pairs where lo collided, repeated hi values among all 2n digests)
    of n random rows of ``rowbytes`` bytes, each against itself with one random 4-byte word
    replaced by another value: through the row path of ``fingerprint`` without the hex text
    (``core.rows_lanes`` and the finalizer), in batches."""
    sch = versions.SCHEMES[V]
    g = torch.Generator().manual_seed(seed)
    words = rowbytes // 4
    meta = torch.tensor([core.meta_words(sch, torch.int32, (words,))], dtype=torch.int64)
    hi_same = lo_same = 0
    his = []
    batch = max(1, (64 << 20) // rowbytes)
    for a in range(0, n, batch):
        k = min(batch, n - a)
        x = torch.randint(-(2**31), 2**31 - 1, (k, words), dtype=torch.int32, generator=g)
        y = x.clone()
        r = torch.arange(k)
        at = torch.randint(0, words, (k,), generator=g)
        y[r, at] += torch.randint(1, 2**31 - 1, (k,), dtype=torch.int32, generator=g)  # never 0 mod 2^32
        out = []
        for m in (x, y):
            lanes = core.rows_lanes(m, k, rowbytes, sch)
            out.append(sch.finalize(lanes, meta.expand(k, 2)))
        hi_same += int((out[0][:, 0] == out[1][:, 0]).sum())
        lo_same += int((out[0][:, 1] == out[1][:, 1]).sum())
        his += [out[0][:, 0], out[1][:, 0]]
    allhi = torch.cat(his)
    return hi_same, lo_same, allhi.numel() - torch.unique(allhi).numel()


def test_random_pairs_never_collide_in_either_half():
    assert random_pairs(100_000, 1088, seed=9) == (0, 0, 0)  # rows of two blocks: two levels


@pytest.mark.slow
def test_ten_million_random_pairs_never_collide_in_either_half():
    assert random_pairs(10_000_000, 1088, seed=10) == (0, 0, 0)
