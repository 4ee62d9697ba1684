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
from pathlib import Path

import polars as pl
import pytest

from detfp_analyze.io.reader import open_run
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
