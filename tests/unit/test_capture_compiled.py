"""Capture in and around compiled code, without compiling: the callbacks C++ makes into capture.

Torch calls the dispatch mode from C++ code that cannot pass a Python exception on: a tensor
subclass whose metadata is dispatched to Python (dynamo's fake tensors are one) is asked for its
``prim.device`` while autograd wraps an output (``DelayedError``, which dynamo applies to every
example input it fakes). An exception there is ``std::terminate``: the whole job dies with
SIGABRT and no Python traceback (issue 41, a compiled DDP module at level ops under autocast).
These run in a child process, so an abort fails the test instead of killing pytest; the real
compiled jobs are the compiled zoo's (tests/integration/test_zoo_compiled.py).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import polars as pl
import pytest
import torch
from torch.utils._python_dispatch import _disable_current_modes

from detfp_analyze.io.reader import open_run
from detfp_capture import Session
from tests.fixtures.models import digest_hi, read
from tests.fixtures.zoo.harness import ROOT

#: A subclass that dispatches its device to Python, called from C++ (``DelayedError`` wraps it in
#: an autograd node, which asks for its device) inside autocast at level ops; then it trains on.
_FROM_CPP = textwrap.dedent(
    """
    import sys, warnings
    import torch
    from detfp_capture import Session

    class DeviceInPython(torch.Tensor):
        @staticmethod
        def __new__(cls, inner):
            return torch.Tensor._make_wrapper_subclass(
                cls, inner.shape, dtype=inner.dtype, device=inner.device,
                requires_grad=inner.requires_grad, dispatch_device=True,
            )

        def __init__(self, inner):
            self.inner = inner

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            if func is torch.ops.prim.device.default:
                return args[0].inner.device
            un = lambda t: t.inner if isinstance(t, DeviceInPython) else t
            return func(*[un(a) for a in args], **{k: un(v) for k, v in (kwargs or {}).items()})

    class Broken:
        # Capture's own code fails on that path (called from C++), with its warnings as errors.
        def __enter__(self):
            from detfp_capture._sources import dispatch

            self.keys = keys = dispatch.CaptureMode._uncovered_autocast_keys

            def broken(mode, func):
                if func.namespace == "prim":
                    raise RuntimeError("planted failure")
                return keys(mode, func)

            dispatch.CaptureMode._uncovered_autocast_keys = broken
            warnings.filterwarnings("error", category=RuntimeWarning)

        def __exit__(self, *exc):
            from detfp_capture._sources import dispatch

            dispatch.CaptureMode._uncovered_autocast_keys = self.keys
            warnings.resetwarnings()

    def job(out):
        torch.manual_seed(0)
        m = torch.nn.Linear(4, 4)
        with Session(out, "ops") as s:
            s.watch(m)
            for step in range(2):
                with s.step(step):
                    with torch.autocast("cpu", dtype=torch.bfloat16):
                        y = m(torch.randn(2, 4))
                        w = DeviceInPython(torch.randn(3, requires_grad=True))
                        torch._C._functions.DelayedError("unused", 1)(w)
                    y.float().sum().backward()
        print("finished", out, flush=True)

    job(sys.argv[1] + "/plain")
    with Broken():
        job(sys.argv[1] + "/planted")
    """
)


@pytest.fixture(scope="module")
def from_cpp(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """Both jobs in one child process (one torch import): ``plain``, then ``planted``."""
    root = tmp_path_factory.mktemp("from_cpp")
    proc = subprocess.run(
        [sys.executable, "-c", _FROM_CPP, str(root)], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    return root, proc


def _events(run) -> pl.DataFrame:
    return pl.read_parquet(open_run(run, allow_incomplete=True).files("events"), hive_partitioning=False)


def test_prim_op_from_cpp_under_autocast_is_passed_through(from_cpp):
    """The abort of issue 41, without a compiler: ``prim.device`` of a Python-dispatched tensor
    reaches the mode from C++ under autocast. It runs plainly (a TorchScript prim has no autocast
    kernel); the job finishes and capture stays on."""
    root, proc = from_cpp
    assert proc.returncode == 0 and f"finished {root}/plain" in proc.stdout, proc.stderr[-3000:]
    ev = _events(root / "plain")
    assert not ev.filter(pl.col("type").is_in(["capture_error", "capture_disabled"])).height, ev


def test_capture_failure_on_a_cpp_path_is_an_event_never_an_abort(from_cpp):
    """Any exception of capture's own code on that path (here its autocast bookkeeping, with
    warnings as errors) becomes one capture_error event and one warning line; the op runs and
    the job finishes."""
    root, proc = from_cpp
    assert proc.returncode == 0 and f"finished {root}/planted" in proc.stdout, proc.stderr[-3000:]
    assert proc.stderr.count("detfp capture disabled") == 1, proc.stderr[-3000:]
    err = _events(root / "planted").filter(pl.col("type") == "capture_error")
    assert err.height == 1 and err["detail"][0].startswith("dispatch of prim.device.default: RuntimeError: planted")


# --------------------------------------------------------------------------------------------
# Kernels of compiled code, on a wrapper module of Inductor's shape (no compiler needed): the
# C++ kernel is a Python function writing through numpy, as a kernel writes through raw pointers
# (no dispatcher, no version counter); the module is loaded through Inductor's own loader.

#: How Inductor defines a C++ kernel in its wrapper (text only here: capture reads the definitions).
_DEFINITION = """cpp_fused_add_mul_0 = async_compile.cpp_pybinding(['const float*', 'float*', 'float*', 'const int64_t'], r'''
#include <torch/csrc/inductor/cpp_prefix.h>
extern "C"  void  kernel(const float* in_ptr0,
                       float* in_out_ptr0,
                       float* out_ptr0,
                       const int64_t ks0)
{
}
''')
"""

_WRAPPER = textwrap.dedent(
    '''
    import torch
    from types import SimpleNamespace
    from torch.utils._python_dispatch import _disable_current_modes

    empty_strided_cpu = torch._C._dynamo.guards._empty_strided_cpu
    reinterpret_tensor = torch._C._dynamo.guards._reinterpret_tensor
    extern_kernels = SimpleNamespace(mul=torch.mul)

    _DEFINITIONS = """
    @KERNELS@"""


    def cpp_fused_add_mul_0(in_ptr0, in_out_ptr0, out_ptr0, ks0):
        with _disable_current_modes():  # no op the dispatcher sees
            a, io, o = in_ptr0.numpy(), in_out_ptr0.numpy(), out_ptr0.numpy()
            io[:ks0] = a[:ks0] * 2 + (io[:ks0] if WRITTEN[0] else 0)
            o[:ks0] = a[:ks0] + 1


    WRITTEN = [False]


    def call(x):
        buf0 = empty_strided_cpu((4,), (1,), torch.float32)
        extern_kernels.mul(x, 3.0, out=buf0)
        buf1 = empty_strided_cpu((2, 2), (2, 1), torch.float32)
        buf2 = reinterpret_tensor(buf1, (4,), (1,), 0); del buf1  # reuse
        buf3 = empty_strided_cpu((4,), (1,), torch.float32)
        WRITTEN[0] = False
        cpp_fused_add_mul_0(x, buf2, buf3, 4)  # a fresh buffer reused in place: written, not read
        WRITTEN[0] = True
        cpp_fused_add_mul_0(x, buf0, buf3, 4)  # the GEMM's output updated in place: read, then written
        return buf2, buf0, buf3
    '''
).replace("@KERNELS@", _DEFINITION)


@pytest.fixture
def wrapper(tmp_path):
    """A wrapper module of Inductor's shape, loaded through ``PyCodeCache`` (the loader capture watches)."""
    from torch._inductor.codecache import PyCodeCache

    path = tmp_path / "cwrapper.py"
    path.write_text(_WRAPPER)

    def load():
        return PyCodeCache.load_by_key_path(f"detfp-test-{tmp_path.name}", str(path))

    return load


