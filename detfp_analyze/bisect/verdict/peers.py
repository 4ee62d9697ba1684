"""The tests that need other ranks: the group-wide test of a collective and the cross-rank test.

* ``group_verdict``: a collective (collective, p2p, reduced_grad) whose local inputs matched is an
  origin only if every rank of its group had matching inputs for the same call; otherwise a
  receiver (a carrier of a difference that started on a peer). ``group_of`` names the group
  (``<op>@<group>``, the manifests' ``groups``); ``peer_state_from_found`` judges a peer's call
  without input records (``reduced_grad``) by the peer's own first divergence.
* ``p2p_receiver``: a receive has no peer call with the same key (the peer ran a send): its
  output differing with matching local inputs means the sender's data differed.
* ``cross_rank``: a difference an exchange capture did not see may have carried (a gradient
  reduction, a collective issued from C++) is a receiver when a peer in any group of the rank
  had a difference before it: at an earlier step, earlier in the same step (``PHASE_ORDER``:
  forward, backward, optimizer, step end), whatever that peer's own verdict (a receiver carries
  a difference too: on a 2-D mesh a rank's dp peer may only have received it from its tp peer),
  or in the same phase when that difference started there (origin or source). Else an origin
  (or, unproven, a receiver). The ranks' first differences are all known before any test runs
  (``resolve``), so no answer depends on the order ranks are looked at.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from detfp_analyze import rule
from detfp_analyze.bisect.records import CallKey, Found
from detfp_analyze.bisect.verdict.local import LocalVerdict, Pending
from detfp_analyze.bisect.vocab import Verdict
from detfp_analyze.ranks import format_ranks, without

__all__ = [
    "PHASE_ORDER",
    "GroupTest",
    "Start",
    "cross_rank",
    "group_of",
    "group_starts",
    "group_states",
    "group_verdict",
    "p2p_receiver",
    "peer_state_from_found",
    "phase_order",
    "rank_groups",
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


def rank_groups(
    rank: int, groups: Mapping[str, Sequence[int]], world: Sequence[int]
) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """(name, ranks) of every group ``rank`` belongs to (dp, tp, cp, pp, ep, named ones; sorted by
    name), or the world when the manifests name none: where a difference can reach it from."""
    mine = tuple(
        (name, tuple(sorted(int(r) for r in ranks))) for name, ranks in sorted(groups.items()) if rank in ranks
    )
    return mine or (("world", tuple(sorted(world))),)


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

#: The order of a step's phases in the program: a difference from an earlier phase can reach a
#: later one (a forward difference reaches the gradients the optimizer reads).
PHASE_ORDER = {"forward": 0, "backward": 1, "recompute": 1, "optimizer": 2, "step": 3}


def phase_order(phase: str) -> int:
    """``PHASE_ORDER`` of ``phase`` (an unknown one counts as the forward: the earliest)."""
    return PHASE_ORDER.get(phase, 0)


class Start(NamedTuple):
    """Where a compared rank's first difference is, and its verdict (before the cross-rank test)."""

    step: int
    #: ``PHASE_ORDER`` of its phase.
    phase: int
    verdict: str


def group_starts(
    group: Sequence[int], at: tuple[int, int], starts: Mapping[int, Start], compared: Collection[int]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(started, unknown): the members of ``group`` (sorted) whose first difference can have reached
    a record at ``at`` (step, ``PHASE_ORDER``) through an exchange capture did not see, and those
    not compared (``cross_rank``). ``starts``: compared rank -> its ``Start``; ``compared``: a set.
    A member counts when its difference comes earlier (any verdict: a receiver carries it on),
    or at the same point where it started there (origin or source). One answer serves every
    member's cross-rank test at that point (``cross_rank`` leaves the asking rank out)."""
    started = tuple(
        sorted(
            p
            for p in group
            if (got := starts.get(p)) is not None
            and ((got.step, got.phase) < at or ((got.step, got.phase) == at and got.verdict in _LOCAL_STARTS))
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
    gradient: bool = True,
) -> GroupTest | None:
    """The cross-rank test for a first difference that an exchange capture did not see may have
    carried (local verdict ``reduction``, or ``unobserved_producer`` in a multi-rank job).

    ``states``: ``group_starts`` of the ranks of the rank's groups (``gname`` names them) at its
    first difference; ``gradient``: that difference is of what the optimizer reads or writes (a
    gradient reduction carries it) rather than of the forward or backward (a collective does).
    Any peer counted there makes this rank a ``receiver``; otherwise a ``reduction`` is an
    ``origin`` when every peer was compared (a ``receiver`` that cannot be proven otherwise when
    some were not), and an ``unobserved_producer`` stays one (None).
    """
    started, unknown = (without(x, rank) for x in states)
    if started:
        how = "a gradient reduction" if gradient else "a collective in the forward or backward"
        return GroupTest(
            verdict=Verdict.RECEIVER,
            peers_differing=started,
            peers_unknown=unknown,
            explanation=f"{label}: {_ranks(started)} of group {gname} differed earlier (at step {step} or before), "
            f"and an exchange capture did not see ({how}) carries the difference here",
        )
    if local.verdict != Pending.REDUCTION:
        return None
    if unknown:
        return GroupTest(
            verdict=Verdict.RECEIVER,
            peers_differing=(),
            peers_unknown=unknown,
            explanation=f"{label}: no compared rank of group {gname} differed before it, but {_ranks(unknown)} were "
            "not compared, so a local start cannot be proven; treat it as received until they are",
        )
    return GroupTest(verdict=Verdict.ORIGIN, peers_differing=(), peers_unknown=(), explanation=local.explanation)


def _ranks(ranks: Sequence[int]) -> str:
    """``rank 3`` or ``ranks 0-2``."""
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {format_ranks(ranks)}"


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
