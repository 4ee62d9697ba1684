"""Property tests of bisect's invariants on tiny paired runs written through the real writer.

* identical runs are identical;
* one changed digest is found exactly there, on exactly that rank;
* swapping A and B changes nothing but labels (and which side a value is reported for).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from detfp_analyze.bisect import bisect
from tests.fixtures.pairs import build_pair, template

LABELS = [r["label"] for r in template(0)]
FAST = settings(max_examples=10, deadline=None, derandomize=True)


@FAST
@given(world=st.integers(1, 3), steps=st.integers(1, 3))
def test_identical_runs_are_identical(world, steps):
    with tempfile.TemporaryDirectory() as d:
        a, b = build_pair(Path(d), world=world, steps=range(steps))
        res = bisect(a, b)
        assert res.status == "identical"
        assert all(r.status == "identical" for r in res.ranks)
        assert res.diagnosis.pattern == "identical"


@FAST
@given(data=st.data())
def test_one_changed_digest_is_found_exactly_there(data):
    world = data.draw(st.integers(1, 3))
    rank = data.draw(st.integers(0, world - 1))
    step = data.draw(st.integers(0, 1))
    label = data.draw(st.sampled_from(LABELS))
    with tempfile.TemporaryDirectory() as d:
        a, b = build_pair(Path(d), world=world, steps=range(2), edits_b={(rank, step): {"change": (label,)}})
        res = bisect(a, b)
        want = next(r for r in template(step) if r["label"] == label)
        for r in res.ranks:
            if r.rank != rank:
                assert r.status == "identical"
                continue
            f = r.first
            assert (f.step, f.op, f.role, f.arg, f.module) == (
                step,
                want["name"],
                want["role"],
                want["arg"],
                want.get("module", ""),
            )
            assert f.seq_a == f.seq_b


def _view(res):
    ranks = [
        (r.rank, r.status, r.step, r.verdict)
        + (
            (r.first.phase, r.first.module, r.first.op, r.first.role, r.first.diff_kind, r.first.presence != "both")
            if r.first
            else ()
        )
        for r in res.ranks
    ]
    return ranks, res.diagnosis.pattern, res.diagnosis.origin_ranks, res.first_step


@FAST
@given(data=st.data())
def test_swapping_a_and_b_changes_nothing_but_labels(data):
    world = data.draw(st.integers(1, 3))
    edits = {}
    for _ in range(data.draw(st.integers(1, 3))):
        rank = data.draw(st.integers(0, world - 1))
        step = data.draw(st.integers(0, 1))
        kind = data.draw(st.sampled_from(["change", "after", "extra"]))
        label = data.draw(st.sampled_from(LABELS))
        if kind == "extra":  # an inserted call: structural
            clone = dict(module="l1", name="aten::clone.default", role="output", arg="out[0]")
            edits[(rank, step)] = {"extra_before": {label: [clone]}}
        else:
            edits[(rank, step)] = {"change": (label,)} if kind == "change" else {"after": label}
    with tempfile.TemporaryDirectory() as d:
        a, b = build_pair(Path(d), world=world, steps=range(2), edits_b=edits)
        ab, ba = bisect(a, b), bisect(b, a)
        assert _view(ab) == _view(ba)
        assert (ab.label_a, ab.label_b) == (ba.label_b, ba.label_a)
        for x, y in zip(ab.ranks, ba.ranks, strict=True):
            if x.first is not None:
                assert (x.first.seq_a, x.first.seq_b) == (y.first.seq_b, y.first.seq_a)
