"""The pictures and the HTML report of every bundled sample pair, from the command line.

``detfp-analyze plot`` writes its figures (exit 0) and ``bisect --html`` writes a
self-contained page, with bisect's own exit code: the commands a user runs first on the bundled
traces. Three pairs cover the shapes of an answer (an op-level origin on every rank, one rank's
data, an identical resumed pair); the renderers' own tests cover every verdict and state.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from detfp_analyze.cli import app

pytest.importorskip("matplotlib")

SAMPLES = Path(__file__).resolve().parents[2] / "sample_traces"
PNG = b"\x89PNG\r\n\x1a\n"
PAIRS = [("ops/a", "ops/b"), ("data_rank/a", "data_rank/b"), ("resume/full", "resume/restored")]


@pytest.mark.parametrize(("a", "b"), PAIRS, ids=[f"{a}:{b}" for a, b in PAIRS])
def test_plot_and_html_report_of_each_sample_pair(tmp_path, a, b):
    runner = CliRunner()
    A, B = str(SAMPLES / a), str(SAMPLES / b)
    res = runner.invoke(app, ["bisect", A, B, "--json"])
    assert res.exit_code in (0, 1), res.output
    status = json.loads(res.output)["status"]
    assert status == ("identical" if res.exit_code == 0 else "diverged")

    out = tmp_path / "plots"
    res = runner.invoke(app, ["plot", A, B, "--out", str(out)])
    assert res.exit_code == 0, res.output
    pngs = sorted(out.glob("*.png"))
    assert pngs and all(p.read_bytes().startswith(PNG) for p in pngs)
    one_step = a == "ops/a"  # captured at one step: said in words, not drawn as one column
    assert ("ranks_steps.png" in {p.name for p in pngs}) != one_step
    assert ("skipped ranks_steps: one step compared (step 1)" in res.output) == one_step

    page = tmp_path / "report.html"
    res = runner.invoke(app, ["bisect", A, B, "--html", str(page)])
    assert res.exit_code == (0 if status == "identical" else 1), res.output
    html = page.read_text(encoding="utf-8")
    assert html.lstrip().lower().startswith("<!doctype html") and status in html
