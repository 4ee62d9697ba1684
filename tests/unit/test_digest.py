"""Properties of the detfp digest: sensitivity, layout invariance, paths, rows, moments, subclasses, errors.

Every sensitivity issue 2 asks for is pinned by a hypothesis property (bit flips, signed zeros,
NaN payloads, swaps, permutations, length, dtype, shape, zero runs, duplicates), next to the
invariants that make the digest a function of logical contents only. test_digest_spec.py checks
the same implementation against an independent reimplementation of docs/digest.md.
"""

from __future__ import annotations

import math

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from detfp_capture._digest import core, gemm, versions
from detfp_capture._digest import moments as M
from detfp_capture._digest import pending as D
from detfp_capture._digest import results as T
from detfp_capture.digest import DigestError, Fingerprint, Moments, fingerprint, resolve, start

FAST = settings(max_examples=30, deadline=None)
pytestmark = pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")


def fp(t: torch.Tensor, **kw) -> Fingerprint:
    f = fingerprint(t, **kw)
    assert f.error is None, f.error
    return f


def from_bytes(data: bytes, dtype=torch.uint8) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).clone()


# --- sensitivity -----------------------------------------------------------------------------


@FAST
@given(st.binary(min_size=1, max_size=5000), st.data())
def test_any_single_bit_flip_changes_the_digest(data, draw):
    i = draw.draw(st.integers(0, len(data) - 1))
    bit = draw.draw(st.integers(0, 7))
    flipped = bytearray(data)
    flipped[i] ^= 1 << bit
    assert fp(from_bytes(data)).digest != fp(from_bytes(bytes(flipped))).digest


def test_signed_zero_and_nan_payloads_differ():
    pos, neg = torch.tensor([0.0, 1.0]), torch.tensor([-0.0, 1.0])
    assert torch.equal(pos, neg)  # equal as numbers...
    assert fp(pos) != fp(neg)  # ...different bits
    n1 = torch.tensor([0x7FC00000, 0], dtype=torch.int32).view(torch.float32)
    n2 = torch.tensor([0x7FC00001, 0], dtype=torch.int32).view(torch.float32)
    assert fp(n1) != fp(n2)


@FAST
@given(st.lists(st.floats(allow_nan=False, width=32), min_size=2, max_size=3000, unique=True), st.data())
def test_adjacent_swap_changes_the_digest(values, draw):
    i = draw.draw(st.integers(0, len(values) - 2))
    t = torch.tensor(values, dtype=torch.float32)
    s = t.clone()
    s[i], s[i + 1] = t[i + 1], t[i]
    assume(not torch.equal(t.view(torch.int32), s.view(torch.int32)))
    assert fp(t) != fp(s)


@FAST
@given(st.integers(2, 5000), st.integers(0, 2**32))
def test_any_permutation_of_distinct_values_changes_the_digest(n, seed):
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    assume(not torch.equal(perm, torch.arange(n)))
    base = torch.arange(n, dtype=torch.int32)
    assert fp(base) != fp(base[perm])


def test_hash_tensor_is_blind_where_detfp_is_not():
    base = torch.arange(4096, dtype=torch.int64)
    perm = base.flip(0)
    swap = base.clone()
    swap[10], swap[11] = base[11], base[10]
    # torch.hash_tensor XOR-reduces: permutations, swaps and zero runs of any length collide
    assert torch.hash_tensor(base) == torch.hash_tensor(perm) == torch.hash_tensor(swap)
    assert torch.hash_tensor(torch.zeros(4096)) == torch.hash_tensor(torch.zeros(8192))
    assert fp(base) != fp(perm) and fp(base) != fp(swap) and fp(perm) != fp(swap)
    assert fp(torch.zeros(4096)) != fp(torch.zeros(8192))


@FAST
@given(st.lists(st.integers(-(2**31), 2**31 - 1), min_size=1, max_size=3000))
def test_length_duplicate_and_padding_change_the_digest(values):
    t = torch.tensor(values, dtype=torch.int32)
    assert fp(t) != fp(t[:-1])
    assert fp(t) != fp(torch.cat([t, t[-1:]]))  # x vs x with a duplicate appended
    assert fp(t) != fp(torch.cat([t, torch.zeros(1, dtype=torch.int32)]))  # zero padding is not free


def test_zero_runs_of_different_lengths_differ():
    digests = {fp(torch.zeros(n)).digest for n in (0, 1, 255, 256, 257, 4096, 8192, 16384)}
    assert len(digests) == 8


