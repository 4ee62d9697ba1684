"""A user's 2-rank DDP ViT, one setting or piece of state changed between two runs (issue 42).

The zoo member ``tests/fixtures/zoo/vit_train.py`` is launched once over gloo (every job of the
plan in one process per rank) and captured for real at level ``boundaries``, without
``torch.use_deterministic_algorithms``. Each test is a change a user made and checks the first
sentence of the diagnosis, which names that change, never a kernel:

1. autocast bf16 in A, fp16 in B: a dtype difference named by the autocast setting;
2. ``torch.backends.mkldnn.enabled = False`` on both ranks of B: the setting, on every rank;
3. rank 0 of B loads a checkpoint without ``head.bias`` (``strict=False``) before DDP broadcasts
   it: a source at "state before step 0: head.bias";
4. B raises at step 3: status ``ended_early``, exit 1, also with ``--json``; ``--allow-incomplete``
   and a gate expecting it pass;
5. gradient accumulation 2 vs 4 micro-batches: "forward calls per step: A 2, B 4" and the hint to
   label micro-batches;

and the member's invariants: an identical pair is identical, capture on vs off is bitwise equal.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from detfp_analyze.cli import app
from detfp_analyze.render.report import render_text
from detfp_analyze.sql import connect
from tests.fixtures.zoo.harness import ZOO, check_identical, check_onoff, expect, launch, pair

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(900)]

SCRIPT = ZOO / "vit_train.py"
STEPS = 5
CRASH = 3


def _plan(root: Path) -> list[dict[str, Any]]:
    def job(name: str, **kw: Any) -> dict[str, Any]:
        return {"steps": STEPS, "level": "boundaries", "out": str(root / name), "name": name, **kw}

    ck = str(root / "ckpt.pt")
    return [
        {"name": "off", "steps": STEPS, "autocast": "bf16"},  # capture off: the on/off check
        job("a", autocast="bf16"),
        job("twin", autocast="bf16"),
        job("fp16", autocast="fp16"),
        job("crash", autocast="bf16", crash_step=CRASH),
        job("plain"),
        job("nomkl", mkldnn=False),
        {"name": "save", "steps": 0, "init_seed": 5, "ckpt_save": ck},  # another init, saved by rank 0
        job("ck_a", ckpt_load=ck),
        job("ck_b", ckpt_load=ck, drop=["head.bias"]),
        job("acc2", accum=2),
        job("acc4", accum=4),
    ]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("vit")
    launch(SCRIPT, _plan(root), root, "vit", nproc=2)
    return root


def _cli(*args: Any) -> Any:
    return CliRunner().invoke(app, [str(a) for a in args])


def test_identical_pair_and_capture_off(runs):
    res = check_identical(runs / "a", runs / "twin")
    text = render_text(res)
    expect("also differs" not in text.lower() and res.diagnosis.cause == "none", "no setting note", res)
    check_onoff(runs, "off", ["a", "twin"], [0, 1])


def test_an_autocast_dtype_change_is_named_not_a_kernel(runs):
    res = pair(runs / "a", runs / "fp16")
    dg = res.diagnosis
    expect(dg.cause == "setting", "the autocast setting is the cause", res)
    expect(dg.headline.startswith('determinism.autocast.cpu.dtype differs ("torch.bfloat16" -> "torch.float16") and '
                                  "most likely caused this"), dg.headline, res)  # fmt: skip
    expect("(its dtype: bfloat16 -> float16)" in dg.headline and "nondeterministic" not in dg.explanation, "dtype", res)
    d = res.rank(0).first
    expect(d is not None and d.diff_kind == "dtype" and d.diff is not None, "the difference kind", res)
    assert (d.diff.dtype_a, d.diff.dtype_b) == ("torch.bfloat16", "torch.float16")
    assert d.diff.detail.startswith("the dtype differs (bfloat16 -> float16): an autocast dtype or a cast changed")
    env = _cli("env", runs / "a", runs / "fp16")
    assert 'determinism.autocast.cpu.dtype: "torch.bfloat16" -> "torch.float16"' in env.output, env.output


def test_a_backend_flag_off_on_every_rank_is_the_setting(runs):
    res = pair(runs / "plain", runs / "nomkl")
    dg = res.diagnosis
    expect(dg.cause == "setting" and dg.headline.startswith("determinism.backends.mkldnn.enabled differs (true -> "
                                                            "false) and most likely caused this"), dg.headline, res)  # fmt: skip
    expect(dg.cause != "rank_local" and "Only rank" not in dg.explanation, "not one rank's problem", res)
    expect(dg.next_steps[0].startswith("rerun B with A's value (determinism.backends.mkldnn.enabled = true)"), "next", res)


def test_a_checkpoint_missing_a_key_is_the_state_before_step_0(runs):
    res = pair(runs / "ck_a", runs / "ck_b")
    dg = res.diagnosis
    expect(dg.cause == "restore" and dg.pattern == "all_ranks_same_source", "a source on every rank", res)
    expect(dg.headline.startswith("The state before step 0 differs: head.bias (a parameter) on every rank (0-1)"),
           dg.headline, res)  # fmt: skip
    for rr in res.ranks:
        f = rr.first
        expect(f is not None and (f.kind, f.op, f.verdict, f.arg) == ("state", "head.bias", "source", "param"), "", res)
    assert "state before step 0: head.bias" in render_text(res)


def test_a_run_that_died_never_passes(runs, tmp_path):
    a, b = runs / "a", runs / "crash"
    res = pair(a, b)
    expect(res.status == "ended_early" and res.diagnosis.cause == "ended_early", "its own status", res)
    expect(res.diagnosis.headline.startswith(f"Run B ended at step {CRASH}: step {CRASH} raised RuntimeError: user "
                                             f"bug at step {CRASH}"), res.diagnosis.headline, res)  # fmt: skip
    assert [(e.side, e.step, e.ranks) for e in res.endings] == [("B", CRASH, (0, 1))]
    text = _cli("bisect", a, b)
    assert text.exit_code == 1 and text.output.splitlines()[2].startswith("status: ended_early (run B ended at step 3")
    doc = _cli("bisect", a, b, "--json")
    got = json.loads(doc.output)
    assert doc.exit_code == 1 and got["status"] == "ended_early" and got["endings"][0]["run"] == "B"
    allowed = _cli("bisect", a, b, "--allow-incomplete")
    assert allowed.exit_code == 0 and "status: identical; cause ended_early" in allowed.output, allowed.output
    assert f"Run B ended at step {CRASH}" in allowed.output  # still said
    gate = tmp_path / "expect.toml"
    gate.write_text('[[expect]]\nstatus = "ended_early"\nsteps = 3\nreason = "the smoke run stops at step 3"\n')
    ok = _cli("bisect", a, b, "--expect", gate)
    assert ok.exit_code == 0 and "gate: pass (the early end expected: ranks 0-1)" in ok.output, ok.output
    other = tmp_path / "other.toml"
    other.write_text('[[expect]]\nmodule = "head"\nreason = "a changed head"\n')
    failed = _cli("bisect", a, b, "--expect", other)
    assert failed.exit_code == 1 and "gate: FAIL (a run ended early on ranks 0-1)" in failed.output, failed.output


def test_gradient_accumulation_counts_the_forward_calls(runs):
    res = pair(runs / "acc2", runs / "acc4")
    dg = res.diagnosis
    expect(dg.cause == "control_flow" and dg.pattern == "control_flow", "control flow", res)
    expect(dg.headline.startswith("Control flow differs: forward calls per step: A 2, B 4 (step 0) on every rank "
                                  "(0-1)"), dg.headline, res)  # fmt: skip
    expect("run one run" not in dg.explanation, "the typo", res)
    expect(any("session.microbatch(i)" in s for s in dg.next_steps), "the micro-batch hint", res)
    text = render_text(res)
    assert "loss has a value in run B only in step 0 (its values before that match)" in text, text


def test_sql_and_text_agree_and_each_note_is_said_once(runs):
    res = pair(runs / "plain", runs / "nomkl")
    text = render_text(res)
    # Each rank group says its difference's size once; the summary after the diagnosis does not repeat it.
    groups = [ln for ln in text.splitlines() if ln.startswith("  rank")]
    assert text.count("magnitude unknown") == len(groups) == 2, text
    assert "magnitude unknown" not in text.split("difference at rank", 1)[1], text
    con = connect(runs / "plain", runs / "nomkl")
    try:
        got = con.sql("SELECT rank, kind, module, call_inputs, inputs_differing FROM first_divergence").fetchall()
    finally:
        con.close()
    first = res.rank(0).first
    assert first is not None and f"all {got[0][3]} input(s) of" in first.explanation, (got, first.explanation)
    assert [r[1:] for r in got] == [("module_output", "patch", 1, 0)] * 2
