"""The stored rollups: step candidates and divergent block slices without reading records.

A run written with the rollups table (``contract.ROLLUP_VERSION``, manifest key ``rollups``) holds
per (rank, step, block) fingerprints computed by the capture (``detfp_format.rollups``). When
both runs have them for every compared rank:

1. ``step_rollup``: the blocks folded into the same per (rank, step) rollup ``narrow.step_rollup``
   computes from records (count, order-free key and value XORs, errors), so
   ``narrow.divergent_steps`` picks the same candidate steps while reading a few rows per block;
2. ``slices``: for a candidate step with the same record count and key set on both sides and no
   digest error (no structural difference), the records the exact walk must read: from the block
   before the first block whose ordered fingerprint differs to the last such block. Blocks before
   and after hold the same records in the same order on both sides, so the walk's alignment of
   the slice is the full step's alignment restricted to it (positions shift equally on both
   sides). Any other candidate step is read whole, as for runs without rollups. The slice's
   ``head`` ends with its first differing block: the walk reads that first (``walk``).

A rollup match is evidence from 64-bit hashes, as for ``narrow.step_rollup``; a mismatch is only
a candidate. ``reads.ReadPaths(stored_rollups=False)`` has the bisect ignore stored rollups
(the path of older runs), for benchmarks and tests that compare both paths.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import polars as pl

from detfp_analyze.io.binding import Fold
from detfp_analyze.io.reader import Run
from detfp_format import contract

__all__ = ["Slice", "available", "block_rollup", "slices", "step_rollup"]


@dataclass(frozen=True)
class Slice:
    """The part of one candidate rank-step the walk reads, on each side."""

    #: Inclusive seq range of run A's and run B's records to read.
    seq_a: tuple[int, int]
    seq_b: tuple[int, int]
    #: The slice starts after the step's first record (the walk checks that what it picks lies inside).
    cut: bool
    #: Record kinds the whole rank-step holds on either side.
    kinds: frozenset[str]
    #: The last seq of the slice's head on A's and B's side: the slice up to the end of its first
    #: differing block, which holds the first divergence whenever the step has one the walk can
    #: pick there. The walk reads the head first and the rest only where the head does not settle
    #: the pick (``walk``). None when the head is the whole slice.
    head: tuple[int, int] | None = None
    #: The fold of the blocks the slice covers on A's and B's side, and of those its head covers:
    #: what its records must fold to when read (``io.binding``: rows not what was committed are
    #: refused). None: not known.
    folds: tuple[Fold, Fold] | None = None
    head_folds: tuple[Fold, Fold] | None = None

    def span(self, side: int, head: bool = False) -> tuple[int, int]:
        """The seq span a read of this slice covers on ``side`` (0: A, 1: B); with ``head``, only
        its head (the whole slice when it has none)."""
        lo, hi = (self.seq_a, self.seq_b)[side]
        return (lo, self.head[side]) if head and self.head is not None else (lo, hi)

    def fold(self, side: int, head: bool = False) -> Fold | None:
        """The fold a read of ``span(side, head)`` must give (None: not known)."""
        folds = self.head_folds if head and self.head is not None else self.folds
        return None if folds is None else folds[side]


def available(run_a: Run, run_b: Run, ranks: Sequence[int]) -> bool:
    """Whether both runs wrote rollups on every launch of ``ranks``."""
    for run in (run_a, run_b):
        for r in ranks:
            if not all(m.get("rollups") == contract.ROLLUP_VERSION for m in run.manifests.get(r, ())):
                return False
    return True


def block_rollup(rollups: pl.LazyFrame) -> pl.LazyFrame:
    """Per (rank, step, block): the window rows of a block combined.

    Columns: rank, step, block, n, n_err, kx, vx, ox (XORs), kinds (OR of masks), seq_lo, seq_hi.
    """
    return rollups.group_by("rank", "step", "block").agg(
        pl.col("n").sum(),
        pl.col("n_err").sum(),
        pl.col("kx").bitwise_xor(),
        pl.col("vx").bitwise_xor(),
        pl.col("ox").bitwise_xor(),
        pl.col("kinds").bitwise_or(),
        pl.col("seq").min().alias("seq_lo"),
        pl.col("seq_hi").max(),
    )


def step_rollup(blocks: pl.DataFrame) -> pl.DataFrame:
    """``narrow.step_rollup``'s columns (rank, step, n, kx, vx, n_err) from ``block_rollup`` rows."""
    return blocks.group_by("rank", "step").agg(
        pl.col("n").sum(), pl.col("kx").bitwise_xor(), pl.col("vx").bitwise_xor(), pl.col("n_err").sum()
    )