@FAST
@given(st.lists(st.floats(-1e3, 1e3, width=16), min_size=1, max_size=500))
def test_dtype_and_shape_are_part_of_the_digest(values):
    bf = torch.tensor(values, dtype=torch.bfloat16)
    assert torch.equal(bf.float(), bf.float().bfloat16().float())
    assert fp(bf) != fp(bf.float())  # equal values, different dtype
    i16 = bf.view(torch.int16)
    assert fp(bf) != fp(i16)  # same bytes, different dtype
    if len(values) % 2 == 0:
        assert fp(bf) != fp(bf.view(2, -1))  # same bytes, different shape


def test_same_bytes_different_shape():
    t = torch.arange(24, dtype=torch.float32)
    shapes = [(24,), (4, 6), (6, 4), (2, 3, 4), (24, 1), (1, 24)]
    assert len({fp(t.reshape(s)).digest for s in shapes}) == len(shapes)


# --- invariants: logical contents only, every path agrees -----------------------------------


@FAST
@given(
    st.integers(1, 60), st.integers(1, 60), st.sampled_from([torch.float32, torch.bfloat16, torch.int64, torch.uint8])
)
def test_views_digest_their_logical_contents(r, c, dtype):
    base = torch.randint(0, 100, (r + 3, c + 5)).to(dtype)
    views = [
        base.t(),
        base[1:, 2:],
        base[::2, ::3],
        base[2],
        base[:, 1],
        base[:1].expand(r, c + 5),
        base.reshape(-1)[7:],
        base.unsqueeze(1).expand(-1, 3, -1),
    ]
    for v in views:
        assert fp(v) == fp(v.contiguous()), v.stride()


def test_large_views_with_bounded_scratch(monkeypatch):
    base = torch.randn(300, 700)
    want = {k: fp(v, rows=True, moments=True) for k, v in {"t": base.t(), "e": base[:1].expand(300, 700)}.items()}
    monkeypatch.setattr(core, "SCRATCH", 4096)  # force the chunked copies
    for k, v in {"t": base.t(), "e": base[:1].expand(300, 700)}.items():
        got = fp(v, rows=True, moments=True)
        assert got == want[k] and got.rows == want[k].rows
        assert got.moments.nan == want[k].moments.nan and got.moments.absmax == want[k].moments.absmax
    assert fp(base.t()) == fp(base.t().contiguous())


def test_fingerprint_equals_resolve_of_start_in_any_batch():
    ts = [torch.randn(n) for n in (0, 1, 5, 256, 257, 1000, 5000)] + [torch.tensor(3.0)]
    single = [fingerprint(t) for t in ts]
    assert resolve([start(t) for t in ts]) == single
    assert resolve([start(t) for t in reversed(ts)]) == single[::-1]
    ps = [start(t) for t in ts]
    assert resolve(ps[::2]) == single[::2]  # a subset, in a different order than started
    assert resolve(ps[1::2]) == single[1::2]
    assert resolve(ps * 40) == single * 40  # > 32: the device finalizer


def test_a_single_fingerprint_takes_the_whole_tree_route_with_the_same_value():
    # fingerprint() of one plain contiguous CPU tensor computes its tree in one call where the
    # version can (2, native kernel built) and finalizes on the host: no arena, no batch.
    cases = [
        torch.randn(16),
        torch.randn(3, 5, 7),
        torch.arange(10),
        torch.tensor(3.5),
        torch.randn(1 << 16),
        torch.randn(30, 100).bfloat16(),
        torch.zeros(5, dtype=torch.bool),
        torch.randn(64).to(torch.float8_e4m3fn),
        torch.randn(8, dtype=torch.complex64),
        torch.randn(5, requires_grad=True),
        torch.randint(0, 255, (1025,), dtype=torch.uint8),
    ]
    others = [torch.randn(0), torch.randn(4, 6).t(), torch.randn(4, dtype=torch.complex64).conj()]
    for v, sch in versions.SCHEMES.items():
        root = sch.root(torch.zeros(4, dtype=torch.int8)) is not None
        for t in cases + others:
            want = resolve([start(t, version=v)])[0]
            got = fingerprint(t, version=v)
            assert (got, got.digest, got.dtype, got.shape, got.rows, got.moments) == (
                want,
                want.digest,
                want.dtype,
                want.shape,
                want.rows,
                want.moments,
            ), (v, t.dtype, t.shape)
            taken = D._whole_tree_now(t, sch) is not None
            assert taken == (root and any(t is c for c in cases)), (v, t.dtype, t.shape)


