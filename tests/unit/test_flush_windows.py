"""Where a flush window ends is a function of the job, never of the machine's speed.

A trace's windows (its shard files, the commit lines, the rollups' rows of a block a window
boundary cuts, the seq of events a flush adds) used to depend on a clock: a step end flushed
once the window was 20 s old, so the same job captured on a loaded machine wrote other windows
(the capture-route test saw 28 rollups rows on one route, 27 on the other). Here the same fixed
capture runs with the real clock and with a clock that jumps 30 s at every reading (what a
machine at load 50 looks like to the capture): every file and every row must be equal.
"""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import pytest

from detfp_capture import Session
from detfp_capture._config import FLUSH_STEPS
from detfp_capture.errors import ConfigError
from tests.fixtures.models import train
from tests.golden.test_capture_records import MICROBATCHES, _hash, _tables

STEPS = 4


def _capture(run: Path, **options) -> dict:
    """Every file of a fixed boundaries-level capture (several windows, cut mid-step by
    ``flush_records``), and each table's rows in seq order, hashed per column."""
    with Session(str(run), level="boundaries", flush_records=60, **options) as s:
        train(s, steps=STEPS, microbatches=MICROBATCHES)
    files = sorted(str(p.relative_to(run)) for p in run.rglob("*.parquet"))
    logs = {
        str(p.relative_to(run)): [line.split(b" ", 1)[1] for line in p.read_bytes().splitlines()]
        for p in sorted(run.rglob("*.commits"))
    }
    tables = {name: {c: _hash(t.column(c).to_pylist()) for c in t.column_names} for name, t in _tables(run).items()}
    return {"files": files, "commit_lines": logs, "tables": tables}


def test_a_clock_that_runs_fast_moves_no_window(tmp_path, monkeypatch):
    want = _capture(tmp_path / "real")
    assert len(want["files"]) > 2 * 4, "the fixture must write several windows"
    ticks = itertools.count(time.monotonic(), 30.0)
    for name in ("monotonic", "time", "perf_counter"):
        monkeypatch.setattr(time, name, lambda: next(ticks))
    got = _capture(tmp_path / "slow")
    monkeypatch.undo()
    assert got["files"] == want["files"]
    assert got["commit_lines"] == want["commit_lines"]
    assert got["tables"] == want["tables"]


@pytest.mark.parametrize("flush_steps", [1, 3])
def test_flush_steps_commits_a_window_every_n_steps(tmp_path, flush_steps):
    run = tmp_path / "r"
    with Session(str(run), level="metrics", flush_steps=flush_steps) as s:
        for step in range(7):
            with s.step(step):
                s.metric("loss", float(step))
    names = sorted(p.name for p in (run / "metrics" / "rank=0").iterdir())
    # 7 steps: a window per flush_steps step ends, the rest at close.
    assert len(names) == -(-7 // flush_steps)


def test_flush_steps_default_and_bad_values(tmp_path):
    assert FLUSH_STEPS == 50
    for bad in (0, -1, True, 2.5, "3"):
        with pytest.raises(ConfigError, match="flush_steps="):
            Session(str(tmp_path / "r"), level="metrics", flush_steps=bad)
