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

__all__ = ["ROLLUP_BATCH", "WALK_BATCH", "ReadPaths", "chunks", "collect", "collect_pair", "scan"]

#: Ranks per rollup scan and per exact walk batch (memory bound: one walk batch holds
#: WALK_BATCH rank-steps of records from each run).
ROLLUP_BATCH = 64
WALK_BATCH = 32


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
