"""Heatmap frames and figures: right counts, right shape, readable at thousands of ranks."""

from __future__ import annotations

import polars as pl
import pytest
from polars.testing import assert_frame_equal

from detfp_analyze.bisect import bisect
from detfp_analyze.render.frames import STATE_COLORS
from detfp_analyze.render.heatmap import STATES, bisect_frame, divergence_frame, divergence_heatmap
from detfp_analyze.sql import connect
from detfp_analyze.testing.synth import Plant, SynthSpec, write_pair

pytest.importorskip("matplotlib")


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    root = tmp_path_factory.mktemp("plot")
    return write_pair(root / "a", root / "b", SynthSpec(ranks=3, steps=3, records=300), Plant(rank=1, step=1, index=50))


def test_divergence_frame_matches_step_summary_view(planted):
    frame = divergence_frame(planted.a, planted.b)
    with connect(planted.a, planted.b) as con:
        view = con.sql("SELECT * FROM step_summary").pl()
    assert_frame_equal(frame, view, check_dtypes=False)
    # Step 0 is clean everywhere; step 1 differs on every rank (the all-reduce carried it).
    clean = frame.filter(pl.col("step") == 0)
    assert clean["differing"].to_list() == [0, 0, 0]
    assert frame.filter(pl.col("step") == 1)["differing"].min() > 0


def test_heatmap_of_counts_has_rank_by_step_cells(planted):
    fig = divergence_heatmap(divergence_frame(planted.a, planted.b), title="t")
    img = fig.axes[0].images[0].get_array()
    assert img.shape == (3, 3)
    assert img[0, 0] == 0.0 and 0 < img[1, 1] <= 1.0
    assert fig.axes[0].get_title() == "t"
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == ["0", "1", "2"]


def test_bins_thousands_of_ranks_and_keeps_a_lone_origin_visible():
    n, steps = 4096, 3
    frame = pl.DataFrame(
        {"rank": [r for r in range(n) for _ in range(steps)], "step": [s for _ in range(n) for s in range(steps)]}
    ).with_columns(
        state=pl.when((pl.col("rank") == 3001) & (pl.col("step") == 1))
        .then(pl.lit("origin"))
        .otherwise(pl.lit("identical"))
    )
    fig = divergence_heatmap(frame, max_rows=128)
    img = fig.axes[0].images[0].get_array()
    assert img.shape == (128, 3)
    origin = STATES.index("origin")
    assert img[3001 // 32, 1] == origin and (img == origin).sum() == 1
    assert fig.axes[0].get_ylabel() == "rank (32 per row, worst shown)"
    w, h = fig.get_size_inches()
    assert (w, h) == (8.0, 5.0)


def test_bisect_frame_states(planted):
    # Each rank: identical before its first divergence, its verdict there, "after" later.
    res = bisect(planted.a, planted.b)
    got = bisect_frame(res)
    for e in planted.expected:
        states = got.filter(pl.col("rank") == e.rank).sort("step")["state"].to_list()
        assert states == ["identical" if s < e.step else e.verdict if s == e.step else "after" for s in (0, 1, 2)]
    assert set(got["state"]) <= set(STATES)


def test_empty_frame_is_an_error():
    with pytest.raises(ValueError, match="no rows"):
        divergence_heatmap(pl.DataFrame(schema={"rank": pl.Int32, "step": pl.Int64, "state": pl.String}))


@pytest.mark.parametrize("how", ["structural", "rng", "arguments", "missing"])
def test_bisect_frame_of_real_results_shows_each_verdict(tmp_path, how):
    """Real BisectResults of other plants (structural, source, an arguments origin, missing records):
    each rank's cell at its first divergence is its verdict, drawn in that verdict's colour."""
    p = write_pair(
        tmp_path / "a",
        tmp_path / "b",
        SynthSpec(ranks=2, steps=3, records=200),
        Plant(rank=1, step=1, index=50, how=how),
    )
    res = bisect(p.a, p.b)
    got = bisect_frame(res)
    assert p.expected
    for e in p.expected:
        cell = got.filter((pl.col("rank") == e.rank) & (pl.col("step") == e.step))["state"].to_list()
        assert cell == [e.verdict]
    img = divergence_heatmap(got).axes[0].images[0]
    e = p.expected[0]
    code = img.get_array()[e.rank, [0, 1, 2].index(e.step)]
    assert img.cmap(img.norm(code))[:3] == pytest.approx(
        tuple(int(STATE_COLORS[e.verdict][i : i + 2], 16) / 255 for i in (1, 3, 5))
    )
