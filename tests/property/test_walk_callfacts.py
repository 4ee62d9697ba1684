"""The walk's batched call facts (``bisect.callfacts``) equal the per-rank queries they replace.

The reference below is the walk's former per-rank code (``_pick`` / ``_outside_slice``), with
its sort made stable (``maintain_order``): rows of equal ``o1`` keep the alignment's order, the
tie rule ``callfacts`` states. Frames are random alignments with ties, hazards, several ranks
and several calls; plus whole bisects of property-generated pairs against the per-rank reference.
"""

from __future__ import annotations

import polars as pl
from hypothesis import given, reject, settings
from hypothesis import strategies as st

from detfp_analyze.bisect import callfacts

_KINDS = ("op", "module_input", "module_output", "batch")


def _reference(al: pl.DataFrame, rank: int, call_hash: int) -> callfacts.CallFacts:
    mine = al.filter(pl.col("rank") == rank)
    call = mine.filter(pl.col("call_hash") == call_hash)
    start = call["o1"].min()
    prev = mine.filter((pl.col("o1") < start) & (pl.col("call_hash") != call_hash))
    up = int(prev.sort("o1", maintain_order=True)["call_hash"][-1]) if prev.height else None
    at_first = up is not None and mine.filter(pl.col("call_hash") == up)["o1"].min() == mine["o1"].min()
    return callfacts.CallFacts(int(start), bool(call["hz"].any()), up, at_first)


@st.composite
def _alignments(draw) -> pl.DataFrame:
    rows = []
    # Ranks far apart (the index orders by rank, then o1).
    for rank in draw(st.lists(st.sampled_from([0, 1, 2, 3, 4, 5, 6, 1 << 30]), min_size=1, max_size=4, unique=True)):
        n = draw(st.integers(1, 30))
        for _ in range(n):
            rows.append(
                {
                    "rank": rank,
                    "call_hash": draw(st.integers(1, 6)) * 0x9E3779B97F4A7C15 % (1 << 64),
                    "o1": draw(st.integers(0, n // 2 + 1)),  # small range: ties
                    "hz": draw(st.booleans()) and draw(st.booleans()),
                    "kind": draw(st.sampled_from(_KINDS)),
                    "value": draw(st.booleans()),
                }
            )
    schema = {"rank": pl.Int32, "call_hash": pl.UInt64, "o1": pl.Int64, "hz": pl.Boolean, "kind": pl.String,
              "value": pl.Boolean}  # fmt: skip
    return pl.DataFrame(rows, schema=schema)


@settings(max_examples=150, deadline=None)
@given(al=_alignments(), data=st.data())
def test_batched_call_facts_equal_the_per_rank_queries(al, data):
    pairs = sorted(set(zip(al["rank"].to_list(), al["call_hash"].to_list(), strict=True)))
    asked = data.draw(st.lists(st.sampled_from(pairs), min_size=1, max_size=len(pairs), unique=True))
    got = callfacts.call_facts(al, asked)
    assert got == {(r, c): _reference(al, r, c) for r, c in asked}
    ranks = callfacts.rank_facts(al)
    for r in set(al["rank"].to_list()):
        mine = al.filter(pl.col("rank") == r)
        assert ranks[r].kinds == frozenset(mine["kind"].unique().to_list())
        assert ranks[r].values == mine.filter(pl.col("value") & ~pl.col("hz")).height


@settings(max_examples=12, deadline=None)
@given(data=st.data())
def test_walk_with_batched_facts_equals_the_per_rank_walk(data, tmp_path_factory):
    # Whole bisects of generated pairs (every rank a receiver of one origin, planted anywhere):
    # the walk with callfacts against the walk with the per-rank reference swapped in.
    import json

    from detfp_analyze.bisect import bisect
    from detfp_analyze.testing.synth import Plant, SynthSpec, write_pair

    ranks, steps = data.draw(st.integers(1, 5)), data.draw(st.integers(1, 3))
    records = data.draw(st.integers(20, 2500))
    plant = Plant(rank=data.draw(st.integers(0, ranks - 1)), step=data.draw(st.integers(0, steps - 1)),
                  index=data.draw(st.integers(0, records - 1)))  # fmt: skip
    root = tmp_path_factory.mktemp("pair")
    a, b = root / "a", root / "b"
    try:
        write_pair(a, b, SynthSpec(ranks=ranks, steps=steps, records=records), plant)
    except ValueError as exc:  # an index past the step's last digested output: no origin to plant
        if "no digested output record" not in str(exc):
            raise
        reject()
    batched = json.dumps(bisect(a, b).to_json_dict(), sort_keys=True)

    class PerRank:  # the walk's index (callfacts.CallIndex) answered by the per-rank reference
        def __init__(self, al: pl.DataFrame) -> None:
            self.al = al

        def facts(self, queries):
            return {(r, c): _reference(self.al, r, c) for r, c in set(queries)}

    real = callfacts.CallIndex
    try:
        callfacts.CallIndex = PerRank
        per_rank = json.dumps(bisect(a, b).to_json_dict(), sort_keys=True)
    finally:
        callfacts.CallIndex = real
    assert batched == per_rank