SCHEMES = [versions.SCHEMES[v] for v in sorted(versions.SCHEMES)]


@pytest.mark.parametrize("sch", SCHEMES, ids=repr)
def test_arena_path_equals_direct_path(sch):
    for n in (0, 1, 3, 255, 256):
        t = torch.randn(n)
        direct = D.Pending(t.dtype, t.shape, t.numel(), t.device)
        direct.scheme = sch
        direct.lanes = core.lanes_of(t, sch)
        assert resolve([direct]) == [fp(t, version=sch.version)]
        assert start(t, version=sch.version).arena is not None  # the fast path really was taken


@pytest.mark.parametrize("sch", SCHEMES, ids=repr)
def test_int_mm_and_float_fallback_are_bit_identical(monkeypatch, sch):
    g = torch.Generator().manual_seed(0)
    extreme = torch.full((1024 * 40,), -128, dtype=torch.int8)  # largest |partial sum|
    ts = [torch.randn(70000, generator=g), extreme, torch.randint(-128, 128, (5000,), dtype=torch.int8, generator=g)]
    # blocks of 256 rows (float32 GEMM) and of 1024 rows (int8 GEMM on CPU), each with a rest
    x = torch.randint(-128, 128, (2600, 1024), dtype=torch.int8, generator=g)
    x[0] = -128
    x[1] = 127
    monkeypatch.setattr(sch, "native_cpu", False)  # torch's routes (the native one: test_native_lanes.py)
    monkeypatch.setitem(gemm._INT_MM, "cpu", True)  # whichever path the speed test picked here
    exact = sch.mm(x, 0)
    want = [fp(t, version=sch.version) for t in ts]
    monkeypatch.setitem(gemm._INT_MM, "cpu", False)
    assert torch.equal(sch.mm(x, 0), exact) and torch.equal(sch.mm(x[:64], 0), exact[:64])
    monkeypatch.setitem(gemm._INT_MM, "cpu", True)
    assert torch.equal(sch.mm(x[:1024], 0), exact[:1024])  # one block of the int8 GEMM: no loop
    monkeypatch.setitem(gemm._INT_MM, "cpu", False)
    into = torch.full((2600, sch.lanes), 7, dtype=torch.int32)
    assert sch.mm(x, 0, out=into) is into and torch.equal(into, exact)
    if sch.version == 1:
        assert torch.equal(
            sch.mm(extreme[:2048].view(2, 1024), 0),
            -128 * sch.weights.get(x.device, 0).sum(0, dtype=torch.int32).expand(2, 16),
        )
    assert [fp(t, version=sch.version) for t in ts] == want


def test_the_faster_exact_gemm_is_chosen_without_touching_the_rng(monkeypatch):
    # The real timing runs both GEMMs on fixed rows, never on torch's RNG (the job owns it).
    cpu = torch.device("cpu")
    w = versions.SCHEMES[1].weights
    monkeypatch.delitem(gemm._INT_MM, "cpu", raising=False)
    rng = torch.get_rng_state()
    assert isinstance(gemm.use_int_mm(cpu, w), bool)
    assert torch.equal(torch.get_rng_state(), rng)
    # The decision follows the timings: the int8 GEMM when it is at least as fast, else float32.
    for int_s, float_s, want in ((1.0, 2.0, True), (2.0, 1.0, False), (1.0, 1.0, True)):
        monkeypatch.setattr(gemm, "best_seconds", lambda device, fns, t=(int_s, float_s): {True: t[0], False: t[1]})
        monkeypatch.delitem(gemm._INT_MM, "cpu")
        assert gemm.use_int_mm(cpu, w) is want


@pytest.mark.parametrize("sch", SCHEMES, ids=repr)
def test_row_padding_for_accelerator_kernels_is_exact(monkeypatch, sch):
    x = torch.randint(-128, 128, (40, 1024), dtype=torch.int8)
    ts = [torch.randn(5000), torch.ones(3)]
    want = [sch.mm(x[:m], 2) for m in (1, 16, 17, 32, 33, 40)]
    want_fps = [fp(t, version=sch.version) for t in ts]
    monkeypatch.setattr(gemm, "ANY_M_DEVICES", frozenset())  # take the CUDA path's zero-row padding
    monkeypatch.setattr(sch, "native_cpu", False)  # ... through torch's int8 GEMM, which pads
    monkeypatch.setitem(gemm._INT_MM, "cpu", True)
    assert all(torch.equal(sch.mm(x[:m], 2), w) for m, w in zip((1, 16, 17, 32, 33, 40), want, strict=True))
    assert [fp(t, version=sch.version) for t in ts] == want_fps


