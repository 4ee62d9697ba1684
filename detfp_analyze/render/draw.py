"""The divergence pictures: frames from ``frames`` in, matplotlib Figures out, nothing read.

* ``rank_step_figure``: ranks (rows, in layout order, grouped by parallel coordinate) x steps;
* ``rank_module_figure``: ranks x modules (a module's forward and backward apart, in execution
  order) at the first divergent step, every column named;
* ``metric_figure``: each metric of A and B per step, and ``|A - B|`` on a log scale;
* ``discriminator_figure``: clean vs divergent calls of the origin op per (module, dtype, shape).

Heatmaps bin rows (and columns) beyond ``max_rows``/``max_cols``; a bin shows its most severe
cell (``frames.STATES`` order), so one divergent rank among thousands stays visible, and the
axis label says how many ranks a row holds. Every state drawn has a legend entry; colours are
fixed per state, the same in every figure. ``figure_bytes`` renders PNG or SVG byte-stably (no
dates, fixed SVG ids). matplotlib is optional (``_deps.require``); figures use the Agg canvas
without pyplot, so nothing global changes.
"""

from __future__ import annotations

import io
import math
from typing import Any, Literal, cast

import polars as pl

from detfp_analyze._deps import require
from detfp_analyze.io.names import shown_name
from detfp_analyze.render.frames import STATE_COLORS, STATE_HELP, STATES, check_state

__all__ = [
    "binned_grid", "discriminator_figure", "escape_texts", "figure_bytes", "metric_figure", "rank_module_figure",
    "rank_step_figure"]

_CODE = {s: i for i, s in enumerate(STATES)}


def _new_figure(
    width: float, height: float, layout: Literal["constrained", "compressed", "tight"] | None = "constrained"
) -> Any:
    require("matplotlib")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout=layout)
    FigureCanvasAgg(fig)
    return fig


def escape_texts(fig: Any) -> Any:
    """``fig`` with every text in it (titles, labels, tick labels, legends, annotations) shown as
    ``io.names.shown_name`` shows a name: control characters from a trace (a module or probe
    named with ``\\x1b``) drawn as visible escapes, never handed to the font machinery, which
    has no glyph for them and says so on stderr with the raw character in its warning."""
    from matplotlib.text import Text
    from matplotlib.ticker import FixedFormatter, FuncFormatter

    for text in fig.findobj(Text):
        raw = text.get_text()
        shown = shown_name(raw) if raw else raw
        if shown != raw:
            text.set_text(shown)
    # Tick labels given as names are redrawn from their formatter at every draw: escape its names
    # (a list of them, or the function that names a tick).
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            for fmt in (axis.get_major_formatter(), axis.get_minor_formatter()):
                if isinstance(fmt, FixedFormatter):
                    fmt.seq = [shown_name(s) if isinstance(s, str) else s for s in fmt.seq]
                elif isinstance(fmt, FuncFormatter) and not getattr(fmt.func, "_escaped", False):
                    fmt.func = _escaping(fmt.func)
    return fig


def _escaping(name: Any) -> Any:
    """A tick-naming function whose names come out as ``shown_name`` shows them."""

    def escaped(x: Any, pos: Any = None) -> Any:
        text = name(x, pos)
        return shown_name(text) if isinstance(text, str) and text else text

    escaped._escaped = True  # type: ignore[attr-defined]
    return escaped


def _bins(n: int, most: int) -> tuple[int, int]:
    """(items per bin, number of bins) for n items shown in at most ``most`` bins."""
    per = max(1, math.ceil(n / most))
    return per, max(1, math.ceil(n / per))


