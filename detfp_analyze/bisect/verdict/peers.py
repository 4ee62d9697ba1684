"""The tests that need other ranks: the group-wide test of a collective and the cross-rank test.

* ``group_verdict``: a collective (collective, p2p, reduced_grad) whose local inputs matched is an
  origin only if every rank of its group had matching inputs for the same call; otherwise a
  receiver (a carrier of a difference that started on a peer). ``group_of`` names the group
  (``<op>@<group>``, the manifests' ``groups``); ``peer_state_from_found`` judges a peer's call
  without input records (``reduced_grad``) by the peer's own first divergence.
* ``p2p_receiver``: a receive has no peer call with the same key (the peer ran a send): its
  output differing with matching local inputs means the sender's data differed.
* ``cross_rank``: a difference an uncaptured cross-rank reduction may have carried is a receiver
  when a peer started a difference at that step or before, else an origin (or, unproven, a receiver).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from detfp_analyze import rule
from detfp_analyze.bisect.records import CallKey, Found
from detfp_analyze.bisect.verdict.local import LocalVerdict, Pending
from detfp_analyze.bisect.vocab import Verdict
from detfp_analyze.ranks import format_ranks, without

__all__ = [
    "GroupTest",
    "cross_rank",
    "group_of",
    "group_starts",
    "group_states",
    "group_verdict",
    "p2p_receiver",
    "peer_state_from_found",
]


def group_of(
    name: str, kind: str, groups: Mapping[str, Sequence[int]], world: Sequence[int]
) -> tuple[str, tuple[int, ...]]:
    """(group name, ranks) of a collective named ``<op>@<group>``; the world when unnamed or unknown.

    ``reduced_grad`` records reduce over the data-parallel group: ``dp`` when the manifests
    name one, else the world.
    """
    gname = name.rsplit("@", 1)[1] if "@" in name else ("dp" if kind == "reduced_grad" else "world")
    ranks = groups.get(gname)
    if ranks is None:
        return (gname if gname in groups else "world"), tuple(sorted(world))
    return gname, tuple(sorted(int(r) for r in ranks))


@dataclass(frozen=True, kw_only=True)
class GroupTest:
    """Outcome of the group-wide test for one collective call."""

    verdict: Verdict
    #: Peers whose inputs to the same call differed (or whose first difference came earlier).
    peers_differing: tuple[int, ...]
    #: Peers that could not be checked (not traced, or the call is missing there).
    peers_unknown: tuple[int, ...]
    explanation: str


def group_states(
    group: Sequence[int],
    step: int,
    call_hash: int,
    peer_inputs: Mapping[CallKey, str],
    found: Mapping[int, Found],
    compared: Collection[int],
    own_inputs: bool,
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(differing, unknown): the members of ``group`` (sorted) whose inputs to the call (``step``,
    ``call_hash``) differ, and those that could not be checked. ``peer_inputs``: the group-wide
    test's read (``evidence.peer_inputs``); a member it does not name (the call has no input
    records there) is judged by its own first divergence (``peer_state_from_found``) when the
    asking rank's call has no input records either (``own_inputs`` false), else unknown.

    One answer serves every member's test of the same call (``group_verdict`` leaves the asking
    rank out): a job whose ranks all receive through one collective asks it once, not once per
    rank over every peer (ranks x group size lookups)."""
    differing, unknown = [], []
    for p in group:
        st = peer_inputs.get(CallKey(p, step, call_hash))
        if st is None and not own_inputs:
            st = peer_state_from_found(found, p, step, call_hash, compared)
        if st is None or st == rule.UNKNOWN:
            unknown.append(p)
        elif st == rule.DIFFERS:
            differing.append(p)
    return tuple(sorted(differing)), tuple(sorted(unknown))


