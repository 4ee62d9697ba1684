"""Record alignment inside one step: match A to B by call-site key, in each rank's own order.

Input: the records of a set of (rank, step) pairs from each run (one step per rank), with the
``ALIGN_COLUMNS`` (or the ``NARROW_COLUMNS``) and each record's ``hazard`` flag
(``HAZARD_FLAG``). Record equality and the structural refinements are ``detfp_analyze.rule``'s;
this module is their polars implementation:

1. ``prepare``: number each rank's records by (segment, seq): ``pos`` is the record's index in
   that rank's stream for the step (rows are not moved). Positions are only ever compared
   between the two runs of the same rank, never across ranks.
2. ``align``: full outer join on (rank, step, key_hash, dup) where ``dup`` numbers repeated
   keys (a capture bug, but it must not explode the join). Each row gets its ``state``
   (``rule.STATES``): the pair's ``rule.MATCH``, refined to ``shifted`` (a call-site family
   with a different non-zero number of calls; needs the call-site columns, so the walk
   re-aligns such steps with ALIGN_COLUMNS) and ``reordered`` (matched records in another order).
3. ``first_divergences``: per rank, the first divergent row by (priority, min(pos_a, pos_b),
   max(...), key_hash). The order is symmetric in A and B, so swapping the runs changes
   nothing but labels. ``priority`` puts resume boundary-state records first.

The output of ``align`` keeps both sides' columns with ``_a``/``_b`` suffixes.
"""

from __future__ import annotations

from collections.abc import Iterable

import polars as pl

from detfp_analyze import rule
from detfp_analyze.rule.to_polars import to_polars

