"""Pictures of a bisect: every cell drawn in its state at 2,432 ranks, binning that keeps one
divergent rank visible, the layout's groups, the plot command's files, and the missing-extra path."""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET

import numpy as np
import polars as pl
import pytest
from typer.testing import CliRunner

from detfp_analyze.bisect import bisect
from detfp_analyze.bisect.result import (
    VERDICTS,
    BisectResult,
    Diagnosis,
    Divergence,
    RankResult,
    ResumeInfo,
    Window,
)
from detfp_analyze.cli import app
from detfp_analyze.errors import OptionalDependencyError
from detfp_analyze.render.draw import figure_bytes, rank_module_figure, rank_step_figure
from detfp_analyze.render.frames import (
    STATE_COLORS,
    STATE_HELP,
    STATES,
    UnknownStateError,
    discriminator_frame,
    metric_frame,
    module_frame,
    rank_step_frame,
    state_of,
)
from detfp_analyze.render.html import svg_for_html
from detfp_analyze.render.layout import rank_layout

pytest.importorskip("matplotlib")

WORLD, ORIGIN = 2432, 1717
CODE = {s: i for i, s in enumerate(STATES)}


def test_every_verdict_has_a_state_colour_and_legend():
    assert set(VERDICTS) <= set(STATES)
    assert set(STATES) == set(STATE_COLORS) == set(STATE_HELP)
    with pytest.raises(UnknownStateError, match=r"verdict 'gremlin' \(rank 3\) has no picture state"):
        state_of("gremlin", 3)


def _div(step: int, module: str, verdict: str, seq: int) -> Divergence:
    return Divergence(step, -1, "forward", module, "op", "aten::mm.default", 0, "output", "out", "both", verdict,
                      "values", (), seq, seq)  # fmt: skip


def _result_2432() -> BisectResult:
    """One origin (rank 1717, step 1, module layers.5.attn) among 2,431 receivers, as bisect reports it."""
    ranks = []
    for r in range(WORLD):
        d = _div(1, "layers.5.attn", "origin", 500) if r == ORIGIN else _div(1, "", "receiver", 900)
        ranks.append(RankResult(r, "diverged", 1, record_step=1, first=d))
    diag = Diagnosis("single_rank", (ORIGIN,), "only rank 1717 starts the difference", "aten::mm.default")
    window = Window((0, 2), (0, 2), (0, 2), tuple(range(WORLD)))
    return BisectResult("a", "b", "diverged", (), 1, tuple(ranks), diag, None, None, window,
                        ResumeInfo(False, 0, 0, 0), None)  # fmt: skip


