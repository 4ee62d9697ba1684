"""Every picture of one bisect, in one call: frames from ``frames``, figures from ``draw``.

``bisect_pictures(result, a, b)`` is the facade the ``plot`` command, the HTML report and
notebooks share: it lays the ranks out (``layout.rank_layout``), computes each frame once and
draws it. A picture that has nothing to show (no divergent record, no metric, no origin op) is
left out with the reason, never drawn empty; so is one that would say nothing over a single
compared step (one column of states, one dot per metric): the reason then says what it shows.
Writing files is the caller's business.

    pics = bisect_pictures(result, run_a, run_b)
    for p in pics.figures: open(f"{p.name}.png", "wb").write(figure_bytes(p.figure, "png"))
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, cast

import polars as pl

from detfp_analyze._deps import require
from detfp_analyze.bisect.result import BisectResult
from detfp_analyze.bisect.vocab import Status, Verdict
from detfp_analyze.io.reader import Run, as_run
from detfp_analyze.render import draw, frames
from detfp_analyze.render.layout import rank_layout

__all__ = ["NAMES", "Picture", "Pictures", "bisect_pictures"]

#: Picture names, in the order they are drawn and listed.
NAMES = ("ranks_steps", "ranks_modules", "metrics", "discriminator")


@dataclass(frozen=True)
class Picture:
    """One drawn picture."""

    #: One of NAMES (the file stem the ``plot`` command writes).
    name: str
    #: One line saying what it shows.
    caption: str
    #: The matplotlib Figure.
    figure: Any
    #: The frame it was drawn from (``frames``).
    frame: pl.DataFrame


@dataclass(frozen=True)
class Pictures:
    """The pictures of one bisect and why any were left out."""

    figures: tuple[Picture, ...]
    #: (name, reason) of pictures with nothing to show.
    skipped: tuple[tuple[str, str], ...]
    #: The rank layout the heatmaps used (``layout.rank_layout``).
    layout: pl.DataFrame

    def get(self, name: str) -> Picture | None:
        """The picture called ``name``, or None when it was skipped."""
        return next((p for p in self.figures if p.name == name), None)


def bisect_pictures(
    result: BisectResult,
    a: Run | str | os.PathLike[str],
    b: Run | str | os.PathLike[str],
    *,
    max_rows: int = 256,
) -> Pictures:
    """Draw the pictures of ``result`` (a bisect of ``a`` and ``b``): ranks x steps, ranks x modules
    at the first divergent step, metric curves with ``|A - B|``, and the discriminator.

    Reads the first divergent step's records and the window's metrics again (the result does not
    hold them). Raises OptionalDependencyError without matplotlib and UnknownStateError for a
    verdict the pictures have no colour for.
    """
    require("matplotlib")
    ra, rb = as_run(a), as_run(b)
    ranks = sorted({*result.window.ranks, *result.window.one_sided_ranks})
    layout = rank_layout(ra, ranks)
    done: list[Picture] = []
    skipped: list[tuple[str, str]] = []
    origin = result.diagnosis.origin_ranks
    w = result.window.steps
    one = w is not None and w[0] == w[1]
    if w is None or not ranks:
        skipped.append(("ranks_steps", "the runs share no compared rank and step"))
    elif one:
        skipped.append(
            ("ranks_steps", f"one step compared (step {w[0]}): ranks_modules shows where each rank differs in it")
        )
    else:
        f = frames.rank_step_frame(result, layout=layout)
        fig = draw.rank_step_figure(f, layout=layout, origin_ranks=origin, max_rows=max_rows)
        done.append(Picture("ranks_steps", "each rank's state per step, origin ranks marked", fig, f))
    step = frames.first_record_step(result)
    if step is None:
        skipped.append(("ranks_modules", "no record differs, so there is no divergent step to open"))
    else:
        f = frames.module_frame(ra, rb, result, step=step, layout=layout)
        fig = draw.rank_module_figure(f, layout=layout, step=step, max_rows=max_rows)
        done.append(Picture("ranks_modules", f"where each rank's first difference appeared in step {step}", fig, f))
    m = frames.metric_frame(ra, rb, ranks=result.window.ranks, steps=result.window.steps)
    if m.is_empty():
        skipped.append(("metrics", "neither run recorded a metric in the compared window"))
    elif one:
        skipped.append(("metrics", _one_step_metrics(m)))
    else:
        rank = result.diff_rank if result.diff_rank is not None else None
        fig = draw.metric_figure(m, rank=rank if rank in set(m["rank"].to_list()) else None, first_record_step=step)
        done.append(Picture("metrics", "metrics of A and B per step, and |A - B| on a log scale", fig, m))
    d = frames.discriminator_frame(result)
    if d.is_empty() or result.discriminator is None:
        skipped.append(("discriminator", _no_discriminator(result)))
    else:
        disc = result.discriminator
        fig = draw.discriminator_figure(d, op=disc.op, ranks=disc.ranks, steps=disc.steps)
        done.append(
            Picture("discriminator", f"calls of {disc.op} that differ vs match, by module, dtype, shape", fig, d)
        )
    return Pictures(tuple(done), tuple(skipped), layout)


def _one_step_metrics(m: pl.DataFrame) -> str:
    """What the metrics picture would show over one step, said in words."""
    parts = []
    for name in sorted(m["name"].unique().to_list(), key=lambda n: (n != "loss", n))[:4]:
        rows = m.filter(pl.col("name") == name)
        if rows["equal"].all():
            parts.append(f"{name} bitwise equal on every rank")
        else:
            worst = cast("float | None", rows["abs_diff"].max())  # a Float64 column
            parts.append(f"{name} differs (largest |A - B| {worst:.3g})" if worst is not None else f"{name} differs")
    return f"one step compared (step {int(m['step'][0])}): " + "; ".join(parts)


def _no_discriminator(result: BisectResult) -> str:
    """Why there is no origin op to discriminate, in the result's own terms."""
    if not result.diverged:
        return "no origin op to discriminate (the runs are identical)"
    if result.status == Status.RNG_ONLY:
        return "no origin op to discriminate: only an RNG state differs, no value"
    if result.status == Status.ENDED_EARLY:
        return "no origin op to discriminate: a run ended early and nothing both runs hold differs"
    rep = next((r.effective for r in result.ranks if r.rank in result.diagnosis.origin_ranks and r.effective), None)
    if rep is not None and rep.verdict == Verdict.SOURCE:
        return f"no origin op to discriminate: the difference enters at a source ({rep.kind} {rep.op}), not at an op"
    if rep is not None and rep.kind != "op":
        return f"no origin op to discriminate: the first difference is a {rep.kind} record (capture level ops names the op)"
    if not result.diagnosis.origin_ranks:
        return "no origin op to discriminate: no rank starts the difference locally"
    return f"no origin op to discriminate (cause {result.diagnosis.cause})"
