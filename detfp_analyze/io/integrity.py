"""Integrity of the rows bisect reads: a trace that contradicts its own contract is refused.

The reader validates metadata only (footers, manifests, commit logs); a shard can still hold
rows no capture writes. Bisect checks the rows it actually reads (each compared rank-step, on
the narrow columns it reads anyway, and the calls a verdict needs), so the checks cost no
extra I/O:

* ``check_stream``: within a (rank, segment), ``seq`` strictly increases in file order, and no
  record key occurs twice in one step (a duplicate call-site key makes "the record's twin in
  the other run" ambiguous);
* ``check_shapes``: shapes have at most ``MAX_DIMS`` dimensions, none negative, and fewer than
  2^62 elements.

Each failure is a ShardError naming the run, rank and step.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import polars as pl

from detfp_analyze.errors import ShardError

__all__ = ["MAX_DIMS", "check_shapes", "check_stream"]

#: More dimensions than any tensor library supports (PyTorch allows 64).
MAX_DIMS = 64
_FIX = "the shard is corrupt or was not written by a detfp capture; re-run the capture"


def check_stream(df: pl.DataFrame, label: str) -> None:
    """Refuse backwards ``seq`` or a repeated key in one (rank, step) of ``df`` (rows in file order;
    needs rank, segment, step, seq and key_hash)."""
    if df.height < 2:
        return
    same = (pl.col("rank") == pl.col("rank").shift(1)) & (pl.col("segment") == pl.col("segment").shift(1))
    back = df.select("rank", "step", "seq", same.alias("same"), pl.col("seq").shift(1).alias("prev")).filter(
        pl.col("same") & (pl.col("seq") <= pl.col("prev"))
    )
    if back.height:
        r = back.row(0, named=True)
        raise ShardError(
            f"{label}: rank {r['rank']} step {r['step']}: seq {r['seq']} follows {r['prev']}, "
            f"sequence numbers must strictly increase; {_FIX}"
        )
    # Counting distinct keys per (rank, segment, step) is far cheaper than grouping by the key
    # itself; the group-by that names the repeated key runs only when a count says there is one.
    per_step = df.group_by("rank", "segment", "step").agg((pl.len() - pl.col("key_hash").n_unique()).alias("d"))
    if not per_step["d"].sum():
        return
    dup = df.group_by("rank", "segment", "step", "key_hash").len().filter(pl.col("len") > 1)
    if dup.height:
        r = dup.sort("rank", "step", "key_hash").row(0, named=True)
        raise ShardError(
            f"{label}: rank {r['rank']} step {r['step']}: record key {r['key_hash']:#018x} occurs {r['len']} times, "
            f"a call-site key is unique within a step; {_FIX}"
        )


def check_shapes(rows: Iterable[Mapping[str, Any]], label: str, columns: Iterable[str] = ("shape",)) -> None:
    """Refuse an absurd shape in ``rows`` (dicts with rank, step and the shape ``columns``)."""
    cols = tuple(columns)
    for row in rows:
        for c in cols:
            shape = row.get(c)
            if shape is None:
                continue
            n = 1
            for d in shape:
                n *= max(d, 0) if d is not None else 0
            if len(shape) > MAX_DIMS or any(d is None or d < 0 for d in shape) or n >= 1 << 62:
                text = str(list(shape[:8]))[:-1] + (", ...]" if len(shape) > 8 else "]")
                raise ShardError(
                    f"{label}: rank {row.get('rank')} step {row.get('step')}: shape {text} "
                    f"({len(shape)} dimensions) is not a tensor shape; {_FIX}"
                )
