"""The native level functions (``_digest/_lanes.c``) compute exactly what torch's routes compute.

Version 1: ``torch._int_mm`` on the zero-padded rows and the exact float32 GEMM. Version 2: the
GEMM route's partial sums combined, on every instruction set the CPU runs (AVX-512, AVX2, plain
C). For every shape the digest hands them (any rows, 0..1024 bytes per row, strided rows) and
every byte value, at every level. A fingerprint is the same bits whichever route or instruction
set a process takes (only a speed decision)."""

from __future__ import annotations

import shutil
import sysconfig
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from detfp_capture._digest import core, gemm, native, tlh2, versions
from detfp_capture.digest import fingerprint
from tests import native_half

CPU = torch.device("cpu")
V1, V2 = versions.SCHEMES[1], versions.SCHEMES[2]
needs_native = native_half.needs(native.AVAILABLE, native_half.DIGEST)


def pairs(level: int) -> torch.Tensor:
    return V1.pairs(level)


def reference(x: torch.Tensor, level: int) -> torch.Tensor:
    """torch's int8 GEMM on the rows zero-padded to 1024 bytes (zero bytes add nothing)."""
    if x.shape[0] == 0:
        return torch.zeros(0, 16, dtype=torch.int32)
    pad = torch.nn.functional.pad(x, (0, core.K - x.shape[1]))
    return torch._int_mm(pad.contiguous(), V1.weights.get(CPU, level))


def reference2(x: torch.Tensor, level: int) -> torch.Tensor:
    """Version 2's torch route: ``_int_mm`` on the zero-padded rows, partial sums combined."""
    if x.shape[0] == 0:
        return torch.zeros(0, 4, dtype=torch.int32)
    pad = torch.nn.functional.pad(x, (0, core.K - x.shape[1]))
    return tlh2._combine(torch._int_mm(pad.contiguous(), V2.weights.get(CPU, level)))


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
    want2 = reference2(x, level)
    for isa in native.ISAS:  # every instruction set this CPU runs: AVX-512, AVX2, plain C
        assert torch.equal(native.mm2(x, tlh2.pack_keys(level), isa=isa), want2), isa


@needs_native
@given(rows=st.integers(1, 9), cols=st.integers(1, 300), gap=st.integers(0, 40), offset=st.integers(0, 7))
def test_native_reads_strided_and_offset_rows(rows, cols, gap, offset):
    base = torch.randint(-128, 128, (offset + rows * (cols + gap),), dtype=torch.int8)
    x = base[offset:].as_strided((rows, cols), (cols + gap, 1))
    assert torch.equal(native.mm(x, pairs(1)), reference(x.contiguous(), 1))
    assert torch.equal(native.mm2(x, tlh2.pack_keys(1)), reference2(x.contiguous(), 1))
    # every column of a transposed (non-unit column stride) view too: copied before the kernel
    xt = torch.randint(-128, 128, (cols, rows), dtype=torch.int8).t()
    assert torch.equal(native.mm(xt, pairs(0)), reference(xt.contiguous(), 0))
    assert torch.equal(native.mm2(xt, tlh2.pack_keys(0)), reference2(xt.contiguous(), 0))


@needs_native
def test_native_writes_into_out_or_copies_into_one_it_cannot_write():
    x = torch.randint(-128, 128, (37, 1024), dtype=torch.int8)
    want = reference(x, 0)
    into = torch.full((37, 16), 7, dtype=torch.int32)
    assert native.mm(x, pairs(0), out=into) is into and torch.equal(into, want)
    strided = torch.zeros(37, 32, dtype=torch.int32)[:, ::2]
    assert native.mm(x, pairs(0), out=strided) is strided and torch.equal(strided, want)
    want2 = reference2(x, 0)
    into2 = torch.full((37, 4), 7, dtype=torch.int32)
    assert native.mm2(x, tlh2.pack_keys(0), out=into2) is into2 and torch.equal(into2, want2)
    strided2 = torch.zeros(37, 8, dtype=torch.int32)[:, ::2]
    assert native.mm2(x, tlh2.pack_keys(0), out=strided2) is strided2 and torch.equal(strided2, want2)


