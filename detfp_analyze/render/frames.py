"""Frames behind the divergence pictures: one row per cell, computed once, drawn by ``draw``.

Compute and draw are separate (house rule): every function here returns a polars frame and
draws nothing; ``draw`` takes these frames and never reads a run.

* ``rank_step_frame(result)``: each rank's state per step, from a ``BisectResult`` alone;
* ``module_frame(a, b, result)``: per rank and module at the first divergent step, how many
  record pairs differ and where the rank's first difference sits (reads that step's records);
* ``metric_frame(a, b, ...)``: every metric of A and B side by side with ``|A - B|`` and
  bitwise equality (reads the metrics tables);
* ``discriminator_frame(result)``: the discriminator table of the origin op.

Cell states (``STATES``) are one vocabulary for every picture, ordered by severity so a binned
cell shows its worst member. Verdict states come from ``result.VERDICTS``; a verdict this
module does not know raises ``UnknownStateError`` instead of being drawn as something else.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import polars as pl

from detfp_analyze import rule
from detfp_analyze.bisect.narrow import METRIC_KEY
from detfp_analyze.bisect.result import VERDICTS, BisectResult, RankResult
from detfp_analyze.bisect.vocab import Status
from detfp_analyze.errors import AnalysisError
from detfp_analyze.io.reader import Run, as_run
from detfp_analyze.rule.to_polars import names_for, to_polars

__all__ = [
    "MATCH_COLUMNS",
    "STATES",
    "STATE_COLORS",
    "STATE_HELP",
    "UnknownStateError",
    "check_state",
    "discriminator_frame",
    "first_record_step",
    "match_expr",
    "metric_frame",
    "module_frame",
    "rank_step_frame",
    "state_of",
]

#: Cell states, least severe first: a cell that bins several ranks or modules shows the last one.
STATES = (
    "absent",
    "identical",
    "not_compared",
    "state_only",
    "after",
    "differs",
    "receiver",
    "metric_only",
    "unobserved_producer",
    "structural",
    "source",
    "origin",
)
#: One colour per state (colour-blind safe ordering of the strong colours; light tones for calm states).
STATE_COLORS = {
    "absent": "#ffffff",
    "identical": "#e3eee3",
    "not_compared": "#bdbdbd",
    "state_only": "#fff3b0",
    "after": "#fde4c8",
    "differs": "#f5a65b",
    "receiver": "#9ecae1",
    "metric_only": "#c9a6d9",
    "unobserved_producer": "#756bb1",
    "structural": "#2c7fb8",
    "source": "#e6ab02",
    "origin": "#c0152f",
}
#: Legend text of each state.
STATE_HELP = {
    "absent": "no record there",
    "identical": "bitwise identical",
    "not_compared": "one run lacks the rank",
    "state_only": "only an RNG state differs, every value equal",
    "after": "differs after the rank's first difference",
    "differs": "differs, no verdict (or a likely false root)",
    "receiver": "got the difference from a peer",
    "metric_only": "metrics differ, no captured record does",
    "unobserved_producer": "uncaptured producer: look one hop upstream",
    "structural": "control flow differed",
    "source": "entered from outside the capture",
    "origin": "inputs matched, output differs",
}
_BATCH = 64
#: Matches of a record pair that differs, on one side only or both (plain values for ``is_in``).
_DIFFERING = (rule.DIFFERS.value, *rule.ONE_SIDED)
#: The records columns ``match_expr`` reads from each side.
MATCH_COLUMNS = ("role", "status", "digest_hi", "digest_lo", "args_digest")


class UnknownStateError(AnalysisError):
    """A result carries a verdict the pictures have no state (colour, legend) for."""


def state_of(verdict: str | None, rank: int | None = None) -> str:
    """The cell state of a verdict (None: a divergence without verdict, e.g. ``--depth step``).

    Raises UnknownStateError for a value that is not one of ``result.VERDICTS``, or a verdict
    the pictures have no state (colour, legend) for: never drawn as something else."""
    if verdict is None:
        return "differs"
    if verdict not in VERDICTS or verdict not in STATES:
        where = "" if rank is None else f" (rank {rank})"
        raise UnknownStateError(
            f"verdict {verdict!r}{where} has no picture state; known verdicts: {', '.join(VERDICTS)}; a verdict is "
            "added to detfp_analyze.bisect.result.VERDICTS, then to detfp_analyze.render.frames.STATES, "
            "STATE_COLORS and STATE_HELP"
        )
    return verdict


def check_state(state: str) -> str:
    """``state`` when it is one of STATES (a cell state); UnknownStateError otherwise."""
    if state not in STATES:
        raise UnknownStateError(
            f"cell state {state!r} is not one of {', '.join(STATES)} (detfp_analyze.render.frames.STATES)"
        )
    return state


def match_expr(suffix: str = "_b") -> pl.Expr:
    """Record-pair equality (``rule.MATCH``: only_a, only_b, unknown, same or differs) on a join of
    run A's columns (no suffix) with run B's (``suffix``): role, status, digest_hi, digest_lo and
    args_digest of each side (``MATCH_COLUMNS``)."""
    return to_polars(rule.MATCH, names_for("", suffix))


def _cells(r: RankResult) -> dict[int, str]:
    """step -> state for the steps where this rank's divergence is located (others: before/after)."""
    eff = r.effective
    out: dict[int, str] = {}
    if r.first is not None and eff is not r.first:
        out[r.first.step] = "differs"  # a likely false root: the diagnosis looks past it
    if eff is not None:
        out[eff.step] = state_of(eff.verdict, r.rank)
    elif r.status == Status.DIVERGED and r.step is not None:
        out[r.step] = state_of(r.verdict, r.rank)
    return out


