"""The pytest plugin, run by pytester: the detfp_repeat fixture, its assertion, the marker, trace
directories (tmp_path, --detfp-traces per xdist worker) and the entry point in a fresh process."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import tests.fixtures.planted  # inline runs find the planted custom ops already registered

pytest_plugins = ("pytester",)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", autouse=True)
def _capture_imported():
    tests.fixtures.planted.warm_capture()


_INNER = """
import pytest
import torch
from tests.fixtures.planted import PermutedSum

SEEN = []


@pytest.fixture
def trained():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.5)


def test_fixture_passes(detfp_repeat):
    torch.manual_seed(0)
    res = detfp_repeat.assert_bitwise_reproducible(torch.nn.Linear(4, 4), torch.randn(2, 4))
    assert res.ok and res.traces is None


def test_fixture_fails_with_the_report(detfp_repeat):
    torch.manual_seed(0)
    detfp_repeat.assert_bitwise_reproducible(PermutedSum(8), torch.randn(2, 8), detail=False)


@pytest.mark.detfp_repeat(runs=3)
def test_marker_passes_and_restores_fixture_state(trained):
    model, opt = trained
    SEEN.append(model.weight.detach().clone())
    torch.nn.functional.dropout(model(torch.ones(3, 4)), 0.5).sum().backward()
    opt.step()


def test_marker_started_every_run_from_the_same_state():
    assert len(SEEN) == 3 and all(torch.equal(SEEN[0], s) for s in SEEN)


@pytest.fixture
def planted():
    torch.manual_seed(0)
    return PermutedSum(8)


@pytest.mark.detfp_repeat(runs=3, detail=False)
def test_marker_fails(planted):
    planted(torch.ones(2, 8)).sum().backward()


@pytest.mark.detfp_repeat(run=5)
def test_marker_option_typo():
    pass
"""


def test_fixture_assertion_and_marker(pytester):
    pytester.makepyfile(test_inner=_INNER)
    result = pytester.runpytest("-p", "no:randomly", "-p", "no:cacheprovider", "--strict-markers")
    result.assert_outcomes(passed=3, failed=3)
    out = result.stdout.str()
    result.stdout.fnmatch_lines(["plugins: *detfp-0*"])  # loaded from the pytest11 entry point
    # The failure message is the repeat check's report: op, verdict, difference, the command to investigate.
    for line in (
        # Which later run differs first depends on the planted op's call counter, shared with the
        # tests this worker ran before (the inner session runs in-process): run 1 or run 2.
        "*NOT bitwise reproducible: run [12] differs from run 0 (level ops)*",
        "*first difference: forward <root> op:detfp_planted::permuted_sum.default output out -- origin, values*",
        "*investigate: detfp-analyze bisect *detfp/check-1/run-0 *detfp/check-1/run-[12]*",
        "*cause: detfp_planted::permuted_sum.default in <root> (forward, step 0) is the first call whose output differs*",
        "*@pytest.mark.detfp_repeat: unknown option(s) run; use *runs*",
    ):
        result.stdout.fnmatch_lines([line])
    assert "test_marker_fails" in out and "detfp/repeat/run-0" in out
    # Traces of failing checks stay under the test's tmp_path; passing ones are removed.
    run0 = Path(re.search(r"investigate: detfp-analyze bisect (\S+/check-1/run-0) ", out).group(1))
    assert run0.is_dir() and run0.parent.parent.name == "detfp"
    base = run0.parents[3]  # pytest's basetemp of the inner session
    kept = sorted(str(p.relative_to(base)) for p in base.glob("*/detfp/*/run-0") if not p.parts[-4].endswith("current"))
    assert kept == ["test_fixture_fails_with_the_re0/detfp/check-1/run-0", "test_marker_fails0/detfp/repeat/run-0"]


_WORKER_TESTS = """
import torch
from tests.fixtures.planted import PermutedSum

def test_a(detfp_repeat):
    detfp_repeat(torch.nn.Linear(2, 2), torch.ones(1, 2), runs=2, level="boundaries")

def test_b(detfp_repeat):
    detfp_repeat(torch.nn.Linear(2, 2), torch.ones(1, 2), runs=2, level="boundaries")

def test_c(detfp_repeat):
    torch.manual_seed(0)
    detfp_repeat.assert_bitwise_reproducible(PermutedSum(64), torch.randn(4, 64), runs=2, level="boundaries")
"""


def _check_worker_dirs(traces: Path, workers: set[str]) -> None:
    runs = sorted(traces.glob("*/*/check-1/run-0"))
    assert {p.relative_to(traces).parts[0] for p in runs} <= workers and runs
    assert {p.relative_to(traces).parts[1] for p in runs} == {
        "test_x.py_test_a",
        "test_x.py_test_b",
        "test_x.py_test_c",
    }


def test_traces_dir_per_worker(pytester, monkeypatch):
    # What an xdist worker sees (PYTEST_XDIST_WORKER); the real multi-process run is the slow test below.
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    pytester.makepyfile(test_x=_WORKER_TESTS)
    traces = pytester.path / "traces"
    result = pytester.runpytest("-p", "no:randomly", "--detfp-traces", str(traces), "--detfp-keep", "all")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines([f"detfp: repeat-check traces under {traces} (keep all)"])
    _check_worker_dirs(traces, {"gw1"})


@pytest.mark.slow
def test_entry_point_and_real_xdist_workers(pytester, monkeypatch):
    pytest.importorskip("xdist")  # a dev dependency (requirements-dev.txt)
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    pytester.makepyfile(test_x=_WORKER_TESTS)
    traces = pytester.path / "traces"
    # A fresh interpreter: the plugin comes from the pytest11 entry point, nothing names it.
    result = pytester.runpytest_subprocess(
        "-n", "2", "-p", "no:randomly", "--detfp-traces", str(traces), "--detfp-keep", "all", timeout=240
    )
    result.assert_outcomes(passed=2, failed=1)
    _check_worker_dirs(traces, {"gw0", "gw1"})
