"""Record alignment inside one step: match A to B by call-site key, in each rank's own order.

Input: the records of a set of (rank, step) pairs from each run (one step per rank),
with the ``ALIGN_COLUMNS``. Pipeline:

1. ``prepare``: order each rank's records by (segment, seq) and number them: ``pos`` is
   the record's index in that rank's stream for the step. Positions are only ever compared
   between the two runs of the same rank, never across ranks.
2. ``align``: full outer join on (rank, step, key_hash, dup) where ``dup`` numbers repeated
   keys (a capture bug, but it must not explode the join). Each row gets a ``state``:
   match, differ (digest, argument digest or a digest error), unknown (skipped on a side:
   no evidence), a_only / b_only (structural: control flow differed), or reordered (both
   sides hold the key but the matched records come in a different order, the mark of a
   shifted occurrence counter; reported as structural instead of a cascade of false value
   mismatches).
3. ``first_divergences``: per rank, the first divergent row by (priority, min(pos_a,
   pos_b), max(...), key_hash). The order is symmetric in A and B, so swapping the runs
   changes nothing but labels. ``priority`` lets resume put boundary-state records first.

The output of ``align`` keeps both sides' columns with ``_a``/``_b`` suffixes.
"""

from __future__ import annotations

from collections.abc import Iterable

import polars as pl

__all__ = [
    "ALIGN_COLUMNS",
    "DIVERGENT_STATES",
    "KEY_COLUMNS",
    "align",
    "first_divergences",
    "prepare",
]

#: Key columns (identical on both sides of a matched row).
KEY_COLUMNS = ("rank", "step", "key_hash", "dup")
#: Records columns read for the exact walk of a step (no rows/moments: fetched per record later).
ALIGN_COLUMNS = (
    "rank",
    "segment",
    "step",
    "seq",
    "microbatch",
    "phase",
    "module",
    "kind",
    "name",
    "occurrence",
    "role",
    "arg",
    "call_hash",
    "key_hash",
    "dtype",
    "shape",
    "status",
    "digest_hi",
    "digest_lo",
    "hazards",
    "args_digest",
)
#: Side-specific columns (suffixed _a/_b after the join).
_SIDE = (*tuple(c for c in ALIGN_COLUMNS if c not in ("rank", "step", "key_hash")), "pos")
#: Call-site columns that are equal on both sides of a match: coalesced into one column.
_SHARED = ("microbatch", "phase", "module", "kind", "name", "occurrence", "role", "arg", "call_hash")
#: States that are a divergence.
DIVERGENT_STATES = ("differ", "a_only", "b_only", "reordered")


def prepare(records: pl.DataFrame) -> pl.DataFrame:
    """Order one side's records per rank by (segment, seq); add pos and dup."""
    return records.sort("rank", "step", "segment", "seq").with_columns(
        pl.int_range(pl.len()).over("rank", "step").alias("pos"),
        (pl.col("key_hash").cum_count().over("rank", "step", "key_hash") - 1).alias("dup"),
    )


def _suffix(df: pl.DataFrame, s: str) -> pl.DataFrame:
    return df.rename({c: f"{c}_{s}" for c in _SIDE})


def align(a: pl.DataFrame, b: pl.DataFrame) -> pl.DataFrame:
    """Full outer match of prepared sides A and B (see module docstring).

    Columns: rank, step, key_hash, dup, the call-site columns (microbatch, phase, module,
    kind, name, occurrence, role, arg, call_hash; from whichever side has the record),
    every ALIGN column of each side suffixed _a/_b, pos_a/pos_b, state (str), o1/o2 (the
    symmetric order keys), hz (bool: the record carries a hazard on either side).
    """
    j = _suffix(a, "a").join(_suffix(b, "b"), on=list(KEY_COLUMNS), how="full", coalesce=True)
    j = j.with_columns([pl.coalesce(f"{c}_a", f"{c}_b").alias(c) for c in _SHARED])
    both = pl.col("pos_a").is_not_null() & pl.col("pos_b").is_not_null()
    ok = (pl.col("status_a") == "ok") & (pl.col("status_b") == "ok")
    same_digest = (pl.col("digest_hi_a") == pl.col("digest_hi_b")) & (pl.col("digest_lo_a") == pl.col("digest_lo_b"))
    same_args = pl.col("args_digest_a").eq_missing(pl.col("args_digest_b"))
    state = (
        pl.when(pl.col("pos_b").is_null())
        .then(pl.lit("a_only"))
        .when(pl.col("pos_a").is_null())
        .then(pl.lit("b_only"))
        .when((pl.col("status_a") == "error") | (pl.col("status_b") == "error"))
        .then(pl.lit("differ"))
        .when((pl.col("status_a") == "skipped") | (pl.col("status_b") == "skipped"))
        .then(pl.lit("unknown"))
        .when(ok & same_digest & same_args)
        .then(pl.lit("match"))
        .otherwise(pl.lit("differ"))
    )
    j = j.with_columns(state.alias("state"))
    # Order check among rows present on both sides: the k-th matched record of A must be the
    # k-th matched record of B. A shifted occurrence counter breaks this and is structural.
    idx = (
        j.filter(both)
        .select(
            "rank",
            "step",
            "key_hash",
            "dup",
            pl.col("pos_a").rank("ordinal").over("rank", "step").alias("ia"),
            pl.col("pos_b").rank("ordinal").over("rank", "step").alias("ib"),
        )
        .filter(pl.col("ia") != pl.col("ib"))
        .select(*KEY_COLUMNS, pl.lit(True).alias("moved"))
    )
    j = j.join(idx, on=list(KEY_COLUMNS), how="left").with_columns(
        pl.when(pl.col("moved").fill_null(False) & (pl.col("state") != "unknown"))
        .then(pl.lit("reordered"))
        .otherwise(pl.col("state"))
        .alias("state"),
        pl.min_horizontal("pos_a", "pos_b").alias("o1"),
        pl.max_horizontal("pos_a", "pos_b").alias("o2"),
        ((pl.col("hazards_a").list.len().fill_null(0) > 0) | (pl.col("hazards_b").list.len().fill_null(0) > 0)).alias(
            "hz"
        ),
    )
    return j.drop("moved").sort("rank", "step", "o1", "o2", "key_hash")


def first_divergences(
    aligned: pl.DataFrame,
    *,
    priority_kinds: Iterable[str] = (),
    priority_steps: Iterable[int] = (),
    exclude_hazard_calls: bool = False,
) -> pl.DataFrame:
    """Per rank, the first divergent row of ``aligned`` (one row per rank with any, sorted by rank).

    ``priority_kinds`` records at a step in ``priority_steps`` come first (resume boundary state).
    ``exclude_hazard_calls``: skip rows whose call has a hazard on any of its records (the
    next non-hazard divergence).
    """
    div = aligned.filter(pl.col("state").is_in(DIVERGENT_STATES))
    if exclude_hazard_calls:
        hz_calls = aligned.group_by("rank", "step", "call_hash").agg(pl.col("hz").any().alias("call_hz"))
        div = div.join(hz_calls, on=["rank", "step", "call_hash"], how="left").filter(~pl.col("call_hz"))
    kinds, psteps = list(priority_kinds), list(priority_steps)
    if kinds and psteps:
        div = div.with_columns(
            pl.when(pl.col("step").is_in(psteps) & pl.col("kind").is_in(kinds)).then(0).otherwise(1).alias("prio")
        )
    else:
        div = div.with_columns(pl.lit(1).alias("prio"))
    return div.sort("rank", "prio", "o1", "o2", "key_hash").group_by("rank", maintain_order=True).first()
