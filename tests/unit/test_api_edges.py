"""Edges a new user of detfp_analyze hits first: paths everywhere, short reprs, a clean dir(),
plain --help, one "all ranks" in certify's text, and --level module naming what it can."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

import detfp_analyze
from detfp_analyze.bisect import bisect
from detfp_analyze.cli import app
from detfp_analyze.io.reader import open_run
from detfp_analyze.render.report import render_text
from tests.fixtures.shards import write_run
from tests.unit.test_certify import clean

SAMPLES = Path(__file__).parent.parent.parent / "sample_traces"
OPS = (str(SAMPLES / "ops" / "a"), str(SAMPLES / "ops" / "b"))


def test_every_entry_point_takes_a_path_or_a_run():
    import detfp_analyze.bisect  # binds the submodule on the package: the function must stay

    a, b = OPS
    by_path = detfp_analyze.bisect(a, b)
    by_run = detfp_analyze.bisect(open_run(a), open_run(b))
    assert by_path.to_json_dict() == by_run.to_json_dict()
    assert by_path.label_a == a  # labels are the paths as given
    assert detfp_analyze.env_diff(a, b) == detfp_analyze.env_diff(open_run(a), open_run(b))
    assert detfp_analyze.summarize(a) == detfp_analyze.summarize(open_run(a))
    assert detfp_analyze.certify(a).to_json_dict() == detfp_analyze.certify(open_run(a)).to_json_dict()
    with detfp_analyze.connect(a, b) as con:
        assert con.execute("SELECT count(*) FROM first_divergence").fetchall() == [(2,)]


def test_reprs_are_short():
    a, b = OPS
    run = open_run(a)
    assert repr(run) == f"Run({a!r}: world size 2, ranks 0-1, tables args, events, metrics, records)"
    res = bisect(a, b)
    assert repr(res) == f"BisectResult({a!r} vs {b!r}: diverged, first step 1, pattern all_ranks_same_op, 2 rank(s))"


def test_dir_lists_only_the_public_names():
    names = dir(detfp_analyze)
    assert names == sorted(detfp_analyze.__all__)
    for private in ("Any", "TYPE_CHECKING", "importlib", "annotations"):
        assert private not in names


@pytest.mark.parametrize("command", [[], ["summary"], ["certify"], ["env"], ["bisect"], ["sql"], ["plot"], ["export"]])
def test_help_has_no_type_metavars(command):
    res = CliRunner().invoke(app, [*command, "--help"])
    out = res.output
    assert res.exit_code == 0 and out.startswith(" ".join(["Usage: detfp-analyze", *command, "[OPTIONS]"]))
    for noise in ("<bool>", "<str>", "<path>", "<list", "{A}", "{RUN", "╭"):
        assert noise not in out, (command, noise)
    if command == ["bisect"]:
        assert "--ranks RANKS" in out and "--json " in out and "Usage: detfp-analyze bisect [OPTIONS] A B" in out


def test_certify_text_says_all_ranks_once(tmp_path):
    det = {"deterministic_algorithms": False}
    write_run(tmp_path / "r", clean(), manifest_overrides={0: {"determinism": det}, 1: {"determinism": det}})
    out = CliRunner().invoke(app, ["certify", str(tmp_path / "r")]).output
    line = next(x for x in out.splitlines() if "determinism" in x)
    assert line.count("all ranks") == 1, line
    assert line.startswith("  determinism: all ranks: torch.use_deterministic_algorithms is off")


def test_level_module_names_the_module_and_keeps_record_names():
    ops = bisect(*OPS, level="module")
    text = render_text(ops)
    assert "None" not in text
    assert ops.diagnosis.headline.startswith("An op in blocks.0.moe (forward, step 1) is the first difference")
    assert ops.diagnosis.next_steps == ("rerun bisect with --depth op to name the op",)
    assert ops.diagnosis.op is None and ops.ranks[0].first.op is None  # no op name below --depth op
    resume = bisect(str(SAMPLES / "resume" / "full"), str(SAMPLES / "resume" / "resumed"), level="module")
    text = render_text(resume)
    assert "None" not in text
    # An RNG state (like a parameter) is named by its record, not by an op: the name stays.
    assert "source at step <root> rng_state:cpu value state" in text
    assert "rng_state cpu at step 2" in resume.diagnosis.explanation
    assert json.loads(json.dumps(resume.to_json_dict()))["ranks"][0]["op"] == "cpu"