def _kinds(mask: int) -> frozenset[str]:
    return frozenset(k for i, k in enumerate(contract.KINDS) if mask >> i & 1)


def slices(
    blocks_a: pl.DataFrame, blocks_b: pl.DataFrame, cands: Mapping[int, Sequence[int]]
) -> dict[tuple[int, int], Slice]:
    """(rank, step) -> Slice for the candidate steps a slice covers exactly (see the module docstring)."""
    want = pl.DataFrame(
        [(r, s) for r, ss in cands.items() for s in ss], schema={"rank": pl.Int32, "step": pl.Int64}, orient="row"
    )
    if not want.height:
        return {}
    j = (
        blocks_a.join(want, on=["rank", "step"], how="semi")
        .join(blocks_b, on=["rank", "step", "block"], how="full", coalesce=True, suffix="_b")
        .sort("rank", "step", "block")
    )
    # Every candidate step's test in one aggregation (not a few series queries per step).
    i = pl.int_range(pl.len(), dtype=pl.Int64)
    differs = (pl.col("n") != pl.col("n_b")) | (pl.col("ox") != pl.col("ox_b"))
    first, last = i.filter(differs).first(), i.filter(differs).last()
    start = (first - 1).clip(lower_bound=0).fill_null(0)
    in_slice, in_head = i.is_between(start, last.fill_null(0)), i.is_between(start, first.fill_null(0))

    def folded(part: pl.Expr, side: str, name: str) -> list[pl.Expr]:
        """The fold (n, n_err, kx, vx) of the blocks ``part`` selects on one side."""
        return [
            pl.col(f"n{side}").filter(part).sum().alias(f"{name}_n"),
            pl.col(f"n_err{side}").filter(part).sum().alias(f"{name}_e"),
            pl.col(f"kx{side}").filter(part).bitwise_xor().alias(f"{name}_kx"),
            pl.col(f"vx{side}").filter(part).bitwise_xor().alias(f"{name}_vx"),
        ]

    g = j.group_by("rank", "step", maintain_order=True).agg(
        (pl.col("n").null_count() + pl.col("n_b").null_count()).alias("nulls"),
        (pl.col("n").sum() == pl.col("n_b").sum()).alias("same_n"),
        pl.col("kx").bitwise_xor().fill_null(0).alias("kx"),
        pl.col("kx_b").bitwise_xor().fill_null(0).alias("kx_b"),
        (pl.col("n_err").sum() + pl.col("n_err_b").sum()).alias("errors"),
        first.alias("first"),
        start.alias("start"),
        pl.col("seq_lo").get(start).alias("lo_a"),
        pl.col("seq_hi").get(last.fill_null(0)).alias("hi_a"),
        pl.col("seq_lo_b").get(start).alias("lo_b"),
        pl.col("seq_hi_b").get(last.fill_null(0)).alias("hi_b"),
        pl.col("seq_hi").get(first.fill_null(0)).alias("head_a"),
        pl.col("seq_hi_b").get(first.fill_null(0)).alias("head_b"),
        pl.col("kinds").bitwise_or().fill_null(0).alias("kinds"),
        pl.col("kinds_b").bitwise_or().fill_null(0).alias("kinds_b"),
        *folded(in_slice, "", "fa"),
        *folded(in_slice, "_b", "fb"),
        *folded(in_head, "", "ha"),
        *folded(in_head, "_b", "hb"),
    )

    def fold_of(row: dict, name: str) -> Fold:
        return Fold(*(int(row[f"{name}_{c}"] or 0) for c in ("n", "e", "kx", "vx")))

    out: dict[tuple[int, int], Slice] = {}
    for row in g.iter_rows(named=True):
        if row["nulls"]:
            continue  # a block on one side only: structural, read whole
        if not (row["same_n"] and row["kx"] == row["kx_b"]) or row["errors"]:
            continue
        if row["first"] is None:
            continue  # no block differs although the step rollup did: cannot happen, read whole
        head = (int(row["head_a"]), int(row["head_b"]))
        out[(int(row["rank"]), int(row["step"]))] = Slice(
            (int(row["lo_a"]), int(row["hi_a"])),
            (int(row["lo_b"]), int(row["hi_b"])),
            row["start"] > 0,
            _kinds(int(row["kinds"]) | int(row["kinds_b"])),
            head if head != (int(row["hi_a"]), int(row["hi_b"])) else None,
            (fold_of(row, "fa"), fold_of(row, "fb")),
            (fold_of(row, "ha"), fold_of(row, "hb")),
        )
    return out
