"""The group-wide and cross-rank tests, answered once per call for a whole group, give every rank
exactly what a pass over its own peers gives (the definitions the tests had before they were
shared, written out here as the oracle), on random groups, peer states and first differences."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from detfp_analyze import rule
from detfp_analyze.bisect.records import CallKey
from detfp_analyze.bisect.verdict.local import LocalVerdict
from detfp_analyze.bisect.verdict.peers import (
    _LOCAL_STARTS,
    Start,
    cross_rank,
    group_starts,
    group_states,
    group_verdict,
    peer_state_from_found,
)
from detfp_analyze.ranks import without

FAST = settings(max_examples=200, deadline=None, derandomize=True)
STEP, CALL = 3, 77


@FAST
@given(ranks=st.sets(st.integers(0, 40)), rank=st.integers(-2, 42))
def test_without_is_the_sorted_ranks_less_one(ranks, rank):
    got = without(tuple(sorted(ranks)), rank)
    assert got == tuple(sorted(ranks - {rank}))


_STATE = st.sampled_from([None, rule.SAME, rule.DIFFERS])


@FAST
@given(
    group=st.sets(st.integers(0, 12), min_size=1),
    states=st.dictionaries(st.integers(0, 12), _STATE),
    compared=st.sets(st.integers(0, 12)),
    own_inputs=st.booleans(),
)
def test_group_verdict_per_rank_equals_a_pass_over_its_peers(group, states, compared, own_inputs):
    members = tuple(sorted(group))
    read = {CallKey(p, STEP, CALL): s for p, s in states.items() if s is not None}
    found: dict = {}  # no peer found a difference: peer_state_from_found says same or unknown
    shared = group_states(members, STEP, CALL, read, found, sorted(compared), own_inputs)
    for r in members:
        peers = [p for p in members if p != r]
        per: dict[int, str] = {}
        for p in peers:
            s = read.get(CallKey(p, STEP, CALL))
            if s is None and not own_inputs:
                s = peer_state_from_found(found, p, STEP, CALL, sorted(compared))
            per[p] = s or rule.UNKNOWN
        want_diff = tuple(p for p in peers if per[p] == rule.DIFFERS)
        want_unknown = tuple(p for p in peers if per[p] == rule.UNKNOWN)
        test = group_verdict(r, "op", "g", members, shared)
        assert test.peers_differing == want_diff
        assert test.peers_unknown == want_unknown
        assert test.verdict == ("origin" if not want_diff and not want_unknown else "receiver")
        if want_diff:
            assert f"{len(want_diff)} of {len(peers)} peer(s)" in test.explanation


@FAST
@given(
    group=st.sets(st.integers(0, 12), min_size=1),
    starts=st.dictionaries(
        st.integers(0, 12),
        st.tuples(st.integers(2, 4), st.integers(0, 3), st.sampled_from(["origin", "source", "receiver", "structural"])),
    ),
    compared=st.sets(st.integers(0, 12)),
    reduction=st.booleans(),
    phase=st.integers(0, 3),
)
def test_cross_rank_per_rank_equals_a_pass_over_its_peers(group, starts, compared, reduction, phase):
    members = tuple(sorted(group))
    local = LocalVerdict(verdict="reduction" if reduction else "unobserved_producer", consumer=None, contradiction=None, explanation="local")
    firsts = {r: Start(*v) for r, v in starts.items()}
    shared = group_starts(members, (STEP, phase), firsts, compared)
    for r in members:
        peers = [p for p in members if p != r]
        unknown = tuple(p for p in peers if p not in compared)
        # A peer counts when its first difference comes before this point in program order
        # (whatever its verdict), or at this very point where it started (origin or source).
        started = tuple(
            p
            for p in peers
            if p in firsts
            and (
                (firsts[p].step, firsts[p].phase) < (STEP, phase)
                or ((firsts[p].step, firsts[p].phase) == (STEP, phase) and firsts[p].verdict in _LOCAL_STARTS)
            )
        )
        test = cross_rank(r, STEP, local, "op", "g", shared)
        if started:
            assert (test.verdict, test.peers_differing, test.peers_unknown) == ("receiver", started, unknown)
        elif not reduction:
            assert test is None
        elif unknown:
            assert (test.verdict, test.peers_differing, test.peers_unknown) == ("receiver", (), unknown)
        else:
            assert test.verdict == "origin"
