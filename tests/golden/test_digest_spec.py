"""detfp-tlh128 versions 1 and 2 against independent reimplementations of docs/digest.md.

The references below share no code with ``detfp_capture``: they are written from the
specification alone (numpy and plain Python), so these tests check the implementation against
the document, not against itself. Golden digests pin the output across processes and releases:
if one of them changes, the digest changed and needs a new version in contract.DIGEST_VERSIONS.
"""

from __future__ import annotations

import functools
import hashlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from detfp_capture._digest import core, versions
from detfp_capture.digest import fingerprint, resolve, start
from detfp_format.contract import DIGEST_VERSION, DIGEST_VERSIONS

pytestmark = pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")

M64 = (1 << 64) - 1
VERSIONS = (1, 2)


def _mix(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def _stream(seed: int, n: int) -> list[int]:
    """n splitmix64 outputs from ``seed``."""
    out, state = [], seed
    for _ in range(n):
        state = (state + 0x9E3779B97F4A7C15) & M64
        out.append(_mix(state))
    return out


def _meta(version: int, data: bytes, dtype: str, shape: tuple[int, ...]) -> tuple[int, int]:
    numel = 1
    for d in shape:
        numel *= d
    text = "\x1f".join(["detfp-tlh128", str(version), dtype, str(len(data)), str(numel), ",".join(map(str, shape))])
    h = hashlib.blake2b(text.encode(), digest_size=16).digest()
    return int.from_bytes(h[:8], "little"), int.from_bytes(h[8:], "little")


# --- version 1 -------------------------------------------------------------------------------


@functools.cache
def weights(level: int) -> np.ndarray:
    vals = []
    for z in _stream((0x6465746670746C68 + level) & M64, 1024 * 16):
        v = z % 254
        vals.append(v - 127 if v < 127 else v - 126)
    return np.array(vals, dtype=np.int64).reshape(1024, 16)


def lanes(data: bytes) -> list[int]:
    x = np.frombuffer(data, dtype=np.int8).astype(np.int64)
    level = 0
    while True:
        m = max(1, -(-len(x) // 1024))
        x = np.concatenate([x, np.zeros(m * 1024 - len(x), dtype=np.int64)])
        y = (x.reshape(m, 1024) @ weights(level)).astype("<i4")
        if m == 1:
            return [int(v) for v in y[0]]
        x = np.frombuffer(y.tobytes(), dtype=np.int8).astype(np.int64)
        level += 1


def digest1(data: bytes, dtype: str, shape: tuple[int, ...]) -> str:
    a, b = _meta(1, data, dtype, shape)
    u = [v & 0xFFFFFFFF for v in lanes(data)]
    for i in range(8):
        w = u[2 * i] | (u[2 * i + 1] << 32)
        a, b = _mix(a ^ w), _mix(b ^ w)
    hi = _mix((a + b) & M64)
    lo = _mix(b ^ hi)
    return f"{hi:016x}{lo:016x}"


# --- version 2 -------------------------------------------------------------------------------


@functools.cache
def keys(level: int) -> tuple[np.ndarray, np.ndarray]:
    z = np.array(_stream((0x6465746670746C32 + level) & M64, 256), dtype=np.uint64)
    return z & np.uint64(0xFFFFFFFF), z >> np.uint64(32)


def root2(data: bytes) -> tuple[int, int]:
    """The tree of version 2: per 1024-byte row, a = sum A[i] * w_i and b = sum B[i] * w_i mod
    2^64 over the row's 256 balanced words; the outputs (16 bytes per row) form the next level."""
    level = 0
    while True:
        m = max(1, -(-len(data) // 1024))
        padded = data + bytes(m * 1024 - len(data))
        s = np.frombuffer(padded, dtype=np.int8).astype(np.int64).reshape(m, 256, 4)
        w = s[..., 0] + 256 * s[..., 1] + 65536 * s[..., 2] + 16777216 * s[..., 3]  # |w| < 2^32
        wu = w.view(np.uint64)  # two's complement: the value mod 2^64
        ka, kb = keys(level)
        with np.errstate(over="ignore"):
            a = (wu * ka).sum(axis=1, dtype=np.uint64)  # uint64 arithmetic wraps mod 2^64
            b = (wu * kb).sum(axis=1, dtype=np.uint64)
        if m == 1:
            return int(a[0]), int(b[0])
        data = np.stack([a, b], axis=1).astype("<u8").tobytes()
        level += 1


def digest2(data: bytes, dtype: str, shape: tuple[int, ...]) -> str:
    m0, m1 = _meta(2, data, dtype, shape)
    a, b = root2(data)
    x = _mix(a ^ m0)
    y = _mix(b ^ m1 ^ x)
    hi = _mix((x + y) & M64)
    lo = _mix(y ^ hi)
    return f"{hi:016x}{lo:016x}"


def digest(data: bytes, dtype: str, shape: tuple[int, ...], version: int) -> str:
    """32-hex digest of raw little-endian row-major bytes of a tensor of ``dtype`` (str) and ``shape``."""
    return (digest1 if version == 1 else digest2)(data, dtype, shape)


def ref(t: torch.Tensor, version: int) -> str:
    c = t.contiguous()
    data = c.reshape(-1).view(torch.uint8).numpy().tobytes() if c.numel() else b""
    return digest(data, str(t.dtype), tuple(t.shape), version)


# --- the implementation against the references --------------------------------------------------


def test_the_versions_are_the_contracts():
    assert sorted(versions.SCHEMES) == sorted(DIGEST_VERSIONS) == list(VERSIONS)
    assert all(versions.SCHEMES[v].algorithm == DIGEST_VERSIONS[v] for v in VERSIONS)
    assert versions.active().version == DIGEST_VERSION == 2  # the default of new captures


def test_v1_weights_match_the_spec():
    sch = versions.SCHEMES[1]
    for level in (0, 1, 5):
        w = sch.weights.get(torch.device("cpu"), level)
        assert np.array_equal(w.numpy().astype(np.int64), weights(level))
        assert (w != 0).all()
        col = sch.weights.get(torch.device("cpu"), level, col_major=True)  # long batches' copy
        assert col.stride() == (1, 1024) and torch.equal(col, w)
    assert not np.array_equal(weights(0), weights(1))


def test_v1_weight_rows_are_pairwise_distinct():
    # so swapping two different bytes inside one 1024-byte row always changes that row's output
    for level in range(6):
        assert len({tuple(r) for r in weights(level).tolist()}) == 1024


def test_v2_keys_match_the_spec_and_are_nonzero_and_distinct():
    # Nonzero keys: changing any one word of a row changes both sums (|k * d| < 2^64); keys
    # pairwise distinct: swapping two different words changes both ((k_i - k_j) * (w_i - w_j)).
    from detfp_capture._digest import tlh2

    for level in range(8):
        a, b = tlh2.level_keys(level)
        ka, kb = keys(level)
        assert a == [int(v) for v in ka] and b == [int(v) for v in kb]
        for k in (a, b):
            assert 0 not in k and len(set(k)) == 256


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("n", [0, 1, 7, 256, 257, 1024, 4095, 17000, 70000, 300000])
def test_matches_reference_across_levels(n, version):
    # 70000 bytes -> 3 levels in version 1, 2 in version 2; 300000 -> 4 and 3 (a partial row on each)
    g = torch.Generator().manual_seed(n)
    t = torch.randint(-(2**31), 2**31 - 1, (n,), dtype=torch.int32, generator=g).view(torch.float32)
    assert fingerprint(t, version=version).digest == ref(t, version)


def test_v2_matches_reference_beyond_two_levels_and_at_the_extremes():
    # 4 levels (more than 64 * 64 rows), and rows of the bytes with the largest |word|s
    g = torch.Generator().manual_seed(9)
    big = torch.randint(-128, 128, (64 * 64 * 1024 + 3000,), dtype=torch.int8, generator=g)
    assert fingerprint(big, version=2).digest == ref(big, 2)
    for fill in (-128, 127, -1):
        t = torch.full((5000,), fill, dtype=torch.int8)
        assert fingerprint(t, version=2).digest == ref(t, 2)


DTYPES = [
    torch.bool, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.uint16, torch.uint32,
    torch.uint64, torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex32, torch.complex64,
    torch.complex128, torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2, torch.float8_e5m2fnuz,
    torch.float8_e8m0fnu, torch.float4_e2m1fn_x2,
]  # fmt: skip


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_matches_reference(dtype, version):
    for shape in [(), (0,), (3, 5), (40, 33)]:
        n = 1
        for d in shape:
            n *= d
        gen = torch.Generator().manual_seed(n)
        raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=gen)
        if dtype is torch.bool:
            raw = raw & 1
        t = raw.view(dtype).reshape(shape)
        f = fingerprint(t, version=version)
        assert f.error is None and f.dtype == str(dtype) and f.shape == shape and f.numel == n
        assert f.digest == ref(t, version)
        if t.dim() == 2:  # a transposed view digests its logical (transposed) contents
            assert fingerprint(t.t(), version=version).digest == ref(t.t(), version)


@settings(max_examples=40, deadline=None)
@given(st.binary(min_size=0, max_size=6000), st.sampled_from(VERSIONS))
def test_bytes_match_reference(data, version):
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    assert fingerprint(t, version=version).digest == digest(data, "torch.uint8", (len(data),), version)


@settings(max_examples=15, deadline=None)
@given(
    st.lists(st.integers(0, 2**64 - 1), min_size=16, max_size=16),
    st.integers(0, 2**64 - 1),
    st.integers(0, 2**64 - 1),
    st.sampled_from(VERSIONS),
)
def test_host_and_device_finalizers_agree(lanes32, m0, m1, version):
    sch = versions.SCHEMES[version]
    vals = [(v & 0xFFFFFFFF) - (1 << 32) if v & 0x80000000 else v & 0xFFFFFFFF for v in lanes32[: sch.lanes]]
    lanes_t = torch.tensor([vals], dtype=torch.int32)
    meta = (core.s64(m0), core.s64(m1))
    dev = sch.finalize(lanes_t, torch.tensor([meta], dtype=torch.int64))[0].tolist()
    host = sch.finalize_host(lanes_t[0].tolist(), meta)
    assert [v & M64 for v in dev] == list(host)


def _no_numpy_bridge(self, *a, **k):
    raise RuntimeError("Numpy is not available")


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("batch", [1, 3, 40, 1000])
def test_numpy_and_torch_finalizers_agree(monkeypatch, batch, version):
    # On CPU the finalizer runs through numpy when it is importable; the torch ops (every
    # other device, or no numpy) must give the same bits, negative lanes and meta included.
    sch = versions.SCHEMES[version]
    g = torch.Generator().manual_seed(batch)
    lanes = torch.randint(-(2**31), 2**31 - 1, (batch, sch.lanes), dtype=torch.int32, generator=g)
    meta = torch.randint(-(2**63), 2**63 - 1, (batch, 2), dtype=torch.int64, generator=g)
    lanes[0] = torch.tensor([-1, 0, 2**31 - 1, -(2**31)] * (sch.lanes // 4), dtype=torch.int32)
    via_numpy = sch.finalize(lanes, meta)
    monkeypatch.setattr(core, "_NUMPY", [None])
    via_torch = sch.finalize(lanes, meta)
    assert via_numpy.dtype == via_torch.dtype == torch.int64
    assert torch.equal(via_numpy, via_torch)
    # A numpy that torch cannot bridge to: the torch ops take over, same bits.
    monkeypatch.setattr(core, "_NUMPY", [np])
    monkeypatch.setattr(torch.Tensor, "numpy", _no_numpy_bridge)
    assert torch.equal(sch.finalize(lanes, meta), via_torch)
    assert core._NUMPY == [None]
    assert [v & M64 for v in via_torch[0].tolist()] == list(
        sch.finalize_host(lanes[0].tolist(), tuple(meta[0].tolist()))
    )


# Computed once with this implementation and cross-checked with the references above; a change
# here means the digest changed: add a digest version and pin its values here.
GOLDEN = {
    1: {
        "arange_f32_10": "d2eb8f9688e1a0aaea841293a3e83d1d",
        "zeros_f32_4096": "230817085a4bf5bb839bba537a0a1fde",
        "empty_f32": "c9cbd2036c189aafa0cd9c2edcce4833",
        "scalar_bf16": "a221343e4806bcef204c76cca594b8f0",
        "arange_i32_100000": "f122f0a28b5ce83d645f82ca472ac166",
        "bool_3x5": "a5abe5f1a9fa0762d6f50f473810fa80",
    },
    2: {
        "arange_f32_10": "9ecb8f4fb473849afe067647de4d2f41",
        "zeros_f32_4096": "1ca8227b8a5d82f14e626e10a72bd1a4",
        "empty_f32": "605e7b57a60355e8939219390dbb2545",
        "scalar_bf16": "cc65a25b4f6005007f285bf366cfcd91",
        "arange_i32_100000": "d70e237c065fcb153f9c256c166fe6b3",
        "bool_3x5": "f79441812b31820758d5f27437abf255",
    },
}


def golden_tensors() -> dict[str, torch.Tensor]:
    return {
        "arange_f32_10": torch.arange(10, dtype=torch.float32),
        "zeros_f32_4096": torch.zeros(4096),
        "empty_f32": torch.empty(0),
        "scalar_bf16": torch.tensor(1.5, dtype=torch.bfloat16),
        "arange_i32_100000": torch.arange(100000, dtype=torch.int32),
        "bool_3x5": (torch.arange(15) % 3 == 0).reshape(3, 5),
    }


@pytest.mark.parametrize("version", VERSIONS)
def test_golden_digests(version):
    ts = golden_tensors()
    got = {k: fingerprint(t, version=version).digest for k, t in ts.items()}
    assert got == {k: ref(t, version) for k, t in ts.items()}
    assert got == GOLDEN[version]


@pytest.mark.parametrize("version", VERSIONS)
def test_batched_resolve_matches_reference(version):
    # > 32 digests: the vectorized device finalizer; mixes arena and direct paths
    ts = [torch.randn(i, generator=torch.Generator().manual_seed(i)) for i in range(0, 600, 7)]
    fps = resolve([start(t, version=version) for t in ts])
    assert [f.digest for f in fps] == [ref(t, version) for t in ts]
