"""``bisect --engine spark``: the same report as the local engine, byte for byte, in a few Spark jobs.

Equivalence on every bundled sample pair and on synthetic pairs for every plant kind of
``tests/golden/test_sql_bisect_equivalence.py`` (single-rank origin, rank subset, all ranks,
structural insertion, resume, missing ranks with ``--allow-missing-ranks``, the identical pair,
...), through the library (JSON and text) and through the command line (in-process, and once
in a real process whose terminal must stay free of Spark's noise). Both of bisect's rollup paths
run on Spark: the stored rollups (synthetic runs) and the records' rollups (the sample traces,
written before the rollups table, and a synthetic pair with rollups switched off). The number of
Spark jobs does not grow with the ranks. Bad input gets the local engine's one-line errors and
exit 2. All tests share one SparkSession (``conftest.spark``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from detfp_analyze.bisect import bisect, walk
from detfp_analyze.cli import app
from detfp_analyze.io.reader import open_run
from detfp_analyze.render.report import render_text
from detfp_analyze.testing.synth import Plant, SynthSpec, write_pair
from tests.fixtures.pairs import PLANTS, SAMPLE_PAIRS, SAMPLES, build_pair

REPO = Path(__file__).resolve().parents[2]
#: The shared session starts in the first test that uses it (~20 s, more on a loaded machine).
pytestmark = pytest.mark.timeout(600)


def _spark_bisect(spark, a, b, **kw):
    """bisect on the Spark engine; also returns its stages (their job counts)."""
    from detfp_analyze.spark import engine

    bound = {}

    def bind(run_a, run_b):
        bound["stages"] = engine(spark)(run_a, run_b)
        return bound["stages"]

    return bisect(a, b, engine=bind, **kw), bound.get("stages")


def _same(local, spark_result) -> None:
    assert json.dumps(spark_result.to_json_dict(), indent=2, sort_keys=True) == json.dumps(
        local.to_json_dict(), indent=2, sort_keys=True
    )
    assert render_text(spark_result) == render_text(local)


@pytest.mark.parametrize(("a", "b"), SAMPLE_PAIRS, ids=[f"{a}:{b}" for a, b in SAMPLE_PAIRS])
def test_sample_pairs_give_the_local_report(spark, a, b):
    ra, rb = open_run(SAMPLES / a), open_run(SAMPLES / b)
    got, stages = _spark_bisect(spark, ra, rb)
    _same(bisect(ra, rb), got)
    # The sample traces predate the rollups table: the records' rollups ran on Spark.
    assert stages.jobs.get("rollups") == 1


#: Every plant kind (``testing.plants.HOWS``) and the issue's cases: one rank, a subset, all ranks,
#: structural, resume, missing ranks (``--allow-missing-ranks``) and, below, the identical pair.
#: (The hazard and lost-RNG-resume variants add nothing the Spark stages see differently; the
#: all-ranks plant is bisected on 8 ranks by ``test_spark_jobs_do_not_grow_with_the_ranks``.)
SPARK_PLANTS = {k: v for k, v in PLANTS.items() if k not in ("hazard", "resume_lost_rng", "all_ranks")}
assert {p.how for p in SPARK_PLANTS.values()} == {p.how for p in PLANTS.values()}


@pytest.fixture
def planted(planted_pairs):
    """The golden test's pairs (``conftest.planted_pairs``: written once per session), of which
    this module bisects ``SPARK_PLANTS`` and the identical pair."""
    return planted_pairs


@pytest.mark.parametrize("name", [*SPARK_PLANTS, "identical"])
def test_synthetic_plants_give_the_local_report(spark, planted, name):
    p = planted[name]
    missing = bool(p.plant and p.plant.missing_ranks)
    a, b = open_run(p.a, allow_missing_ranks=missing), open_run(p.b, allow_missing_ranks=missing)
    got, stages = _spark_bisect(spark, a, b)
    local = bisect(a, b)
    _same(local, got)
    assert got.diverged == (name not in ("identical", "digest_error"))  # a digest error is no evidence
    if local.diverged:
        # Both runs stored rollups: Spark folded them, one job, instead of rolling up records.
        assert stages.jobs.get("rollups", 0) <= 1


def test_spark_jobs_do_not_grow_with_the_ranks(spark, tmp_path, monkeypatch):
    """8 ranks, each with its own divergent step (the local walk's batches made 2 ranks small: the
    Spark walk takes every rank in one batch anyway): one job for metrics, one for the stored
    rollups, and 4 reads of records: the walk's rank-steps of both runs (the narrow columns), the
    calls its verdicts need (each run's spans) and the discriminator's origin calls; not one per
    rank, batch or slice. The plant is the golden test's all-ranks plant (step 0), so this is
    also that plant's equivalence case, on twice its ranks."""
    spec = SynthSpec(ranks=8, steps=3, records=120)
    p = write_pair(tmp_path / "a", tmp_path / "b", spec, PLANTS["all_ranks"])
    local = bisect(p.a, p.b)  # the local walk's own batches, as in the plants' cases
    monkeypatch.setattr(walk, "walk_batch", lambda a, b: 2)
    got, stages = _spark_bisect(spark, p.a, p.b)
    _same(local, got)
    _same(bisect(p.a, p.b), got)
    assert sum(r.status == "diverged" for r in got.ranks) == 8
    assert stages.jobs == {"metrics": 1, "rollups": 1}
    # ... and one read of the first differing steps' metrics rows, both runs in one job, bound to
    # the commit lines' metrics folds before the report names them (issue 43).
    assert stages.a.jobs == {"metrics": 1, "records": 4}, stages.a.jobs


def _mixed_steps(root: Path) -> tuple[Path, Path]:
    """A synthetic pair whose ranks diverge at different steps: B is the pair "early"'s B (an
    origin on rank 0 at step 1, carried to every rank by the all-reduce) with rank 2 taken from
    the pair "late"'s B (an origin on rank 2 at step 3) and rank 3 from A (identical)."""
    import shutil

    spec = SynthSpec(ranks=4, steps=4, records=120)
    early = write_pair(root / "early" / "a", root / "early" / "b", spec, Plant(rank=0, step=1, index=40))
    late = write_pair(root / "late" / "a", root / "late" / "b", spec, Plant(rank=2, step=3, index=70))
    for rank, src in ((2, late.b), (3, early.a)):
        for part in src.glob(f"*/rank={rank}"):
            dest = early.b / part.parent.name / part.name
            shutil.rmtree(dest)
            shutil.copytree(part, dest)
    return early.a, early.b


def _mixed_steps_no_rollups(root: Path) -> tuple[Path, Path]:
    """The same shape from the tiny hand-built runs (no stored rollups: the records' rollups run on
    Spark): rank 0 diverges at step 1, rank 2 at step 3 (from its relu on), ranks 1 and 3 not."""
    return build_pair(
        root,
        world=4,
        steps=range(4),
        edits_b={(0, 1): {"change": ["mm.out"]}, (2, 3): {"after": "relu.out"}},
        open_runs=False,
    )


@pytest.mark.parametrize("make", [_mixed_steps, _mixed_steps_no_rollups], ids=["stored_rollups", "records_rollups"])
def test_ranks_diverging_at_different_steps_give_the_local_report(spark, tmp_path, make):
    """The walk's rank-steps span several steps (rank 0 at step 1, rank 2 at step 3, an identical
    rank): `bisect --engine spark --json` prints the local engine's bytes."""
    a, b = make(tmp_path)
    local = _cli(["bisect", a, b, "--json"])
    assert local[0] == 1
    firsts = {r["rank"]: r["first"]["step"] for r in json.loads(local[1])["ranks"] if r.get("first")}
    assert firsts[0] == 1 and firsts[2] == 3 and 3 not in firsts, firsts
    assert _cli(["bisect", a, b, "--json", "--engine", "spark"]) == local


def _cli(args) -> tuple[int, str, str]:
    r = CliRunner().invoke(app, [str(x) for x in args])
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    return r.exit_code, r.stdout, r.stderr


def test_command_line_reports_are_byte_identical(spark):
    """The text report through the command (in-process: the shared session is the active one; the
    library tests above compare JSON and text, the slow real-process test --json)."""
    a, b = SAMPLES / "data_rank/a", SAMPLES / "data_rank/b"
    local = _cli(["bisect", a, b])
    assert local[0] == 1 and local[1].startswith("A = ")
    assert _cli(["bisect", a, b, "--engine", "spark"]) == local


def _damaged(root: Path) -> Path:
    """A copy of sample ops/b whose records shard of rank 1 has its data pages overwritten (footer intact)."""
    import shutil

    b = root / "b"
    shutil.copytree(SAMPLES / "ops/b", b)
    shard = sorted((b / "records" / "rank=1").glob("*.parquet"))[0]
    data = bytearray(shard.read_bytes())
    body = len(data) - int.from_bytes(data[-8:-4], "little") - 8
    for i in range(8, body - 8, 3):
        data[i] ^= 0x5A
    shard.write_bytes(bytes(data))
    return b


def _incomparable(root: Path) -> Path:
    import shutil

    b = root / "inc"
    shutil.copytree(SAMPLES / "ops/b", b)
    for m in (b / "manifest").glob("rank=*/segment-*.json"):
        doc = json.loads(m.read_text())
        doc["world_size"] = 3
        m.write_text(json.dumps(doc))
    return b


@pytest.mark.parametrize("case", ["missing_run", "not_a_run", "corrupt_shard", "incomparable", "bad_conf"])
def test_bad_input_gets_the_local_engines_line_and_exit_2(spark, tmp_path, case):
    a = SAMPLES / "ops/a"
    b = {
        "missing_run": lambda: tmp_path / "nope",
        "not_a_run": lambda: SAMPLES,
        "corrupt_shard": lambda: _damaged(tmp_path),
        "incomparable": lambda: _incomparable(tmp_path),
        "bad_conf": lambda: SAMPLES / "ops/b",
    }[case]()
    conf = ["--conf", "spark.sql.shuffle.partitions"] if case == "bad_conf" else []  # no "=VALUE"
    code, out, err = _cli(["bisect", a, b, "--engine", "spark", *conf])
    assert code == 2 and out == "" and err.count("\n") == 1 and err.startswith("detfp-analyze: "), err
    assert "Traceback" not in err and "\tat " not in err and "py4j" not in err
    if case == "bad_conf":
        assert "--conf 'spark.sql.shuffle.partitions': not KEY=VALUE" in err
        return
    local = _cli(["bisect", a, b])
    assert local[0] == 2
    if case == "corrupt_shard":  # the decoder's own words differ; the diagnosis and the fix do not
        prefix = "detfp-analyze: a shard could not be decoded ("
        assert local[2].startswith(prefix) and err.startswith(prefix), (local[2], err)
        assert err.endswith("then delete the shard or re-run the capture\n")
    else:
        assert err == local[2]


@pytest.mark.slow
def test_a_real_process_keeps_sparks_noise_off_the_terminal(spark):
    """The command in a process of its own (its own JVM, local[1]): stdout is the local engine's
    JSON byte for byte, stderr is empty (no log4j banner, no progress bar, no warning). Slow (a
    second JVM start, ~30-70 s on the shared 2-core machine): outside the default suite."""
    a, b = SAMPLES / "nondet/a", SAMPLES / "nondet/b"
    local = _cli(["bisect", a, b, "--json"])
    cmd = [sys.executable, "-m", "detfp_analyze", "bisect", str(a), str(b), "--json"]
    cmd += ["--engine", "spark", "--master", "local[1]", "--conf", "spark.sql.shuffle.partitions=1"]
    cmd += ["--conf", "spark.driver.extraJavaOptions=-XX:TieredStopAtLevel=1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=500, cwd=REPO, env={**os.environ})
    assert (proc.returncode, proc.stdout, proc.stderr) == (1, local[1], "")


def test_reading_a_table_costs_the_same_py4j_round_trips_for_any_number_of_shards(spark, planted_pairs, monkeypatch):
    """``source.table`` hands the JVM its shard list and columns in a fixed number of py4j round
    trips: pyspark's own list conversion costs one per element (a Spark bisect of 64 ranks made
    8,600 round trips, 2,600 of them for shard lists). Counted without py4j's garbage-collection
    messages, whose timing is Python's."""
    import py4j.clientserver

    from detfp_analyze.spark import source

    run = open_run(planted_pairs["identical"].a)
    sent: list[str] = []
    send = py4j.clientserver.ClientServerConnection.send_command

    def counting(self, command):
        if not command.startswith("m\nd\n"):  # py4j's "memory: delete" for a collected Python proxy
            sent.append(command)
        return send(self, command)

    monkeypatch.setattr(py4j.clientserver.ClientServerConnection, "send_command", counting)
    counts = {}
    for ranks in ([0], sorted(run.ranks)):
        sent.clear()
        source.table(spark, run, "records", ranks, provenance=True, columns=("rank", "step", "seq"), where="step = 1")
        counts[len(run.files("records", ranks))] = len(sent)
    assert len(counts) == 2 and len(set(counts.values())) == 1, counts  # {shards: round trips}


def test_stages_asked_about_no_ranks_answer_as_the_local_stages(spark, tmp_path):
    """Every stage given no ranks (or no peers) selects no rows, as the local stages do; Spark's
    SQL has no empty ``IN ()`` list, so the predicates built as text must say ``false`` there."""
    from detfp_analyze.bisect.engine import LocalStages
    from detfp_analyze.spark import engine

    p = write_pair(tmp_path / "a", tmp_path / "b", SynthSpec(ranks=2, steps=2, records=120), PLANTS["all_ranks"])
    a, b = open_run(p.a), open_run(p.b)
    local, remote = LocalStages(a, b), engine(spark)(a, b)
    for st in (local, remote):
        assert st.metric_divergence([], 0, 1).height == 0
        assert all(f.height == 0 for f in st.block_rollups([], 0, 1))
        errors = [0, 0]
        assert st.rollup_candidates([], 0, 1, None, "steps", errors) == {} and errors == [0, 0]
        assert st.peer_inputs([(0, 1, 7, ())]) == {}
    remote.a.fetch("records", keys=[])  # no rank-steps: no rows, no error
