"""Shared pytest configuration: torch's CPU thread count fixed so results are stable, and
fixtures used by several test modules."""

from __future__ import annotations

import os

import pytest

# Reductions and matmuls on CPU change with the thread count; fix it for every test process
# (and the subprocesses they spawn, which inherit the environment).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")


#: Test files that start a Spark JVM (``tests/integration/conftest.py``'s session fixture).
SPARK_FILES = "tests/integration/test_spark_*.py"
#: The longest units of work of the default suite, longest first (a full run at load ~6: zoo 305 s,
#: Spark 267 s, example 119 s, zoo launcher 92 s, SQL equivalence 88 s, Megatron-Core zoo 57 s,
#: faults 55 s, the parallel zoo 50 s at load 13 (30 s at load 2), torch pipelining zoo 44 s, the
#: low-precision zoo 38 s alone at load ~2, diagnosis about 30 s at load 2 (29 CPU s);
#: the next is 43 s). The compiled zoo (every compile tens of seconds): 680 s at load 10-13.
LONGEST = (
    "tests/integration/test_zoo.py",
    "tests/integration/test_zoo_compiled.py",
    SPARK_FILES,
    "tests/integration/test_example.py",
    "tests/integration/test_zoo_launcher.py",
    "tests/integration/test_zoo_lightning.py",
    "tests/golden/test_sql_bisect_equivalence.py",
    "tests/integration/test_zoo_mcore.py",
    "tests/integration/test_faults.py",
    "tests/integration/test_record_native_asan.py",  # 55 s at load ~3: a sanitizer build, then its tests
    "tests/integration/test_zoo_parallel.py",
    "tests/integration/test_zoo_pipelining.py",
    "tests/integration/test_zoo_lowp.py",
    "tests/integration/test_diagnosis.py",
)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under ``--dist loadfile``: the Spark test files are one unit of work (each xdist worker that
    runs one starts a JVM of its own, 36-70 s on the shared 2-core machine: one worker runs them
    all and starts one), every other file its own; and the ``LONGEST`` units go out first (xdist
    hands out files by number of tests, so a long file with few tests started late and ran on
    alone at the end)."""
    if config.getoption("dist") != "loadfile":
        return None
    from fnmatch import fnmatch

    from xdist.scheduler import LoadFileScheduling

    rank = {scope: i for i, scope in enumerate(LONGEST)}

    class OneJvmLongestFirst(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            scope = super()._split_scope(nodeid)
            return SPARK_FILES if fnmatch(scope, SPARK_FILES) else scope

        def _assign_work_unit(self, node) -> None:
            # The parent hands out the queue's first unit: put the longest one waiting there.
            if self.workqueue:
                first = min(self.workqueue, key=lambda scope: rank.get(scope, len(rank)))
                self.workqueue.move_to_end(first, last=False)
            super()._assign_work_unit(node)

    return OneJvmLongestFirst(config, log)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A test marked ``native`` (``tests/native_half.py``: ``needs``) skips without its extension,
    or fails where ``DETFP_REQUIRE_NATIVE=1`` and a compiler could have built it."""
    mark = item.get_closest_marker("native")
    if mark is not None:
        from tests import native_half

        native_half.check(mark.kwargs["available"], mark.kwargs["what"])


@pytest.fixture
def gloo1(tmp_path):
    """A one-rank gloo process group in this process (collectives without spawning)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="session")
def layout_pair(tmp_path_factory):
    """A synthetic 48-rank pair (tp 2 x dp 6 x pp 4) with one origin on rank 29 at step 1 that the
    gradient all-reduce carries to every other rank: the pair the picture, report and timeline
    tests read from disk (built once per session)."""
    from detfp_analyze.testing.synth import Plant, SynthSpec, write_pair

    root = tmp_path_factory.mktemp("layout_pair")
    spec = SynthSpec(ranks=48, steps=3, records=150, windows="run", layout=(("tp", 2), ("dp", 6), ("pp", 4)))
    return write_pair(root / "a", root / "b", spec, Plant(rank=29, step=1, index=20))


@pytest.fixture(scope="session")
def layout_twin(layout_pair, tmp_path_factory):
    """A copy of the layout pair's run A: the identical run to compare it with (a run is never
    compared with itself: the same directory twice is refused)."""
    import shutil

    return shutil.copytree(layout_pair.a, tmp_path_factory.mktemp("layout_twin") / "a")


@pytest.fixture(scope="session")
def report_page(layout_pair, tmp_path_factory):
    """``bisect --html`` of the layout pair as the command line writes it, in a process of its own
    with a fixed hash seed (tests render pages and pictures again in this process, under another
    seed, and compare bytes)."""
    import subprocess
    import sys

    out = tmp_path_factory.mktemp("html") / "report.html"
    cmd = [sys.executable, "-m", "detfp_analyze", "bisect", str(layout_pair.a), str(layout_pair.b), "--html", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONHASHSEED": "7"})
    assert res.returncode == 1, res.stderr  # diverged
    assert res.stderr == f"detfp-analyze: wrote {out}\n"
    assert res.stdout.startswith(f"A = {layout_pair.a}\n")  # stdout is still the text report
    return out


@pytest.fixture(scope="session")
def planted_pairs(tmp_path_factory):
    """One synthetic pair per plant of the golden equivalence test (its ``PLANTS`` and
    ``"identical"``, ``tests.fixtures.pairs.write_planted``), written once per test session: the
    SQL and the Spark equivalence tests read the same pairs (each wrote its own before). Under
    xdist a worker that finds another worker's finished set (its index, pickled next to the
    workers' directories, published by an atomic rename) reads that one instead of writing its
    own; the synthetic runs are a function of the spec and the plant, so either set is the same."""
    import pickle

    from tests.fixtures.pairs import PLANTS, SPEC, write_planted

    worker = os.environ.get("PYTEST_XDIST_WORKER")
    # The session's directory holds every worker's own (popen-gwN); without xdist, nothing to share.
    index = tmp_path_factory.getbasetemp().parent / "planted_pairs.pickle" if worker else None
    if index is not None and index.exists():
        return pickle.loads(index.read_bytes())
    planted = write_planted(tmp_path_factory.mktemp("planted"), SPEC, PLANTS)
    if index is not None:
        part = index.with_name(f"{index.name}.{worker}")
        part.write_bytes(pickle.dumps(planted))
        os.replace(part, index)
    return planted