def _kernel_rows(run) -> pl.DataFrame:
    return read(run).filter(pl.col("kind") == "kernel").select("step", "name", "occurrence", "role", "arg", "digest_hi")


def test_wrapper_code_reads_each_kernels_arguments_and_fused_ops():
    from detfp_capture._sources.wrapper_code import ArgRole, cpp_kernels, fused_ops

    sig = cpp_kernels(_WRAPPER, {"add", "mul"}.__contains__)["cpp_fused_add_mul_0"]
    assert sig.params == ("in_ptr0", "in_out_ptr0", "out_ptr0", "ks0")
    assert sig.roles == (ArgRole.READ, ArgRole.READ_WRITE, ArgRole.WRITE, ArgRole.SCALAR)
    assert sig.aten == ("add", "mul")
    known = {"native_layer_norm", "native_layer_norm_backward", "add", "sum", "_to_copy", "view"}.__contains__
    assert fused_ops("cpp_fused__to_copy_add_native_layer_norm_native_layer_norm_backward_sum_view_3", known) == (
        "_to_copy", "add", "native_layer_norm", "native_layer_norm_backward", "sum", "view",
    )  # fmt: skip
    assert fused_ops("triton_red_fused_native_layer_norm_0", known) == ("native_layer_norm",)
    assert fused_ops("cpp_fused_unknown_op_1", known) == ("unknown", "op")  # words no op name starts: kept
    assert fused_ops("extern_kernel", known) == ()