def binned_grid(
    frame: pl.DataFrame,
    row: str,
    col: str,
    value: str,
    *,
    shape: tuple[int, int],
    per: tuple[int, int] = (1, 1),
    fill: float = math.nan,
) -> Any:
    """The one heatmap grid of every picture: a float matrix of ``shape`` (rows x cols) whose cell
    (i, j) holds the largest ``value`` over the frame's rows with ``row // per[0] == i`` and
    ``col // per[1] == j`` (``fill`` where none is). A String ``value`` is a cell state, drawn as
    its code (``frames.STATES`` order, most severe last), so a bin shows its most severe member;
    a state without a colour raises ``frames.UnknownStateError``, never drawn as another one."""
    import numpy as np

    if frame.schema[value] == pl.String:
        for s in sorted(frame[value].drop_nulls().unique().to_list()):
            check_state(s)
        v = pl.col(value).replace_strict(_CODE, return_dtype=pl.Float64)
    else:
        v = pl.col(value).cast(pl.Float64)
    cells = (
        frame.select((pl.col(row) // per[0]).alias("r"), (pl.col(col) // per[1]).alias("c"), v.alias("v"))
        .group_by("r", "c")
        .agg(pl.col("v").max())
    )
    grid = np.full(shape, fill, dtype=np.float64)
    grid[cells["r"].to_numpy(), cells["c"].to_numpy()] = cells["v"].fill_null(math.nan).to_numpy()
    return grid


def _state_grid(frame: pl.DataFrame, row: str, col: str, nrows: int, ncols: int, rper: int, cper: int) -> Any:
    """The binned state codes (rows x cols) of a state frame; ``absent`` where no row is."""
    grid = binned_grid(frame, row, col, "state", shape=(nrows, ncols), per=(rper, cper), fill=_CODE["absent"])
    return grid.astype("int64")


def _draw_states(fig: Any, ax: Any, grid: Any) -> None:
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    cmap = ListedColormap([STATE_COLORS[s] for s in STATES])
    ax.imshow(grid, aspect="auto", interpolation="nearest", cmap=cmap, vmin=-0.5, vmax=len(STATES) - 0.5)
    present = sorted({int(v) for v in grid.ravel()} | {_CODE["identical"]})
    handles = [
        Patch(facecolor=STATE_COLORS[STATES[c]], edgecolor="#777777", label=f"{STATES[c]}: {STATE_HELP[STATES[c]]}")
        for c in reversed(present)
    ]
    fig.legend(handles=handles, loc="outside lower center", ncols=2, fontsize=8, frameon=False)


def _rank_axis(ax: Any, layout_rows: list[tuple[int, str]], rper: int, nrows: int) -> None:
    """Y ticks naming the ranks of each tick's bin, group separators and group labels."""
    ticks = list(range(0, nrows, max(1, math.ceil(nrows / 16))))

    def rank_at(pos: int) -> int:
        return layout_rows[min(pos, len(layout_rows) - 1)][0]

    labels = []
    for t in ticks:
        lo, hi = rank_at(t * rper), rank_at(min((t + 1) * rper, len(layout_rows)) - 1)
        labels.append(str(lo) if rper == 1 or lo == hi else f"{lo}-{hi}" if hi == lo + rper - 1 else f"{lo}..")
    ax.set_yticks(ticks, labels, fontsize=8)
    ax.set_ylabel("rank" if rper == 1 else f"rank ({rper} per row, the most severe shown)")
    groups = [g for _, g in layout_rows]
    if not any(groups):
        return
    starts = [i for i in range(len(groups)) if i == 0 or groups[i] != groups[i - 1]]
    for i in starts[1:]:
        ax.axhline(i / rper - 0.5, color="#444444", linewidth=0.6)
    if len(starts) <= 32:
        sec = ax.secondary_yaxis("right")
        ends = [*starts[1:], len(groups)]
        sec.set_yticks(
            [((s + e) / 2) / rper - 0.5 for s, e in zip(starts, ends, strict=True)], [groups[s] for s in starts]
        )
        sec.tick_params(labelsize=7, length=0)


def _layout_rows(frame: pl.DataFrame) -> list[tuple[int, str]]:
    """(rank, group) per position 0..n-1 (positions without a rank are dropped from labels)."""
    cols = ["position", "rank"] + (["group"] if "group" in frame.columns else [])
    rows = frame.select(cols).unique("position").sort("position").rows()
    return [(r[1], r[2] if len(r) > 2 else "") for r in rows]


def _with_groups(frame: pl.DataFrame, layout: pl.DataFrame | None) -> pl.DataFrame:
    if layout is None or "group" not in layout.columns:
        return frame
    return frame.join(layout.select(pl.col("rank").cast(pl.Int32), "group"), on="rank", how="left")


def rank_step_figure(
    frame: pl.DataFrame,
    *,
    layout: pl.DataFrame | None = None,
    origin_ranks: tuple[int, ...] = (),
    max_rows: int = 256,
    max_cols: int = 400,
    title: str | None = None,
) -> Any:
    """Ranks x steps, one colour per state (``frames.rank_step_frame``). ``layout``
    (``layout.rank_layout``) adds group separators and labels; ``origin_ranks`` are marked with
    a triangle at the right edge of their row (named when there are at most eight)."""
    if frame.is_empty():
        raise ValueError("rank_step_figure: the frame has no rows; the runs share no compared rank and step")
    frame = _with_groups(frame, layout)
    steps = sorted(frame["step"].unique().to_list())
    col_of = {s: i for i, s in enumerate(steps)}
    npos = int(frame["position"].max()) + 1  # type: ignore[arg-type]
    rper, nrows = _bins(npos, max_rows)
    cper, ncols = _bins(len(steps), max_cols)
    cells = frame.with_columns(pl.col("step").replace_strict(col_of, return_dtype=pl.Int64).alias("col"))
    grid = _state_grid(cells, "position", "col", nrows, ncols, rper, cper)
    rows = _layout_rows(frame)
    fig = _new_figure(9.0, min(9.0, 3.2 + 0.05 * nrows))
    ax = fig.add_subplot()
    _draw_states(fig, ax, grid)
    if ncols <= 40:
        ax.set_xticks(range(ncols), [str(steps[i * cper]) for i in range(ncols)], fontsize=8)
    else:
        ticks = list(range(0, ncols, math.ceil(ncols / 20)))
        ax.set_xticks(ticks, [str(steps[t * cper]) for t in ticks], fontsize=8)
    ax.set_xlabel("step" if cper == 1 else f"step ({cper} per column)")
    _rank_axis(ax, rows, rper, nrows)
    pos_of = {r: p for p, (r, _) in enumerate(rows)}
    marked = [o for o in origin_ranks if o in pos_of]
    if marked:
        ys = [pos_of[o] // rper for o in marked]
        ax.scatter([ncols - 0.5] * len(ys), ys, marker="<", s=40, color="#000000", clip_on=False, zorder=3)
        if len(marked) <= 8:
            for o, y in zip(marked, ys, strict=True):
                ax.annotate(
                    f"rank {o}",
                    (ncols - 0.5, y),
                    xytext=(-8, 0),
                    textcoords="offset points",
                    ha="right",
                    va="center",
                    fontsize=8,
                    bbox={"boxstyle": "round,pad=0.15", "facecolor": "white", "edgecolor": "none", "alpha": 0.85},
                )
    n = len(origin_ranks)
    ax.set_title(title or f"state per rank and step ({npos} ranks; {n} origin rank{'s' if n != 1 else ''} marked)")
    return escape_texts(fig)


def rank_module_figure(
    frame: pl.DataFrame,
    *,
    layout: pl.DataFrame | None = None,
    step: int | None = None,
    max_rows: int = 256,
    max_cols: int = 80,
    title: str | None = None,
) -> Any:
    """Ranks x modules in execution order at one step (``frames.module_frame``: a module's forward
    and backward are columns of their own): where on each rank the first difference appeared (its
    verdict colour), which modules differ, which match. Every column is named: beyond
    ``max_cols`` columns are binned, and the axis says how many modules a column holds."""
    if frame.is_empty():
        raise ValueError("rank_module_figure: the frame has no rows; no record differs, so there is no divergent step")
    frame = _with_groups(frame, layout)
    label = "column" if "column" in frame.columns else "module"
    cols = frame.select("module_index", label).unique("module_index").sort("module_index")[label].to_list()
    npos = int(frame["position"].max()) + 1  # type: ignore[arg-type]
    rper, nrows = _bins(npos, max_rows)
    cper, ncols = _bins(len(cols), max_cols)
    grid = _state_grid(frame, "position", "module_index", nrows, ncols, rper, cper)
    # Every column is named: wide enough for one 7-point label per column.
    fig = _new_figure(max(10.0, 2.0 + 0.14 * ncols), min(10.0, 4.2 + 0.05 * nrows))
    ax = fig.add_subplot()
    _draw_states(fig, ax, grid)
    import numpy as np

    # A cell can be a few pixels wide: ring the cells where a rank's difference started locally.
    starts = np.argwhere(np.isin(grid, [_CODE["origin"], _CODE["source"]]))
    if 0 < len(starts) <= 16:
        ax.scatter(starts[:, 1], starts[:, 0], s=150, facecolors="none", edgecolors="#000000", linewidths=1.2, zorder=3)

    # A column is named by its first module, a column where a difference started by that module.
    started = (
        frame.filter(pl.col("state").is_in(["origin", "source"]))
        .sort("module_index")
        .select((pl.col("module_index") // cper).alias("c"), label)
        .unique("c", keep="first", maintain_order=True)
    )
    start_names = dict(started.rows())

    def name(i: int) -> str:
        m = start_names.get(i, cols[i * cper]) or "<root>"
        m = m if len(m) <= 28 else "…" + m[-27:]
        return m if cper == 1 else f"{m} +{min(cper, len(cols) - i * cper) - 1}"

    ax.set_xticks(range(ncols), [name(i) for i in range(ncols)], rotation=60, ha="right", fontsize=7)
    what = "module and phase, in execution order"
    ax.set_xlabel(what + ("" if cper == 1 else f" ({cper} per column, named by the first, the most severe shown)"))
    _rank_axis(ax, _layout_rows(frame), rper, nrows)
    at = "" if step is None else f" at step {step}"
    ax.set_title(title or f"where each rank's first difference appeared{at} ({len(cols)} columns, {npos} ranks)")
    return escape_texts(fig)


def metric_figure(
    frame: pl.DataFrame, *, rank: int | None = None, first_record_step: int | None = None, title: str | None = None
) -> Any:
    """Per metric: A and B on ``rank`` (default: the lowest rank) per step, the first bitwise
    difference marked, and the largest ``|A - B|`` over ranks on a log scale (steps where A and B
    are bitwise equal sit on the axis as open circles). ``frame``: ``frames.metric_frame``.
    With several microbatches or occurrences per step, the values are the step's last one."""
    if frame.is_empty():
        raise ValueError("metric_figure: the frame has no rows; neither run recorded a metric in the window")
    names = sorted(frame["name"].unique().to_list(), key=lambda n: (n != "loss", n))
    rank = int(frame["rank"].min()) if rank is None else rank  # type: ignore[arg-type]
    height = 1.3 + 2.1 * len(names)
    # A fixed grid: constrained layout over 2 x n axes costs seconds for a regular layout.
    fig = _new_figure(10.0, height, layout=None)
    fig.subplots_adjust(left=0.08, right=0.98, top=1 - 0.85 / height, bottom=0.85 / height, hspace=0.62, wspace=0.18)
    from matplotlib.ticker import MaxNLocator, NullLocator

    axes = fig.subplots(len(names), 2, squeeze=False, sharex=True)  # one step axis for every panel
    for (left, right), name in zip(axes, names, strict=True):
        m = frame.filter(pl.col("name") == name)
        mine = (
            m.filter(pl.col("rank") == rank)
            .sort("step", "microbatch", "occurrence")
            .group_by("step", maintain_order=True)
            .last()
        )
        left.plot(mine["step"], mine["value_a"], "-o", color="#1f77b4", markersize=3, label="A")
        left.plot(mine["step"], mine["value_b"], "--x", color="#d62728", markersize=4, label="B")
        per_step = (
            m.group_by("step").agg(pl.col("abs_diff").max().alias("d"), pl.col("equal").all().alias("eq")).sort("step")
        )
        first = cast("int | None", per_step.filter(~pl.col("eq"))["step"].min())  # an Int64 column
        for ax in (left, right):
            if first is not None:
                ax.axvline(
                    first,
                    color="#c0152f",
                    linewidth=1.0,
                    linestyle=":",
                    label=f"first bitwise difference: step {first}",
                )
            if first_record_step is not None and first_record_step != first:
                ax.axvline(
                    first_record_step,
                    color="#555555",
                    linewidth=1.0,
                    linestyle="-.",
                    label=f"first divergent record: step {first_record_step}",
                )
            ax.tick_params(labelsize=8)
        left.set_title(f"{name} on rank {rank}", fontsize=9)
        diff = per_step.filter(~pl.col("eq") & pl.col("d").is_not_null() & (pl.col("d") > 0))
        equal = per_step.filter(pl.col("eq"))
        right.set_yscale("log")
        if not diff.is_empty():
            right.plot(diff["step"], diff["d"], "-o", color="#c0152f", markersize=3, label="max |A - B| over ranks")
        else:
            right.set_yticks([], [])
            right.yaxis.set_minor_locator(NullLocator())
        # Zero has no place on a log axis: bitwise-equal steps sit on the x axis itself.
        right.scatter(
            equal["step"],
            [0.04] * equal.height,
            transform=right.get_xaxis_transform(),
            facecolors="none",
            edgecolors="#2ca02c",
            s=18,
            clip_on=False,
            label="bitwise equal",
        )
        right.set_title(
            f"{name}: |A - B| (log)" + (" - A and B bitwise equal at every step" if diff.is_empty() else ""), fontsize=9
        )
        for ax in (left, right):
            if name == names[-1]:  # the panels share one step axis: label it once, at the bottom
                ax.set_xlabel("step", fontsize=8)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            if per_step.height == 1:  # one step: a window around it, not a 0.1-step-wide axis
                s0 = int(per_step["step"][0])
                ax.set_xlim(s0 - 1, s0 + 1)
    # One legend for the figure (a "best" legend per axes costs seconds to place, and repeats itself).
    seen: dict[str, Any] = {}
    for ax in fig.axes:
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            seen.setdefault(lab, h)
    fig.legend(list(seen.values()), list(seen), loc="lower center", ncols=3, fontsize=8, frameon=False)
    fig.suptitle(title or "metrics of A and B", fontsize=11, y=1 - 0.2 / height)
    return escape_texts(fig)


def discriminator_figure(
    frame: pl.DataFrame, *, op: str, ranks: tuple[int, ...] = (), steps: tuple[int, ...] = (), max_rows: int = 24
) -> Any:
    """The discriminator table as bars: per (phase, module, dtype, shape), how many calls of the
    origin op matched (grey) and how many differ (red). Shows the axis the break sits on."""
    if frame.is_empty():
        raise ValueError("discriminator_figure: the frame has no rows; the result has no origin op to discriminate")
    shown = frame.head(max_rows)
    labels = [x if len(x) <= 60 else "…" + x[-59:] for x in shown["label"].to_list()]
    ys = list(range(shown.height))[::-1]
    fig = _new_figure(9.0, 1.8 + 0.32 * shown.height)
    from matplotlib.ticker import MaxNLocator

    ax = fig.add_subplot()
    div, clean = shown["divergent"].to_list(), shown["clean"].to_list()
    ax.barh(ys, div, color=STATE_COLORS["origin"], label="divergent calls")
    ax.barh(ys, clean, left=div, color=STATE_COLORS["not_compared"], label="clean calls")
    for y, d, c in zip(ys, div, clean, strict=True):
        ax.annotate(
            f"{d} divergent / {c} clean", (d + c, y), xytext=(4, 0), textcoords="offset points", va="center", fontsize=7
        )
    ax.set_yticks(ys, labels, fontsize=7)
    ax.set_xlabel("calls of the op in the divergent step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.margins(x=0.25)
    fig.legend(loc="outside lower center", ncols=2, fontsize=7, frameon=False)
    more = f" (first {max_rows} of {frame.height} rows)" if frame.height > max_rows else ""
    where = f" on rank{'s' if len(ranks) > 1 else ''} {_short(ranks)}" if ranks else ""
    at = f", step(s) {', '.join(map(str, steps))}" if steps else ""
    ax.set_title(f"discriminator: {op}{where}{at}{more}", fontsize=10)
    return escape_texts(fig)


def _short(ranks: tuple[int, ...]) -> str:
    from detfp_analyze.ranks import format_ranks

    return format_ranks(ranks)


def figure_bytes(fig: Any, fmt: str = "png") -> bytes:
    """The figure as PNG or SVG bytes, identical for identical figures (no date, no random ids)."""
    import matplotlib

    if fmt not in ("png", "svg"):
        raise ValueError(f"format {fmt!r}: use png or svg")
    escape_texts(fig)  # a figure built elsewhere, or changed since it was made
    buf = io.BytesIO()
    if fmt == "png":
        fig.savefig(buf, format="png", dpi=110, metadata={"Software": None})
    else:
        with matplotlib.rc_context({"svg.hashsalt": "detfp", "svg.fonttype": "none"}):
            fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": None})
    return buf.getvalue()