def _layout_2432() -> pl.DataFrame:
    # tp 8 x dp 19 x pp 16 = 2,432: rank = tp + 8 * (dp + 19 * pp); grouped by pipeline stage.
    rows = [(r, r % 8, (r // 8) % 19, r // 152) for r in range(WORLD)]
    f = pl.DataFrame(rows, schema={"rank": pl.Int32, "tp": pl.Int64, "dp": pl.Int64, "pp": pl.Int64}, orient="row")
    f = f.sort("pp", "dp", "tp", "rank").with_row_index("position").with_columns(pl.col("position").cast(pl.Int64))
    return f.with_columns(pl.format("pp {}", "pp").alias("group"), pl.format("rank {}", "rank").alias("label"))


def _expected(frame: pl.DataFrame, row: str, col: str, rper: int, cper: int, shape: tuple[int, int]) -> np.ndarray:
    """The most severe state per bin, computed here independently of draw._grid."""
    want = np.full(shape, CODE["absent"])
    codes = np.array([CODE[s] for s in frame["state"].to_list()])
    np.maximum.at(want, (frame[row].to_numpy() // rper, frame[col].to_numpy() // cper), codes)
    return want


def test_rank_step_figure_draws_every_cell_at_2432_ranks():
    result, layout = _result_2432(), _layout_2432()
    frame = rank_step_frame(result, layout=layout)
    assert frame.height == WORLD * 3
    fig = rank_step_figure(frame, layout=layout, origin_ranks=(ORIGIN,), max_rows=256)
    ax = fig.axes[0]
    img = np.asarray(ax.images[0].get_array())
    rper = 10  # ceil(2432 / 256)
    assert img.shape == (244, 3)
    cells = frame.with_columns((pl.col("step")).alias("col"))
    assert (img == _expected(cells, "position", "col", rper, 1, img.shape)).all()
    # The lone origin is one row among 244, in the bin of its layout position, at step 1.
    pos = layout.filter(pl.col("rank") == ORIGIN)["position"][0]
    assert img[pos // rper, 1] == CODE["origin"] and (img == CODE["origin"]).sum() == 1
    assert set(img[:, 0]) == {CODE["identical"]} and set(img[:, 2]) == {CODE["after"]}
    assert ax.get_ylabel() == "rank (10 per row, the most severe shown)"
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend == [f"{s}: {STATE_HELP[s]}" for s in ("origin", "receiver", "after", "identical")]
    assert any(t.get_text() == f"rank {ORIGIN}" for t in ax.texts)  # the origin is named
    assert len(ax.lines) == 15  # a separator between each of the 16 pipeline stages


def test_rank_module_figure_bins_thousands_of_modules_and_keeps_the_origin_cell():
    layout = _layout_2432()
    # 2,400 layer modules and the root; pipeline stage p runs layers 50p..50p+49 (and the root),
    # so most cells are absent. The first difference: <root> on receivers, layers.555.attn on the origin.
    modules = [""] + [f"layers.{i // 3}.{('attn', 'mlp', 'norm')[i % 3]}" for i in range(2400)]
    mods = pl.DataFrame(
        {"module": modules, "module_index": range(len(modules)), "stage": [-1] + [i // 150 for i in range(2400)]},
        schema={"module": pl.String, "module_index": pl.Int64, "stage": pl.Int64},
    )
    frame = (
        layout.select(pl.col("rank").cast(pl.Int32), "position", "pp")
        .join(mods, how="cross")
        .filter((pl.col("stage") == -1) | (pl.col("stage") == pl.col("pp")))
        .with_columns(
            pl.when((pl.col("rank") == ORIGIN) & (pl.col("module") == "layers.555.attn"))
            .then(pl.lit("origin"))
            .when((pl.col("rank") != ORIGIN) & (pl.col("module") == ""))
            .then(pl.lit("receiver"))
            .otherwise(pl.lit("identical"))
            .alias("state")
        )
        .drop("pp", "stage")
    )  # fmt: skip
    fig = rank_module_figure(frame, layout=layout, step=1, max_rows=256)
    img = np.asarray(fig.axes[0].images[0].get_array())
    assert img.shape == (244, 78)  # 2,401 modules, 31 per column
    assert (img == _expected(frame, "position", "module_index", 10, 31, img.shape)).all()
    pos = layout.filter(pl.col("rank") == ORIGIN)["position"][0]
    assert (
        img[pos // 10, modules.index("layers.555.attn") // 31] == CODE["origin"] and (img == CODE["origin"]).sum() == 1
    )
    assert (img[:, 0] == CODE["receiver"]).all() and (img == CODE["absent"]).sum() > 0.8 * img.size
    assert "2401 columns, 2432 ranks" in fig.axes[0].get_title()
    assert fig.axes[0].get_xlabel() == (
        "module and phase, in execution order (31 per column, named by the first, the most severe shown)"
    )
    rings = fig.axes[0].collections[-1].get_offsets()  # the origin cell is ringed: visible at any size
    assert rings.tolist() == [[modules.index("layers.555.attn") // 31, pos // 10]]
    labels = [t.get_text() for t in fig.axes[0].get_xticklabels()]
    assert len(labels) == 78 and all(labels)  # every column named
    assert "layers.555.attn +30" in labels  # its column is named by the module where it started


def test_layout_orders_ranks_by_coordinates(layout_pair):
    lay = rank_layout(layout_pair.a)
    assert lay.columns == ["rank", "position", "group", "label", "pp", "dp", "tp"]
    assert lay["group"].unique(maintain_order=True).to_list() == ["pp 0", "pp 1", "pp 2", "pp 3"]
    assert lay.filter(pl.col("rank") == 29)["label"][0] == "rank 29 (pp 2, dp 2, tp 1)"
    assert lay["rank"].to_list() == list(range(48))  # tp fastest: the layout order is the rank order here


def test_frames_of_a_real_pair(layout_pair):
    res = bisect(layout_pair.a, layout_pair.b)
    mods = module_frame(layout_pair.a, layout_pair.b, res)
    exp = {e.rank: e for e in layout_pair.expected}
    marked = mods.filter(~pl.col("state").is_in(["identical", "after", "differs"]))
    # One marked cell per rank: the module of its expected first divergence, in its verdict.
    assert sorted(marked["rank"].to_list()) == list(range(48))
    for rank, module, state in marked.select("rank", "module", "state").iter_rows():
        assert (module, state) == (exp[rank].module, exp[rank].verdict)
    order = mods.filter(pl.col("rank") == 0).sort("module_index")["module"].to_list()
    assert order.index("layers.0.attn.qkv") < order.index("layers.0.mlp.fc1")  # execution order
    metrics = metric_frame(layout_pair.a, layout_pair.b)
    assert metrics.filter(pl.col("step") == 0)["equal"].all()
    loss = metrics.filter((pl.col("name") == "loss") & (pl.col("step") == 1) & (pl.col("rank") == 29))
    assert not loss["equal"][0] and 0 < loss["abs_diff"][0] < 1e-12  # one ULP
    disc = discriminator_frame(res)
    assert disc["divergent"].sum() > 0 and disc.columns[0] == "label"


def test_plot_command_writes_byte_stable_files(layout_pair, report_page, tmp_path):
    args = ["plot", str(layout_pair.a), str(layout_pair.b), "--format", "svg"]
    # In a process of its own (hash seed 11): the same bytes as the pictures of the HTML report,
    # drawn by another process (seed 7).
    env = {**os.environ, "PYTHONHASHSEED": "11"}
    first = subprocess.run(
        [sys.executable, "-m", "detfp_analyze", *args, "--out", str(tmp_path)], capture_output=True, text=True, env=env
    )
    assert first.returncode == 0, first.stderr
    names = ["ranks_steps", "ranks_modules", "metrics", "discriminator"]
    assert [line.split(":")[0] for line in first.stdout.splitlines()] == [f"wrote {tmp_path / n}.svg" for n in names]
    page = report_page.read_text()
    for n in names:
        svg = (tmp_path / f"{n}.svg").read_text()
        ET.fromstring(svg)  # well-formed SVG
        assert svg_for_html(svg, f"fig-{n}") in page, n  # byte-stable across processes
    svg = (tmp_path / "ranks_steps.svg").read_text()
    assert "rank 29" in svg and "pp 3" in svg and "origin: inputs matched, output differs" in svg


def test_plot_of_identical_runs_says_what_it_left_out(layout_pair, layout_twin, tmp_path):
    res = CliRunner().invoke(app, ["plot", str(layout_pair.a), str(layout_twin), "--out", str(tmp_path)])
    assert res.exit_code == 0
    assert "skipped ranks_modules: no record differs, so there is no divergent step to open" in res.output
    assert "skipped discriminator: no origin op to discriminate (the runs are identical)" in res.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.png", "ranks_steps.png"]
    assert (tmp_path / "ranks_steps.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_plot_options_exit_2(layout_pair, tmp_path):
    res = CliRunner().invoke(
        app, ["plot", str(layout_pair.a), str(layout_pair.b), "--out", str(tmp_path), "--format", "gif"]
    )
    assert res.exit_code == 2 and "--format 'gif': use png or svg" in res.output


def test_without_matplotlib_plot_names_the_install_command_and_exits_2(tmp_path):
    code = (
        "import sys; sys.modules['matplotlib'] = None\n"
        "from detfp_analyze.cli import main\n"
        f"sys.argv = ['detfp-analyze', 'plot', 'x', 'y', '--out', {str(tmp_path)!r}]\n"
        "main()\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 2
    assert res.stderr == "detfp-analyze: matplotlib is not installed; install it with: pip install 'detfp[plot]'\n"
    assert not any(tmp_path.iterdir())


def test_figure_bytes_rejects_unknown_formats():
    with pytest.raises(ValueError, match="use png or svg"):
        figure_bytes(object(), "gif")
    assert issubclass(OptionalDependencyError, ImportError)
