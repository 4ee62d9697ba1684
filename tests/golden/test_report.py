"""The bisect CLI and its reports: exit codes, one-line errors, byte-stable text and JSON."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from detfp_analyze.bisect import bisect
from detfp_analyze.bisect.result import REPORT_VERSION
from detfp_analyze.render.report import render_text
from tests.fixtures.pairs import build_pair

runner = CliRunner()


def _invoke(*args: str):
    from detfp_analyze.cli import app

    return runner.invoke(app, list(args))


@pytest.fixture
def pair(tmp_path, monkeypatch):
    edits = {(0, 1): {"after": "mm.out"}, (1, 1): {"change": ("ar.out",)}}
    build_pair(tmp_path, world=2, edits_b=edits, open_runs=False)
    build_pair(tmp_path / "same", world=2, open_runs=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_text_report_golden(pair):
    out = _invoke("bisect", "a", "b")
    assert out.exit_code == 1
    assert out.output == (
        "A = a\n"
        "B = b\n"
        "status: diverged, first at step 1; pattern single_rank; cause rank_local\n"
        "environment: no difference\n"
        "window: steps 0-2 (A 0-2, B 0-2), ranks 0-1; captured at level ops, bisect depth op\n"
        "ranks:\n"
        "  rank 0: step 1 origin at forward l1 op:aten::mm.default output out[0]\n"
        "    all 2 input(s) of aten::mm.default in l1 matched and its output out[0] differs: this call introduced the difference\n"
        "    seq A 18 / B 18\n"
        "    difference: values (fingerprint): magnitude unknown (capture moments or dumps to see it)\n"
        "  rank 1: step 1 receiver at backward <root> collective:all_reduce@dp output out[0]\n"
        "    all_reduce@dp in <root>: this rank's inputs matched but 1 of 1 peer(s) in group dp had differing inputs (ranks 0): a carrier of a difference that started elsewhere\n"
        "    seq A 26 / B 26\n"
        "    difference: values (fingerprint): magnitude unknown (capture moments or dumps to see it)\n"
        "diagnosis: Only rank 0 starts the difference, at aten::mm.default in l1 (forward, step 1) with matching inputs: look at what differs there (its input data, placement, topology, reduction order).\n"
        "  cause rank_local; pattern single_rank; origin ranks 0\n"
        "  next: compare what those ranks do differently: their batch, device and host, their place in each reduction\n"
        '  next: compare the kernels under it: bisect --depth kernel --steps 1 on runs that captured them (Session("NEW_DIR", level="ops", steps="1", kernels="1") in the script)\n'
        "difference at rank 0: values, confirmed by fingerprint\n"
        "discriminator: aten::mm.default on ranks 0, step(s) 1\n"
        "  divergent    1 clean    0  forward l1 torch.float32 [4]\n"
        "  divergent    1 clean    0  forward l2 torch.float32 [4]\n"
    )


def test_identical_exit_zero_and_folded_ranks(pair):
    out = _invoke("bisect", "same/a", "same/b")
    assert out.exit_code == 0
    assert "status: identical\n" in out.output
    assert "  ranks 0-1: identical\n" in out.output


def test_json_schema_and_byte_stability(pair):
    first = _invoke("bisect", "a", "b", "--json")
    second = _invoke("bisect", "a", "b", "--json")
    assert first.exit_code == 1 and first.output == second.output
    doc = json.loads(first.output)
    assert doc["report_version"] == REPORT_VERSION
    assert doc["status"] == "diverged" and doc["first_step"] == 1
    assert (doc["a"], doc["b"]) == ("a", "b")
    for key in ("env_diff", "ranks", "diagnosis", "diff", "window", "resume", "discriminator", "notes"):
        assert key in doc
    r0 = doc["ranks"][0]
    for key in ("rank", "step", "phase", "module", "op", "verdict", "kind", "hazards", "seq_a", "seq_b", "kernels"):
        assert key in r0
    assert (r0["rank"], r0["step"], r0["module"], r0["op"], r0["verdict"], r0["kind"]) == (
        0,
        1,
        "l1",
        "aten::mm.default",
        "origin",
        "op",
    )
    assert doc["diagnosis"]["pattern"] == "single_rank" and doc["diagnosis"]["origin_ranks"] == [0]
    assert doc["diff"]["kind"] == "values" and doc["diff"]["rank"] == 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--ranks", "x"],
            "detfp-analyze: --ranks 'x': cannot parse 'x'; use comma-separated numbers and ranges like '3-5,9' or '10-'\n",
        ),
        (["--steps", "5-3"], "detfp-analyze: --steps '5-3': range '5-3' is empty; write the lower bound first\n"),
        (["--depth", "deep"], "detfp-analyze: --depth 'deep': not a depth; use one of step|phase|module|op|kernel\n"),
        (
            ["--level", "deep"],
            "detfp-analyze: --level 'deep': not a depth; use one of step|phase|module|op|kernel "
            "(--level is deprecated: use --depth)\n",
        ),
        (
            ["--depth", "op", "--level", "step"],
            "detfp-analyze: --depth 'op' and --level 'step' disagree; pass --depth alone (--level is its deprecated "
            "name)\n",
        ),
        (
            ["--ranks", "7"],
            "detfp-analyze: a vs b: rank(s) 7 are in neither run (ranks present: 0-1); pick ranks from those\n",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_two(pair, args, message):
    out = _invoke("bisect", "a", "b", *args)
    assert out.exit_code == 2
    assert out.stderr == message


def test_incomparable_needs_force(tmp_path, monkeypatch):
    build_pair(tmp_path, world=2, manifest_b={"groups": {"dp": [0, 1], "tp": [0]}}, open_runs=False)
    monkeypatch.chdir(tmp_path)
    out = _invoke("bisect", "a", "b")
    assert out.exit_code == 2
    assert out.stderr == (
        "detfp-analyze: a vs b: groups.tp differs (null vs [0]), so records cannot be compared bit for bit; "
        "rerun with matching settings or pass --force\n"
    )
    forced = _invoke("bisect", "a", "b", "--force")
    assert forced.exit_code == 0
    assert "groups.tp: null -> [0] (blocking, forced)" in forced.output


def test_levels_and_selection_on_the_cli(pair):
    out = _invoke("bisect", "a", "b", "--depth", "step", "--ranks", "1", "--steps", "1")
    assert out.exit_code == 1
    assert "  rank 1: step 1 records differ\n" in out.output
    assert "; pattern undetermined; cause undetermined\n" in out.output
    assert out.stderr == ""
    # The old flag still works: the same report, and one line on stderr saying the new name.
    old = _invoke("bisect", "a", "b", "--level", "step", "--ranks", "1", "--steps", "1")
    assert (old.exit_code, old.stdout) == (1, out.stdout)
    assert old.stderr == (
        "detfp-analyze: --level is deprecated for the narrowing depth (capture's --level names what was recorded); "
        "use --depth step\n"
    )
    out = _invoke("bisect", "a", "b", "--steps", "2")
    assert out.exit_code == 0


def test_selector_flags_share_the_capture_grammar(tmp_path):
    """--ranks/--steps take the capture's selector text: lists, ranges, open ends, ``all``."""
    a, b = build_pair(tmp_path, world=3, steps=range(3), edits_b={(1, 2): {"after": "relu.out"}})
    cases = {
        ("--ranks", "1-"): "ranks 1-2; captured",
        ("--steps", "2-"): "rank 1: step 2 origin",
        ("--steps", "all"): "rank 1: step 2 origin",
        ("--ranks", "all"): "rank 1: step 2 origin",
    }
    for (flag, value), expected in cases.items():
        res = _invoke("bisect", str(a.path), str(b.path), flag, value)
        assert res.exit_code == 1 and expected in res.output, (flag, value, res.output)
    res = _invoke("bisect", str(a.path), str(b.path), "--ranks", "0,2")
    assert res.exit_code == 0, res.output
    res = _invoke("bisect", str(a.path), str(b.path), "--steps", "0-1")
    assert res.exit_code == 0, res.output
    for flag, bad in (("--ranks", "a"), ("--ranks", "3-1"), ("--steps", "0,2"), ("--steps", "-1"), ("--ranks", "5-")):
        res = _invoke("bisect", str(a.path), str(b.path), flag, bad)
        assert res.exit_code == 2, (flag, bad, res.output)
        assert flag in res.output and len(res.output.strip().splitlines()) == 1, res.output