def rank_step_frame(
    result: BisectResult, *, steps: Iterable[int] | None = None, layout: pl.DataFrame | None = None
) -> pl.DataFrame:
    """Each rank's state per step: ``identical`` before its first difference, its verdict at it
    (past a likely false root, which shows as ``differs``), ``after`` later (``state_only`` when
    the result is ``rng_only``: only an RNG state differs there, no value); ranks present in one
    run only are ``not_compared``.

    Columns: ``rank`` (Int32), ``position`` (Int64: row order, from ``layout`` when given, else
    rank order), ``step`` (Int64), ``state`` (one of STATES). Sorted by position and step.
    ``steps``: the steps to lay out (default: the compared window).
    """
    window = result.window.steps
    if steps is None:
        steps = range(window[0], window[1] + 1) if window else ()
    steps = sorted(set(steps))
    later = "state_only" if result.status == Status.RNG_ONLY else "after"
    rows: list[tuple[int, int, str]] = []
    for r in result.ranks:
        cells = _cells(r)
        start = min(cells) if cells else None
        for s in steps:
            state = cells.get(s) or ("identical" if start is None or s < start else later)
            rows.append((r.rank, s, state))
    for rank in result.window.one_sided_ranks:
        rows.extend((rank, s, "not_compared") for s in steps)
    frame = pl.DataFrame(rows, schema={"rank": pl.Int32, "step": pl.Int64, "state": pl.String}, orient="row")
    return _positioned(frame, layout)


def _positioned(frame: pl.DataFrame, layout: pl.DataFrame | None) -> pl.DataFrame:
    if layout is None:
        ranks = sorted(set(frame["rank"].to_list()))
        layout = pl.DataFrame(
            {"rank": ranks, "position": range(len(ranks))}, schema={"rank": pl.Int32, "position": pl.Int64}
        )
    pos = layout.select(pl.col("rank").cast(pl.Int32), pl.col("position").cast(pl.Int64))
    out = frame.join(pos, on="rank", how="left")
    missing = out.filter(pl.col("position").is_null())["rank"].unique().sort().to_list()
    if missing:
        raise ValueError(f"layout has no position for rank(s) {missing[:8]}; build it for the ranks of the result")
    cols = ["rank", "position", *(c for c in frame.columns if c != "rank")]
    return out.select(cols).sort("position", *(c for c in ("step", "module_index") if c in frame.columns))


def first_record_step(result: BisectResult) -> int | None:
    """The lowest step holding a rank's first divergent record (None when no record differs)."""
    steps = [r.first.step for r in result.ranks if r.first is not None]
    return min(steps) if steps else None