@needs_native
def test_native_refuses_what_it_cannot_read():
    with pytest.raises(ValueError, match="int8"):
        native.mm(torch.zeros(2, 4, dtype=torch.int16), pairs(0))
    with pytest.raises(ValueError, match="at most 1024"):
        native.mm(torch.zeros(2, 1025, dtype=torch.int8), pairs(0))
    with pytest.raises(ValueError, match="pair_weights"):  # the int8 weights themselves: refused
        native.mm(torch.zeros(2, 8, dtype=torch.int8), V1.weights.get(CPU, 0))
    with pytest.raises(ValueError, match="pack_keys"):
        native.mm2(torch.zeros(2, 8, dtype=torch.int8), tlh2.pack_keys(0)[:-8])
    with pytest.raises(ValueError, match="at most 1024"):
        native.mm2(torch.zeros(2, 1025, dtype=torch.int8), tlh2.pack_keys(0))
    with pytest.raises(ValueError, match="instruction set"):
        native.mm2(torch.zeros(2, 8, dtype=torch.int8), tlh2.pack_keys(0), isa="sse9")


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("route", ["native", "int_mm", "float"])
def test_every_route_gives_the_same_fingerprints(monkeypatch, route, version):
    if route == "native":
        native_half.check(native.AVAILABLE, native_half.DIGEST)
    sch = versions.SCHEMES[version]
    g = torch.Generator().manual_seed(3)
    ts = [
        torch.randn(70000, generator=g),
        torch.full((1024 * 40,), -128, dtype=torch.int8),
        torch.randn(33, 17, generator=g).to(torch.bfloat16),
        torch.randn(5, generator=g),
        torch.zeros(0),
    ]
    monkeypatch.setattr(sch, "native_cpu", route == "native")
    monkeypatch.setitem(gemm._INT_MM, "cpu", route == "int_mm")
    got = [fingerprint(t, version=version) for t in ts]
    monkeypatch.setattr(sch, "native_cpu", False)
    monkeypatch.setitem(gemm._INT_MM, "cpu", True)  # the reference route
    assert got == [fingerprint(t, version=version) for t in ts]


def test_route_choice_is_timed_once_without_touching_the_rng(monkeypatch):
    monkeypatch.setattr(V1, "native_cpu", None)
    timed = []
    real = gemm.best_seconds

    def best_seconds(*args, **kwargs):
        timed.append(real(*args, **kwargs))
        return timed[-1]

    monkeypatch.setitem(gemm._INT_MM, "cpu", True)  # gemm's own route choice, timed once too: made
    monkeypatch.setattr(gemm, "best_seconds", best_seconds)
    rng = torch.get_rng_state()
    chosen = V1.use_native(CPU)
    assert torch.equal(torch.get_rng_state(), rng)
    assert V1.use_native(CPU) is chosen and V1.native_cpu is chosen  # remembered: not timed again
    if native.AVAILABLE and not native.FORCED:  # timed once, and the faster route taken
        assert len(timed) == 1 and chosen is (timed[0][True] <= timed[0][False])
    else:
        assert timed == [] and chosen is native.AVAILABLE
    assert not V1.use_native(torch.device("meta"))  # never off the CPU
    assert not V2.use_native(torch.device("meta"))


@needs_native
def test_detfp_native_1_uses_the_kernel_without_timing_it(monkeypatch):
    monkeypatch.setattr(native, "FORCED", True)
    monkeypatch.setattr(V1, "native_cpu", None)
    monkeypatch.setattr(gemm, "best_seconds", lambda *a: pytest.fail("timed although forced"))
    assert V1.use_native(CPU) is True


@needs_native
def test_version_2_takes_the_kernel_wherever_it_is_built_without_timing_it(monkeypatch):
    monkeypatch.setattr(V2, "native_cpu", None)
    monkeypatch.setattr(gemm, "best_seconds", lambda *a: pytest.fail("version 2 timed its kernel"))
    assert V2.use_native(CPU) is True


def test_without_the_kernel_torch_routes_are_taken(monkeypatch):
    monkeypatch.setattr(native, "AVAILABLE", False)
    monkeypatch.setattr(V1, "native_cpu", None)
    monkeypatch.setattr(V2, "native_cpu", None)
    assert V1.use_native(CPU) is False and V2.use_native(CPU) is False
    x = torch.randint(-128, 128, (300, 1024), dtype=torch.int8)
    assert torch.equal(V1.mm(x, 0), reference(x, 0))
    assert torch.equal(V2.mm(x, 0), reference2(x, 0))