def test_triton_kernel_signature_from_its_autotuner():
    from types import SimpleNamespace

    from detfp_capture._sources.wrapper_code import ArgRole, triton_kernel

    k = SimpleNamespace(
        run=lambda *a, **kw: None,
        triton_meta={"signature": {"in_ptr0": "*fp32", "in_ptr1": "*fp32", "out_ptr0": "*fp32", "xnumel": "i32", "XBLOCK": "constexpr"}},
        inductor_meta={"mutated_arg_names": ["in_ptr1"]},
    )  # fmt: skip
    sig = triton_kernel("triton_poi_fused_add_0", k, {"add"}.__contains__)
    assert sig is not None and sig.params == ("in_ptr0", "in_ptr1", "out_ptr0", "xnumel")
    assert sig.roles == (ArgRole.READ, ArgRole.READ_WRITE, ArgRole.WRITE, ArgRole.SCALAR)
    assert triton_kernel("triton_helper", SimpleNamespace(), {"add"}.__contains__) is None


def test_kernels_of_a_loaded_wrapper_are_recorded_and_restored_at_close(tmp_path, wrapper):
    """A module loaded while the session is open (through Inductor's loader): each kernel call is
    one ``kernel`` record call, inputs before, outputs after; a fresh buffer reused in place (even
    through a reinterpreted view whose base is gone) is an output only, one an extern GEMM wrote
    is an input too; closing the session puts every global back. Values as without capture."""
    x = torch.arange(4, dtype=torch.float32)
    with Session(tmp_path / "r", "ops") as s:
        mod = wrapper()
        kernel, externs, alloc = mod.cpp_fused_add_mul_0, mod.extern_kernels, mod.empty_strided_cpu
        assert getattr(kernel, "sig", None) is not None  # the probe
        with s.step(0):
            got = mod.call(x)
    assert mod.__dict__["cpp_fused_add_mul_0"] is kernel.kernel
    assert mod.extern_kernels is externs._externs and mod.empty_strided_cpu is not alloc
    want = mod.call(x)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    rows = _kernel_rows(tmp_path / "r")
    assert rows.select("occurrence", "role", "arg").rows() == [
        (0, "input", "in_ptr0"), (0, "output", "in_out_ptr0"), (0, "output", "out_ptr0"),
        (1, "input", "in_ptr0"), (1, "input", "in_out_ptr0"), (1, "output", "in_out_ptr0"), (1, "output", "out_ptr0"),
    ]  # fmt: skip
    # The in-place input is the GEMM's output as the extern call left it (the same digest).
    mul = read(tmp_path / "r").filter((pl.col("name") == "aten::mul.out") & (pl.col("role") == "output"))
    second_in = rows.filter(
        (pl.col("occurrence") == 1) & (pl.col("arg") == "in_out_ptr0") & (pl.col("role") == "input")
    )
    assert mul["digest_hi"].to_list() == second_in["digest_hi"].to_list()
    # The outputs are the values the kernel wrote (not a stale digest of the same tensor object).
    outs = rows.filter(pl.col("role") == "output")
    assert outs.filter(pl.col("occurrence") == 1)["digest_hi"].to_list() == [digest_hi(want[1]), digest_hi(want[2])]
    args = pl.read_parquet(open_run(tmp_path / "r").files("args"), hive_partitioning=False)["text"].to_list()
    assert "aten=['add','mul']; ks0=4" in args


def test_a_module_loaded_before_the_session_is_instrumented_and_unselected_steps_pass_through(tmp_path, wrapper):
    mod = wrapper()
    x = torch.arange(4, dtype=torch.float32)
    with Session(tmp_path / "r", "ops", steps="1") as s:
        for step in range(2):
            with s.step(step):
                mod.call(x)
    rows = _kernel_rows(tmp_path / "r")
    assert set(rows["step"]) == {1} and rows.height == 7


