"""The test command's scheduling (``tests/conftest.py``): under ``--dist loadfile`` the files that
start a Spark JVM are one unit of work, so one xdist worker runs them all and starts one JVM, and
the longest units are handed out first."""

from __future__ import annotations

import re
from collections import OrderedDict
from fnmatch import fnmatch
from pathlib import Path

from tests.conftest import LONGEST, SPARK_FILES, pytest_xdist_make_scheduler

TESTS = Path(__file__).resolve().parents[1]


def _scheduler(pytestconfig, monkeypatch, dist: str):
    monkeypatch.setattr(pytestconfig.option, "dist", dist)
    monkeypatch.setattr(pytestconfig.option, "tx", ["2*popen"], raising=False)  # what -n 2 sets
    return pytest_xdist_make_scheduler(pytestconfig, None)


def _scope(pytestconfig, monkeypatch, dist: str):
    sched = _scheduler(pytestconfig, monkeypatch, dist)
    return None if sched is None else sched._split_scope


def test_the_spark_files_are_one_unit_and_every_other_file_its_own(pytestconfig, monkeypatch):
    scope = _scope(pytestconfig, monkeypatch, "loadfile")
    engine = scope("tests/integration/test_spark_engine.py::test_x[a:b]")
    assert engine == scope("tests/integration/test_spark_views.py::test_y")
    assert scope("tests/integration/test_s3_runs.py::test_z") == "tests/integration/test_s3_runs.py"
    assert scope("tests/unit/test_spark_dialect.py::test_w") == "tests/unit/test_spark_dialect.py"  # no JVM
    assert engine not in ("tests/integration/test_s3_runs.py", "tests/unit/test_spark_dialect.py")
    assert _scope(pytestconfig, monkeypatch, "load") is None  # other modes: xdist's own scheduler


def test_every_file_that_starts_spark_is_in_the_unit():
    """A test asking for the ``spark`` fixture in a file outside ``SPARK_FILES`` would start a
    second JVM on another worker."""
    uses = {
        p.relative_to(TESTS.parent).as_posix()
        for p in TESTS.rglob("test_*.py")
        if re.search(r"def test_\w+\(\s*spark\b", p.read_text())
    }
    assert uses and all(fnmatch(f, SPARK_FILES) for f in uses), sorted(uses)


def test_the_longest_units_go_out_first_the_rest_in_xdists_order(pytestconfig, monkeypatch):
    sched = _scheduler(pytestconfig, monkeypatch, "loadfile")

    class Node:
        def send_runtest_some(self, indexes):
            pass

    # xdist's queue: most tests first; the zoo (few tests, the longest) last.
    units = ["tests/unit/test_many.py", LONGEST[2], "tests/unit/test_some.py", LONGEST[1], LONGEST[0]]
    node = Node()
    sched.registered_collections[node] = [f"{u}::t" for u in units]
    sched.workqueue = OrderedDict((u, {f"{u}::t": False}) for u in units)
    for _ in units:
        sched._assign_work_unit(node)
    assert list(sched.assigned_work[node]) == [*LONGEST[:3], "tests/unit/test_many.py", "tests/unit/test_some.py"]
