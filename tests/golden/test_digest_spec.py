"""detfp-tlh128 against an independent reimplementation of docs/digest.md (numpy + plain Python).

The reference below shares no code with ``detfp_capture``: it is written from the
specification alone, so these tests check the torch implementation against the document,
not against itself. Golden digests pin the output across processes and versions: if one of
them changes, the digest changed and contract.DIGEST_VERSION must be bumped.
"""

from __future__ import annotations

import functools
import hashlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from detfp_capture._digest import core
from detfp_capture.contract import DIGEST_VERSION
from detfp_capture.digest import fingerprint, resolve, start

pytestmark = pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")

M64 = (1 << 64) - 1


def _splitmix(state: int) -> tuple[int, int]:
    state = (state + 0x9E3779B97F4A7C15) & M64
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return state, z ^ (z >> 31)


@functools.cache
def weights(level: int) -> np.ndarray:
    state = (0x6465746670746C68 + level) & M64
    vals = []
    for _ in range(1024 * 16):
        state, z = _splitmix(state)
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


def _mix(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def digest(data: bytes, dtype: str, shape: tuple[int, ...], version: int = 1) -> str:
    """32-hex digest of raw little-endian row-major bytes of a tensor of ``dtype`` (str) and ``shape``."""
    numel = 1
    for d in shape:
        numel *= d
    text = "\x1f".join(["detfp-tlh128", str(version), dtype, str(len(data)), str(numel), ",".join(map(str, shape))])
    h = hashlib.blake2b(text.encode(), digest_size=16).digest()
    a, b = int.from_bytes(h[:8], "little"), int.from_bytes(h[8:], "little")
    u = [v & 0xFFFFFFFF for v in lanes(data)]
    for i in range(8):
        w = u[2 * i] | (u[2 * i + 1] << 32)
        a, b = _mix(a ^ w), _mix(b ^ w)
    hi = _mix((a + b) & M64)
    lo = _mix(b ^ hi)
    return f"{hi:016x}{lo:016x}"


def ref(t: torch.Tensor) -> str:
    c = t.contiguous()
    data = c.reshape(-1).view(torch.uint8).numpy().tobytes() if c.numel() else b""
    return digest(data, str(t.dtype), tuple(t.shape), DIGEST_VERSION)


def test_weights_match_the_spec():
    for level in (0, 1, 5):
        w = core.weights(torch.device("cpu"), level, False)
        assert np.array_equal(w.numpy().astype(np.int64), weights(level))
        assert (w != 0).all()
        col = core.weights(torch.device("cpu"), level, False, col_major=True)  # long batches' copy
        assert col.stride() == (1, 1024) and torch.equal(col, w)
    assert not np.array_equal(weights(0), weights(1))


def test_weight_rows_are_pairwise_distinct():
    # so swapping two different bytes inside one 1024-byte row always changes that row's output
    for level in range(6):
        assert len({tuple(r) for r in weights(level).tolist()}) == 1024


@pytest.mark.parametrize("n", [0, 1, 7, 256, 257, 1024, 4095, 17000, 70000, 300000])
def test_matches_reference_across_levels(n):
    # 70000 bytes -> 3 levels, 300000 -> 4 levels; 256 float32 = exactly one 1024-byte row
    g = torch.Generator().manual_seed(n)
    t = torch.randint(-(2**31), 2**31 - 1, (n,), dtype=torch.int32, generator=g).view(torch.float32)
    assert fingerprint(t).digest == ref(t)


DTYPES = [
    torch.bool, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.uint16, torch.uint32,
    torch.uint64, torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex32, torch.complex64,
    torch.complex128, torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2, torch.float8_e5m2fnuz,
    torch.float8_e8m0fnu, torch.float4_e2m1fn_x2,
]  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (3, 5), (40, 33)])
def test_every_dtype_matches_reference(dtype, shape):
    n = 1
    for d in shape:
        n *= d
    raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    if dtype is torch.bool:
        raw = raw & 1
    t = raw.view(dtype).reshape(shape)
    f = fingerprint(t)
    assert f.error is None and f.dtype == str(dtype) and f.shape == shape and f.numel == n
    assert f.digest == ref(t)
    if t.dim() == 2:  # a transposed view digests its logical (transposed) contents
        assert fingerprint(t.t()).digest == ref(t.t())


