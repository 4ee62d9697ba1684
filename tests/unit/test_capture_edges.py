"""Capture API edges a new user hits: metrics and probes outside a step, re-running into a directory,
a second thread."""

from __future__ import annotations

import threading
import warnings

import polars as pl
import pytest
import torch

from detfp_analyze.io.reader import open_run
from detfp_capture import Session
from detfp_capture._launch.cli import main as launcher_main
from detfp_capture.errors import ConfigError, RunExistsError
from detfp_format.writer import clear_rank
from tests.fixtures.models import read


def _caught(fn) -> list[str]:
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        fn()
    return [str(w.message) for w in got if issubclass(w.category, RuntimeWarning)]


def test_probe_and_metric_outside_a_step_say_where_they_went(tmp_path):
    t = torch.arange(4.0)
    with Session(tmp_path / "r", "boundaries") as s:
        before = _caught(lambda: (s.probe("early", t), s.metric("early_loss", 1.0)))
        with s.step(3):
            inside = _caught(lambda: (s.probe("inside", t), s.metric("loss", 2.0)))
        after = _caught(lambda: (s.probe("late", t), s.probe("late", t), s.metric("late_loss", 3.0)))
    assert inside == []
    assert before == [
        "detfp: probe 'early' on rank 0 was made outside session.step(): not recorded: no step has begun yet; "
        "make it inside 'with session.step(n):' to file it under step n",
        "detfp: metric 'early_loss' on rank 0 was made outside session.step(): not recorded: no step has begun "
        "yet; make it inside 'with session.step(n):' to file it under step n",
    ]
    # Once per name, and it says the step it was filed under.
    assert len(after) == 2
    assert "probe 'late' on rank 0 was made outside session.step(): filed under step 3, the last step" in after[0]
    assert "metric 'late_loss'" in after[1] and "filed under step 3" in after[1]
    run = open_run(tmp_path / "r")
    probes = run.scan("records").filter(pl.col("kind") == "probe").collect()
    assert sorted(set(probes["name"])) == ["inside", "late"]
    assert set(probes.filter(pl.col("name") == "late")["step"]) == {3}
    metrics = run.scan("metrics").collect()
    assert sorted(metrics["name"]) == ["late_loss", "loss"] and set(metrics["step"]) == {3}


def test_outside_an_uncaptured_step_is_not_recorded_and_says_so(tmp_path):
    with Session(tmp_path / "r", "metrics", steps="0") as s:
        with s.step(0):
            s.metric("loss", 1.0)
        with s.step(1):
            pass
        got = _caught(lambda: s.metric("loss", 2.0))
    assert len(got) == 1 and "not recorded: the last step (1) is not captured" in got[0]
    assert open_run(tmp_path / "r").scan("metrics").collect()["value"].to_list() == [1.0]


def _run(path, value: float) -> None:
    with Session(path, "metrics", overwrite=True) as s, s.step(0):
        s.metric("loss", value)


def test_overwrite_replaces_an_earlier_run(tmp_path):
    out = tmp_path / "r"
    with Session(out, "metrics") as s, s.step(0):
        s.metric("loss", 1.0)
    with pytest.raises(RunExistsError, match="overwrite=True"):
        Session(out, "metrics")
    _run(out, 2.0)
    run = open_run(out)
    assert run.segments(0) == (0,)
    assert run.scan("metrics").collect()["value"].to_list() == [2.0]


def test_overwrite_refuses_a_directory_that_is_not_a_run(tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "thesis.tex").write_text("keep me")
    with pytest.raises(RunExistsError, match=r"is not a detfp run directory .* refusing to overwrite it"):
        Session(out, "metrics", overwrite=True)
    assert (out / "thesis.tex").read_text() == "keep me"
    with pytest.raises(ConfigError, match="contradict"):
        Session(tmp_path / "x", "metrics", overwrite=True, append=True)


def test_clear_rank_deletes_only_its_own_partitions_and_stale_ranks(tmp_path):
    for r in (0, 1, 5):
        (tmp_path / "manifest" / f"rank={r}").mkdir(parents=True)
        (tmp_path / "records" / f"rank={r}").mkdir(parents=True)
    clear_rank(tmp_path, 1, world_size=4)
    assert sorted(p.name for p in (tmp_path / "records").iterdir()) == ["rank=0", "rank=5"]
    clear_rank(tmp_path, 0, world_size=4)  # rank 0 also removes ranks beyond the world size
    assert sorted(p.name for p in (tmp_path / "manifest").iterdir()) == []


def test_launcher_overwrite_flag(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    out = tmp_path / "r"
    assert launcher_main(["--out", str(out), "--", str(script)]) == 0
    assert launcher_main(["--out", str(out), "--", str(script)]) == 2  # create-only by default
    assert launcher_main(["--out", str(out), "--overwrite", "--", str(script)]) == 0
    assert open_run(out).segments(0) == (0,)


def test_ops_on_another_thread_are_not_recorded_but_its_watched_modules_are(tmp_path):
    # docs/capture.md, Limitations: the dispatch mode is the session thread's; module hooks fire
    # on whichever thread calls the module.
    m = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    with Session(tmp_path / "r", "ops") as s:
        s.watch(m)
        with s.step(0):
            m(x)
            th = threading.Thread(target=lambda: (m(x), torch.relu(x)))
            th.start()
            th.join()
    r = read(tmp_path / "r").filter(pl.col("step") == 0)
    calls = r.filter(pl.col("role") != "input").group_by("kind", "name").agg(pl.len())
    count = {(k, n): c for k, n, c in calls.iter_rows()}
    assert count[("module_output", "Linear")] == 2  # both calls of the module
    assert count[("op", "aten::addmm.default")] == 1  # only the session thread's op
    assert ("op", "aten::relu.default") not in count
