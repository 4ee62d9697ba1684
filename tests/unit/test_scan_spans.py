"""``Run.scan_spans``: each (rank, step)'s rows within its own seq span, in (rank, step) order.

The reader reads one scan per step bounded by the step's widest span and keeps each span with a
join on the ranks' own bounds; the reference is the definition, one filtered scan per span.
Shards are written with one window per rank ("run"), so a file holds every step (the step
filter matters) and with several row groups (the seq bounds prune some).
"""

from __future__ import annotations

import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from detfp_analyze.io.reader import open_run
from detfp_analyze.testing.synth import SynthSpec, write_run


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("spans")
    return open_run(write_run(root / "run", SynthSpec(ranks=4, steps=3, records=300, windows="run")))


def _reference(run, spans, columns):
    parts = [
        run.scan("records", ranks=[r], steps=[s]).filter(pl.col("seq").is_between(lo, hi)).select(columns).collect()
        for (r, s), (lo, hi) in sorted(spans.items())
    ]
    return pl.concat(parts) if parts else None


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_scan_spans_equals_one_scan_per_span(run, data):
    seqs = run.scan("records", columns=["rank", "step", "seq"]).collect()
    keys = sorted(set(zip(seqs["rank"].to_list(), seqs["step"].to_list(), strict=True)))
    chosen = data.draw(st.lists(st.sampled_from(keys), min_size=1, max_size=len(keys), unique=True))
    spans = {}
    for r, s in chosen:
        mine = seqs.filter((pl.col("rank") == r) & (pl.col("step") == s))["seq"]
        lo = data.draw(st.integers(int(mine.min()) - 5, int(mine.max())))
        spans[(r, s)] = (lo, data.draw(st.integers(lo, int(mine.max()) + 5)))
    columns = ["rank", "step", "seq", "key_hash", "name"]
    got = run.scan_spans("records", spans, columns).collect()
    assert got.equals(_reference(run, spans, columns))


def test_scan_spans_without_spans_is_an_empty_typed_frame(run):
    got = run.scan_spans("records", {}, ["rank", "seq"]).collect()
    assert got.height == 0 and got.schema == {"rank": pl.Int32, "seq": pl.Int64}
