"""The stored rollups path of bisect gives the same report as the records path, and never a wrong one.

* the writer's vectorized rollup hashes are the contract's reference ``rollup_hashes``, bit for bit;
* every synthetic plant (each HOWS value, subsets, resume, hazards), with its origin in the first
  block and past the second (a slice that starts after the step's first record), and every sample
  pair: the JSON report with the rollups, from the commit lines' step folds or from the stored
  blocks (``ReadPaths(step_sums=False)``), equals the report without (``stored_rollups=False``);
* a rollup that differs although the records match is decided by the exact walk (identical);
* a missing rollups shard is refused or reported by the completeness contract, a damaged one
  refused; a run without rollups (an older writer) bisects on the records path, with the same answer.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from detfp_analyze.bisect import blocks
from detfp_analyze.bisect.pipeline import bisect
from detfp_analyze.bisect.reads import ReadPaths
from detfp_analyze.errors import DetfpError, IncompleteRunError
from detfp_analyze.io import stepsums
from detfp_analyze.io.reader import open_run
from detfp_analyze.testing.synth import Plant, SynthSpec, write_pair
from detfp_format import contract
from detfp_format.rollups import Positions, _python_rollups, window_rollups
from tests.fixtures.pairs import write_planted

SAMPLES = Path(__file__).resolve().parents[2] / "sample_traces"
SPEC = SynthSpec(ranks=4, steps=3, records=2600)
LATE = 2300  # block 2: the slice starts at block 1
PLANTS = {
    "values_early": Plant(rank=2, step=1, index=40),
    "values_late": Plant(rank=2, step=2, index=LATE),
    "subset_late": Plant(rank=1, step=1, index=LATE, also_ranks=(3,)),
    "all_ranks": Plant(step=0, index=1500, all_ranks=True),
    "structural": Plant(rank=0, step=1, index=LATE, how="structural"),
    "arguments": Plant(rank=1, step=1, index=LATE, how="arguments"),
    "digest_error": Plant(rank=3, step=1, index=LATE, how="digest_error"),
    "missing_records": Plant(rank=2, step=2, index=LATE, how="missing"),
    "rng": Plant(rank=0, step=1, how="rng"),
    "hazard": Plant(rank=1, step=1, index=LATE, hazard=True),
    "resume": Plant(rank=2, step=2, index=LATE, resume_at=1),
}


def report(a, b, rollups: bool, sums: bool = True) -> dict:
    return bisect(open_run(a), open_run(b), reads=ReadPaths(step_sums=sums, stored_rollups=rollups)).to_json_dict()


@pytest.mark.parametrize("impl", [window_rollups, _python_rollups], ids=["numpy", "python"])
def test_writer_hashes_are_the_reference(impl):
    rows = [
        # key_hash, status, hi, lo, args, kind
        (1, "ok", 2, 3, None, "op"),
        (5, "ok", (1 << 64) - 1, 0, "00000000000000a1", "op"),
        (9, "skipped", None, None, "ffffffffffffffff", "module_input"),
        (11, "error", None, None, None, "param"),
    ] * 700  # 2800 records: three blocks of one step
    cols = dict(
        zip(
            ("key_hash", "status", "digest_hi", "digest_lo", "args_digest", "kind"),
            zip(*rows, strict=True),
            strict=True,
        )
    )
    n = len(rows)
    t = pa.table(
        {
            "step": pa.array([7] * n, pa.int64()),
            "seq": pa.array(range(10, 10 + n), pa.int64()),
            "key_hash": pa.array(cols["key_hash"], pa.uint64()),
            "status": pa.array(cols["status"]),
            "digest_hi": pa.array(cols["digest_hi"], pa.uint64()),
            "digest_lo": pa.array(cols["digest_lo"], pa.uint64()),
            "args_digest": pa.array(cols["args_digest"], pa.string()),
            "kind": pa.array(cols["kind"]),
        }
    )
    got = impl(t, Positions())
    B = contract.ROLLUP_BLOCK
    for b in range(3):
        part = rows[b * B : (b + 1) * B]
        kx = vx = ox = 0
        for i, (k, s, hi, lo, args, _) in enumerate(part):
            hk, hv, ho = contract.rollup_hashes(k, s, hi, lo, args, i)
            kx, vx, ox = kx ^ hk, vx ^ hv, ox ^ ho
        assert (got["block"][b], got["n"][b], got["kx"][b], got["vx"][b], got["ox"][b]) == (b, len(part), kx, vx, ox)
        assert got["n_err"][b] == sum(r[1] == "error" for r in part)
        assert got["kinds"][b] == contract.kinds_mask(r[5] for r in part)
        assert got["seq"][b] == 10 + b * B and got["seq_hi"][b] == 10 + b * B + len(part) - 1


def test_a_step_cut_by_windows_has_the_positions_of_the_whole_step():
    pos = Positions()
    assert pos.take([1] * 1000) == list(range(1000))
    assert pos.take([1] * 500 + [2] * 3) == [*range(1000, 1500), 0, 1, 2]


def test_both_writer_paths_agree_on_windows_of_several_steps():
    n = 3000
    steps = [4] * 700 + [5] * 2300
    t = pa.table(
        {
            "step": pa.array(steps, pa.int64()),
            "seq": pa.array(range(n), pa.int64()),
            "key_hash": pa.array([i * 7919 for i in range(n)], pa.uint64()),
            "status": pa.array(["ok"] * n),
            "digest_hi": pa.array(range(n), pa.uint64()),
            "digest_lo": pa.array([None] * n, pa.uint64()),
            "args_digest": pa.array([None] * n, pa.string()),
            "kind": pa.array(["op"] * n),
        }
    )
    pa_, pb_ = Positions(), Positions()
    pa_.advance(4, 1000)
    pb_.advance(4, 1000)  # step 4 began in an earlier window
    got = window_rollups(t, pa_)
    assert got == _python_rollups(t, pb_)
    assert got["block"][:3] == [0, 1, 0] and got["n"][:3] == [24, 676, 1024]


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    return write_planted(tmp_path_factory.mktemp("rollups"), SPEC, PLANTS)


@pytest.mark.parametrize("name", [*PLANTS, "identical"])
def test_rollups_and_records_give_the_same_report(planted, name):
    p = planted[name]
    ra, rb = open_run(p.a), open_run(p.b)
    assert blocks.available(ra, rb, range(SPEC.ranks))
    assert stepsums.pair(ra, rb, range(SPEC.ranks), 0, SPEC.steps) is not None
    # Three paths, one report: the commit lines' step folds, the stored blocks, the records.
    with_rollups = report(p.a, p.b, True)
    assert with_rollups == report(p.a, p.b, True, sums=False)
    assert with_rollups == report(p.a, p.b, False)
    got = {r["rank"]: (r["first"]["step"], r["first"]["seq_a"]) for r in with_rollups["ranks"] if r.get("first")}
    if name not in ("structural", "missing_records", "resume", "hazard", "digest_error"):
        assert got == {e.rank: (e.step, e.seq) for e in p.expected}


def test_a_late_divergence_reads_a_slice(planted):
    p = planted["values_late"]
    a, b = open_run(p.a), open_run(p.b)
    read = [blocks.block_rollup(run.scan("rollups")).collect().sort("rank", "step", "block") for run in (a, b)]
    cands = {e.rank: [e.step] for e in p.expected}
    sl = blocks.slices(*read, cands)
    assert set(sl) == {(e.rank, e.step) for e in p.expected}
    assert all(s.cut and s.seq_a[1] - s.seq_a[0] < SPEC.records for s in sl.values())


@pytest.mark.parametrize(("a", "b"), [("ops/a", "ops/b"), ("resume/full", "resume/resumed")])
def test_sample_traces_have_no_rollups_and_bisect_on_records(a, b):
    ra, rb = open_run(SAMPLES / a), open_run(SAMPLES / b)
    assert not blocks.available(ra, rb, ra.ranks)
    assert report(SAMPLES / a, SAMPLES / b, True) == report(SAMPLES / a, SAMPLES / b, False)


def test_an_older_run_without_rollups_takes_the_records_path(tmp_path):
    plant = PLANTS["values_late"]
    old = write_pair(tmp_path / "a", tmp_path / "b", SynthSpec(ranks=4, steps=3, records=2600, rollups=False), plant)
    new = write_pair(tmp_path / "na", tmp_path / "nb", SPEC, plant)
    # One run with rollups, one without: the records path, the same answer.
    ra, rb = open_run(new.a), open_run(old.b)
    assert "rollups" not in rb.tables and not blocks.available(ra, rb, ra.ranks)
    res = bisect(ra, rb)
    assert {r.rank: (r.first.step, r.first.seq_a) for r in res.ranks if r.first} == {
        e.rank: (e.step, e.seq) for e in new.expected
    }


def _rewrite(path: Path, edit) -> None:
    t = pl.read_parquet(path)
    pq.write_table(edit(t).to_arrow(), path)


def test_a_rollup_mismatch_with_equal_records_is_decided_by_the_walk(tmp_path):
    # Written without the commit lines' shard facts: a shard rewritten after its commit would be
    # refused by its size (tests/unit/test_footers_committed.py), and this is about the walk.
    p = write_pair(tmp_path / "a", tmp_path / "b", dataclasses.replace(SPEC, shard_facts=False))
    shard = sorted((p.b / "rollups" / "rank=2").glob("*.parquet"))[1]
    _rewrite(shard, lambda t: t.with_columns(pl.col("vx") ^ 1, pl.col("ox") ^ 1))
    ra, rb = open_run(p.a), open_run(p.b)
    assert blocks.available(ra, rb, ra.ranks)
    res = bisect(ra, rb)
    assert not res.diverged
    assert res.to_json_dict() == report(p.a, p.b, False)


def test_a_missing_rollups_shard_is_incomplete_and_a_damaged_one_refused(tmp_path):
    p = write_pair(tmp_path / "a", tmp_path / "b", SPEC, PLANTS["values_late"])
    shard = sorted((p.b / "rollups" / "rank=1").glob("*.parquet"))[2]
    saved = shard.read_bytes()
    shard.unlink()
    with pytest.raises(IncompleteRunError, match="rollups"):
        open_run(p.b)
    # Leniency reports the gap and leaves the step out on both sides: never a wrong answer.
    rb = open_run(p.b, allow_incomplete=True)
    assert rb.completeness.gaps
    shard.write_bytes(saved[: len(saved) // 2])
    with pytest.raises(DetfpError):
        open_run(p.b)
    shutil.rmtree(p.b / "rollups")
    with pytest.raises(IncompleteRunError):
        open_run(p.b)
