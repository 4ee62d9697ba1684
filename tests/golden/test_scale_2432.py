"""Every new command on a synthetic 2,432-rank pair on disk (tp 8 x dp 19 x pp 16, one origin).

Marked slow: writing and bisecting 2,432 ranks x 2 runs costs a minute or more on two cores, so
the default suite checks the same pictures and page from a 2,432-rank result built in memory
(tests/unit/test_pictures.py, tests/integration/test_html_report.py); run this with ``pytest -m slow``.
"""

from __future__ import annotations

import json

import numpy as np
import polars as pl
import pytest
from typer.testing import CliRunner

from detfp_analyze.bisect import bisect
from detfp_analyze.cli import app
from detfp_analyze.render.frames import STATES, rank_step_frame
from detfp_analyze.render.gallery import bisect_pictures
from detfp_analyze.testing.synth import Plant, SynthSpec, write_pair
from tests.unit.test_perfetto import validate_trace

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]
ORIGIN = 1717


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("scale")
    spec = SynthSpec(ranks=2432, steps=2, records=150, windows="run", layout=(("tp", 8), ("dp", 19), ("pp", 16)))
    return write_pair(root / "a", root / "b", spec, Plant(rank=ORIGIN, step=1, index=20))


def test_pictures_page_and_timeline_at_2432_ranks(pair, tmp_path):
    res = bisect(pair.a, pair.b)
    assert res.diagnosis.origin_ranks == (ORIGIN,)
    pics = bisect_pictures(res, pair.a, pair.b)
    steps = pics.get("ranks_steps")
    img = np.asarray(steps.figure.axes[0].images[0].get_array())
    code = {s: i for i, s in enumerate(STATES)}
    pos = pics.layout.filter(pl.col("rank") == ORIGIN)["position"][0]
    assert img.shape == (244, 2) and img[pos // 10, 1] == code["origin"] and (img == code["origin"]).sum() == 1
    frame = rank_step_frame(res, layout=pics.layout)
    assert frame.filter(pl.col("step") == 1)["state"].value_counts().sort("state").rows() == [
        ("origin", 1),
        ("receiver", 2431),
    ]
    mods = pics.get("ranks_modules").frame
    assert mods.filter(pl.col("state") == "origin")["rank"].to_list() == [ORIGIN]

    out = CliRunner().invoke(app, ["plot", str(pair.a), str(pair.b), "--out", str(tmp_path / "plots")])
    assert out.exit_code == 0 and len(list((tmp_path / "plots").iterdir())) == 4
    page = tmp_path / "r.html"
    out = CliRunner().invoke(app, ["bisect", str(pair.a), str(pair.b), "--html", str(page)])
    assert out.exit_code == 1 and page.read_text().count("<tr>") > 2432
    trace = tmp_path / "t.json"
    refused = CliRunner().invoke(app, ["export", str(pair.a), str(pair.b), "--perfetto", str(trace)])
    assert refused.exit_code == 2 and f"--steps 1 --ranks {ORIGIN}" in refused.output
    out = CliRunner().invoke(
        app, ["export", str(pair.a), str(pair.b), "--perfetto", str(trace), "--steps", "1", "--ranks", "1712-1719"]
    )
    assert out.exit_code == 0, out.output
    assert validate_trace(json.loads(trace.read_text())) == []
