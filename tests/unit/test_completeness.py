"""The completeness contract: commit logs against the files on disk, refusal, --allow-incomplete.

Runs are written by the real writer (tests/fixtures/shards.py: one flush window per step, so window w
holds step w), then damaged the ways a killed writer or a partial copy damages them. Every
damage must be refused with one line naming rank, table and window (exit 2), be listed by
certify under its kind, and with --allow-incomplete be left out of the comparison, never
reported as a difference between the runs.
"""

from __future__ import annotations

import json
import shutil
import zlib
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from detfp_analyze.bisect import bisect
from detfp_analyze.cli import app
from detfp_analyze.errors import IncomparableError, IncompleteRunError, ManifestError, SchemaVersionError
from detfp_analyze.io.reader import open_run
from detfp_analyze.single.certify import certify
from detfp_analyze.single.summary import summarize, summary_dict
from detfp_format import commitlog
from detfp_format.writer import ShardWriter, write_manifest
from tests.fixtures.shards import default_manifest, hexdigest, write_run

STEPS = range(4)


def _rank(rank: int, planted: dict | None = None) -> dict:
    """Rank ``rank``'s tables over STEPS: three records, a loss and step events per step."""
    planted = planted or {}
    records, metrics, events = [], [], []
    for s in STEPS:
        events.append(dict(step=s, type="step_begin"))
        for name in ("aten::mm.default", "aten::add.Tensor", "aten::relu.default"):
            records.append(dict(step=s, name=name, digest=planted.get((s, name), hexdigest((rank, s, name)))))
        metrics.append(dict(step=s, value=float(s)))
        events.append(dict(step=s, type="step_end"))
    return {"records": records, "metrics": metrics, "events": events}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``runs(path, planted=None, **write_run_kw)``: a complete 2-rank run at ``path``; ``planted``:
    {(step, op name): digest} on rank 1. Plain runs are written once and copied (the writer is
    the slow part)."""
    clean: dict[tuple, Path] = {}

    def make(path, planted=None, **kw):
        if planted:
            return write_run(path, {0: _rank(0), 1: _rank(1, planted)}, **kw)
        key = tuple(sorted(kw.items()))
        if key not in clean:
            clean[key] = write_run(tmp_path_factory.mktemp("clean") / "run", {0: _rank(0), 1: _rank(1)}, **kw)
        shutil.copytree(clean[key], path)
        return Path(path)

    return make


def _log(run, rank=1, segment=0):
    return run / commitlog.commit_log_relpath(rank, segment)


def _cut_close(run, rank=1):
    """Drop the close line: the launch looks killed after its last committed window."""
    log = _log(run, rank)
    lines = log.read_bytes().splitlines(keepends=True)
    assert b'"t":"close"' in lines[-1]
    log.write_bytes(b"".join(lines[:-1]))


def _cli(*args):
    r = CliRunner().invoke(app, [str(a) for a in args])
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception
    return r


def _one_line_error(r) -> str:
    assert r.exit_code == 2, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("detfp-analyze: "), r.output
    return lines[0]


# ---------------------------------------------------------------------------- the contract
def test_a_clean_run_is_complete_and_its_log_says_why(tmp_path, runs):
    a = runs(tmp_path / "a")
    lines = [commitlog._decode(line) for line in _log(a).read_bytes().splitlines()]
    assert lines[0] == {"t": "open", "version": 1, "rank": 1, "segment": 0}
    facts = lines[1].pop("shards")  # each shard's size, steps and footer checksum (commitlog.ShardFact)
    assert lines[1] == {"t": "window", "window": 0, "rows": {"events": 2, "metrics": 1, "records": 3}, "steps": [0, 0]}
    for table, (size, lo, hi, crc) in facts.items():
        data = (a / table / "rank=1" / "part-s00000-w0000000.parquet").read_bytes()
        assert (size, lo, hi) == (len(data), 0, 0)
        assert crc == zlib.crc32(data[-8 - int.from_bytes(data[-8:-4], "little") :])
    assert lines[-1] == {"t": "close", "windows": 4, "status": "ok", "reason": None}
    r = open_run(a)
    assert r.completeness.complete and r.excluded == {}
    assert {(s.status, s.windows, s.closed) for s in r.completeness.segments} == {("complete", 4, True)}
    assert summary_dict(summarize(r))["completeness"] == {"0-1": "complete"}
    res = bisect(r, open_run(runs(tmp_path / "b")))
    assert res.status == "identical" and res.complete and res.to_json_dict()["complete"] is True


def test_a_second_launch_of_the_same_segment_is_refused_atomically(tmp_path):
    from detfp_format.errors import RunExistsError

    w = ShardWriter(tmp_path, 0, 0)
    with pytest.raises(RunExistsError, match="rank 0 segment 0 is already being written by another launch"):
        ShardWriter(tmp_path, 0, 0)
    w.close()


def _missing_shard(run):
    (run / "records" / "rank=1" / "part-s00000-w0000002.parquet").unlink()


def _row_mismatch(run):
    p = run / "metrics" / "rank=1" / "part-s00000-w0000002.parquet"
    t = pq.read_table(p)
    pq.write_table(t.slice(0, 0), p)  # a shard with the right schema and the wrong number of rows


def _uncommitted(run):
    d = run / "records" / "rank=1"
    shutil.copy(d / "part-s00000-w0000002.parquet", d / "part-s00000-w0000009.parquet")


def _damaged_line(run):
    log = _log(run)
    lines = log.read_bytes().splitlines(keepends=True)
    lines[3] = lines[3].replace(b'"window":2', b'"window":7')  # the checksum no longer matches
    log.write_bytes(b"".join(lines))


def _missing_log(run):
    m = run / "manifest" / "rank=1" / "segment-00000.json"
    doc = json.loads(m.read_text())
    doc["commit_log"] = 1
    m.write_text(json.dumps(doc))
    _log(run).unlink()


# damage -> (gap kinds certify reports, words the refusal must hold, first step left out on rank 1)
DAMAGES = {
    "missing_shard": (_missing_shard, {"missing_shard"}, "records window 2 was committed with 3 row(s) but its shard is missing", 2),
    "row_mismatch": (_row_mismatch, {"row_mismatch"}, "metrics window 2 holds 0 row(s), its commit says 1", 2),
    "uncommitted": (_uncommitted, {"uncommitted_window"}, "records window 9 was written but never committed", 2),
    "not_closed": (_cut_close, {"not_closed"}, "the capture never closed (windows 0-3 committed", 3),
    "damaged_line": (_damaged_line, {"damaged_commit_log", "uncommitted_window"}, "line(s) of segment-00000.commits cannot be read", 2),
    "missing_log": (_missing_log, {"missing_commit_log"}, "the manifest promises a commit log but segment-00000.commits is missing", 0),
}  # fmt: skip


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_each_damage_is_refused_reported_and_left_out(tmp_path, damage, runs):
    fn, kinds, words, first = DAMAGES[damage]
    a, b = runs(tmp_path / "a"), runs(tmp_path / "b")
    fn(b)
    with pytest.raises(IncompleteRunError) as err:
        open_run(b)
    msg = str(err.value)
    assert "\n" not in msg and "rank 1 segment 0" in msg and words in msg and "--allow-incomplete" in msg
    line = _one_line_error(_cli("bisect", a, b))
    assert words in line
    for cmd in (["env", a, b], ["sql", a, b, "SELECT count(*) FROM pairs"]):
        assert words in _one_line_error(_cli(*cmd))
    # certify names each gap by kind (exit 1: problems), summary says rank 1 is incomplete
    res = certify(b, checks=["completeness"])
    assert {p.kind for p in res.problems} == kinds and {p.rank for p in res.problems} == {1}
    assert _cli("certify", b).exit_code == 1
    assert summary_dict(summarize(open_run(b, allow_incomplete=True)))["completeness"]["1"].startswith("incomplete: ")
    # --allow-incomplete: only the steps both runs hold completely are compared
    r = _cli("bisect", a, b, "--allow-incomplete", "--json")
    assert r.exit_code == 0, r.output  # never a difference between the runs
    report = json.loads(r.output)
    assert report["status"] == "identical" and report["complete"] is False
    assert any(n.startswith(f"B ({b}) incomplete: rank 1 segment 0") for n in report["notes"])
    rb = open_run(b, allow_incomplete=True)
    assert rb.excluded[1][0][0] == first
    held = rb.scan("records", ranks=[1]).select("step").collect()["step"].unique().sort().to_list()
    assert held == [s for s in STEPS if s < first or (rb.excluded[1][0][1] is not None and s > rb.excluded[1][0][1])]


def test_allow_incomplete_compares_complete_steps_and_still_finds_a_real_difference(tmp_path, runs):
    a = runs(tmp_path / "a")
    late = runs(tmp_path / "late", planted={(3, "aten::add.Tensor"): hexdigest("x")})
    early = runs(tmp_path / "early", planted={(1, "aten::add.Tensor"): hexdigest("x")})
    for b in (late, early):
        _cut_close(b)  # rank 1 killed during step 3: steps 3- are not held completely
    # A difference inside the incomplete steps is not a finding, and not "identical" either: the run
    # ended early (status ended_early unless the comparison allows it too), and complete is false.
    res = bisect(open_run(a), open_run(late, allow_incomplete=True))
    assert (res.status, res.complete) == ("ended_early", False)
    res = bisect(open_run(a), open_run(late, allow_incomplete=True), allow_incomplete=True)
    assert (res.status, res.complete) == ("identical", False)
    assert any("steps 3 and later not compared" in n for n in res.notes)
    # A difference in a step both runs hold completely is still found exactly there.
    res = bisect(open_run(a), open_run(early, allow_incomplete=True))
    assert res.status == "diverged" and res.rank(1).first.step == 1 and res.rank(1).first.op == "aten::add.Tensor"
    assert not res.complete


def test_closed_incomplete_says_why(tmp_path, runs):
    run = runs(tmp_path / "r")
    (run / "manifest" / "rank=1" / "segment-00000.commits").unlink()
    for table in ("records", "metrics", "events"):
        shutil.rmtree(run / table / "rank=1")
    w = ShardWriter(run, 1, 0)
    for s in STEPS:
        w.write_window({"metrics": {"step": [s], "seq": [s], "microbatch": [-1], "name": ["loss"], "occurrence": [0],
                                    "value": [1.0], "bits": [0], "dtype": ["float"]}})  # fmt: skip
    w.mark_incomplete("capture disabled at step 3 after an internal error (boom)")
    w.close()
    with pytest.raises(
        IncompleteRunError, match=r"closed incomplete: capture disabled at step 3 .*\(steps 3 and later"
    ):
        open_run(run)


# ---------------------------------------------------------------------------- the two cases
def test_a_rank_whose_records_are_missing_is_never_a_divergence(tmp_path, runs):
    a, b = runs(tmp_path / "a"), runs(tmp_path / "b")
    shutil.rmtree(b / "records" / "rank=1")  # a partial copy from the cluster
    line = _one_line_error(_cli("bisect", a, b))
    assert "rank 1 segment 0: records window 0 was committed with 3 row(s) but its shard is missing" in line
    assert "and 3 more gap(s)" in line
    r = _cli("bisect", a, b, "--allow-incomplete", "--json")
    report = json.loads(r.output)
    assert r.exit_code == 0 and report["complete"] is False and [x["rank"] for x in report["ranks"]] == [0]
    assert any(n.startswith("ranks 1 hold no record or metric in either run") for n in report["notes"])
    # The same partial copy of a legacy run (no commit log): a rank with a manifest and no data at all.
    la, lb = runs(tmp_path / "la", legacy=True), runs(tmp_path / "lb", legacy=True)
    for d in lb.glob("*/rank=1"):
        if d.parent.name != "manifest":
            shutil.rmtree(d)
    assert "rank 1 segment 0: legacy run (no commit log) and this rank has a manifest but not a single shard" in (
        _one_line_error(_cli("bisect", la, lb))
    )
    report = json.loads(_cli("bisect", la, lb, "--allow-incomplete", "--json").output)
    assert report["status"] == "identical" and report["complete"] is False and len(report["ranks"]) == 1


def _crashed_before_first_flush(path, legacy=False):
    """Manifests (and, unless legacy, commit logs with their open line) and nothing else."""
    for rank in (0, 1):
        if not legacy:
            log = path / commitlog.commit_log_relpath(rank, 0)
            log.parent.mkdir(parents=True, exist_ok=True)
            log.write_bytes(commitlog.encode({"t": "open", "version": 1, "rank": rank, "segment": 0}))
        write_manifest(path, default_manifest(rank, 2) | ({} if legacy else {"commit_log": 1}))
    return path


@pytest.mark.parametrize("legacy", [False, True])
def test_two_runs_that_captured_nothing_are_never_identical(tmp_path, legacy):
    a = _crashed_before_first_flush(tmp_path / "a", legacy)
    b = _crashed_before_first_flush(tmp_path / "b", legacy)
    gap = "legacy run (no commit log)" if legacy else "the capture never closed (no window committed"
    assert gap in _one_line_error(_cli("bisect", a, b))
    line = _one_line_error(_cli("bisect", a, b, "--allow-incomplete"))
    assert "neither run holds a record or metric on rank(s) 0-1; there is nothing to compare" in line
    with pytest.raises(IncomparableError, match="nothing to compare"):
        bisect(open_run(a, allow_incomplete=True), open_run(b, allow_incomplete=True))


def test_one_empty_side_is_nothing_to_compare_not_a_divergence(tmp_path, runs):
    a = runs(tmp_path / "a")
    b = write_run(tmp_path / "b", {0: {"events": [dict(step=0)]}, 1: {"events": [dict(step=0)]}})
    line = _one_line_error(_cli("bisect", a, b))
    assert f"{b} holds no record or metric on rank(s) 0-1 while {a} does" in line


# ---------------------------------------------------------------------------- resume
def test_a_crashed_launch_resumed_by_a_later_segment_is_complete(tmp_path, runs):
    run = runs(tmp_path / "r")
    _cut_close(run)  # rank 1 killed in step 3 ...
    for rank in (0, 1):  # ... and the job resumed from the checkpoint of step 2 on every rank
        write_run(run, {rank: _rank(rank)}, world_size=2, segment=1, start_step=2)
    r = open_run(run)  # the steps the crash left incomplete were captured again
    assert r.completeness.complete and r.segments(1) == (0, 1)
    assert r.scan("records", ranks=[1]).select("step").collect()["step"].unique().sort().to_list() == list(STEPS)


def test_a_resume_that_leaves_a_hole_is_incomplete(tmp_path):
    run = write_run(tmp_path / "r", {0: _rank(0)})
    lines = _log(run, 0).read_bytes().splitlines(keepends=True)
    _log(run, 0).write_bytes(b"".join(lines[:2]))  # killed after window 0, during step 1
    write_run(run, {0: _rank(0)}, segment=1, start_step=3)  # resumed from a checkpoint at step 3
    with pytest.raises(IncompleteRunError, match=r"rank 0 segment 0: the capture never closed .*\(steps 0-2 not held"):
        open_run(run)
    r = open_run(run, allow_incomplete=True)
    assert r.excluded == {0: ((0, 2),)}


# ---------------------------------------------------------------------------- the log itself
def test_torn_last_line_is_ignored_and_a_mid_file_corruption_counted():
    good = commitlog.encode({"t": "open", "version": 1, "rank": 0, "segment": 0})
    w0 = commitlog.encode({"t": "window", "window": 0, "rows": {"records": 2}, "steps": [0, 0]})
    st = commitlog.parse(good + w0 + w0[:20])
    assert st.opened and list(st.windows) == [0] and st.torn_tail and st.bad_lines == 1 and st.close is None
    st = commitlog.parse(good + w0.replace(b"records", b"recorDs") + w0)
    assert st.bad_lines == 1 and list(st.windows) == [0]
    st = commitlog.parse(good + commitlog.encode({"t": "window", "window": 1, "rows": {"records": -1}, "steps": None}))
    assert st.bad_lines == 1 and not st.windows
    st = commitlog.parse(good + commitlog.encode({"t": "future-kind"}))
    assert st.bad_lines == 1  # not understood means not trusted


def test_future_log_versions_and_huge_logs_are_refused(tmp_path, runs):
    run = runs(tmp_path / "r")
    log = _log(run)
    log.write_bytes(commitlog.encode({"t": "open", "version": 2, "rank": 1, "segment": 0}) + log.read_bytes())
    with pytest.raises(SchemaVersionError, match="commit log version 2 is not supported"):
        open_run(run)
    with open(log, "wb") as f:
        f.truncate(commitlog.COMMIT_LOG_MAX_BYTES + 1)
    with pytest.raises(ManifestError, match=r"commit log segment-00000\.commits is larger than 64 MiB"):
        open_run(run)
