"""The verdict stage: every walked record's final verdict (``resolve``), every test applied.

Three passes over what the walk found: each rank's own records (``local.local_verdict``); the
group-wide test of collectives, from the peers' inputs to the same call (``evidence.peer_inputs``,
``peers.group_verdict``, ``peers.p2p_receiver``); then the cross-rank test of differences an
uncaptured reduction may have carried, from every rank's first difference (``peers.cross_rank``).
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
    cross_rank,
    group_of,
    group_starts,
    group_states,
    group_verdict,
    p2p_receiver,
)
from detfp_analyze.io.reader import Run
from detfp_analyze.ranks import without

__all__ = ["RankVerdicts", "Verdict", "resolve", "uncaptured_exchange"]


def _gradient_like(rec: Aligned) -> bool:
    """A record a data-parallel gradient reduction may have carried a difference into: what the
    optimizer reads and writes, and anything after the backward."""
    return rec.kind in DERIVED_KINDS or rec.phase in ("optimizer", "step")


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
    # 3. The cross-rank test, from every rank's first difference as the diagnosis will see it.
    starts: dict[int, tuple[int, str]] = {}
    for r, f in found.items():
        start: _Slot = (r, "next") if f.start is f.next_clean else (r, "first")
        test = tests[start]
        starts[r] = (f.start.record.step, test.verdict if test is not None else local[start].verdict)
    met: dict[tuple[int, tuple[int, ...]], tuple[tuple[int, ...], tuple[int, ...]]] = {}
    for key, lv in local.items():
        if lv.verdict != Pending.REDUCTION and not (lv.verdict == vocab.Verdict.UNOBSERVED_PRODUCER and world > 1):
            continue
        rec = extracts[key].record
        if _gradient_like(rec):  # a data-parallel gradient reduction carries it: its group
            g = group_of(rec.name, "reduced_grad", _evidence.groups_of(run_a, key[0], every), ranks_all)
        else:  # an exchange inside the model's forward or backward: any group, so any rank
            g = ("world", tuple(ranks_all))
        if (rec.step, g[1]) not in met:
            met[(rec.step, g[1])] = group_starts(g[1], rec.step, starts, compared_set)
        ct = cross_rank(key[0], rec.step, lv, f"{rec.kind} {rec.name}", g[0], met[(rec.step, g[1])])
        if ct is not None:
            groups[key], tests[key] = g, ct
    final = {key: _final(extracts[key].record, lv, groups.get(key), tests[key]) for key, lv in local.items()}
    return {r: RankVerdicts(final[(r, "first")], final.get((r, "next"))) for r in found}