@settings(max_examples=40, deadline=None)
@given(st.binary(min_size=0, max_size=6000))
def test_bytes_match_reference(data):
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    assert fingerprint(t).digest == digest(data, "torch.uint8", (len(data),), DIGEST_VERSION)


@settings(max_examples=15, deadline=None)
@given(
    st.lists(st.integers(0, 2**64 - 1), min_size=16, max_size=16), st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1)
)
def test_host_and_device_finalizers_agree(lanes32, m0, m1):
    lanes_t = torch.tensor(
        [[(v & 0xFFFFFFFF) - (1 << 32) if v & 0x80000000 else v & 0xFFFFFFFF for v in lanes32]], dtype=torch.int32
    )
    meta = (core._s64(m0), core._s64(m1))
    dev = core.finalize(lanes_t, torch.tensor([meta], dtype=torch.int64))[0].tolist()
    host = core.finalize_host(lanes_t[0].tolist(), meta)
    assert [v & M64 for v in dev] == list(host)


def _no_numpy_bridge(self, *a, **k):
    raise RuntimeError("Numpy is not available")


@pytest.mark.parametrize("batch", [1, 3, 40, 1000])
def test_numpy_and_torch_finalizers_agree(monkeypatch, batch):
    # On CPU the finalizer runs through numpy when it is importable; the torch ops (every
    # other device, or no numpy) must give the same bits, negative lanes and meta included.
    g = torch.Generator().manual_seed(batch)
    lanes = torch.randint(-(2**31), 2**31 - 1, (batch, 16), dtype=torch.int32, generator=g)
    meta = torch.randint(-(2**63), 2**63 - 1, (batch, 2), dtype=torch.int64, generator=g)
    lanes[0] = torch.tensor([-1, 0, 2**31 - 1, -(2**31)] * 4, dtype=torch.int32)
    via_numpy = core.finalize(lanes, meta)
    monkeypatch.setattr(core, "_NUMPY", [None])
    via_torch = core.finalize(lanes, meta)
    assert via_numpy.dtype == via_torch.dtype == torch.int64
    assert torch.equal(via_numpy, via_torch)
    # A numpy that torch cannot bridge to: the torch ops take over, same bits.
    monkeypatch.setattr(core, "_NUMPY", [np])
    monkeypatch.setattr(torch.Tensor, "numpy", _no_numpy_bridge)
    assert torch.equal(core.finalize(lanes, meta), via_torch)
    assert core._NUMPY == [None]
    assert [v & M64 for v in via_torch[0].tolist()] == list(
        core.finalize_host(lanes[0].tolist(), tuple(meta[0].tolist()))
    )


# Computed once with this implementation and cross-checked with the reference above; a change
# here means the digest changed: bump contract.DIGEST_VERSION and update these values.
GOLDEN = {
    "arange_f32_10": "d2eb8f9688e1a0aaea841293a3e83d1d",
    "zeros_f32_4096": "230817085a4bf5bb839bba537a0a1fde",
    "empty_f32": "c9cbd2036c189aafa0cd9c2edcce4833",
    "scalar_bf16": "a221343e4806bcef204c76cca594b8f0",
    "arange_i32_100000": "f122f0a28b5ce83d645f82ca472ac166",
    "bool_3x5": "a5abe5f1a9fa0762d6f50f473810fa80",
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


def test_golden_digests():
    ts = golden_tensors()
    got = {k: fingerprint(t).digest for k, t in ts.items()}
    assert got == {k: ref(t) for k, t in ts.items()}
    assert DIGEST_VERSION == 1
    assert got == GOLDEN


def test_batched_resolve_matches_reference():
    # > 32 digests: the vectorized device finalizer; mixes arena and direct paths
    ts = [torch.randn(i, generator=torch.Generator().manual_seed(i)) for i in range(0, 600, 7)]
    fps = resolve([start(t) for t in ts])
    assert [f.digest for f in fps] == [ref(t) for t in ts]