def group_verdict(
    rank: int,
    label: str,
    gname: str,
    group: Sequence[int],
    states: tuple[tuple[int, ...], tuple[int, ...]],
) -> GroupTest:
    """Group-wide test of ``rank``'s collective. ``states``: ``group_states`` of its call (the
    members whose inputs differ, those unknown: not traced or the call absent); the rank itself
    is left out of both and of the peer count.
    """
    differing, unknown = (without(x, rank) for x in states)
    n_peers = len(group) - (rank in group)
    if differing:
        return GroupTest(
            verdict=Verdict.RECEIVER,
            peers_differing=differing,
            peers_unknown=unknown,
            explanation=f"{label}: this rank's inputs matched but {len(differing)} of {n_peers} peer(s) in group {gname} "
            f"had differing inputs (ranks {format_ranks(differing)}): a carrier of a difference that started elsewhere",
        )
    if unknown:
        return GroupTest(
            verdict=Verdict.RECEIVER,
            peers_differing=(),
            peers_unknown=unknown,
            explanation=f"{label}: inputs matched here, but peers {format_ranks(unknown)} of group {gname} were not traced, so an "
            "origin cannot be proven; treat it as received until they are",
        )
    return GroupTest(
        verdict=Verdict.ORIGIN,
        peers_differing=(),
        peers_unknown=(),
        explanation=f"{label}: every rank of group {gname} ({len(group)} ranks) had matching inputs and the result differs: "
        "the collective itself is nondeterministic (reduction order, algorithm, topology)",
    )


#: Verdicts that say a rank started the difference itself.
_LOCAL_STARTS = (Verdict.ORIGIN, Verdict.SOURCE)


def group_starts(
    group: Sequence[int], step: int, starts: Mapping[int, tuple[int, str]], compared: Collection[int]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(started, unknown): the members of ``group`` (sorted) that started a difference at or
    before ``step`` (``cross_rank``), and those not compared. ``starts``: compared rank ->
    (step, verdict) of its first difference; ``compared``: a set (a membership test per member).
    One answer serves every member's cross-rank test at that step (``cross_rank`` leaves the
    asking rank out)."""
    started = tuple(
        sorted(
            p
            for p in group
            if (got := starts.get(p)) is not None and (got[0] < step or (got[0] == step and got[1] in _LOCAL_STARTS))
        )
    )
    return started, tuple(sorted(p for p in group if p not in compared))


def cross_rank(
    rank: int,
    step: int,
    local: LocalVerdict,
    label: str,
    gname: str,
    states: tuple[tuple[int, ...], tuple[int, ...]],
) -> GroupTest | None:
    """The cross-rank test for a first difference that an uncaptured cross-rank reduction may
    have carried (local verdict ``reduction``, or ``unobserved_producer`` in a multi-rank job).

    ``states``: ``group_starts`` of the rank's group at ``step``. A peer started the difference
    when its first difference comes at an earlier step, or at the same step as a local start
    (origin or source). Any such peer makes this rank a ``receiver``; otherwise a ``reduction``
    is an ``origin`` when every peer was compared (a ``receiver`` that cannot be proven
    otherwise when some were not), and an ``unobserved_producer`` stays one (None).
    """
    started, unknown = (without(x, rank) for x in states)
    if started:
        return GroupTest(
            verdict=Verdict.RECEIVER,
            peers_differing=started,
            peers_unknown=unknown,
            explanation=f"{label}: ranks {format_ranks(started)} of group {gname} started a difference at or before step {step}, "
            "and an uncaptured cross-rank reduction (data-parallel gradients) carries it here",
        )
    if local.verdict != Pending.REDUCTION:
        return None
    if unknown:
        return GroupTest(
            verdict=Verdict.RECEIVER,
            peers_differing=(),
            peers_unknown=unknown,
            explanation=f"{label}: no compared rank of group {gname} started a difference, but ranks {format_ranks(unknown)} were "
            "not compared, so a local start cannot be proven; treat it as received until they are",
        )
    return GroupTest(verdict=Verdict.ORIGIN, peers_differing=(), peers_unknown=(), explanation=local.explanation)


def p2p_receiver(label: str, group: str | None) -> GroupTest:
    """The verdict of a p2p receive whose output differs with matching local inputs."""
    where = "" if group is None else " in group " + group
    return GroupTest(
        verdict=Verdict.RECEIVER, peers_differing=(), peers_unknown=(), explanation=f"{label}: received over p2p{where}; the difference started on the sending rank"
    )


def peer_state_from_found(
    found: Mapping[int, Found], peer: int, step: int, call_hash: int, compared: Collection[int]
) -> str:
    """A peer's state for a call without input records (e.g. reduced_grad), from the peer's own
    first divergence: ``rule.SAME`` when it comes later (or is this call), ``rule.DIFFERS`` when
    earlier, ``rule.UNKNOWN`` for a peer that was not compared."""
    if peer not in compared:
        return rule.UNKNOWN
    f = found.get(peer)
    if f is None:
        return rule.SAME
    rec = f.first.record
    if rec.step > step or (rec.step == step and rec.call_hash == call_hash):
        return rule.SAME
    return rule.DIFFERS
