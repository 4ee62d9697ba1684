"""Divergence heatmaps across ranks and steps: frames in, a matplotlib Figure out.

Two pure steps, HTA-style (compute returns a frame, a separate function draws it):

1. a frame per (rank, step): ``divergence_frame(a, b)`` (record pairs counted with polars,
   ranks in batches so memory stays bounded), the ``step_summary`` SQL view (same columns),
   or ``bisect_frame(result)`` (each rank's state from a BisectResult, no extra scan);
2. ``divergence_heatmap(frame)``: ranks on the y axis, steps on the x axis. Above
   ``max_rows`` ranks, consecutive ranks are binned and a bin shows its worst cell, so a
   single divergent rank among 4096 stays visible.

matplotlib is optional (``detfp_analyze._deps.require``); figures are built on the Agg
canvas without pyplot, so nothing global (backend, current figure) changes.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from typing import Any

import polars as pl

from detfp_analyze import rule
from detfp_analyze._deps import require
from detfp_analyze.bisect.result import BisectResult
from detfp_analyze.io.reader import Run, as_run
from detfp_analyze.render.draw import binned_grid, escape_texts
from detfp_analyze.render.frames import MATCH_COLUMNS, STATE_COLORS, STATES, match_expr, rank_step_frame

__all__ = ["STATES", "bisect_frame", "divergence_frame", "divergence_heatmap"]

_BATCH = 64


def divergence_frame(
    a: Run | str | os.PathLike[str], b: Run | str | os.PathLike[str], *, ranks: Iterable[int] | None = None
) -> pl.DataFrame:
    """Per (rank, step): how many record pairs are the same, differ, or exist on one side.

    ``a``/``b``: Runs or run directories. Columns (as the ``step_summary`` SQL view):
    ``rank``, ``step``, ``records`` (pairs), ``same``, ``differing``, ``only_a``, ``only_b``,
    ``unknown`` (a side without a digest), sorted by rank and step.
    """
    ra, rb = as_run(a), as_run(b)
    wanted = sorted(set(ra.ranks) | set(rb.ranks) if ranks is None else set(ranks))
    cols = ["rank", "step", "key_hash", *MATCH_COLUMNS]
    out = []
    for i in range(0, len(wanted), _BATCH):
        batch = wanted[i : i + _BATCH]
        la = ra.scan("records", ranks=batch).select(cols)
        lb = rb.scan("records", ranks=batch).select(cols)
        j = la.join(lb, on=["rank", "step", "key_hash"], how="full", suffix="_b", coalesce=True)
        out.append(
            j.with_columns(pl.coalesce("role", "role_b").alias("role"))
            .with_columns(match_expr().alias("m"))
            .group_by("rank", "step")
            .agg(
                pl.len().cast(pl.Int64).alias("records"),
                *((pl.col("m") == k).sum().cast(pl.Int64).alias(n) for k, n in _MATCH_COLUMNS),
            )
            .collect()
        )
    schema = {"rank": pl.Int32, "step": pl.Int64, "records": pl.Int64} | {n: pl.Int64 for _, n in _MATCH_COLUMNS}
    if not out:
        return pl.DataFrame(schema=schema)
    return pl.concat(out).cast(schema).sort("rank", "step")  # type: ignore[arg-type]


#: (match, its count column), as the ``step_summary`` SQL view names them.
_MATCH_COLUMNS = (
    (rule.SAME, "same"),
    (rule.DIFFERS, "differing"),
    (rule.ONLY_A, "only_a"),
    (rule.ONLY_B, "only_b"),
    (rule.UNKNOWN, "unknown"),
)


def bisect_frame(result: BisectResult, steps: Iterable[int] | None = None) -> pl.DataFrame:
    """Per (rank, step), the state a BisectResult implies, without reading the runs again.

    Columns: ``rank``, ``step``, ``state`` (one of STATES; ``frames.rank_step_frame`` explains
    each). ``steps``: the steps to lay out (default: the compared window).
    """
    return rank_step_frame(result, steps=steps).select("rank", "step", "state")


def _grid(frame: pl.DataFrame, value: str, max_rows: int) -> tuple[Any, list[int], int, list[str] | None]:
    """(cells[rows][steps], steps, ranks per bin, state names or None) from a long frame: ranks
    binned into at most ``max_rows`` rows (``draw.binned_grid``, NaN where a bin has no cell)."""
    steps = sorted(frame["step"].unique().to_list())
    ranks = frame["rank"]
    lo, hi = int(ranks.min()), int(ranks.max())  # type: ignore[arg-type]
    per_bin = max(1, math.ceil((hi - lo + 1) / max_rows))
    nrows = (hi - lo) // per_bin + 1
    at = frame.with_columns(
        (pl.col("rank") - lo).alias("_row"),
        pl.col("step").replace_strict(steps, list(range(len(steps))), return_dtype=pl.Int64).alias("_col"),
    )
    grid = binned_grid(at, "_row", "_col", value, shape=(nrows, len(steps)), per=(per_bin, 1))
    names = list(STATES) if frame.schema[value] == pl.String else None
    return grid, steps, per_bin, names


def divergence_heatmap(
    frame: pl.DataFrame,
    *,
    value: str | None = None,
    max_rows: int = 128,
    title: str | None = None,
    width: float = 8.0,
    height: float = 5.0,
):
    """A heatmap Figure of divergence per rank (y) and step (x).

    ``frame``: long format with ``rank``, ``step`` and a value column: numeric counts
    (``divergence_frame``/``step_summary``: default ``value`` is the fraction of pairs that differ
    or are one-sided) or a string ``state`` (``bisect_frame``: one color per state; a value that is not one of
    STATES raises ``frames.UnknownStateError``). Ranks beyond
    ``max_rows`` are binned (each bin shows its worst cell). Returns a matplotlib Figure on the
    Agg canvas; the image's array has shape (rows, steps).
    """
    require("matplotlib")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.colors import ListedColormap
    from matplotlib.figure import Figure

    if frame.is_empty():
        raise ValueError("divergence_heatmap: the frame has no rows; compare runs that share ranks and steps")
    if value is None:
        if "state" in frame.columns:
            value = "state"
        else:
            one_sided = pl.col("only_a") + pl.col("only_b") if "only_a" in frame.columns else pl.lit(0)
            frame = frame.with_columns(
                ((pl.col("differing") + one_sided) / pl.max_horizontal(pl.col("records"), pl.lit(1))).alias(
                    "fraction differing"
                )
            )
            value = "fraction differing"
    grid, steps, per_bin, names = _grid(frame, value, max_rows)
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    nrows = len(grid)
    lo = int(frame["rank"].min())  # type: ignore[arg-type]
    extent = (-0.5, len(steps) - 0.5, nrows - 0.5, -0.5)
    if names is not None:
        palette = [STATE_COLORS[n] for n in names]
        im = ax.imshow(
            grid,
            aspect="auto",
            interpolation="nearest",
            cmap=ListedColormap(palette[: len(names)]),
            vmin=-0.5,
            vmax=len(names) - 0.5,
            extent=extent,
        )
        cb = fig.colorbar(im, ax=ax, ticks=range(len(names)))
        cb.ax.set_yticklabels(names)
    else:
        im = ax.imshow(grid, aspect="auto", interpolation="nearest", cmap="Reds", vmin=0.0, extent=extent)
        fig.colorbar(im, ax=ax, label=value)
    ax.set_xticks(range(len(steps)), [str(s) for s in steps] if len(steps) <= 40 else None)
    if len(steps) > 40:
        ax.set_xticks([])
    ax.set_xlabel("step")
    ticks = _nice_ticks(nrows)
    ax.set_yticks(ticks, [_rank_label(lo + t * per_bin, per_bin) for t in ticks])
    ax.set_ylabel("rank" if per_bin == 1 else f"rank ({per_bin} per row, worst shown)")
    ax.set_title(title or f"divergence by rank and step: {value}")
    return escape_texts(fig)


def _nice_ticks(n: int, most: int = 16) -> list[int]:
    step = max(1, math.ceil(n / most))
    return list(range(0, n, step))


def _rank_label(first: int, per_bin: int) -> str:
    return str(first) if per_bin == 1 else f"{first}-{first + per_bin - 1}"
