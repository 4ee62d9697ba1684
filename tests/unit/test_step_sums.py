"""The commit lines' step folds (``sums``) and the bisect's use of them (``io.stepsums``).

* the writer commits, per step, exactly the fold of the rollups and metrics shards it wrote,
  also for a step cut by windows; ``metric_hash`` is pinned (a format constant);
* a malformed ``sums`` is left out, and a launch without folds anywhere sends the bisect to
  the shards (older writers, ``ReadPaths(step_sums=False)``, a window line without them, exclusions);
* the report is the same with and without the folds, and they cut the reads: an identical pair
  reads no metrics or rollups shard, a pair reads those of the ranks that differ only;
* a difference in the metrics alone is found from the folds;
* certify's advice for shards that disagree with their folds names ``bisect --no-step-sums``,
  which finds the difference the folds hide.
"""

from __future__ import annotations

import json

import polars as pl
import pytest

from detfp_analyze.bisect import engine as _engine
from detfp_analyze.bisect.pipeline import bisect
from detfp_analyze.bisect.reads import ReadPaths
from detfp_analyze.io import stepsums
from detfp_analyze.io.reader import open_run
from detfp_analyze.testing.synth import Plant, SynthSpec, write_pair
from detfp_format import commitlog
from detfp_format.writer import ShardWriter
from tests.fixtures.pairs import build_pair
from tests.fixtures.shards import fold_shards
from tests.fixtures.stages import spy

SPEC = SynthSpec(ranks=4, steps=3, records=300)
#: The shards, not the commit lines' folds.
NO_SUMS = ReadPaths(step_sums=False)


def test_metric_hash_is_pinned():
    # A format constant: runs written by one release are compared by another.
    assert commitlog.metric_hash(-1, "loss", 0, 0x3FF0000000000000) == 0x5428A1666875F0EE
    assert commitlog.metric_hash(-1, "loss", 1, 0x3FF0000000000000) != 0x5428A1666875F0EE


@pytest.mark.parametrize("windows", ["step", "run"])
def test_committed_folds_are_the_folds_of_the_shards(tmp_path, windows):
    import dataclasses

    spec = dataclasses.replace(SPEC, windows=windows)
    p = write_pair(tmp_path / "a", tmp_path / "b", spec, Plant(rank=1, step=1, index=40))
    for run_dir in (p.a, p.b):
        run = open_run(run_dir)
        got = stepsums.pair(run, run, run.ranks, 0, 10)
        assert got is not None
        assert stepsums.as_dict(got[0]) == fold_shards(run_dir)


def test_a_step_cut_by_windows_folds_to_the_whole_step(tmp_path):
    rows = [
        {"step": 3, "seq": i, "microbatch": -1, "phase": "forward", "module": "", "kind": "op",
         "name": f"aten::op{i % 7}", "occurrence": i, "role": "output", "arg": "out[0]", "status": "ok",
         "digest_hi": i * 11, "digest_lo": i * 13}
        for i in range(1500)
    ]  # fmt: skip
    from tests.fixtures.shards import _columnar, _Filler

    filler = _Filler(0)
    full = [filler.record(r) for r in rows]
    with ShardWriter(tmp_path, 0, 0, rollups=True) as w:
        w.write_window({"records": _columnar(full[:700], "records")})
        w.write_window({"records": _columnar(full[700:], "records")})
    state = commitlog.parse((tmp_path / "manifest" / "rank=0" / "segment-00000.commits").read_bytes())
    assert sorted(state.sums) == [0, 1]
    folded = stepsums._fold([state.sums[0], state.sums[1]], {})
    roll = pl.read_parquet(tmp_path / "rollups" / "**" / "*.parquet")
    kx = vx = 0
    for a, b in roll.select("kx", "vx").iter_rows():
        kx, vx = kx ^ a, vx ^ b
    assert folded == {3: (1500, 0, kx, vx, 0, 0)}


def _line(rec: dict) -> bytes:
    return commitlog.encode(rec)


