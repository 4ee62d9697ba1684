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


class CallIndex:
    """One alignment's rows indexed for ``call_facts``: built once per walk batch, then asked as
    often as the walk needs (its picks, the slice test, a clean pick past a hazard).

    The rows are ordered once by (rank, o1) with ties in row order (a stable sort of four
    narrow columns), so each question is a binary search and a scan of the asked rank's rows
    only, instead of group-bys and joins over the whole batch per question.
    """

    def __init__(self, al: pl.DataFrame) -> None:
        rows = al.select("rank", "o1", "call_hash", pl.col("hz").fill_null(False)).sort("rank", "o1", maintain_order=True)
        self._o1, self._call, self._hz = rows["o1"], rows["call_hash"], rows["hz"]
        bounds = rows.with_row_index("i").group_by("rank").agg(pl.col("i").min().alias("lo"), pl.len().alias("n"))
        #: rank -> (first row, number of rows) in the index.
        self._span = {int(r): (int(lo), int(n)) for r, lo, n in bounds.iter_rows()}

    def facts(self, queries: Iterable[tuple[int, int]]) -> dict[tuple[int, int], CallFacts]:
        """(rank, call_hash) -> CallFacts for each query whose call has rows in the alignment."""
        out: dict[tuple[int, int], CallFacts] = {}
        for rank, c in sorted(set(queries)):
            if rank not in self._span:
                continue
            lo, n = self._span[rank]
            o1, calls = self._o1.slice(lo, n), self._call.slice(lo, n)
            mine = calls == c
            at = mine.arg_true()
            if not len(at):
                continue
            # Rows are in (o1, row order): the call's first row holds its smallest o1, and the
            # last row before the first row at that o1 is the last row (in o1, then row order)
            # of another call with a smaller o1 (no row of the call itself has one).
            start = int(o1[int(at[0])])
            hz = bool(self._hz.slice(lo, n).filter(mine).any())
            before = int(o1.search_sorted(start, "left")) - 1
            up = None if before < 0 else int(calls[before])
            # The upstream call starts at the rank-step's first row: its first row holds the
            # rank's smallest o1 (any row of that o1 may come first).
            at_first = up is not None and int(o1[int((calls == up).arg_true()[0])]) == int(o1[0])
            out[(rank, c)] = CallFacts(start, hz, up, at_first)
        return out


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
