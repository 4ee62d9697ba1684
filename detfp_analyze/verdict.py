"""Verdicts: did this rank's first divergent record start the difference, or receive it?

Pure functions over aligned rows (dicts from ``align.align``). A call is the set of records
sharing a call_hash on one rank and step: its inputs are written before it runs, its
outputs after, so the first divergent record of a rank is either

* on one side only or out of order -> ``structural`` (control flow differed);
* of an inputless kind (batch, rng_state, param, grad, optimizer_state, probe) ->
  ``source`` (the difference entered from outside: data pipeline, restore, RNG);
* an input of a call -> ``unobserved_producer`` (no earlier record differs, so whatever
  wrote it was not captured; the call is the consumer to name);
* an output whose call's inputs all matched -> ``origin``, except that collectives
  (collective, p2p, reduced_grad) need the group-wide test (``group_verdict``): an origin
  only if every rank of the group had matching inputs for the same call, otherwise
  ``receiver`` (a carrier of a difference that started on a peer).

A view or pure data-movement op cannot create a difference: an "origin" there is reported
as ``unobserved_producer`` with a ``contradiction`` pointing one hop upstream.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from detfp_capture.contract import INPUTLESS_KINDS

__all__ = [
    "COLLECTIVE_KINDS",
    "COPY_OPS",
    "VIEW_OPS",
    "GroupTest",
    "LocalVerdict",
    "format_ranks",
    "group_of",
    "group_verdict",
    "is_view_op",
    "local_verdict",
]

#: Kinds whose output depends on peers: the verdict needs the group-wide test.
COLLECTIVE_KINDS = ("collective", "p2p", "reduced_grad")
#: View/metadata ops: their output aliases the input's storage, they cannot create a difference.
VIEW_OPS = frozenset(
    {
        "aten::view",
        "aten::_unsafe_view",
        "aten::slice",
        "aten::select",
        "aten::t",
        "aten::transpose",
        "aten::expand",
        "aten::expand_as",
        "aten::as_strided",
        "aten::permute",
        "aten::reshape",
        "aten::alias",
        "aten::squeeze",
        "aten::unsqueeze",
        "aten::flatten",
        "aten::narrow",
        "aten::detach",
        "aten::split",
        "aten::split_with_sizes",
        "aten::chunk",
        "aten::unbind",
        "aten::view_as",
        "aten::unflatten",
        "aten::lift_fresh",
    }
)
#: Pure data movement: deterministic copies, typical first consumers of an unseen producer.
COPY_OPS = frozenset({"aten::cat", "aten::stack", "aten::clone", "aten::contiguous", "aten::copy_", "aten::_to_copy"})

_STRUCTURAL = ("a_only", "b_only", "reordered", "shifted")
_DIVERGENT = ("differ", "a_only", "b_only", "reordered", "shifted")


def is_view_op(name: str) -> bool:
    """True for view/metadata or pure copy ops, with or without an overload suffix."""
    base = name.split(".", 1)[0] if name.startswith("aten::") else name
    return base in VIEW_OPS or base in COPY_OPS


@dataclass(frozen=True)
class LocalVerdict:
    """What one rank's own records say about its first divergent record."""

    #: A VERDICTS value, or "collective" when the group-wide test must decide.
    verdict: str
    #: The consuming call for unobserved_producer.
    consumer: str | None
    #: Set when the op cannot have created the difference (view/copy op).
    contradiction: str | None
    explanation: str


def _call_label(rec: Mapping[str, Any]) -> str:
    mod = rec.get("module") or "<root>"
    return f"{rec['name']} in {mod}"