def module_frame(
    a: Run | str | os.PathLike[str],
    b: Run | str | os.PathLike[str],
    result: BisectResult,
    *,
    step: int | None = None,
    layout: pl.DataFrame | None = None,
) -> pl.DataFrame:
    """Per rank, module and phase at one step (default: ``first_record_step(result)``): where each
    rank's first difference sits. Reads that step's records of every compared rank, 64 ranks at a time.

    A module runs in the forward and again in the backward (and the optimizer and the step's start
    and end at the root): each (module, phase) is its own column, in execution order, so a
    module's backward sits after every forward, and nothing left of a rank's first difference ran
    after it. Phase ``step`` is two columns: ``step start`` (RNG states, the state a capture starts
from) and ``step end``.

    Columns: ``rank``, ``position``, ``module`` ('' is the root), ``phase``, ``column`` (the
    column's label: the module, with `` (phase)`` unless forward), ``module_index`` (Int64: the
    (module, phase) columns in execution order: by each one's mean relative first position over
    the ranks), ``records`` (pairs), ``differing`` (digests differ), ``one_sided`` (a record on one
    side only), ``state``: the rank's verdict state in the column of its first divergent record;
    ``after`` where records differ only after that record in the rank's order (consequences);
    ``differs`` where a record differs before it (past a likely false root) or the rank has no
    located first record; ``identical`` where every pair matches. Columns a rank did not run have
    no row (drawn ``absent``). Empty when no record differs.
    """
    ra, rb = as_run(a), as_run(b)
    step = first_record_step(result) if step is None else step
    schema = {
        "rank": pl.Int32,
        "module": pl.String,
        "phase": pl.String,
        "column": pl.String,
        "module_index": pl.Int64,
        "records": pl.Int64,
        "differing": pl.Int64,
        "one_sided": pl.Int64,
        "state": pl.String,
    }
    if step is None:
        return _positioned(pl.DataFrame(schema=schema), layout)
    ranks = list(result.window.ranks)
    cols = ["rank", "seq", "module", "phase", "kind", "key_hash", *MATCH_COLUMNS]
    parts = []
    for i in range(0, len(ranks), _BATCH):
        batch = ranks[i : i + _BATCH]
        la = ra.scan("records", ranks=batch, steps=step).select(cols)
        lb = rb.scan("records", ranks=batch, steps=step).select(cols)
        j = la.join(lb, on=["rank", "key_hash"], how="full", suffix="_b", coalesce=True)
        parts.append(
            j.with_columns(pl.coalesce("role", "role_b").alias("role"))
            .with_columns(
                match_expr().alias("m"),
                pl.coalesce("module", "module_b").alias("module"),
                _phase_part(pl.coalesce("phase", "phase_b"), pl.coalesce("kind", "kind_b")).alias("phase"),
                pl.coalesce("seq", "seq_b").alias("at"),
            )
            .group_by("rank", "module", "phase")
            .agg(
                pl.len().cast(pl.Int64).alias("records"),
                (pl.col("m") == rule.DIFFERS).sum().cast(pl.Int64).alias("differing"),
                pl.col("m").is_in(rule.ONE_SIDED).sum().cast(pl.Int64).alias("one_sided"),
                pl.col("at").min().alias("first_seq"),
                pl.col("at").filter(pl.col("m").is_in(_DIFFERING)).min().alias("first_bad"),
            )
            .collect()
        )
    if not parts:
        return _positioned(pl.DataFrame(schema=schema), layout)
    cells = pl.concat(parts)
    order = _column_order(cells)
    marks = _first_marks(result, step)
    here = (pl.col("module") == pl.col("first_module")) & (pl.col("phase") == pl.col("first_phase"))
    frame = (
        cells.join(order, on=["module", "phase"])
        .join(marks, on="rank", how="left")
        .with_columns(
            pl.when(pl.col("first_state").is_not_null() & here)
            .then(pl.col("first_state"))
            .when(pl.col("first_bad").is_null())
            .then(pl.lit("identical"))
            .when(pl.col("first_at").is_not_null() & (pl.col("first_bad") > pl.col("first_at")))
            .then(pl.lit("after"))
            .otherwise(pl.lit("differs"))
            .alias("state")
        )
        .select(list(schema))
        .cast(schema)  # type: ignore[arg-type]
    )
    return _positioned(frame, layout)


def _column_order(cells: pl.DataFrame) -> pl.DataFrame:
    """The (module, phase) columns in execution order (each one's mean relative first position
    over the ranks) with their labels: module, module_index, phase, column."""
    return (
        cells.with_columns((pl.col("first_seq").rank("ordinal").over("rank") / pl.len().over("rank")).alias("frac"))
        .group_by("module", "phase")
        .agg(pl.col("frac").mean())
        .sort("frac", "module", "phase")
        .with_row_index("module_index")
        .select(
            "module",
            "phase",
            pl.col("module_index").cast(pl.Int64),
            pl.when(pl.col("phase") == "forward")
            .then(pl.col("module").replace("", "<root>"))
            .otherwise(pl.format("{} ({})", pl.col("module").replace("", "<root>"), pl.col("phase")))
            .alias("column"),
        )
    )


