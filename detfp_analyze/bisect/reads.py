"""How the bisect stages read runs: rank batches, step windows, streaming and paired collects.

Every stage reads through ``Run.scan`` (files pruned by rank and step) and collects with the
streaming engine, so memory is bounded by the batch, not the run; run A's and run B's side of a
read are collected together (``collect_pair``), overlapping on two cores. ``ReadPaths`` says
which summaries the capture stored the step search may read instead of the records (both by
default; turning one off gives the same report on a slower path, for benchmarks and tests).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import polars as pl

from detfp_analyze.io.reader import Run

__all__ = [
    "HOLD_ROWS",
    "ROLLUP_BATCH",
    "WALK_MAX",
    "WALK_MIN",
    "WALK_ROWS",
    "ReadPaths",
    "chunks",
    "collect",
    "collect_pair",
    "densest",
    "scan",
    "walk_batch",
]

#: Ranks per rollup scan.
ROLLUP_BATCH = 64
#: Rows of records a walk batch aims to hold per run (``walk_batch``), and its bounds in
#: rank-steps: a batch of a few records per rank-step costs its fixed reads and joins for little
#: work, one of many thousands holds them all twice (two batches at once) for no gain in time.
WALK_ROWS = 64_000
WALK_MIN, WALK_MAX = 16, 1024
#: Records per run the local engine holds in memory for the walk's first rank-steps when they
#: fit (``held``: read once, every column, instead of once per stage that reads them); past
#: it the stages read the shards as they go. About 30 MB a run at the contract's columns.
HOLD_ROWS = 100_000


def densest(run_a: Run, run_b: Run) -> int:
    """The most records a rank-step holds in either run, as the shards tell (the densest
    shard's rows per step of its window; at least 1)."""
    dense = 1
    for run in (run_a, run_b):
        for s in run.shards.get("records", ()):
            if s.step_min is not None and s.step_max is not None and s.step_max >= s.step_min:
                dense = max(dense, s.num_rows // (s.step_max - s.step_min + 1))
    return dense


def walk_batch(run_a: Run, run_b: Run) -> int:
    """Rank-steps per walk batch: ``WALK_ROWS`` over the most records a rank-step holds in
    either run (``densest``), within ``WALK_MIN``..``WALK_MAX``. On the 2M pair (4,000 records
    per rank-step) 16 rank-steps took the time 32 took in 0.78x the memory; on the seed-shaped
    pair (20) 1,024 took 0.94x the time of 32 (docs/report.md)."""
    return max(WALK_MIN, min(WALK_MAX, WALK_ROWS // densest(run_a, run_b)))


@dataclass(frozen=True)
class ReadPaths:
    """The shortcuts the step search may take past the records shards (``search``). Each is used
    only where both runs wrote what it reads, and gives the report of the records path as long as
    the shards still hold what their windows committed (certify's ``step_sums`` check)."""

    #: Use the step folds the commit lines state (``io.stepsums``, docs/trace-format.md §5a) to
    #: tell which (rank, step)s differ, reading the metrics and rollups shards of those only.
    #: The folds are of the stored rollups, so they are used only with ``stored_rollups``.
    step_sums: bool = True
    #: Use the stored rollups table (``blocks``) for the candidate steps and the slices of
    #: records the walk reads; False takes the records path of runs written without rollups.
    stored_rollups: bool = True


def chunks(xs: Sequence[int], n: int) -> list[list[int]]:
    """``xs`` in consecutive lists of at most ``n``."""
    return [list(xs[i : i + n]) for i in range(0, len(xs), n)]


def collect(lf: pl.LazyFrame) -> pl.DataFrame:
    """Collect with the streaming engine (bounded memory on large scans)."""
    return lf.collect(engine="streaming")


def collect_pair(lf_a: pl.LazyFrame, lf_b: pl.LazyFrame) -> tuple[pl.DataFrame, pl.DataFrame]:
    """``collect`` of run A's and run B's side of a read, run concurrently (same frames as two
    ``collect`` calls: the engine releases the GIL, so the two scans overlap on two cores)."""
    a, b = pl.collect_all([lf_a, lf_b], engine="streaming")
    return a, b


def scan(
    run: Run, table: str, ranks: Sequence[int], lo: int, hi: int, columns: Sequence[str] | None = None
) -> pl.LazyFrame:
    """``run.scan`` of ``ranks`` over the inclusive step range [lo, hi] (files pruned by the reader),
    only ``columns`` (default all)."""
    return run.scan(table, ranks=list(ranks), steps=range(lo, hi + 1), columns=columns)