__all__ = [
    "ALIGN_COLUMNS",
    "DIVERGENT_STATES",
    "HAZARD_FLAG",
    "KEY_COLUMNS",
    "NARROW_COLUMNS",
    "STRUCTURAL_STATES",
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
#: The narrow subset the walk aligns first (all rank-steps), before reading ALIGN_COLUMNS
#: for the few calls a verdict needs.
NARROW_COLUMNS = (
    "rank",
    "segment",
    "step",
    "seq",
    "kind",
    "role",
    "call_hash",
    "key_hash",
    "status",
    "digest_hi",
    "digest_lo",
    "args_digest",
)
#: Each record's ``hazard`` (``rule.RECORD_HAZARD``), computed where the records are read instead
#: of materializing the hazards lists.
HAZARD_FLAG = to_polars(rule.RECORD_HAZARD).alias("hazard")
#: Call-site columns that are equal on both sides of a match: coalesced into one column.
_SHARED = ("microbatch", "phase", "module", "kind", "name", "occurrence", "role", "arg", "call_hash")
#: States that are a divergence.
DIVERGENT_STATES = rule.DIVERGENT
#: States that mean control flow differed (structural).
STRUCTURAL_STATES = rule.STRUCTURAL
_MATCH = to_polars(rule.MATCH)
#: A one-sided record of the state a capture starts from: unknown (``rule.UNSTARTED``, on the state column).
_UNSTARTED = to_polars(rule.UNSTARTED, lambda col: "state" if col.name == "match" else col.name)
#: Whether the tensors / the call's arguments are equal (``rule``): what makes a difference an
#: arguments-only one, for the verdict and the difference kind.
_EQUALITY = (
    to_polars(rule.TENSORS_EQUAL).fill_null(False).alias("tensors_same"),
    to_polars(rule.ARGS_EQUAL).alias("args_same"),
)
_HAZARD = to_polars(rule.HAZARD).alias("hz")


def prepare(records: pl.DataFrame, *, one_step_per_rank: bool = False) -> pl.DataFrame:
    """Number one side's records per (rank, step) by (segment, seq): adds ``pos``.

    Rows are not moved (gathering string and list columns is the expensive part); ``pos``
    alone carries the order. ``one_step_per_rank``: the caller guarantees each rank holds a
    single step (the walk), which allows one composite integer key instead of four columns.
    """
    if not records.height:
        return records.with_columns(pl.lit(0, dtype=pl.Int64).alias("pos"))
    r, g, q = records.select(pl.col("rank").max(), pl.col("segment").max(), pl.col("seq").max()).row(0)
    if not (one_step_per_rank and r < (1 << 20) and g < (1 << 4) and q < (1 << 40)):
        return records.sort("rank", "step", "segment", "seq").with_columns(
            pl.int_range(pl.len()).over("rank", "step").cast(pl.Int64).alias("pos")
        )
    key = (
        pl.col("rank").cast(pl.UInt64) * (1 << 44)
        + pl.col("segment").cast(pl.UInt64) * (1 << 40)
        + pl.col("seq").cast(pl.UInt64)
    )
    k = records.select(key.alias("k"))["k"]
    order = None if k.is_sorted() else k.arg_sort()  # scans may return ranks in path order
    ranks = records["rank"] if order is None else records["rank"].gather(order)
    # In key order, pos = index - index of the rank's first row: O(n), no hashing.
    idx = pl.int_range(records.height, eager=True, dtype=pl.Int64)
    start = (ranks != ranks.shift(1)).fill_null(True)
    first = pl.select(pl.when(start).then(idx).otherwise(None).forward_fill()).to_series()
    pos = idx - first
    if order is not None:
        pos = pos.gather(order.arg_sort())  # back to the rows' own order
    return records.with_columns(pos.alias("pos"))


def _with_dup(df: pl.DataFrame) -> pl.DataFrame:
    """Add ``dup``: numbers repeated keys within a rank-step (a capture bug) so joins stay 1:1."""
    dups = df.group_by("rank", "step").agg((pl.len() - pl.col("key_hash").n_unique()).alias("d"))["d"].sum()
    if dups:
        return df.with_columns((pl.col("key_hash").cum_count().over("rank", "step", "key_hash") - 1).alias("dup"))
    return df.with_columns(pl.lit(0, dtype=pl.UInt32).alias("dup"))


def _suffix(df: pl.DataFrame, s: str) -> pl.DataFrame:
    return df.rename({c: f"{c}_{s}" for c in df.columns if c not in KEY_COLUMNS})


def align(a: pl.DataFrame, b: pl.DataFrame) -> pl.DataFrame:
    """Full outer match of prepared sides A and B (see module docstring).

    Columns: rank, step, key_hash, dup, the call-site columns present in the input
    (microbatch, phase, module, kind, name, occurrence, role, arg, call_hash; from whichever
    side has the record), every other input column of each side suffixed _a/_b,
    pos_a/pos_b, state (str, ``rule.STATES``), tensors_same / args_same (bool: the digests / the
    call's arguments are equal, ``rule.TENSORS_EQUAL`` / ``rule.ARGS_EQUAL``), o1/o2 (the symmetric order keys), hz (bool: the
    record carries a hazard on either side, ``rule.HAZARD``). Works on ALIGN_COLUMNS or on the
    NARROW_COLUMNS subset, each with the ``hazard`` flag (HAZARD_FLAG).
    """
    keys = list(KEY_COLUMNS)
    # Fast path: the same keys in the same order on both sides (values-only divergence, the
    # common case) align by position, no hash join and no order check needed.
    pk = ["rank", "step", "key_hash", "pos"]
    same_keys = a.height == b.height and a.select(pk).equals(b.select(pk))
    if same_keys:
        a, b = (
            a.with_columns(pl.lit(0, dtype=pl.UInt32).alias("dup")),
            b.with_columns(pl.lit(0, dtype=pl.UInt32).alias("dup")),
        )
        j = pl.concat([_suffix(a, "a"), _suffix(b, "b").drop(keys)], how="horizontal")
    else:
        a, b = _with_dup(a), _with_dup(b)
        j = _suffix(a, "a").join(_suffix(b, "b"), on=keys, how="full", coalesce=True)
    if same_keys:  # equal keys: the call-site columns are equal on both sides
        j = j.with_columns([pl.col(f"{c}_a").alias(c) for c in _SHARED if c in a.columns])
    else:
        j = j.with_columns([pl.coalesce(f"{c}_a", f"{c}_b").alias(c) for c in _SHARED if c in a.columns])
    both = pl.col("pos_a").is_not_null() & pl.col("pos_b").is_not_null()
    j = j.with_columns(_MATCH.alias("state"), *_EQUALITY)
    if "kind" in a.columns:
        j = j.with_columns(pl.when(_UNSTARTED).then(pl.lit(rule.UNKNOWN)).otherwise(pl.col("state")).alias("state"))
    hz = _HAZARD
    if same_keys:
        return j.with_columns(pl.col("pos_a").alias("o1"), pl.col("pos_a").alias("o2"), hz)
    if "name" in a.columns:
        # A call-site family (same module, kind, name...) with a different number of calls on
        # the two sides has shifted occurrence counters: its divergent rows are structural,
        # whatever their digests say.
        fam = ["rank", "step", *rule.FAMILY]
        shifted = (
            j.group_by(fam)
            .agg(
                pl.col("call_hash_a").drop_nulls().n_unique().alias("na"),
                pl.col("call_hash_b").drop_nulls().n_unique().alias("nb"),
            )
            # A family on one side only is an extra call (a_only/b_only), not a shifted count.
            .filter((pl.col("na") != pl.col("nb")) & (pl.col("na") > 0) & (pl.col("nb") > 0))
            .select(*fam, pl.lit(True).alias("shifted"))
        )
        j = (
            j.join(shifted, on=fam, how="left", nulls_equal=True)
            .with_columns(
                pl.when(pl.col("shifted").fill_null(False) & pl.col("state").is_in(rule.SHIFTABLE))
                .then(pl.lit(rule.SHIFTED))
                .otherwise(pl.col("state"))
                .alias("state")
            )
            .drop("shifted")
        )
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
        pl.when(pl.col("moved").fill_null(False) & (pl.col("state") != rule.UNKNOWN))
        .then(pl.lit(rule.REORDERED))
        .otherwise(pl.col("state"))
        .alias("state"),
        pl.min_horizontal("pos_a", "pos_b").alias("o1"),
        pl.max_horizontal("pos_a", "pos_b").alias("o2"),
        hz,
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
    kinds, psteps = list(priority_kinds), list(priority_steps)
    if kinds and psteps:
        prio = pl.when(pl.col("step").is_in(psteps) & pl.col("kind").is_in(kinds)).then(0).otherwise(1).alias("prio")
    else:
        prio = pl.lit(1).alias("prio")
    divergent = pl.col("state").is_in(DIVERGENT_STATES)
    if exclude_hazard_calls:
        div = aligned.filter(divergent)
        hz_calls = aligned.group_by("rank", "step", "call_hash").agg(pl.col("hz").any().alias("call_hz"))
        div = div.join(hz_calls, on=["rank", "step", "call_hash"], how="left").filter(~pl.col("call_hz"))
        div = div.with_columns(prio)
        if div.height and div["o2"].max() < (1 << 21):  # type: ignore[operator]
            div = _best(div)
    else:
        # The candidates are picked on a few narrow columns and only they are gathered whole: a
        # receiver rank has thousands of divergent rows after its first, and filtering every
        # column of every one of them was most of this function's cost.
        rows = aligned.select(
            pl.int_range(pl.len(), dtype=pl.UInt32).alias("_i"), "rank", "o1", "o2", prio, divergent.alias("_d")
        ).filter("_d")
        if rows.height and rows["o2"].max() < (1 << 21):  # type: ignore[operator]
            rows = _best(rows)
        div = aligned[rows["_i"]].with_columns(rows["prio"])
    return div.sort("rank", "prio", "o1", "o2", "key_hash").group_by("rank", maintain_order=True).first()


def _best(div: pl.DataFrame) -> pl.DataFrame:
    """The rows of ``div`` holding their rank's smallest (prio, o1, o2), as one integer per row
    (o2 < 2^21), in ``div``'s order: no sort of every divergent row, only of these."""
    c = pl.col("prio").cast(pl.Int64) * (1 << 42) + pl.col("o1").cast(pl.Int64) * (1 << 21) + pl.col("o2")
    div = div.with_columns(c.alias("c"))
    best = div.group_by("rank").agg(pl.col("c").min())
    return div.join(best, on=["rank", "c"], how="semi", maintain_order="left").drop("c")