def _first_marks(result: BisectResult, step: int) -> pl.DataFrame:
    """Per rank whose first difference (past a likely false root) is at ``step``: its module
    column, phase part, state and sequence number (first_module, first_phase, first_state, first_at)."""
    rows = []
    for r in result.ranks:
        d = r.effective
        if d is not None and d.step == step:
            seq = d.seq_a if d.seq_a is not None else d.seq_b
            part = d.phase if d.phase != "step" else "step start" if d.kind in _STEP_START else "step end"
            rows.append((r.rank, d.module, part, state_of(d.verdict, r.rank), seq))
    return pl.DataFrame(
        rows,
        schema={
            "rank": pl.Int32,
            "first_module": pl.String,
            "first_phase": pl.String,
            "first_state": pl.String,
            "first_at": pl.Int64,
        },
        orient="row",
    )


#: Kinds of phase ``step`` recorded at the step's start (the rest of that phase is its end).
_STEP_START = ("rng_state", "state")


def _phase_part(phase: pl.Expr, kind: pl.Expr) -> pl.Expr:
    """The phase a module column stands for: phase ``step`` holds the RNG states (and the state a
    capture starts from) at the step's start and the parameters (and a loss reduction) at its end,
    two columns apart in execution order."""
    return (
        pl.when(phase != "step")
        .then(phase)
        .when(kind.is_in(_STEP_START))
        .then(pl.lit("step start"))
        .otherwise(pl.lit("step end"))
    )


def metric_frame(
    a: Run | str | os.PathLike[str],
    b: Run | str | os.PathLike[str],
    *,
    ranks: Iterable[int] | None = None,
    steps: tuple[int, int] | None = None,
) -> pl.DataFrame:
    """Every metric of A next to its twin in B (matched by rank, step, microbatch, name, occurrence).

    Columns: ``name``, ``step``, ``rank``, ``microbatch``, ``occurrence``, ``value_a``, ``value_b``
    (null on the side that lacks it), ``equal`` (raw bits equal on both sides), ``abs_diff``
    (``|value_a - value_b|``, null when a side lacks it). Sorted by name, step, rank, microbatch,
    occurrence. ``steps``: inclusive (first, last) window.
    """
    ra, rb = as_run(a), as_run(b)
    sel = None if steps is None else range(steps[0], steps[1] + 1)
    wanted = None if ranks is None else sorted({int(r) for r in ranks})
    cols = [*METRIC_KEY, "value", "bits"]
    ma = ra.scan("metrics", ranks=wanted, steps=sel).select(cols)
    mb = rb.scan("metrics", ranks=wanted, steps=sel).select(cols)
    j = ma.join(mb, on=list(METRIC_KEY), how="full", coalesce=True, suffix="_b", nulls_equal=True)
    return (
        j.select(
            "name",
            "step",
            "rank",
            "microbatch",
            "occurrence",
            pl.col("value").alias("value_a"),
            pl.col("value_b"),
            (pl.col("bits") == pl.col("bits_b")).fill_null(False).alias("equal"),
            (pl.col("value") - pl.col("value_b")).abs().alias("abs_diff"),
        )
        .sort("name", "step", "rank", "microbatch", "occurrence")
        .collect()
    )


def _shape(shape: Any) -> str:
    return "-" if shape is None else "x".join(str(x) for x in shape) or "scalar"


def discriminator_frame(result: BisectResult) -> pl.DataFrame:
    """The discriminator of the origin op, one row per (phase, module, dtype, shape).

    Columns: ``label`` (``phase module dtype [shape]``), ``phase``, ``module``, ``dtype``, ``shape``
    (``4096x1024``), ``clean`` and ``divergent`` (calls), in the result's order (most divergent
    first). Empty when the result has no discriminator.
    """
    schema = {
        "label": pl.String,
        "phase": pl.String,
        "module": pl.String,
        "dtype": pl.String,
        "shape": pl.String,
        "clean": pl.Int64,
        "divergent": pl.Int64,
    }
    d = result.discriminator
    rows = []
    for row in d.rows if d is not None else ():
        shape = _shape(row.shape)
        mod = row.module or "<root>"
        rows.append(
            (
                f"{row.phase} {mod} {row.dtype or '-'} [{shape}]",
                row.phase,
                mod,
                row.dtype or "-",
                shape,
                row.clean,
                row.divergent,
            )
        )
    return pl.DataFrame(rows, schema=schema, orient="row")