@pytest.mark.parametrize(
    "sums",
    [
        {"9": [1, 0, 1, 1, 0, 0]},  # a step outside the line's steps
        {"1": [1, 0, 1, 1, 0]},  # too short
        {"1": [1, 0, -1, 1, 0, 0]},  # negative
        {"1": [1, 0, 1 << 64, 1, 0, 0]},  # not 64 bits
        {"1": [True, 0, 1, 1, 0, 0]},  # a boolean
        {"x1": [1, 0, 1, 1, 0, 0]},  # not a step
        [1, 0, 1, 1, 0, 0],  # not an object
    ],
)
def test_malformed_sums_are_left_out(sums):
    # Rows as the good folds below count them (a line whose folds do not count its rows is unreadable).
    rec = {"t": "window", "window": 0, "rows": {"records": 1, "metrics": 2}, "steps": [1, 2], "sums": sums}
    state = commitlog.parse(_line({"t": "open", "version": 1}) + _line(rec))
    assert state.windows and 0 not in state.sums and state.bad_lines == 0
    good = dict(rec, sums={"1": [1, 0, (1 << 64) - 1, 1, 2, 3]})
    state = commitlog.parse(_line({"t": "open", "version": 1}) + _line(good))
    assert state.sums == {0: {1: (1, 0, (1 << 64) - 1, 1, 2, 3)}}
    # A later line for the same window without sums: neither is trusted.
    state = commitlog.parse(_line({"t": "open", "version": 1}) + _line(good) + _line(rec))
    assert 0 not in state.sums


def _strip_sums(log) -> None:
    """Rewrite one commit log's window lines without their sums (checksums recomputed)."""
    out = []
    for line in log.read_bytes().splitlines():
        rec = json.loads(line[9:])
        if rec["t"] == "window" and rec["window"] == 1:
            rec.pop("sums")
        out.append(commitlog.encode(rec))
    log.write_bytes(b"".join(out))


def test_the_folds_are_used_only_where_both_runs_hold_them_everywhere(tmp_path):
    import dataclasses

    plant = Plant(rank=1, step=1, index=40)
    new = write_pair(tmp_path / "a", tmp_path / "b", SPEC, plant)
    old = write_pair(tmp_path / "oa", tmp_path / "ob", dataclasses.replace(SPEC, step_sums=False), plant)
    ranks = list(range(SPEC.ranks))
    assert stepsums.pair(open_run(new.a), open_run(new.b), ranks, 0, 2) is not None
    assert stepsums.pair(open_run(old.a), open_run(old.b), ranks, 0, 2) is None
    assert stepsums.pair(open_run(new.a), open_run(old.b), ranks, 0, 2) is None
    _strip_sums(new.b / "manifest" / "rank=2" / "segment-00000.commits")
    rb = open_run(new.b)
    assert rb.step_sums[(2, 0)] is None and rb.step_sums[(1, 0)] is not None
    assert stepsums.pair(open_run(new.a), rb, ranks, 0, 2) is None
    assert stepsums.pair(open_run(new.a), rb, [0, 1, 3], 0, 2) is not None
    # Every path gives the report of the shards.
    expect = bisect(open_run(old.a), open_run(old.b)).to_json_dict()
    got = bisect(open_run(new.a), rb).to_json_dict()
    assert {k: v for k, v in got.items() if k not in ("a", "b")} == {
        k: v for k, v in expect.items() if k not in ("a", "b")
    }


def _spy(monkeypatch) -> dict[str, list]:
    return spy(monkeypatch, ("metric_divergence", "block_rollups"))


def test_an_identical_pair_reads_no_metrics_or_rollups(tmp_path, monkeypatch):
    p = write_pair(tmp_path / "a", tmp_path / "b", SPEC)
    calls = _spy(monkeypatch)
    res = bisect(open_run(p.a), open_run(p.b))
    assert not res.diverged and calls == {"metric_divergence": [], "block_rollups": []}
    assert bisect(open_run(p.a), open_run(p.b), reads=NO_SUMS).to_json_dict() == res.to_json_dict()
    assert calls["metric_divergence"] == [(list(range(SPEC.ranks)), 0, SPEC.steps - 1)]


