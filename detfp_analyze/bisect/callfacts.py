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

import numpy as np
import polars as pl

__all__ = ["CallFacts", "CallIndex", "RankFacts", "call_facts", "rank_facts"]

#: Index key: rank * _O1_LIMIT + o1 (o1 is a position within one rank-step).
_O1_LIMIT = 1 << 40
_RANK_LIMIT = 1 << 22


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

    The rows are ordered once by (rank, o1, row order) (a stable sort of one integer per row),
    so each question is a binary search and a scan of the asked rank's rows only, instead of
    group-bys and joins over the whole batch per question.
    """

    def __init__(self, al: pl.DataFrame) -> None:
        rank = al["rank"].cast(pl.Int64).to_numpy()
        o1 = al["o1"].cast(pl.Int64).to_numpy()
        # o1 is a position in one rank-step (>= 0, far below 2^40) and ranks are below 2^20
        # (``io.manifests``); ranks are numbered densely only if a frame breaks that.
        self._codes: dict[int, int] | None = None
        if len(rank) and (rank.min() < 0 or rank.max() >= _RANK_LIMIT):
            uniq, rank = np.unique(rank, return_inverse=True)
            self._codes = {int(r): i for i, r in enumerate(uniq)}
        key = rank * _O1_LIMIT + o1
        order = np.argsort(key, kind="stable")
        self._key = key[order]
        self._call = al["call_hash"].to_numpy()[order]
        self._hz = al["hz"].fill_null(False).to_numpy()[order]
        self._span: dict[int, tuple[int, int]] = {}

    def _rank(self, rank: int) -> tuple[int, int]:
        """The [lo, hi) range of ``rank``'s rows in the index (``rank``: its code)."""
        got = self._span.get(rank)
        if got is None:
            lo = int(np.searchsorted(self._key, rank * _O1_LIMIT, "left"))
            hi = int(np.searchsorted(self._key, (rank + 1) * _O1_LIMIT, "left"))
            got = self._span[rank] = (lo, hi)
        return got

    def facts(self, queries: Iterable[tuple[int, int]]) -> dict[tuple[int, int], CallFacts]:
        """(rank, call_hash) -> CallFacts for each query whose call has rows in the alignment."""
        out: dict[tuple[int, int], CallFacts] = {}
        for r, c in sorted(set(queries)):
            rank = r if self._codes is None else self._codes.get(r, -1)
            if rank < 0:
                continue
            lo, hi = self._rank(rank)
            calls = self._call[lo:hi]
            mine = np.flatnonzero(calls == c)
            if not len(mine):
                continue
            # Rows are in (o1, row order): the call's first row holds its smallest o1, and the
            # last row before the first row at that o1 is the last row (in o1, then row order)
            # of another call with a smaller o1 (no row of the call itself has one).
            start = int(self._key[lo + mine[0]] - rank * _O1_LIMIT)
            hz = bool(self._hz[lo + mine].any())
            before = int(np.searchsorted(self._key, rank * _O1_LIMIT + start, "left")) - 1
            up = None if before < lo else int(self._call[before])
            # The upstream call starts at the rank-step's first row: the first row of the
            # rank's smallest o1 (rows are ordered by o1) may be any row of that o1.
            at_first = False
            if up is not None:
                first_up = int(np.flatnonzero(calls == up)[0])
                at_first = self._key[lo + first_up] == self._key[lo]
            out[(r, c)] = CallFacts(start, hz, up, bool(at_first))
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
