"""Golden answers on the bundled sample_traces/ (recorded by scripts/make_sample_traces.sh).

Each pair is a real 2-rank run of examples/train_tiny.py with one planted cause of
divergence; the expected answer is where the plant went in. No training runs here: this is
the fast, always-on check that bisect still reads recorded traces the way it should.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from detfp_analyze.bisect import bisect
from detfp_analyze.io.reader import open_run

SAMPLES = Path(__file__).resolve().parents[2] / "sample_traces"


def _bisect(a: str, b: str) -> dict:
    return bisect(open_run(SAMPLES / a), open_run(SAMPLES / b)).to_json_dict()


def _ranks(r: dict) -> dict[int, dict]:
    return {x["rank"]: x for x in r["ranks"]}


def test_samples_are_small():
    size = sum(f.stat().st_size for f in SAMPLES.rglob("*") if f.is_file())
    assert 0 < size < 3_000_000


def test_nondet_boundaries_points_at_the_moe_on_every_rank():
    r = _bisect("nondet/a", "nondet/b")
    assert (r["status"], r["first_step"], r["diagnosis"]["pattern"]) == ("diverged", 1, "all_ranks_same_op")
    for x in r["ranks"]:
        assert (x["step"], x["phase"], x["module"], x["kind"], x["verdict"]) == (
            1,
            "forward",
            "blocks.0.moe",
            "module_output",
            "origin",
        )


def test_nondet_ops_names_the_combine_op():
    r = _bisect("ops/a", "ops/b")
    assert r["first_step"] == 1 and r["diagnosis"]["pattern"] == "all_ranks_same_op"
    assert r["diagnosis"]["origin_ranks"] == [0, 1]
    for x in r["ranks"]:
        assert (x["op"], x["module"], x["verdict"]) == ("detfp_example::index_add.default", "blocks.0.moe", "origin")


def test_data_rank_is_a_source_on_rank_1():
    r = _bisect("data_rank/a", "data_rank/b")
    assert r["first_step"] == 1 and r["diagnosis"]["pattern"] == "single_rank"
    assert r["diagnosis"]["origin_ranks"] == [1]
    ranks = _ranks(r)
    assert (ranks[1]["kind"], ranks[1]["verdict"]) == ("batch", "source")
    assert ranks[0]["verdict"] == "receiver"


def test_moe_permute_is_a_permutation():
    r = _bisect("moe_permute/a", "moe_permute/b")
    assert r["first_step"] == 1 and r["diff"]["kind"] == "permutation"
    assert {(x["kind"], x["op"]) for x in r["ranks"]} == {("probe", "moe.dispatch")}


@pytest.mark.parametrize(("resumed", "status"), [("resume/resumed", "diverged"), ("resume/restored", "identical")])
def test_resume_alignment(resumed, status):
    r = _bisect("resume/full", resumed)
    assert r["status"] == status
    if status == "diverged":
        assert r["first_step"] == 2
        assert {(x["step"], x["kind"], x["verdict"]) for x in r["ranks"]} == {(2, "rng_state", "source")}


def test_cli_exit_codes_on_samples():
    cli = [sys.executable, "-m", "detfp_analyze", "bisect"]
    same = subprocess.run(
        [*cli, str(SAMPLES / "resume/full"), str(SAMPLES / "resume/restored")], capture_output=True, text=True
    )
    assert same.returncode == 0, same.stderr
    diff = subprocess.run(
        [*cli, str(SAMPLES / "data_rank/a"), str(SAMPLES / "data_rank/b")], capture_output=True, text=True
    )
    assert diff.returncode == 1 and "single_rank" in diff.stdout, diff.stderr
