"""``align.first_divergences`` equals its definition: per rank, the first divergent row by
(priority, o1, o2, key_hash), whole (every column), with and without the hazard-call exclusion.

The function picks the candidates on narrow columns and gathers only them; the reference filters
and sorts every divergent row. Frames are random alignments with several ranks and steps,
priority kinds, hazards, ties on (o1, o2) and positions past the packed-integer range (2^21).
"""

from __future__ import annotations

import polars as pl
from hypothesis import given, settings
from hypothesis import strategies as st

from detfp_analyze import rule
from detfp_analyze.bisect import align

_STATES = sorted(rule.STATES)
_KINDS = ("op", "module_input", "rng_state", "param")


def _reference(al: pl.DataFrame, kinds, steps, exclude: bool) -> pl.DataFrame:
    div = al.filter(pl.col("state").is_in(align.DIVERGENT_STATES))
    if exclude:
        hz = al.group_by("rank", "step", "call_hash").agg(pl.col("hz").any().alias("call_hz"))
        div = div.join(hz, on=["rank", "step", "call_hash"], how="left").filter(~pl.col("call_hz"))
    if kinds and steps:
        prio = pl.when(pl.col("step").is_in(steps) & pl.col("kind").is_in(kinds)).then(0).otherwise(1)
    else:
        prio = pl.lit(1)
    div = div.with_columns(prio.alias("prio"))
    return div.sort("rank", "prio", "o1", "o2", "key_hash").group_by("rank", maintain_order=True).first()


@st.composite
def _alignments(draw) -> pl.DataFrame:
    far = draw(st.booleans())  # positions past 2^21: the sort path
    rows = []
    for rank in draw(st.lists(st.integers(0, 5), min_size=1, max_size=4, unique=True)):
        step = draw(st.integers(0, 2))
        n = draw(st.integers(1, 25))
        for k in range(n):
            o1 = draw(st.integers(0, n)) + ((1 << 21) if far else 0)
            rows.append(
                {
                    "rank": rank,
                    "step": step,
                    "key_hash": (k + 1) * 0x9E3779B97F4A7C15 % (1 << 64),  # unique per rank-step
                    "dup": 0,
                    "call_hash": draw(st.integers(1, 4)),
                    "kind": draw(st.sampled_from(_KINDS)),
                    "state": draw(st.sampled_from(_STATES)),
                    "o1": o1,
                    "o2": o1 + draw(st.integers(0, 3)),
                    "hz": draw(st.booleans()) and draw(st.booleans()),
                    "name": f"n{k}",
                }
            )
    schema = {"rank": pl.Int32, "step": pl.Int64, "key_hash": pl.UInt64, "dup": pl.UInt32, "call_hash": pl.UInt64,
              "kind": pl.String, "state": pl.String, "o1": pl.Int64, "o2": pl.Int64, "hz": pl.Boolean,
              "name": pl.String}  # fmt: skip
    return pl.DataFrame(rows, schema=schema)


@settings(max_examples=200, deadline=None)
@given(al=_alignments(), data=st.data())
def test_first_divergences_equal_their_definition(al, data):
    kinds = data.draw(st.sampled_from([(), ("rng_state", "param")]))
    steps = data.draw(st.sampled_from([(), (0,), (1, 2)]))
    exclude = data.draw(st.booleans())
    got = align.first_divergences(al, priority_kinds=kinds, priority_steps=steps, exclude_hazard_calls=exclude)
    assert got.equals(_reference(al, kinds, steps, exclude))
