"""What the walk needs to know about each rank's picked call, for a whole walk batch at once.

The walk picks one divergent row per rank (``align.first_divergences``) and then asks, per rank,
about that row's call on the rank's narrow alignment: where the call starts, whether a record of
it carries a hazard, which call comes just before it (one hop upstream), and whether that call
starts at the rank-step's first row (a slice must then be reread: ``walk._outside_slice``). Asked
rank by rank, that is a handful of small polars queries per rank; here the batch's rows are
indexed once (``CallIndex``: ordered by rank and ``o1``) and each question is a binary search
within its rank's rows, which gives the same answers:

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

__all__ = ["CallFacts", "CallIndex", "RankFacts", "call_facts", "rank_facts"]


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


#: Index key: a rank's dense number * _SPAN + o1 (o1 is a position within one rank-step).
_SPAN = 1 << 40


class CallIndex:
    """One alignment's rows indexed for ``call_facts``: built once per walk batch, then asked as
    often as the walk needs (its picks, the slice test, a clean pick past a hazard).

    The rows are ordered once by (rank, o1) with ties in row order (a stable sort of four narrow
    columns) under one integer key, so a batch of questions is a few queries whatever the number
    of ranks: the asked calls' first rows, one vectorized binary search for the row just before
    each, and the upstream calls' first rows.
    """

    def __init__(self, al: pl.DataFrame) -> None:
        rows = al.select("rank", "o1", "call_hash", pl.col("hz").fill_null(False)).sort("rank", "o1", maintain_order=True)
        code = (pl.col("rank") != pl.col("rank").shift(1)).fill_null(True).cum_sum().cast(pl.Int64)
        self._rows = rows.with_columns((code * _SPAN + pl.col("o1").cast(pl.Int64)).alias("key")).with_row_index("i")
        #: Per rank: its first row in the index and that row's o1 (the rank-step's first).
        self._ranks = self._rows.group_by("rank").agg(pl.col("i").first().alias("lo"), pl.col("o1").first().alias("o1_0"))

    def facts(self, queries: Iterable[tuple[int, int]]) -> dict[tuple[int, int], CallFacts]:
        """(rank, call_hash) -> CallFacts for each query whose call has rows in the alignment."""
        asked = sorted(set(queries))
        if not asked:
            return {}
        rows = self._rows
        q = pl.DataFrame(asked, schema={"rank": rows.schema["rank"], "call_hash": rows.schema["call_hash"]}, orient="row")
        # Rows are in (o1, row order) within a rank: a call's first row holds its smallest o1.
        calls = (
            _rows_of(rows, q)
            .group_by("rank", "call_hash")
            .agg(pl.col("key").first(), pl.col("o1").first().alias("start"), pl.col("hz").any())
            .join(self._ranks, on="rank")
        )
        # The row just before the call's first o1 is the last row (in o1, then row order) of
        # another call with a smaller o1 (no row of the call itself has one); none before the
        # rank's first row.
        before = rows["key"].search_sorted(calls["key"], side="left").cast(pl.Int64) - 1
        calls = calls.with_columns(before.alias("before")).with_columns(
            pl.when(pl.col("before") >= pl.col("lo")).then(pl.col("before")).alias("before")
        )
        up = rows["call_hash"].gather(calls["before"].fill_null(0))
        calls = calls.with_columns(pl.when(pl.col("before").is_not_null()).then(up).alias("up"))
        # The upstream call starts at the rank-step's first row: its first row holds the rank's
        # smallest o1 (any row of that o1 may come first).
        ups = calls.select("rank", pl.col("up").alias("call_hash")).drop_nulls().unique()
        firsts = (
            _rows_of(rows, ups)
            .group_by("rank", "call_hash")
            .agg(pl.col("o1").first().alias("up_o1"))
            .rename({"call_hash": "up"})
        )
        out = calls.join(firsts, on=["rank", "up"], how="left").select(
            "rank", "call_hash", "start", "hz", "up", (pl.col("up_o1") == pl.col("o1_0")).fill_null(False)
        )
        return {
            (int(r), int(c)): CallFacts(int(start), bool(hz), None if u is None else int(u), bool(at))
            for r, c, start, hz, u, at in out.iter_rows()
        }


def _rows_of(rows: pl.DataFrame, calls: pl.DataFrame) -> pl.DataFrame:
    """The rows of ``calls`` (rank, call_hash): a hash-set filter on the call first (cheap on the
    whole batch), then the join on (rank, call) on what is left."""
    hashes = calls["call_hash"].unique()
    return rows.filter(pl.col("call_hash").is_in(hashes.implode())).join(calls, on=["rank", "call_hash"], how="semi")


def call_facts(al: pl.DataFrame, queries: Iterable[tuple[int, int]]) -> dict[tuple[int, int], CallFacts]:
    """(rank, call_hash) -> CallFacts for each query whose call has rows in ``al`` (an alignment,
    one step per rank, with rank, call_hash, o1 and hz)."""
    asked = sorted(set(queries))
    if not asked:
        return {}
    return CallIndex(al).facts(asked)


def rank_facts(al: pl.DataFrame) -> dict[int, RankFacts]:
    """rank -> RankFacts of every rank in ``al`` (with rank, kind, value and hz)."""
    g = al.group_by("rank").agg(
        pl.col("kind").unique().alias("kinds"), (pl.col("value") & ~pl.col("hz")).sum().alias("values")
    )
    return {int(r): RankFacts(frozenset(k), int(v)) for r, k, v in g.iter_rows()}