def test_kernel_probe_failure_is_an_event_and_the_kernel_still_runs(tmp_path, wrapper, monkeypatch):
    from detfp_capture._sources.inductor import CompiledKernels

    def broken(*a, **k):
        raise RuntimeError("planted probe failure")

    mod = wrapper()
    x = torch.arange(4, dtype=torch.float32)
    want = mod.call(x)
    monkeypatch.setattr(CompiledKernels, "_pre", broken)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Session(tmp_path / "r", "ops") as s, s.step(0):
            got = mod.call(x)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert sum("capture disabled" in str(w.message) for w in caught) == 1
    err = _events(tmp_path / "r").filter(pl.col("type") == "capture_error")
    assert err.height == 1 and err["detail"][0].startswith("kernel cpp_fused_add_mul_0 of compiled code: RuntimeError")


# --------------------------------------------------------------------------------------------
# One real compile (Inductor, C++ on this CPU), shared by the tests below: a GEMM (an extern
# kernel), then one fused kernel whose in-place output is a fresh buffer seen through a
# reinterpreted view.


def _f(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    h = x @ w
    return torch.nn.functional.layer_norm(torch.nn.functional.gelu(h) + b, (16,)).sum(-1)


#: The fused kernel Inductor 2.13 makes of ``_f`` (its name lists the ATen ops it fused).
_KERNEL = "cpp_fused_add_gelu_native_layer_norm_sum_0"


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """``_f`` compiled once, in Inductor's cache of this module alone (cold, whatever ran before),
    and its inputs; dynamo's state is reset afterwards."""
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    g = torch.Generator().manual_seed(0)
    inputs = (torch.randn(4, 8, generator=g), torch.randn(8, 16, generator=g), torch.randn(16, generator=g))
    torch._dynamo.reset()
    with temporary_cache_dir(str(tmp_path_factory.mktemp("inductor"))):
        fn = torch.compile(_f)
        fn(*inputs)  # compiled (and its module loaded) before any session opens
        yield fn, inputs
    torch._dynamo.reset()


def test_compiled_function_kernels_recorded_bitwise_as_uncaptured(tmp_path, compiled):
    fn, inputs = compiled
    want = fn(*inputs)
    with Session(tmp_path / "r", "ops") as s, s.step(0):
        got = fn(*inputs)
    assert torch.equal(got, want) and torch.equal(fn(*inputs), want)
    r = read(tmp_path / "r")
    assert r.filter(pl.col("kind") == "op")["name"].unique().to_list() == ["aten::mm.out"]  # the extern GEMM
    k = r.filter(pl.col("kind") == "kernel")
    assert set(k["name"]) == {_KERNEL} and (k["status"] == "ok").all()
    # The fresh buffer it reduces into is written, never read (its contents were garbage).
    assert k.filter(pl.col("role") == "input")["arg"].to_list() == ["in_ptr0", "in_ptr1"]
    assert "in_out_ptr0" in k.filter(pl.col("role") == "output")["arg"].to_list()
    assert k.filter(pl.col("arg") == "in_out_ptr0")["digest_hi"].to_list() == [digest_hi(want)]


def test_repeat_check_names_the_compiled_kernel_that_differs(tmp_path, compiled):
    """A compiled function repeats bitwise; a kernel whose result differs from call to call (as
    float atomics do on a GPU; here one ULP added on every other call) is named, with the ATen
    ops it fused."""
    from torch._inductor.codecache import PyCodeCache

    from detfp_guards import repeat_check

    fn, inputs = compiled
    assert repeat_check(fn, *inputs, runs=2, backward=False).ok
    mod = next(m for m in PyCodeCache.modules if _KERNEL in m.__dict__)
    kernel = mod.__dict__[_KERNEL]
    calls = [0]

    def racy(*args):
        kernel(*args)
        calls[0] += 1
        if calls[0] % 2 == 0:
            with _disable_current_modes():  # written as a kernel writes: no op the dispatcher sees
                args[0].numpy().view("int32")[0] += 1  # in_out_ptr0: the sums

    mod.__dict__[_KERNEL] = racy
    try:
        res = repeat_check(fn, *inputs, runs=2, backward=False, detail=False)
    finally:
        mod.__dict__[_KERNEL] = kernel
    d = res.divergence
    assert not res.ok and (d.kind, d.op, d.role, d.arg) == ("kernel", _KERNEL, "output", "in_out_ptr0")
    assert d.fused == ("add", "gelu", "native_layer_norm", "sum")
    assert f"kernel {_KERNEL} (torch.compile, fusing aten add, gelu, native_layer_norm, sum)" in res.report


def test_an_output_filled_in_part_is_flagged_not_digested(tmp_path):
    """An op that fills part of a fresh buffer and returns the whole (FSDP2's all-gather copy-in
    fills this rank's slot of the buffer the all-gather fills next) holds garbage in the rest,
    which differs between processes: its output record is flagged ``uninitialized`` and not
    digested. (A compiled FSDP2 job, with another allocation history in each run, showed it as a
    difference of an identical pair.) What an op computes from garbage stays digested."""
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives  # noqa: F401  (defines fsdp::all_gather_copy_in)

    with Session(tmp_path / "r", "ops") as s, s.step(0):
        buf = torch.empty(8)
        _, whole = torch.ops.fsdp.all_gather_copy_in([torch.ones(2), torch.ones(2)], buf, [2, 2], 4, 1)
        y = torch.empty(4).add_(1)  # computed from garbage
    assert torch.equal(whole[4:], torch.ones(4)) and y.shape == (4,)
    r = read(tmp_path / "r").filter(pl.col("role") == "output")
    part = r.filter((pl.col("name") == "fsdp::all_gather_copy_in.default") & (pl.col("arg") == "out[1]")).row(0, named=True)
    assert part["hazards"] == ["uninitialized"] and part["status"] == "skipped" and part["digest_hi"] is None
    tainted = r.filter(pl.col("name") == "aten::add_.Tensor").row(0, named=True)
    assert tainted["hazards"] == ["uninitialized"] and tainted["status"] == "ok"


@pytest.mark.parametrize("level", ["boundaries", "ops"])
def test_selected_and_unselected_steps_share_one_compiled_graph(tmp_path, level):
    """Dynamo traces the module hooks of a compiled module's submodules into its graph, and
    guards on whatever they read: hooks that read capture's state (a step selected or not)
    before seeing that dynamo traces made every change of selection a recompile (and, past
    dynamo's limit, the module eager: other kernels than the uncaptured run's)."""
    compiles = [0]

    def counting(gm, example_inputs):
        compiles[0] += 1
        return gm.forward

    torch._dynamo.reset()
    torch.manual_seed(0)
    inner = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.compile(inner, backend=counting))
    with Session(tmp_path / "r", level, steps=[1, 3]) as s:
        s.watch(model)
        for step in range(4):
            with s.step(step):
                model(torch.randn(4, 8)).square().mean().backward()
    torch._dynamo.reset()
    assert compiles[0] == 1
    r = read(tmp_path / "r")
    assert set(r["step"]) == {1, 3} and "compiled" in set(r["kind"])


