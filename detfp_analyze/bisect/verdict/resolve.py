"""The verdict stage: every walked record's final verdict (``resolve``), every test applied.

Three passes over what the walk found: each rank's own records (``local.local_verdict``); the
group-wide test of collectives, from the peers' inputs to the same call (``evidence.peer_inputs``,
``peers.group_verdict``, ``peers.p2p_receiver``); then, once every rank's first difference and
its verdict so far are known, the cross-rank test of differences an exchange capture did not see
may have carried, over every group the rank belongs to (``peers.rank_groups``,
``peers.cross_rank``): on a 2-D mesh a rank's difference can come through its tp group, its dp
group, or both in turn.
The answer is a ``RankVerdicts`` per rank (its ``first`` record's ``Verdict`` and, past a likely
false root, its ``next_clean``'s): one of ``result.VERDICTS`` (an internal value left over fails
loudly), with its explanation, what it depends on and its group.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

from detfp_analyze.bisect import evidence as _evidence
from detfp_analyze.bisect import vocab
from detfp_analyze.bisect.records import Aligned, CallKey, Extract, Found
from detfp_analyze.bisect.result import check_verdict
from detfp_analyze.bisect.scope import Scope
from detfp_analyze.bisect.verdict.local import DERIVED_KINDS, LocalVerdict, Pending, StepFacts, local_verdict
from detfp_analyze.bisect.verdict.peers import (
    GroupTest,
    Start,
    cross_rank,
    group_of,
    group_starts,
    group_states,
    group_verdict,
    p2p_receiver,
    phase_order,
    rank_groups,
)
from detfp_analyze.io.reader import Run
from detfp_analyze.ranks import without
from detfp_format import contract

__all__ = ["RankVerdicts", "Verdict", "resolve", "uncaptured_exchange"]


def _gradient_like(rec: Aligned) -> bool:
    """A record a data-parallel gradient reduction may have carried a difference into: what the
    optimizer reads and writes, and anything after the backward."""
    return rec.kind in DERIVED_KINDS or rec.phase in ("optimizer", "step")


def _through(mine: tuple[tuple[str, tuple[int, ...]], ...], started: tuple[int, ...], rank: int, gradient: bool) -> str:
    """The name of the groups (of ``rank``'s, ``mine``) through which the peers that differed first
    (``started``) reach it, joined with ``+``; with none, the group a difference would have come
    through: a data-parallel one for what the optimizer reads, else the world."""
    peers = set(started) - {rank}
    names = [n for n, g in mine if peers & set(g)]
    if not names and gradient:
        names = [n for n, _ in mine if n.startswith(contract.DATA_PARALLEL_GROUPS)][:1]
    return "+".join(names) or "world"


def uncaptured_exchange(rec: Aligned, group: str) -> str:
    """depends_on of a receiver whose difference came through a cross-rank exchange the capture
    did not see, by what that exchange was: a gradient reduction (the optimizer's inputs, or
    anything after backward) or a collective inside the forward or backward of the model
    (tensor, sequence or expert parallelism)."""
    if _gradient_like(rec):
        return (
            f"a cross-rank reduction in group {group} the capture did not see (a DDP or FSDP gradient reduction, "
            "a C++ collective): capture the wrapper (session.watch on it) or the collective, and see certify"
        )
    return (
        f"a collective in group {group} the capture did not see carried it into this {rec.phase} (a tensor-, "
        "sequence- or expert-parallel exchange issued from C++ or compiled code, or a function bound before "
        "the session opened): record it at level boundaries through torch.distributed or its functional "
        "collectives, or probe its result with session.probe"
    )


@dataclass(frozen=True, kw_only=True)
class Verdict:
    """The verdict of one walked record."""

    #: One of ``result.VERDICTS``.
    verdict: str
    #: One line explaining it.
    explanation: str
    #: What the capture could not see that it depends on, and what to capture next (or None).
    depends_on: str | None = None
    #: For unobserved_producer: the call that consumed the already-different input.
    consumer: str | None = None
    #: Set when the record sits on a view or copy op, which cannot create a difference.
    contradiction: str | None = None
    #: The group of a collective (or of the reduction a cross-rank test looked at), its ranks,
    #: and the peers whose inputs (or first differences) differed.
    group: str | None = None
    group_ranks: tuple[int, ...] = ()
    peers_differing: tuple[int, ...] = ()


class RankVerdicts(NamedTuple):
    """A rank's verdicts: of its ``Found.first`` and of its ``Found.next_clean`` (None without one)."""

    first: Verdict
    next_clean: Verdict | None


#: Which of a rank's walked records: its first, or the next clean one past a likely false root.
_Which = Literal["first", "next"]
#: A walked record, within this module: (rank, which).
_Slot = tuple[int, _Which]
#: asks (peer, step, call_hash, group peers) -> (peer, step, call_hash) -> rule.DIFFERS | rule.SAME.
PeerInputs = Callable[[Sequence[tuple[int, int, int, tuple[int, ...]]]], dict[CallKey, str]]


def _final(
    rec: Aligned, lv: LocalVerdict, group: tuple[str, tuple[int, ...]] | None, test: GroupTest | None
) -> Verdict:
    verdict, explanation, depends = lv.verdict, lv.explanation, lv.depends_on
    if test is not None:
        verdict, explanation = test.verdict, test.explanation
        if lv.verdict in (Pending.REDUCTION, vocab.Verdict.UNOBSERVED_PRODUCER) and verdict == vocab.Verdict.RECEIVER:
            depends = uncaptured_exchange(rec, group[0] if group else "world")
    return Verdict(
        verdict=check_verdict(verdict),
        explanation=explanation,
        depends_on=depends,
        consumer=lv.consumer,
        contradiction=lv.contradiction,
        group=group[0] if group else None,
        group_ranks=group[1] if group else (),
        peers_differing=test.peers_differing if test else (),
    )


def resolve(
    run_a: Run, run_b: Run, found: Mapping[int, Found], scope: Scope, peer_inputs: PeerInputs | None = None
) -> dict[int, RankVerdicts]:
    """rank -> the verdicts of every record the walk found on it. ``peer_inputs``: the group-wide
    test's read (``evidence.peer_inputs`` of the runs; an engine's ``Stages.peer_inputs``)."""
    compared = scope.ranks
    restored = set(scope.boundary)
    entry = restored | {r[0] for r in (scope.range_a, scope.range_b) if r is not None}
    world = max([int(run_a.manifest(r).get("world_size") or 1) for r in compared] or [1])
    every = _evidence.all_groups(run_a)
    ranks_all = sorted(set(run_a.ranks) | set(run_b.ranks))
    extracts: dict[_Slot, Extract] = {}
    for r, f in found.items():
        extracts[(r, "first")] = f.first
        if f.next_clean is not None:
            extracts[(r, "next")] = f.next_clean
    # 1. Each rank's own records.
    local: dict[_Slot, LocalVerdict] = {}
    groups: dict[_Slot, tuple[str, tuple[int, ...]]] = {}
    asks: list[tuple[int, int, int, tuple[int, ...]]] = []
    for (r, which), ex in extracts.items():
        rec = ex.record
        facts = StepFacts(ex.kinds, rec.step in entry, rec.step in restored, world)
        lv = local[(r, which)] = local_verdict(rec, ex.call, ex.upstream, facts)
        if lv.verdict == Pending.COLLECTIVE:
            g = groups[(r, which)] = group_of(rec.name, rec.kind, _evidence.groups_of(run_a, r, every), ranks_all)
            asks.append((r, rec.step, rec.call_hash, without(g[1], r)))
    # 2. The group-wide test of collectives.
    read = peer_inputs if peer_inputs is not None else functools.partial(_evidence.peer_inputs, run_a, run_b)
    peer_states = read(asks) if asks else {}
    tests: dict[_Slot, GroupTest | None] = {}
    # Each call's group-wide answer once (every rank of a group asks about the same call).
    answers: dict[tuple[int, int, tuple[int, ...], bool], tuple[tuple[int, ...], tuple[int, ...]]] = {}
    compared_set = set(compared)
    for key, lv in local.items():
        ex, group = extracts[key], groups.get(key)
        rec, r = ex.record, key[0]
        label = f"{rec.name} in {rec.module or '<root>'}"
        test = None
        if lv.verdict == Pending.COLLECTIVE and rec.kind == "p2p":
            test = p2p_receiver(label, None if group is None else group[0])
        elif lv.verdict == Pending.COLLECTIVE and group is not None:
            own_inputs = any(c.role == "input" for c in ex.call)
            ak = (rec.step, rec.call_hash, group[1], own_inputs)
            if ak not in answers:
                answers[ak] = group_states(
                    group[1], rec.step, rec.call_hash, peer_states, found, compared_set, own_inputs
                )
            test = group_verdict(r, label, group[0], group[1], answers[ak])
        tests[key] = test
    # 3. The cross-rank test, from every rank's first difference as the diagnosis will see it:
    # all of them known first, so no rank's answer depends on which was looked at before it.
    starts: dict[int, Start] = {}
    for r, f in found.items():
        start: _Slot = (r, "next") if f.start is f.next_clean else (r, "first")
        test = tests[start]
        rec = f.start.record
        starts[r] = Start(rec.step, phase_order(rec.phase), test.verdict if test is not None else local[start].verdict)
    met: dict[tuple[tuple[int, int], tuple[int, ...]], tuple[tuple[int, ...], tuple[int, ...]]] = {}
    for key, lv in local.items():
        if lv.verdict != Pending.REDUCTION and not (lv.verdict == vocab.Verdict.UNOBSERVED_PRODUCER and world > 1):
            continue
        rec = extracts[key].record
        mine = rank_groups(key[0], _evidence.groups_of(run_a, key[0], every), ranks_all)
        peers = tuple(sorted({p for _, g in mine for p in g}))
        at = (rec.step, phase_order(rec.phase))
        if (at, peers) not in met:
            met[(at, peers)] = group_starts(peers, at, starts, compared_set)
        gradient = _gradient_like(rec)
        gname = _through(mine, met[(at, peers)][0], key[0], gradient)
        ct = cross_rank(key[0], rec.step, lv, f"{rec.kind} {rec.name}", gname, met[(at, peers)], gradient)
        if ct is not None:
            groups[key], tests[key] = (gname, peers), ct
    final = {key: _final(extracts[key].record, lv, groups.get(key), tests[key]) for key, lv in local.items()}
    return {r: RankVerdicts(final[(r, "first")], final.get((r, "next"))) for r in found}
