"""Step-level narrowing: which (rank, step) pairs differ, without reading every column.

Pipeline (pure functions over polars LazyFrames, so they can be tested on in-memory frames):

1. ``metric_divergence``: metrics are tiny; join them by (rank, step, microbatch, name,
   occurrence) and compare raw IEEE bits. The first differing step per rank bounds where
   the first differing record can be (a loss is a checksum of everything before it).
2. ``step_rollup``: per (rank, step), over only narrow numeric columns, an order-free
   fingerprint of the step: the record count, the XOR of a hash of each record's key
   (structure), the XOR of a hash of (key, status, digest, args digest) (values) and the
   number of error records (no evidence: counted for the report). The aggregation streams, so
   memory stays bounded by the number of (rank, step) groups, not the records; the
   caller feeds rank batches and filters pushed into the Parquet scan.
3. ``divergent_steps``: join the two rollups; a step differs when any part differs or a
   side lacks it. A rollup match is evidence from 64-bit hashes (a collision would hide a
   difference with probability about 2^-64 per step); a rollup mismatch is only a
   candidate: the exact walk (``align.py``) decides, e.g. a record skipped on one side
   and digested on the other flags the step but is no evidence.

The XOR of row hashes is safe because key_hash is unique within (rank, step); the hashes are
the contract's rollup hashes (``contract.rollup_hashes``), fixed across processes, so a step's
rollup equals the step fold its commit lines state and every read is checked against it
(``io.binding``).
"""

from __future__ import annotations

import polars as pl

from detfp_analyze.io import binding as _binding

__all__ = [
    "METRIC_KEY", "ROLLUP_COLUMNS", "add_candidates", "divergent_steps", "metric_divergence", "step_rollup",
]  # fmt: skip

#: Columns matching a metric in A to its twin in B.
METRIC_KEY = ("rank", "step", "microbatch", "name", "occurrence")
#: The only records columns a rollup reads.
ROLLUP_COLUMNS = ("rank", "step", "key_hash", "status", "digest_hi", "digest_lo", "args_digest")


def metric_divergence(metrics_a: pl.LazyFrame, metrics_b: pl.LazyFrame) -> pl.DataFrame:
    """First step per rank whose metrics differ bitwise.

    Columns: rank (int32), step (int64), name (str: the first differing metric of that step,
    by name), value_a / value_b (float64, null when the metric exists on one side only),
    structural (bool: the metric exists on one side only). One row per diverged rank, sorted.
    """
    cols = [*METRIC_KEY, "value", "bits"]
    a = metrics_a.select(cols)
    b = metrics_b.select(cols)
    joined = a.join(b, on=list(METRIC_KEY), how="full", coalesce=True, suffix="_b", nulls_equal=True)
    diff = joined.filter(pl.col("bits").is_null() | pl.col("bits_b").is_null() | (pl.col("bits") != pl.col("bits_b")))
    out = (
        diff.sort(["rank", "step", "name", "microbatch", "occurrence"])
        .group_by("rank", maintain_order=True)
        .first()
        .select(
            pl.col("rank"),
            pl.col("step"),
            pl.col("name"),
            pl.col("value").alias("value_a"),
            pl.col("value_b"),
            (pl.col("bits").is_null() | pl.col("bits_b").is_null()).alias("structural"),
        )
        .sort("rank")
    )
    return out.collect()


def step_rollup(records: pl.LazyFrame) -> pl.LazyFrame:
    """Per (rank, step) order-free fingerprint of the records (lazy; collect with streaming).

    Columns: rank, step, n (records), kx (XOR of key hashes: structure), vx (XOR of
    hashes of key, status, digest and args digest: values), n_err (records with status error).
    The hashes are the rollups table's (``contract.rollup_hashes``, ``io.binding.fold``), so a
    step's rollup is the step fold its commit lines state: a read is checked against it.
    """
    return _binding.fold(records.select(ROLLUP_COLUMNS))


def divergent_steps(rollup_a: pl.DataFrame, rollup_b: pl.DataFrame) -> pl.DataFrame:
    """(rank, step) pairs whose rollups differ, sorted; candidates for the exact walk.

    Columns: rank, step, structural (bool: record count or key set differs, or the step
    exists on one side only), errors (bool: a digest error on either side).
    """
    j = rollup_a.join(rollup_b, on=["rank", "step"], how="full", coalesce=True, suffix="_b")
    structural = (
        pl.col("n").is_null()
        | pl.col("n_b").is_null()
        | (pl.col("n") != pl.col("n_b"))
        | (pl.col("kx") != pl.col("kx_b"))
    )
    errors = (pl.col("n_err").fill_null(0) + pl.col("n_err_b").fill_null(0)) > 0
    # A digest error is no evidence either way: it makes a step a candidate only through its
    # status (an error on one side, a digest on the other), which the walk reads as unknown.
    differs = structural | (pl.col("vx") != pl.col("vx_b"))
    return (
        j.filter(differs)
        .select(
            pl.col("rank").cast(pl.Int32),
            pl.col("step").cast(pl.Int64),
            structural.alias("structural"),
            errors.alias("errors"),
        )
        .sort("rank", "step")
    )


def add_candidates(
    rollup_a: pl.DataFrame, rollup_b: pl.DataFrame, out: dict[int, list[int]], errors: list[int]
) -> None:
    """Add the divergent steps of two step rollups to ``out`` (rank -> steps, in step order) and
    their digest-error counts to ``errors`` ([A, B]): the one tally of every rollup source
    (stored blocks, records read in rank batches, a Spark stage)."""
    errors[0] += int(rollup_a["n_err"].sum() or 0)
    errors[1] += int(rollup_b["n_err"].sum() or 0)
    d = divergent_steps(rollup_a, rollup_b)
    for rank, step in zip(d["rank"].to_list(), d["step"].to_list(), strict=True):
        out.setdefault(int(rank), []).append(int(step))