def test_only_the_ranks_that_differ_are_read(tmp_path, monkeypatch):
    # An origin on rank 1 of the last step after its all-reduce (the optimizer's records): only
    # rank 1's records differ, and no metric (the loss came before it); only that rank-step's
    # rollups are read.
    p = write_pair(tmp_path / "a", tmp_path / "b", SPEC, Plant(rank=1, step=2, index=290))
    calls = _spy(monkeypatch)
    held = bisect(open_run(p.a), open_run(p.b), ranks=[0, 1, 2])
    # The walk's rank-step is held in memory (bisect.held): nothing to slice, no rollups read.
    assert calls == {"metric_divergence": [], "block_rollups": []}
    monkeypatch.setattr(_engine, "HOLD_ROWS", 0)  # the stored rollups slice what the walk reads
    res = bisect(open_run(p.a), open_run(p.b), ranks=[0, 1, 2])
    assert calls == {"metric_divergence": [], "block_rollups": [([1], 2, 2)]}
    assert [r["rank"] for r in res.to_json_dict()["ranks"] if r.get("first")] == [1]
    assert res.to_json_dict() == held.to_json_dict()
    assert bisect(open_run(p.a), open_run(p.b), ranks=[0, 1, 2], reads=NO_SUMS).to_json_dict() == res.to_json_dict()


def test_a_difference_in_the_metrics_alone_is_found(tmp_path, monkeypatch):
    a, b = build_pair(tmp_path, world=3, metrics_b=lambda r, s: 9.5 if (r, s) == (1, 1) else 1.0 + s, rollups=True)
    sums = stepsums.pair(a, b, [0, 1, 2], 0, 2)
    assert sums is not None and stepsums.metric_reads(*sums) == ([1], 1, 1) and stepsums.record_reads(*sums) is None
    calls = _spy(monkeypatch)
    res = bisect(a, b).to_json_dict()
    assert calls == {"metric_divergence": [([1], 1, 1)], "block_rollups": []}
    assert bisect(a, b, reads=NO_SUMS).to_json_dict() == res
    rank1 = next(r for r in res["ranks"] if r["rank"] == 1)
    assert json.dumps(rank1).count("9.5") >= 1


def test_an_early_divergence_reads_each_rank_up_to_its_first_split(tmp_path, monkeypatch):
    # An origin on rank 1 at step 0, carried to every rank by the all-reduce: every later step
    # differs too, but each rank's first split is step 0, so only step 0's metrics and stored
    # rollups are read (the later steps' rollups would only matter for a rank the walk leaves open).
    p = write_pair(tmp_path / "a", tmp_path / "b", SPEC, Plant(rank=1, step=0, index=40))
    ranks = list(range(SPEC.ranks))
    sums = stepsums.pair(open_run(p.a), open_run(p.b), ranks, 0, SPEC.steps - 1)
    assert sums is not None
    assert stepsums.record_reads(*sums) == (ranks, 0, SPEC.steps - 1)
    assert stepsums.record_reads(*sums, ranks=[2, 3], lo=1, hi=1) == ([2, 3], 1, 1)
    assert stepsums.metric_reads(*sums) == (ranks, 0, 0)
    calls = _spy(monkeypatch)
    held = bisect(open_run(p.a), open_run(p.b)).to_json_dict()
    assert calls == {"metric_divergence": [(ranks, 0, 0)], "block_rollups": []}  # step 0 held (bisect.held)
    calls["metric_divergence"].clear()
    monkeypatch.setattr(_engine, "HOLD_ROWS", 0)
    res = bisect(open_run(p.a), open_run(p.b)).to_json_dict()
    assert calls == {"metric_divergence": [(ranks, 0, 0)], "block_rollups": [(ranks, 0, 0)]}
    assert res == held
    assert {r["rank"] for r in res["ranks"] if r.get("first")} == set(ranks)
    for reads in (NO_SUMS, ReadPaths(step_sums=False, stored_rollups=False)):
        assert bisect(open_run(p.a), open_run(p.b), reads=reads).to_json_dict() == res


