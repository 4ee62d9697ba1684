"""The synthetic run generator writes valid runs whose planted divergence is where it says."""

from __future__ import annotations

import polars as pl
import pytest

from detfp_analyze.io.reader import open_run
from detfp_analyze.testing.synth import Plant, SynthSpec, write_pair, write_run

SPEC = SynthSpec(ranks=4, steps=3, records=300)


def first_divergence(a: str, b: str) -> dict[int, tuple[int, int, str]]:
    """rank -> (step, seq in A or B, match) of the first record differing, by A's (or B's) order; a naive oracle."""
    ra, rb = open_run(a), open_run(b)
    cols = ["rank", "step", "seq", "key_hash", "digest_hi", "digest_lo"]
    da = ra.scan("records").select(cols).collect()
    db = rb.scan("records").select(cols).collect()
    j = da.join(db, on=["rank", "step", "key_hash"], how="full", suffix="_b", coalesce=True)
    j = j.with_columns(
        pl.when(pl.col("seq").is_null())
        .then(pl.lit("only_b"))
        .when(pl.col("seq_b").is_null())
        .then(pl.lit("only_a"))
        .when(
            (pl.col("digest_hi").eq_missing(pl.col("digest_hi_b")))
            & (pl.col("digest_lo").eq_missing(pl.col("digest_lo_b")))
        )
        .then(pl.lit("same"))
        .otherwise(pl.lit("differs"))
        .alias("match"),
        pl.coalesce("seq", "seq_b").alias("order"),
    )
    first = (
        j.filter(pl.col("match") != "same").sort("rank", "step", "order").group_by("rank", maintain_order=True).first()
    )
    return {r["rank"]: (r["step"], r["order"], r["match"]) for r in first.iter_rows(named=True)}


def test_identical_pair_has_no_difference(tmp_path):
    p = write_pair(tmp_path / "a", tmp_path / "b", SPEC)
    assert p.expected == ()
    assert first_divergence(p.a, p.b) == {}
    run = open_run(p.a)
    assert run.world_size == 4 and run.tables == {"records", "metrics", "events", "rollups"}
    per_step = run.scan("records").group_by("rank", "step").len().collect()
    assert per_step["len"].to_list() == [300] * 12


def test_planted_origin_is_first_difference_and_reaches_every_rank(tmp_path):
    p = write_pair(tmp_path / "a", tmp_path / "b", SPEC, Plant(rank=2, step=1, index=40))
    found = first_divergence(p.a, p.b)
    exp = {e.rank: e for e in p.expected}
    assert set(found) == {0, 1, 2, 3} == set(exp)
    for r, (step, seq, match) in found.items():
        assert (step, seq, match) == (exp[r].step, exp[r].seq, "differs")
    assert exp[2].verdict == "origin" and exp[2].index >= 40
    assert {exp[r].verdict for r in (0, 1, 3)} == {"receiver"}
    assert exp[0].kind == "collective" and exp[0].name == "all_reduce"
    assert p.origin_ranks == (2,)
    # The origin's inputs match in both runs (an origin, not a receiver).
    a = open_run(p.a).scan("records", ranks=[2], steps=1).collect()
    b = open_run(p.b).scan("records", ranks=[2], steps=1).collect()
    origin = a.filter(pl.col("seq") == exp[2].seq)
    call = origin["call_hash"][0]
    ins_a = a.filter((pl.col("call_hash") == call) & (pl.col("role") == "input")).sort("key_hash")
    ins_b = b.filter((pl.col("call_hash") == call) & (pl.col("role") == "input")).sort("key_hash")
    assert ins_a.height > 0 and ins_a["digest_hi"].to_list() == ins_b["digest_hi"].to_list()


def test_metrics_differ_only_after_divergence(tmp_path):
    p = write_pair(tmp_path / "a", tmp_path / "b", SPEC, Plant(rank=1, step=1, index=10))
    ma = open_run(p.a).scan("metrics").collect()
    mb = open_run(p.b).scan("metrics").collect()
    j = ma.join(mb, on=["rank", "step", "name"], suffix="_b")
    diff = j.filter(pl.col("bits") != pl.col("bits_b"))
    assert diff.filter(pl.col("step") == 0).is_empty()
    assert diff.filter(pl.col("name") == "lr").is_empty()
    assert diff.filter((pl.col("rank") == 1) & (pl.col("step") == 1) & (pl.col("name") == "loss")).height == 1
    # Other ranks' losses of step 1 still match: the difference reached them in the backward all-reduce.
    assert diff.filter((pl.col("rank") == 0) & (pl.col("step") == 1) & (pl.col("name") == "loss")).is_empty()


def test_all_ranks_same_op(tmp_path):
    p = write_pair(tmp_path / "a", tmp_path / "b", SPEC, Plant(step=2, index=100, all_ranks=True))
    assert {e.verdict for e in p.expected} == {"origin"}
    assert len({e.key_hash for e in p.expected}) == 1
    found = first_divergence(p.a, p.b)
    assert {r: (s, q) for r, (s, q, _) in found.items()} == {e.rank: (e.step, e.seq) for e in p.expected}


def test_late_divergence_without_later_all_reduce_stays_local(tmp_path):
    # Last step, after the last all-reduce: nothing carries the difference to other ranks.
    p = write_pair(tmp_path / "a", tmp_path / "b", SPEC, Plant(rank=3, step=2, index=290))
    assert [(e.rank, e.verdict) for e in p.expected] == [(3, "origin")]
    assert set(first_divergence(p.a, p.b)) == {3}


def test_structural_insertion_is_one_sided(tmp_path):
    p = write_pair(tmp_path / "a", tmp_path / "b", SPEC, Plant(rank=0, step=1, index=30, how="structural"))
    (e,) = p.expected
    assert e.verdict == "structural" and e.name == "aten::clone.default"
    found = first_divergence(p.a, p.b)
    assert found == {0: (1, e.seq, "only_b")}
    rb = open_run(p.b).scan("records", ranks=[0]).collect()
    assert rb["seq"].is_unique().all() and rb["seq"].is_sorted()


def test_missing_ranks_and_fresh_directories(tmp_path):
    write_run(tmp_path / "r", SPEC, ranks=[0, 2])
    run = open_run(tmp_path / "r", allow_missing_ranks=True)
    assert run.missing_ranks == (1, 3)
    with pytest.raises(FileExistsError):
        write_run(tmp_path / "r", SPEC)
    with pytest.raises(ValueError, match="plant step"):
        write_pair(tmp_path / "x", tmp_path / "y", SPEC, Plant(step=9))