def test_render_text_is_pure_and_stable(tmp_path):
    a, b = build_pair(tmp_path, world=3, edits_b={(r, 0): {"after": "relu.out"} for r in range(3)})
    res = bisect(a, b)
    assert render_text(res) == render_text(bisect(a, b))
    assert "ranks 0-2: step 0 origin at forward l2 op:aten::relu.default output out[0]" in render_text(res)


def test_allow_missing_ranks_is_counted_in_notes(tmp_path, monkeypatch):
    from tests.fixtures.pairs import records_for
    from tests.fixtures.shards import write_run

    full = {r: {"records": records_for(r, range(2))} for r in range(2)}
    write_run(tmp_path / "a", full, world_size=2)
    write_run(tmp_path / "b", {0: full[0]}, world_size=2)
    monkeypatch.chdir(tmp_path)
    assert _invoke("bisect", "a", "b").exit_code == 2
    out = _invoke("bisect", "a", "b", "--allow-missing-ranks")
    assert out.exit_code == 0
    assert "  missing ranks tolerated: A none, B 1\n" in out.output
    assert "  ranks 1 exist in one run only and were not compared\n" in out.output
    assert "window: steps 0-1 (A 0-1, B 0-1), ranks 0; captured at level ops, bisect depth op\n" in out.output


@pytest.mark.parametrize("command", [["bisect"], ["plot"], ["export"], ["golden", "update"]])
def test_every_bisecting_command_says_depth_not_level(command):
    # One word for bisect's depth, apart from capture's --level; the old flag is listed as deprecated.
    text = " ".join(_invoke(*command, "--help").output.split())
    assert "--depth DEPTH Narrowing depth: step|phase|module|op|kernel (default: op)." in text
    assert "--level DEPTH Deprecated: the old name of --depth." in text