def test_a_launch_resumed_into_the_run_supersedes_its_earlier_folds(tmp_path, monkeypatch):
    # Run B's first launch wrote steps 0-2, step 2 different; its second launch (start_step 2)
    # captured steps 2-3 again, as run A has them: B's steps are A's (the first launch's step 2
    # superseded), and the folds say so without reading a shard.
    from tests.fixtures.pairs import records_for
    from tests.fixtures.shards import write_run

    def tables(steps, edits=None):
        return {r: {"records": records_for(r, steps, edits), "metrics": [dict(step=s, name="loss", value=1.0 + s) for s in steps]}
                for r in range(2)}  # fmt: skip

    write_run(tmp_path / "a", tables(range(4)), rollups=True)
    changed = {(r, 2): {"after": "mm.out"} for r in range(2)}
    write_run(tmp_path / "b", tables(range(3), changed), rollups=True)
    write_run(tmp_path / "b", tables(range(2, 4)), segment=1, start_step=2, rollups=True)
    a, b = open_run(tmp_path / "a"), open_run(tmp_path / "b")
    sums = stepsums.pair(a, b, [0, 1], 0, 3)
    assert sums is not None and stepsums.as_dict(sums[0]) == stepsums.as_dict(sums[1])
    calls = _spy(monkeypatch)
    res = bisect(a, b).to_json_dict()
    assert res["status"] == "identical" and calls == {"metric_divergence": [], "block_rollups": []}
    assert bisect(a, b, reads=NO_SUMS).to_json_dict() == res


def test_certify_finds_shards_that_disagree_with_their_committed_folds(tmp_path):
    import dataclasses

    import pyarrow.parquet as pq

    from detfp_analyze.single.certify import certify

    # Without shard facts: a shard rewritten after its commit would be refused by its size.
    p = write_pair(tmp_path / "a", tmp_path / "b", dataclasses.replace(SPEC, shard_facts=False))
    assert not [x for x in certify(p.b).problems if x.kind == "step_sums"]
    roll = sorted((p.b / "rollups" / "rank=2").glob("*.parquet"))[1]
    t = pl.read_parquet(roll)
    pq.write_table(t.with_columns(pl.col("vx") ^ 1).to_arrow(), roll)
    met = sorted((p.b / "metrics" / "rank=0").glob("*.parquet"))[2]
    t = pl.read_parquet(met)
    pq.write_table(t.with_columns(pl.col("bits") ^ 1).to_arrow(), met)
    got = [(x.rank, x.step, x.detail.split(" differs")[0]) for x in certify(p.b).problems if x.kind == "step_sums"]
    assert got == [
        (0, 2, "the commit lines' step fold of the metrics"),
        (2, 1, "the commit lines' step fold of the rollups"),
    ]
    # The advice: the shards no longer hold what was committed; a bisect that reads them refuses them
    # (io.binding), the one that reads only the folds answers what was committed.
    detail = next(x.detail for x in certify(p.b).problems if x.kind == "step_sums")
    assert "restore the shard or re-run the capture" in detail
    from typer.testing import CliRunner

    from detfp_analyze.cli import app

    def cli(*flags: str):
        return CliRunner().invoke(app, ["bisect", str(p.a), str(p.b), "--json", *flags])

    assert cli().exit_code == 0  # the folds agree: identical, what the runs committed
    # Reading the shards, the bisect meets rows that are not the committed ones: refused, naming the
    # first (issue 43; before, it answered on them).
    got = cli("--no-step-sums")
    assert got.exit_code == 2 and "rank=0/" in got.stderr and "are not what its window committed" in got.stderr