def test_the_report_names_a_compiled_kernel_with_its_fused_ops():
    """A first divergence at a ``kernel`` record: the headline names the kernel, its fused ATen ops
    and its compiled region; on every rank the compiled kernel is the suspect, on one rank also
    how it was compiled there; the next step is comparing its compilation, not a deeper level."""
    from detfp_analyze.bisect.cause import Clues, weigh
    from detfp_analyze.bisect.diagnose import diagnose
    from detfp_analyze.bisect.result import Divergence, RankResult

    def div(**kw) -> Divergence:
        base = dict(step=0, microbatch=-1, phase="backward", module="vit.layers.0.mlp", kind="kernel",
                    op="cpp_fused_gelu_gelu_backward_sum_0", occurrence=0, role="output", arg="in_out_ptr0",
                    presence="both", verdict="origin", diff_kind="values", hazards=(), seq_a=5, seq_b=5,
                    fused=("gelu", "gelu_backward", "sum"))  # fmt: skip
        return Divergence(**{**base, **kw})

    def advice(*firsts):
        rs = tuple(
            RankResult(r, "diverged", 0, record_step=0, first=d) if d else RankResult(r, "identical", None)
            for r, d in enumerate(firsts)
        )
        return weigh(diagnose(rs, {}), rs, Clues(), "diverged", None)

    named = "kernel cpp_fused_gelu_gelu_backward_sum_0 (torch.compile, fusing aten gelu, gelu_backward, sum) in vit.layers.0.mlp (backward, step 0)"
    every = advice(div(), div())
    assert every.cause == "op" and every.headline.startswith(f"{named} is the first difference on every rank")
    assert "the compiled kernel is nondeterministic" in every.headline
    assert any("TORCH_LOGS=output_code" in s for s in every.next_steps)
    one = advice(None, div())
    assert one.cause == "rank_local" and one.headline.startswith(f"Only rank 1 starts the difference, at {named}")
    assert "or how that kernel was compiled there" in one.headline