def local_verdict(rec: Mapping[str, Any], call_rows: Sequence[Mapping[str, Any]], upstream: str | None) -> LocalVerdict:
    """Verdict from the rank's own records: ``rec`` is the first divergent aligned row,
    ``call_rows`` every aligned row of its call (same rank, step, call_hash)."""
    state, kind, role = rec["state"], rec["kind"], rec["role"]
    label = _call_label(rec)
    if state in _STRUCTURAL:
        where = {
            "a_only": "only in run A",
            "b_only": "only in run B",
            "reordered": "in a different order",
            "shifted": "in a call sequence whose number of calls differs (occurrence counters shifted)",
        }[state]
        return LocalVerdict(
            "structural",
            None,
            None,
            f"{label} ({role} {rec['arg']}) is {where}: control flow differed (config or data)",
        )
    if kind in INPUTLESS_KINDS:
        return LocalVerdict(
            "source",
            None,
            None,
            f"{kind} record {rec['name']} differs and has no inputs: the difference entered from outside the "
            "captured region (data pipeline, checkpoint restore, RNG state)",
        )
    hop = f" look one hop upstream ({upstream})" if upstream else " look one hop upstream"
    inputs = [r for r in call_rows if r["role"] == "input"]
    differing = [r for r in inputs if r["state"] in _DIVERGENT]
    view = is_view_op(rec["name"])
    if role == "input" or differing:
        contradiction = f"{rec['name']} only moves data;{hop}" if view else None
        return LocalVerdict(
            "unobserved_producer",
            label,
            contradiction,
            f"the input of {label} already differs although no earlier record differs: its producer was not "
            "captured (e.g. a kernel that bypasses the dispatcher, a fused or extension op)",
        )
    if kind in COLLECTIVE_KINDS:
        return LocalVerdict("collective", None, None, "")
    if view:
        return LocalVerdict(
            "unobserved_producer",
            label,
            f"{rec['name']} is a view or copy and cannot create a difference;{hop}",
            f"{label} appears to create the difference, which a view or copy cannot: something wrote its "
            "input's memory after it was fingerprinted",
        )
    if rec.get("digest_hi_a") == rec.get("digest_hi_b") and rec.get("digest_lo_a") == rec.get("digest_lo_b"):
        return LocalVerdict(
            "origin", None, None, f"{label} was called with different non-tensor arguments on matching tensors"
        )
    n = len(inputs)
    return LocalVerdict(
        "origin",
        None,
        None,
        f"all {n} input(s) of {label} matched and its {role} {rec['arg']} differs: this call introduced the difference",
    )


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


@dataclass(frozen=True)
class GroupTest:
    """Outcome of the group-wide test for one collective call."""

    verdict: str
    #: Peers whose inputs to the same call differed (or whose first difference came earlier).
    peers_differing: tuple[int, ...]
    #: Peers that could not be checked (not traced, or the call is missing there).
    peers_unknown: tuple[int, ...]
    explanation: str


def group_verdict(
    rank: int,
    label: str,
    gname: str,
    group: Sequence[int],
    peer_inputs: Mapping[int, str],
) -> GroupTest:
    """Group-wide test. ``peer_inputs``: peer rank -> "match" (all its inputs to this call
    matched), "differ" or "unknown" (not traced / call absent). The rank itself is excluded.
    """
    peers = [p for p in group if p != rank]
    differing = tuple(sorted(p for p in peers if peer_inputs.get(p, "unknown") == "differ"))
    unknown = tuple(sorted(p for p in peers if peer_inputs.get(p, "unknown") == "unknown"))
    if differing:
        return GroupTest(
            "receiver",
            differing,
            unknown,
            f"{label}: this rank's inputs matched but {len(differing)} of {len(peers)} peer(s) in group {gname} "
            f"had differing inputs (ranks {format_ranks(differing)}): a carrier of a difference that started elsewhere",
        )
    if unknown:
        return GroupTest(
            "receiver",
            (),
            unknown,
            f"{label}: inputs matched here, but peers {format_ranks(unknown)} of group {gname} were not traced, so an "
            "origin cannot be proven; treat it as received until they are",
        )
    return GroupTest(
        "origin",
        (),
        (),
        f"{label}: every rank of group {gname} ({len(group)} ranks) had matching inputs and the result differs: "
        "the collective itself is nondeterministic (reduction order, algorithm, topology)",
    )


def format_ranks(ranks: Sequence[int]) -> str:
    """Compact rank list: 0-3,8,10-11."""
    out: list[str] = []
    rs = sorted(ranks)
    i = 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        out.append(str(rs[i]) if i == j else f"{rs[i]}-{rs[j]}")
        i = j + 1
    return ",".join(out)
