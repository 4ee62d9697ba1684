"""What the walk needs to know about each rank's picked call, for a whole walk batch at once.

The walk picks one divergent row per rank (``align.first_divergences``) and then asks, per rank,
about that row's call on the rank's narrow alignment: where the call starts, whether a record of
it carries a hazard, which call comes just before it (one hop upstream), and whether that call
starts at the rank-step's first row (a slice must then be reread: ``walk._outside_slice``). Asked
rank by rank, that is a handful of small polars queries per rank; here each question is one
query over the whole batch (group-bys and joins keyed by rank), which gives the same answers:

* ``start``: the smallest ``o1`` of the call's rows;
* ``upstream``: among the rank's rows of other calls with ``o1 < start``, the call of the last
  one in ``o1`` order (rows of equal ``o1`` in the alignment's row order, as a stable sort);
* per rank: the record kinds of the rank-step and the rows that are value evidence
  (``rule.VALUE``) without a hazard flag (``walk._judge``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

import polars as pl

__all__ = ["CallFacts", "RankFacts", "call_facts", "rank_facts"]


class CallFacts(NamedTuple):
    """One (rank, call_hash)'s facts on a narrow alignment."""

    #: Smallest o1 of the call's rows.
    start: int
    #: A row of the call carries a hazard flag.
    hz: bool
    #: call_hash of the call one hop upstream; None when no other call's row comes before it.
    upstream: int | None
    #: The upstream call's first row is the rank-step's first row (False without an upstream call).
    upstream_at_first: bool


class RankFacts(NamedTuple):
    """One rank's facts on a narrow alignment."""

    #: Record kinds the rank's rows hold.
    kinds: frozenset[str]
    #: Rows that are value evidence (column ``value``) without a hazard flag.
    values: int


def call_facts(al: pl.DataFrame, queries: Iterable[tuple[int, int]]) -> dict[tuple[int, int], CallFacts]:
    """(rank, call_hash) -> CallFacts for each query whose call has rows in ``al`` (an alignment,
    one step per rank, with rank, call_hash, o1 and hz)."""
    asked = sorted(set(queries))
    if not asked:
        return {}
    q = pl.DataFrame(asked, schema={"rank": al.schema["rank"], "c": al.schema["call_hash"]}, orient="row")
    rows = (
        al.select("rank", "call_hash", "o1", "hz")
        .with_row_index("i")
        .join(q.select("rank").unique(), on="rank", how="semi")
    )
    calls = (
        rows.join(q, left_on=["rank", "call_hash"], right_on=["rank", "c"], how="semi")
        .group_by("rank", "call_hash")
        .agg(pl.col("o1").min().alias("start"), pl.col("hz").any().alias("call_hz"))
        .rename({"call_hash": "c"})
    )
    upstream = (
        rows.with_columns((pl.col("o1").cast(pl.Int64) * (1 << 32) + pl.col("i").cast(pl.Int64)).alias("last"))
        .join(calls.select("rank", "c", "start"), on="rank")
        .filter((pl.col("o1") < pl.col("start")) & (pl.col("call_hash") != pl.col("c")))
        .group_by("rank", "c")
        # The last row in (o1, row order): the row of the largest (o1, i), one integer each.
        .agg(pl.col("call_hash").get(pl.col("last").arg_max()).alias("up"))
    )
    call_first = rows.group_by("rank", "call_hash").agg(pl.col("o1").min().alias("up_first"))
    rank_first = rows.group_by("rank").agg(pl.col("o1").min().alias("rank_first"))
    out = (
        calls.join(upstream, on=["rank", "c"], how="left")
        .join(call_first, left_on=["rank", "up"], right_on=["rank", "call_hash"], how="left")
        .join(rank_first, on="rank", how="left")
        .select("rank", "c", "start", "call_hz", "up", "up_first", "rank_first")
    )
    return {
        (int(r), int(c)): CallFacts(int(start), bool(hz), None if up is None else int(up), up is not None and uf == rf)
        for r, c, start, hz, up, uf, rf in out.iter_rows()
    }


def rank_facts(al: pl.DataFrame) -> dict[int, RankFacts]:
    """rank -> RankFacts of every rank in ``al`` (with rank, kind, value and hz)."""
    g = al.group_by("rank").agg(
        pl.col("kind").unique().alias("kinds"), (pl.col("value") & ~pl.col("hz")).sum().alias("values")
    )
    return {int(r): RankFacts(frozenset(k), int(v)) for r, k, v in g.iter_rows()}