@pytest.mark.skipif(not native_half.can_build(), reason="no C compiler or no Python headers here: the kernel is optional")
def test_the_kernel_is_built_where_it_can_be():
    """``pip install -e .`` (scripts/bootstrap.sh) builds it; a silently missing build would leave
    the digest on the slower route and these tests skipped."""
    assert native._lanes is not None, "detfp_capture._digest._lanes is not built: rerun `pip install -e .`"
    assert native.KERNEL in ("avx2", "portable") and native.ISA in native.ISAS
    assert native.ISAS[0] == "portable" and native.ISA in native.ISAS


def test_route_names_the_gemm_the_process_runs(monkeypatch):
    monkeypatch.setattr(V1, "native_cpu", True)
    monkeypatch.setattr(V2, "native_cpu", True)
    assert V1.route(CPU) == f"native kernel ({native.KERNEL})"
    assert V2.route(CPU) == f"native kernel ({native.ISA})"
    monkeypatch.setattr(V1, "native_cpu", False)
    monkeypatch.setattr(V2, "native_cpu", False)
    monkeypatch.setitem(gemm._INT_MM, "cpu", True)
    assert V1.route(CPU) == "int8 GEMM (torch._int_mm)"
    assert V2.route(CPU) == "torch: int8 GEMM (torch._int_mm)"
    monkeypatch.setitem(gemm._INT_MM, "cpu", False)
    assert V1.route(CPU) == "exact float32 GEMM"
    assert V2.route(CPU) == "torch: exact float32 GEMM"


@needs_native
@pytest.mark.parametrize("isa", native.ISAS)
def test_version_2_whole_tree_in_one_call_equals_level_by_level(isa, monkeypatch):
    # The fused tree (native.root2: no level written to memory) on sizes around every boundary of
    # rows and fan-in, against the levels run one by one through torch's GEMM route.
    monkeypatch.setattr(V2, "native_cpu", False)
    g = torch.Generator().manual_seed(11)
    data = torch.randint(-128, 128, (64 * 64 * 1024 + 70000,), dtype=torch.int8, generator=g)
    for n in (0, 1, 1023, 1024, 1025, 63 * 1024, 64 * 1024 - 1, 64 * 1024, 64 * 1024 + 1, 65 * 1024 + 7,
              64 * 64 * 1024 - 5, 64 * 64 * 1024, 64 * 64 * 1024 + 70000):  # fmt: skip
        b = data[:n]
        want = core.tree(b.view(1, n), 0, V2)
        assert torch.equal(native.root2(b, tlh2.pack_all_keys(), isa=isa), want), n
    with pytest.raises(ValueError, match="more than 1 levels"):
        native.root2(data[:2048], tlh2.pack_keys(0))


def _sanitizer_build(tmp_path: Path) -> list[str] | None:
    """Command lines compiling ``tests/fixtures/digest_asan.c`` with ASan and UBSan, or None where
    there is no compiler, Python headers or shared libpython to link against."""
    cc = shutil.which("cc") or shutil.which("gcc")
    include, libdir = sysconfig.get_paths()["include"], sysconfig.get_config_var("LIBDIR")
    ldver = sysconfig.get_config_var("LDVERSION")
    if not (cc and (Path(include) / "Python.h").is_file() and libdir and ldver):
        return None
    if not any(Path(libdir).glob(f"libpython{ldver}.so*")):
        return None
    src = Path(__file__).resolve().parents[1] / "fixtures" / "digest_asan.c"
    exe = tmp_path / "digest_asan"
    flags = ["-O1", "-g", "-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer"]
    return [cc, *flags, f"-I{include}", str(src), f"-L{libdir}", f"-lpython{ldver}", "-o", str(exe)]


def test_version_2_kernels_are_memory_safe_and_defined_under_sanitizers(tmp_path):
    """Out-of-bounds reads or writes (a row's tail, a level's buffer, a mergeable part's partial rows) and undefined behaviour
    (a signed overflow in a reduction) fail here, on every instruction set the CPU runs."""
    import subprocess

    build = _sanitizer_build(tmp_path)
    if build is None:
        pytest.skip("no C compiler, Python headers or shared libpython to build the sanitizer harness")
    done = subprocess.run(build, capture_output=True, text=True)
    if done.returncode != 0 and "sanitizer" in done.stderr.lower():
        pytest.skip(f"the compiler has no sanitizers here: {done.stderr.strip()[:200]}")
    assert done.returncode == 0, done.stderr[-2000:]
    env = {"LD_LIBRARY_PATH": sysconfig.get_config_var("LIBDIR"), "ASAN_OPTIONS": "detect_leaks=1"}
    run = subprocess.run([str(tmp_path / "digest_asan")], capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), (run.stdout + run.stderr)[-3000:]
