"""Golden-trace gates on the sample traces: --ignore-env, --expect (TOML/JSON allowlists, the JSON
gate object, exit codes) and ``golden update``."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from detfp_analyze.bisect import bisect
from detfp_analyze.bisect.result import RankResult
from detfp_analyze.errors import ExpectationError
from detfp_analyze.gate.expectations import Expectation, evaluate, load_expectations, render_gate
from detfp_analyze.io.reader import open_run

SAMPLES = Path(__file__).resolve().parents[2] / "sample_traces"
runner = CliRunner()

# nondet: both ranks' first divergence is the MoE module of block 0 at step 1 (origin);
# data_rank: rank 1's batch differs at step 1 (source) and rank 0 receives it.
EXPECT_MOE = """
[[expect]]
module = "blocks.0.*"
op = "MoE"
steps = "1-2"
reason = "MoE combine now adds in another order (PR 42)"

[[expect]]
op = "aten::embedding*"
phase = "backward"
reason = "not in these traces"
"""


def _cli(*args: str):
    from detfp_analyze.cli import app

    return runner.invoke(app, list(args))


@pytest.fixture
def samples(tmp_path, monkeypatch):
    for pair in ("nondet", "data_rank", "ops"):
        shutil.copytree(SAMPLES / pair, tmp_path / pair)
    (tmp_path / "expect.toml").write_text(EXPECT_MOE)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_expected_divergence_passes_and_any_other_fails(samples):
    out = _cli("bisect", "nondet/a", "nondet/b", "--expect", "expect.toml")
    assert out.exit_code == 0, out.output
    assert out.output.endswith(
        "gate: pass (every divergence expected: ranks 0-1); expectations from expect.toml\n"
        "  [1] matched ranks 0-1: module=blocks.0.* op=MoE steps=1-2 -- MoE combine now adds in another order (PR 42)\n"
        "  [2] not matched: op=aten::embedding* phase=backward -- not in these traces\n"
    )
    out = _cli("bisect", "data_rank/a", "data_rank/b", "--expect", "expect.toml")
    assert out.exit_code == 1
    assert "gate: FAIL (unexpected divergence on ranks 0-1); expectations from expect.toml\n" in out.output
    # Without --expect nothing changes: a divergence is exit 1 and there is no gate key.
    plain = _cli("bisect", "nondet/a", "nondet/b", "--json")
    assert plain.exit_code == 1 and "gate" not in json.loads(plain.output)


def test_json_report_says_which_expectations_matched(samples):
    (samples / "expect.json").write_text(
        json.dumps({"expect": [{"module": "blocks.0.moe", "verdict": "origin", "ranks": [0], "reason": "rank 0 only"}]})
    )
    out = _cli("bisect", "nondet/a", "nondet/b", "--expect", "expect.json", "--json")
    assert out.exit_code == 1  # rank 1 diverged too, and nothing expects it
    gate = json.loads(out.output)["gate"]
    assert gate == {
        "status": "fail",
        "file": "expect.json",
        "expected_ranks": [0],
        "unexpected_ranks": [1],
        "expectations": [
            {
                "index": 1,
                "reason": "rank 0 only",
                "pattern": {"module": "blocks.0.moe", "verdict": "origin", "ranks": "0"},
                "matched": True,
                "ranks": [0],
            }
        ],
    }


def test_steps_ranks_and_metric_only_divergences(samples):
    res = bisect(open_run("nondet/a"), open_run("nondet/b"))
    later = Expectation(1, "later step", module="blocks.0.moe", steps="2-")
    assert evaluate(res, [later]).unexpected_ranks == (0, 1)
    assert evaluate(res, [Expectation(1, "any op", op="*")]).passed
    # A rank whose metrics alone differ is matched by `metric`, never by record patterns.
    only_metric = dataclasses.replace(
        res, ranks=(RankResult(0, "diverged", 3, metric_step=3, metric_name="loss", metric_a=1.0, metric_b=2.0),)
    )
    assert evaluate(only_metric, [Expectation(1, "loss", metric="lo*", steps="3")]).passed
    assert not evaluate(only_metric, [Expectation(1, "ops", op="*")]).passed
    assert not evaluate(only_metric, [Expectation(1, "loss", metric="loss", steps="4-")]).passed
    identical = dataclasses.replace(res, status="identical", ranks=(RankResult(0, "identical", None),))
    gate = evaluate(identical, [later], "e.toml")
    assert gate.passed and render_gate(gate).startswith("gate: pass (no divergence); expectations from e.toml\n")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[[expect]]\nop = 'x'\n", "expect.toml: expectation 1: no reason; say why this divergence is intended"),
        ("[[expect]]\nreason = 'r'\n", "expect.toml: expectation 1: matches nothing in particular; give at least one"),
        ("[[expect]]\nreason = 'r'\nopp = 'x'\n", "expect.toml: expectation 1: unknown field(s) opp; use kind, "),
        ("[[expect]]\nreason = 'r'\nverdict = 'orign'\n", "expect.toml: expectation 1: verdict='orign' is not one of"),
        ("[[expect]]\nreason = 'r'\nop = 'x'\nsteps = '3-x'\n", "expect.toml: expectation 1: steps='3-x' is not a"),
        ("[[expect]\n", "expect.toml: not valid TOML ("),
        ("[expectations]\n", "expect.toml: unknown top-level key(s) expectations; put every entry under 'expect'"),
    ],
)
def test_bad_expectation_files_are_one_line_and_exit_two(samples, text, message):
    (samples / "expect.toml").write_text(text)
    out = _cli("bisect", "nondet/a", "nondet/b", "--expect", "expect.toml")
    assert out.exit_code == 2 and out.stdout == ""
    assert out.stderr.startswith(f"detfp-analyze: {message}") and out.stderr.count("\n") == 1
    with pytest.raises(ExpectationError):
        load_expectations(samples / "expect.toml")


def test_ignore_env_globs_for_facts_that_may_differ(samples):
    # Run B was captured at another commit of the training code.
    for m in (samples / "ops/b/manifest").glob("rank=*/segment-*.json"):
        doc = json.loads(m.read_text())
        doc["git"]["commit"] = "0" * 40
        m.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    out = _cli("bisect", "ops/a", "ops/b", "--json")
    assert [d["key"] for d in json.loads(out.output)["env_diff"]] == ["git.commit"]
    out = _cli("bisect", "ops/a", "ops/b", "--json", "--ignore-env", "git.*", "--ignore-env", "host.hostname")
    doc = json.loads(out.output)
    assert doc["env_diff"] == [] and "environment differences ignored as asked: git.commit" in doc["notes"]
    env = _cli("env", "ops/a", "ops/b", "--ignore-env", "git.*")
    assert env.exit_code == 0 and "manifests: no difference" in env.output
    # A blocking key blocks until it is ignored on purpose.
    for m in (samples / "data_rank" / "b" / "manifest").glob("rank=*/*.json"):
        doc = json.loads(m.read_text())
        doc["parallel"] = {"tp": 2}
        m.write_text(json.dumps(doc))
    blocked = _cli("bisect", "data_rank/a", "data_rank/b")
    assert blocked.exit_code == 2 and "parallel.tp differs" in blocked.stderr
    assert _cli("bisect", "data_rank/a", "data_rank/b", "--ignore-env", "parallel.*").exit_code == 1


def _tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_golden_update_prints_what_changed_and_replaces(samples):
    shutil.copytree("nondet/a", "golden")
    dry = _cli("golden", "update", "golden", "nondet/b", "--dry-run")
    assert dry.exit_code == 0 and dry.output.startswith(
        "golden golden <- nondet/b: not replaced (dry run)\n\nA = golden\n"
    )
    assert _tree(samples / "golden") == _tree(samples / "nondet" / "a")
    out = _cli("golden", "update", "golden", "nondet/b")
    assert out.exit_code == 0
    assert out.output.startswith("golden golden <- nondet/b: replaced\n\nA = golden\nB = nondet/b\n")
    assert "  ranks 0-1: step 1 origin at forward blocks.0.moe module_output:MoE output out[0]\n" in out.output
    assert _tree(samples / "golden") == _tree(samples / "nondet" / "b")
    assert sorted(p.name for p in samples.iterdir() if p.name.startswith(".golden")) == []
    same = _cli("golden", "update", "golden", "nondet/b")
    assert "bitwise: the new run matches the golden (only the manifests may differ)\n" in same.output
    fresh = _cli("golden", "update", "new-golden", "ops/a", "--json")
    assert fresh.exit_code == 0 and json.loads(fresh.output)["action"] == "created"
    assert _tree(samples / "new-golden") == _tree(samples / "ops" / "a")


def test_golden_update_refuses_what_is_not_a_run(samples):
    (samples / "notes").mkdir()
    (samples / "notes" / "todo.txt").write_text("keep me")
    out = _cli("golden", "update", "notes", "nondet/a")
    assert out.exit_code == 2 and "refusing to replace it" in out.stderr
    assert (samples / "notes" / "todo.txt").read_text() == "keep me"
    bad_new = _cli("golden", "update", "nondet/a", "missing-run")
    assert bad_new.exit_code == 2 and "missing-run: no such directory" in bad_new.stderr
    assert _cli("golden", "update", "nondet/a", "nondet/a").exit_code == 2
    # The new world size or layout is a reason to re-record, not to refuse.
    for m in (samples / "ops" / "b" / "manifest").glob("rank=*/*.json"):
        doc = json.loads(m.read_text())
        doc["parallel"] = {"tp": 2}
        m.write_text(json.dumps(doc))
    out = _cli("golden", "update", "ops/a", "ops/b")
    assert out.exit_code == 0 and "not comparable bit for bit: ops/a vs ops/b: parallel.tp differs" in out.output