def test_no_autograd_and_inference_mode():
    w = torch.randn(300, requires_grad=True)
    small = torch.randn(5, requires_grad=True)
    f = fp(w, moments=True)
    assert f == fp(w.detach().clone())
    p = start(small)
    assert not p.arena.buf.requires_grad
    with torch.inference_mode():
        x = torch.randn(7)
        a, b = fp(x), fp(x * 2)
    assert a == fp(x.clone()) and b == fp(x.clone() * 2)
    assert resolve([p]) == [fp(small.detach())]


def test_start_never_syncs(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("host sync in start()")

    ts = [torch.randn(3), torch.randn(5000), torch.randn(40, 50).t(), torch.arange(9, dtype=torch.int64) << 36]
    for name in ("item", "cpu", "tolist", "numpy", "__bool__", "__int__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, boom)
    ps = [start(t, rows=r, moments=True, pointer_check=True) for t in ts for r in (False, True, 7)]
    assert all(p.error is None for p in ps)
    monkeypatch.undo()
    assert all(f.error is None for f in resolve(ps))


# --- rows and chunks --------------------------------------------------------------------------


@FAST
@given(st.integers(0, 40), st.lists(st.integers(1, 9), max_size=3), st.sampled_from([torch.float32, torch.int8]))
def test_row_digests_are_digests_of_rows(n, rest, dtype):
    t = torch.randint(-50, 50, (n, *rest)).to(dtype)
    for v in (t, t.transpose(0, -1).contiguous().transpose(0, -1)):
        f = fp(v, rows=True)
        assert f.rows == tuple(fingerprint(v[i]).digest for i in range(n))
        assert f == fp(v)  # rows do not change the tensor's own digest


def test_rows_of_big_rows_and_permuted_rows():
    t = torch.randn(6, 3000)
    f = fp(t, rows=True)
    g = fp(t[torch.tensor([1, 0, 2, 3, 4, 5])], rows=True)
    assert f != g and sorted(f.rows) == sorted(g.rows)  # same rows, different order
    assert f.rows[0] == fp(t[0]).digest
    assert fp(torch.tensor(2.0), rows=True).rows is None  # 0-dim: no dim 0


@FAST
@given(st.integers(0, 3000), st.data())
def test_chunk_digests(numel, draw):
    n = draw.draw(st.integers(max(1, numel // 64), 700))
    t = torch.randn(numel)
    v = t.reshape(-1, 1) if numel % 2 else t
    f = fp(v, rows=n)
    want = tuple(fingerprint(t[i : i + n]).digest for i in range(0, numel, n))
    assert f.rows == want


def test_bad_rows_argument_raises():
    for bad in (0, -3, 1.5, "x"):
        with pytest.raises(DigestError, match="rows="):
            start(torch.ones(3), rows=bad)


# --- moments ----------------------------------------------------------------------------------


def test_moments():
    m = fp(torch.tensor([1.0, -3.0, 2.5]), moments=True).moments
    assert m == Moments(0.5, 3.0, 0, 0)
    m = fp(torch.tensor([1.0, float("nan"), float("-inf"), float("inf")]), moments=True).moments
    assert m.nan == 1 and m.inf == 2
    assert fp(torch.tensor([3, -7, 2], dtype=torch.int16), moments=True).moments == Moments(-2.0, 7.0, 0, 0)
    assert fp(torch.tensor([True, False, True]), moments=True).moments == Moments(2.0, 1.0, 0, 0)
    c = fp(torch.tensor([3 + 4j, -1 + 0j], dtype=torch.complex64), moments=True).moments
    assert c == Moments(2.0, 5.0, 0, 0)  # real part summed, modulus for absmax
    assert fp(torch.empty(0), moments=True).moments == Moments(0.0, 0.0, 0, 0)
    big = torch.randn(100000, dtype=torch.float64)
    assert fp(big, moments=True).moments.absmax == big.abs().max().item()
    fp4 = torch.tensor([0x21, 0xF7], dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    assert fp(fp4, moments=True).moments == Moments(0.5 + 1.0 + 6.0 - 6.0, 6.0, 0, 0)
    e8 = torch.tensor([127, 128, 255], dtype=torch.uint8).view(torch.float8_e8m0fnu)
    m = fp(e8, moments=True).moments
    assert m.nan == 1 and m.inf == 0


def test_moments_chunked_equal_unchunked(monkeypatch):
    t = torch.randn(50000, dtype=torch.float64)
    want = fp(t, moments=True).moments
    monkeypatch.setattr(core, "SCRATCH", 32 * 1000)
    got = fp(t, moments=True).moments
    assert got.absmax == want.absmax and got.nan == want.nan and abs(got.sum - want.sum) < 1e-9


# --- tensor subclasses --------------------------------------------------------------------------


class MXTensor(torch.Tensor):
    """An MXFP8-style wrapper: fp8 data plus an e8m0 scale buffer, flattened for the digest."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=torch.bfloat16, device=data.device)

    def __init__(self, data: torch.Tensor, scale: torch.Tensor):
        self._data = data
        self._scale = scale

    def __tensor_flatten__(self):
        return ["_data", "_scale"], None

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        return MXTensor(inner["_data"], inner["_scale"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(f"MXTensor does not run {func}")


class BrokenTensor(MXTensor):
    def __tensor_flatten__(self):
        raise RuntimeError("cannot flatten")


def mx(scale_byte: int = 127) -> MXTensor:
    data = torch.arange(64, dtype=torch.uint8).view(torch.float8_e4m3fn).reshape(2, 32)
    scale = torch.tensor([127, scale_byte], dtype=torch.uint8).view(torch.float8_e8m0fnu)
    return MXTensor(data, scale)


def test_subclass_components_make_a_scale_difference_visible():
    a, b = fp(mx(), moments=True), fp(mx(128))
    assert set(a.components) == {"_data", "_scale"}
    assert a.components["_data"] == b.components["_data"]
    assert a.components["_scale"] != b.components["_scale"]
    assert a != b
    assert a == fp(mx()) and a.dtype == "torch.bfloat16" and a.shape == (2, 32)
    assert a.components["_data"].digest == fp(mx()._data).digest
    assert a.components["_scale"].moments is not None
    with pytest.raises(TypeError):
        a.components["x"] = a  # read-only mapping


def test_subclass_digest_covers_type_and_names():
    class OtherMX(MXTensor):
        pass

    a = fp(mx())
    b = fp(OtherMX(mx()._data, mx()._scale))
    assert a.components == b.components and a != b


# --- errors, pointers, round trip -----------------------------------------------------------


def test_undigestable_tensors_give_error_markers():
    bad = [
        torch.empty(3, device="meta"),
        torch.eye(3).to_sparse(),
        torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
        BrokenTensor(mx()._data, mx()._scale),
    ]
    fps = resolve([start(t) for t in bad])
    for f in fps:
        assert f.error and f.digest == "" and f != f
        with pytest.raises(DigestError):
            _ = f.hi
    assert fps[0] != fingerprint(torch.empty(3, device="meta"))  # two errors never compare equal
    assert start("not a tensor").error == "not a tensor: str"  # type: ignore[arg-type]
    with pytest.raises(DigestError, match=r"needs a torch\.Tensor"):
        fingerprint([1, 2])  # type: ignore[arg-type]


def test_pointer_check():
    ptrs = torch.tensor([0x7F00_0000_1000, 0x7F00_0000_2040], dtype=torch.int64)
    assert fp(ptrs, pointer_check=True).pointer_like
    assert not fp(ptrs).pointer_like  # only when asked
    assert not fp(ptrs + 1, pointer_check=True).pointer_like  # unaligned
    assert not fp(torch.arange(10, dtype=torch.int64), pointer_check=True).pointer_like
    assert not fp(torch.empty(0, dtype=torch.int64), pointer_check=True).pointer_like
    assert not fp(ptrs.to(torch.float64), pointer_check=True).pointer_like


def test_hi_lo_and_parquet_round_trip(tmp_path):
    fps = [fp(torch.randn(n)) for n in (1, 100, 10000)] + [fp(torch.full((4,), -1, dtype=torch.int64))]
    for f in fps:
        assert f"{f.hi:016x}{f.lo:016x}" == f.digest and 0 <= f.hi < 2**64 and 0 <= f.lo < 2**64
    table = pa.table(
        {"hi": pa.array([f.hi for f in fps], pa.uint64()), "lo": pa.array([f.lo for f in fps], pa.uint64())}
    )
    pq.write_table(table, tmp_path / "d.parquet")
    back = pq.read_table(tmp_path / "d.parquet")
    assert back.column("hi").to_pylist() == [f.hi for f in fps]
    assert back.column("lo").to_pylist() == [f.lo for f in fps]


def test_fast_fingerprint_constructor_equals_the_dataclass():
    m = Moments(1.0, 2.0, 0, 0)
    fast = T._fingerprint_fast("torch.float32", (2, 3), 6, "ab" * 16, ("cd" * 16,), m, True)
    slow = Fingerprint("torch.float32", (2, 3), 6, "ab" * 16, ("cd" * 16,), T._NO_COMPONENTS, m, None, True)
    assert repr(fast) == repr(slow) and fast == slow and hash(fast) == hash(slow)
    assert vars(fast) == vars(slow)
    with pytest.raises(AttributeError):
        fast.digest = "x"  # type: ignore[misc]


@pytest.mark.parametrize("n", [10, 1000])
def test_lazy_conjugate_and_negative_views(n):
    z = torch.randn(n, dtype=torch.complex64)
    c = z.conj()
    assert c.is_conj() and fp(c) == fp(c.resolve_conj()) and fp(c) != fp(z)
    im = c.imag  # a real tensor with the negative bit set
    assert im.is_neg() and fp(im) == fp(im.resolve_neg()) and fp(im) != fp(z.imag)
    assert fp(c, rows=3).rows == fp(c.resolve_conj(), rows=3).rows
    assert fp(c, moments=True).moments == fp(c.resolve_conj(), moments=True).moments


def test_zero_size_dims_in_every_layout():
    for shape in [(0,), (0, 5), (5, 0), (3, 0, 2), (300, 0)]:
        t = torch.empty(shape)
        views = [t, t.transpose(0, -1), t.unsqueeze(0).expand(2, *shape)]
        for v in views:
            f = fp(v, rows=True, moments=True)
            assert f == fp(v.contiguous()) and f.numel == 0
            assert f.rows == tuple(fingerprint(v[i]).digest for i in range(v.shape[0]))
            assert f.moments == Moments(0.0, 0.0, 0, 0)
    assert len({fp(torch.empty(s)).digest for s in [(0,), (0, 5), (5, 0), (3, 0, 2)]}) == 4


MOMENT_DTYPES = [torch.bool, torch.int8, torch.uint8, torch.int32, torch.int64, torch.uint64, torch.float16]
MOMENT_DTYPES += [torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.float8_e4m3fn]
MOMENT_DTYPES += [torch.float8_e5m2fnuz, torch.float8_e8m0fnu, torch.float4_e2m1fn_x2]


@pytest.mark.parametrize("dtype", MOMENT_DTYPES, ids=str)
def test_arena_moments_and_pointer_flags_equal_the_per_tensor_path(dtype):
    g = torch.Generator().manual_seed(1)
    ts = []
    for n in (0, 1, 5, 1024 // dtype.itemsize):
        raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g)
        ts.append((raw & 1 if dtype is torch.bool else raw).view(dtype))
    if dtype is torch.int64:
        ts += [torch.tensor([0x7F00_0000_1000, 0x7F00_0000_2040]), torch.tensor([0x7F00_0000_1000, 3])]
    ps = [start(t, moments=True, pointer_check=True) for t in ts]
    assert all(p.arena is not None and p.moments is None for p in ps)  # the arena path
    for t, f in zip(ts, resolve(ps), strict=True):
        want = M.moments_of(t).tolist()
        got = [f.moments.sum, f.moments.absmax, f.moments.nan, f.moments.inf]
        assert got[1:] == pytest.approx(want[1:], nan_ok=True) and got[2:] == want[2:]
        assert got[0] == pytest.approx(want[0], rel=1e-12, nan_ok=True)
        assert f.pointer_like == (dtype is torch.int64 and bool(M.pointer_like(t)))
    if dtype is torch.int64:
        assert [f.pointer_like for f in resolve(ps)][-2:] == [True, False]


def test_arena_created_inside_inference_mode_serves_later_calls(monkeypatch):
    monkeypatch.setattr(D, "_ARENAS", {})
    monkeypatch.setattr(D, "_SPARE", {})
    with torch.inference_mode():
        a = torch.randn(6)
        pa = start(a)
    b = torch.randn(6, requires_grad=True)
    pb = start(b)  # same arena, outside inference mode
    assert pa.arena is pb.arena
    assert resolve([pa, pb]) == [fp(a.clone()), fp(b.detach().clone())]


def test_concurrent_starts_from_threads():
    import threading

    ts = [torch.randn(n) for n in range(1, 200)]
    out: dict[int, list] = {}

    def work(k: int) -> None:
        out[k] = [start(t, moments=True) for t in ts]

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    want = [fp(t) for t in ts]
    for k in range(4):
        assert resolve(out[k]) == want


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@CUDA
def test_cpu_and_cuda_digests_are_identical(monkeypatch):
    g = torch.Generator().manual_seed(3)
    ts = [torch.randn(n, generator=g) for n in (0, 1, 255, 256, 300, 70000, 3 << 20)]
    ts += [torch.randn(300, 500, generator=g).t(), torch.randn(1, 4000, generator=g).expand(64, 4000)]
    ts += [torch.randint(0, 256, (5000,), dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)]
    ts += [torch.arange(40, dtype=torch.int64) << 36, torch.randn(17, dtype=torch.bfloat16)]
    cpu = resolve([start(t, rows=True, moments=True, pointer_check=True) for t in ts])
    cuda = resolve([start(t.cuda(), rows=True, moments=True, pointer_check=True) for t in ts])
    for a, b in zip(cpu, cuda, strict=True):
        assert a == b and a.rows == b.rows and a.pointer_like == b.pointer_like
        assert (a.moments.nan, a.moments.inf) == (b.moments.nan, b.moments.inf)
        # absmax propagates NaN (the fp8 bytes include NaN codes); NaN != NaN, and its payload may
        # differ between devices, so a NaN matches any NaN.
        x, y = a.moments.absmax, b.moments.absmax
        assert x == y or (math.isnan(x) and math.isnan(y))
    assert [fp(t.cuda(), rows=7).rows for t in ts[:5]] == [fp(t, rows=7).rows for t in ts[:5]]
    monkeypatch.setitem(gemm._INT_MM, "cuda", False)  # the exact float32 fallback on the GPU
    assert resolve([start(t.cuda()) for t in ts]) == [fingerprint(t) for t in ts]


@pytest.mark.gpu
@CUDA
def test_cuda_graph_capture_gives_an_error_marker_not_a_recorded_digest():
    x = torch.randn(8, device="cuda")
    big = torch.randn(5000, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ps = [start(x), start(big)]
        y = x * 2
    assert all(p.error and "graph capture" in p.error for p in ps)
    graph.replay()
    assert fp(y) == fp(x * 2)


def test_fetched_words_are_unsigned_and_hex_renders_them():
    # A resolve brings the digests back as int64 words and reads them as unsigned integers (the
    # trace's uint64 columns); Fingerprint.digest and row digests render them as 32 hex.
    from detfp_capture._digest.resolve import _hex, _words

    words = torch.tensor([0, -1, 1, -(2**63), 2**63 - 1, 0x0123456789ABCDEF], dtype=torch.int64)
    want = [w & (2**64 - 1) for w in words.tolist()]
    assert _words(words, [(0, 0)] * 3, False, versions.active()) == want
    assert [_hex(hi, lo) for hi, lo in zip(want[0::2], want[1::2], strict=True)] == [
        f"{hi:016x}{lo:016x}" for hi, lo in zip(want[0::2], want[1::2], strict=True)
    ]
    assert _hex(0, 2**64 - 1) == "0" * 16 + "f" * 16


def test_fingerprints_pickle_and_components_stay_read_only():
    import pickle

    fps = [fp(torch.randn(5), rows=True, moments=True), fp(mx()), fingerprint(torch.empty(2, device="meta"))]
    back = pickle.loads(pickle.dumps(fps))
    assert back[:2] == fps[:2] and back[0].rows == fps[0].rows and back[0].moments == fps[0].moments
    assert back[2].error == fps[2].error and back[2] != fps[2]
    built = Fingerprint("torch.float32", (1,), 1, "0" * 32, components={"a": fps[0]})
    with pytest.raises(TypeError):
        built.components["b"] = fps[0]  # type: ignore[index]
