"""The native level GEMM (``_digest/_lanes.c``) computes exactly what torch's routes compute:
``torch._int_mm`` on the zero-padded rows and the exact float32 GEMM, for every shape the digest
hands it (any rows, 0..1024 bytes per row, strided rows) and every byte value, at every level;
its AVX2 kernel and its portable loop agree. A fingerprint is the same bits whichever route a
process takes (the route is only a speed decision)."""

from __future__ import annotations

import shutil
import sysconfig
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from detfp_capture._digest import core, native
from detfp_capture.digest import fingerprint

CPU = torch.device("cpu")
needs_native = pytest.mark.skipif(not native.AVAILABLE, reason="native digest kernel not built (no C compiler)")


def pairs(level: int) -> torch.Tensor:
    return native.pair_weights(core.weights(CPU, level, False), level)


def reference(x: torch.Tensor, level: int) -> torch.Tensor:
    """torch's int8 GEMM on the rows zero-padded to 1024 bytes (zero bytes add nothing)."""
    if x.shape[0] == 0:
        return torch.zeros(0, 16, dtype=torch.int32)
    pad = torch.nn.functional.pad(x, (0, core.K - x.shape[1]))
    return torch._int_mm(pad.contiguous(), core.weights(CPU, level, False))


@needs_native
@settings(max_examples=300, deadline=None)
@given(
    rows=st.integers(0, 20),
    cols=st.integers(0, 1024),
    level=st.integers(0, 6),
    fill=st.sampled_from(["random", "min", "max", "alternating"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_native_equals_int_mm_on_every_shape_and_byte(rows, cols, level, fill, seed):
    g = torch.Generator().manual_seed(seed)
    x = {
        "random": lambda: torch.randint(-128, 128, (rows, cols), dtype=torch.int8, generator=g),
        "min": lambda: torch.full((rows, cols), -128, dtype=torch.int8),  # the largest |sum|
        "max": lambda: torch.full((rows, cols), 127, dtype=torch.int8),
        "alternating": lambda: (torch.arange(rows * cols) % 2 * 255 - 128).to(torch.int8).view(rows, cols),
    }[fill]()
    want = reference(x, level)
    assert torch.equal(native.mm(x, pairs(level)), want)
    assert torch.equal(native.mm(x, pairs(level), portable=True), want)


@needs_native
@given(rows=st.integers(1, 9), cols=st.integers(1, 300), gap=st.integers(0, 40), offset=st.integers(0, 7))
def test_native_reads_strided_and_offset_rows(rows, cols, gap, offset):
    base = torch.randint(-128, 128, (offset + rows * (cols + gap),), dtype=torch.int8)
    x = base[offset:].as_strided((rows, cols), (cols + gap, 1))
    assert torch.equal(native.mm(x, pairs(1)), reference(x.contiguous(), 1))
    # every column of a transposed (non-unit column stride) view too: copied before the kernel
    xt = torch.randint(-128, 128, (cols, rows), dtype=torch.int8).t()
    assert torch.equal(native.mm(xt, pairs(0)), reference(xt.contiguous(), 0))


@needs_native
def test_native_writes_into_out_or_copies_into_one_it_cannot_write():
    x = torch.randint(-128, 128, (37, 1024), dtype=torch.int8)
    want = reference(x, 0)
    into = torch.full((37, 16), 7, dtype=torch.int32)
    assert native.mm(x, pairs(0), out=into) is into and torch.equal(into, want)
    strided = torch.zeros(37, 32, dtype=torch.int32)[:, ::2]
    assert native.mm(x, pairs(0), out=strided) is strided and torch.equal(strided, want)


@needs_native
def test_native_refuses_what_it_cannot_read():
    with pytest.raises(ValueError, match="int8"):
        native.mm(torch.zeros(2, 4, dtype=torch.int16), pairs(0))
    with pytest.raises(ValueError, match="at most 1024"):
        native.mm(torch.zeros(2, 1025, dtype=torch.int8), pairs(0))
    with pytest.raises(ValueError, match="pair_weights"):  # the int8 weights themselves: refused
        native.mm(torch.zeros(2, 8, dtype=torch.int8), core.weights(CPU, 0, False))


@pytest.mark.parametrize("route", ["native", "int_mm", "float"])
def test_every_route_gives_the_same_fingerprints(monkeypatch, route):
    if route == "native" and not native.AVAILABLE:
        pytest.skip("native digest kernel not built")
    g = torch.Generator().manual_seed(3)
    ts = [
        torch.randn(70000, generator=g),
        torch.full((1024 * 40,), -128, dtype=torch.int8),
        torch.randn(33, 17, generator=g).to(torch.bfloat16),
        torch.randn(5, generator=g),
        torch.zeros(0),
    ]
    monkeypatch.setitem(core._NATIVE, "cpu", route == "native")
    monkeypatch.setitem(core._INT_MM, "cpu", route == "int_mm")
    got = [fingerprint(t) for t in ts]
    monkeypatch.setitem(core._NATIVE, "cpu", False)
    monkeypatch.setitem(core._INT_MM, "cpu", True)  # the reference route
    assert got == [fingerprint(t) for t in ts]


def test_route_choice_is_timed_once_without_touching_the_rng(monkeypatch):
    monkeypatch.delitem(core._NATIVE, "cpu", raising=False)
    rng = torch.get_rng_state()
    assert core.use_native(CPU) in (True, False)
    assert torch.equal(torch.get_rng_state(), rng)
    assert core._NATIVE["cpu"] is core.use_native(CPU)
    assert not core.use_native(torch.device("meta"))  # never off the CPU


@needs_native
def test_detfp_native_1_uses_the_kernel_without_timing_it(monkeypatch):
    monkeypatch.setattr(native, "FORCED", True)
    monkeypatch.delitem(core._NATIVE, "cpu", raising=False)
    monkeypatch.setattr(core, "_best_seconds", lambda *a: pytest.fail("timed although forced"))
    assert core.use_native(CPU) is True


def test_without_the_kernel_torch_routes_are_taken(monkeypatch):
    monkeypatch.setattr(native, "AVAILABLE", False)
    monkeypatch.delitem(core._NATIVE, "cpu", raising=False)
    assert core.use_native(CPU) is False
    x = torch.randint(-128, 128, (300, 1024), dtype=torch.int8)
    assert torch.equal(core.mm(x, 0), reference(x, 0))


def _can_build() -> bool:
    """A C compiler and Python's headers: what building the optional extension needs."""
    has_cc = shutil.which("cc") is not None or shutil.which("gcc") is not None
    return has_cc and (Path(sysconfig.get_paths()["include"]) / "Python.h").is_file()


@pytest.mark.skipif(not _can_build(), reason="no C compiler or no Python headers here: the kernel is optional")
def test_the_kernel_is_built_where_it_can_be():
    """``pip install -e .`` (scripts/bootstrap.sh) builds it; a silently missing build would leave
    the digest on the slower route and these tests skipped."""
    assert native._lanes is not None, "detfp_capture._digest._lanes is not built: rerun `pip install -e .`"
    assert native.KERNEL in ("avx2", "portable")


def test_route_names_the_gemm_the_process_runs(monkeypatch):
    monkeypatch.setitem(core._NATIVE, "cpu", True)
    assert core.route(CPU) == f"native kernel ({native.KERNEL})"
    monkeypatch.setitem(core._NATIVE, "cpu", False)
    monkeypatch.setitem(core._INT_MM, "cpu", True)
    assert core.route(CPU) == "int8 GEMM (torch._int_mm)"
    monkeypatch.setitem(core._INT_MM, "cpu", False)
    assert core.route(CPU) == "exact float32 GEMM"
