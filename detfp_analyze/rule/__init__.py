"""The comparison rule: when do a record of run A and its twin in run B differ? Defined once here.

Every consumer takes it from this module: bisect (``align``, ``walk``, the rollups only
pre-select steps for it), the SQL views (``pairs``, ``first_divergence``, ``step_summary``), the
pictures and the timeline, evidence, resume and diffkind. The definitions are expression trees
(``rule.expr``) that ``to_polars`` and ``to_sql`` render for their engine; a new engine (Spark)
adds a renderer, never a second definition. Tests prove the renderings agree record by record
and that SQL ``first_divergence`` names bisect's record on every rank.

**Match of a pair** (``MATCH``; twins share rank, step and ``key_hash``, the call-site key):

* ``only_a`` / ``only_b``: the record exists in one run only (control flow differed);
* ``unknown``: no evidence either way: a side's digest was skipped by policy or failed (status
  ``skipped``/``error``), or the record is a write-only destination (role ``dest``: recorded
  before the call, never digested). Two failed digests never compare equal;
* ``same``: equal digests, compared as the integers (``digest_hi``, ``digest_lo``), and equal
  non-tensor arguments of the call (``args_digest``, null-safe);
* ``differs``: otherwise. A call whose arguments differ differs on every record, whatever the
  tensors did: the call site passed another value, a local start (diffkind ``arguments``).

**State in the rank-step's alignment** (``STATES``): a match, or ``unknown`` for a record of
``START_KINDS`` (the state a capture starts from) that one run only holds (``UNSTARTED``: only
that run's capture started or reloaded at that step: a resumed run, another ``steps=``
selection, a capture of an earlier release; nothing to compare it with), or one of two
refinements that make differences structural instead of a cascade of value mismatches: ``shifted`` (a record
that differs or is one-sided, in a call-site family, same ``FAMILY`` columns, with a different
non-zero number of calls on the two sides: occurrence counters no longer line up) and
``reordered`` (both sides hold it, not ``unknown``, but the k-th record both sides hold is not
the k-th on the other side: positions are each rank's own (segment, seq) order, never compared
across ranks). ``reordered`` wins over ``shifted``.

**A rank's first divergence.** Divergent states are ``DIVERGENT``. Within a rank-step the
first divergent record is the least (priority, o1, o2, key_hash): priority 0 for a
``BOUNDARY_KINDS`` record at a resume boundary step (restored state comes first), o1/o2 the
lesser/greater of its two positions, symmetric in A and B. A record is under a hazard when either
side carries a hazard flag, unless both runs hold it and its call's arguments differ (``HAZARD``: a
hazard says a tensor's bytes are no evidence; an argument is a value the call site passed, so a
difference there is evidence whatever the tensors held); a call is when any of its records is. A step *changes a value* when
a record not under a hazard is ``VALUE`` evidence, unless its first divergence is reordered or
shifted and the step holds the same calls up to their order within each family (per family, the
multisets of calls, each the sorted ``SIGNATURE`` of its records, are equal, ``START_KINDS``
records left out: DDP's bucket order, a resumed run's first-iteration work). Steps are walked in order, restricted to the compared
ranks and common steps:

* a step that changes no value is passed over;
* a step whose first divergence is under a hazard and holds no divergence outside hazard calls
  is a likely false root: the first such step is kept as the rank's ``first`` (reported with
  ``likely_false_root``) and the walk goes on;
* the first step that changes a value, and holds a divergence outside hazard calls when its
  first is under one, ends the walk: its first divergence is the rank's ``first`` (unless a
  false root was kept), and the next clean one (the first divergence outside hazard calls,
  by (o1, o2, key_hash)) its ``next_clean``. A rank without such a step is identical.
"""

from __future__ import annotations

from detfp_analyze._strenum import StrEnum
from detfp_analyze.rule.expr import All, Any, Case, Col, Eq, Expr, IsNull, IsTrue, Lit, NonEmpty, Not, Same, one_of

__all__ = [
    "ARGS_DIFFER",
    "ARGS_EQUAL",
    "BOUNDARY_KINDS",
    "DIFFERS",
    "DIVERGENT",
    "FAMILY",
    "HAZARD",
    "MATCH",
    "MATCHES",
    "ONE_SIDED",
    "ONLY_A",
    "ONLY_B",
    "RECORD_EVIDENCE",
    "RECORD_HAZARD",
    "REORDERED",
    "SAME",
    "SHIFTABLE",
    "SHIFTED",
    "SIGNATURE",
    "START_KINDS",
    "STATES",
    "STRUCTURAL",
    "TENSORS_EQUAL",
    "UNKNOWN",
    "UNSTARTED",
    "VALUE",
    "RecordState",
    "check_state",
    "evidence",
    "present",
]



class RecordState(StrEnum):
    """State of a pair of twin records: a match (``MATCH``), or its refinement in the alignment."""

    SAME = "same"
    DIFFERS = "differs"
    ONLY_A = "only_a"
    ONLY_B = "only_b"
    UNKNOWN = "unknown"
    REORDERED = "reordered"
    SHIFTED = "shifted"


SAME, DIFFERS, ONLY_A, ONLY_B, UNKNOWN = (
    RecordState.SAME, RecordState.DIFFERS, RecordState.ONLY_A, RecordState.ONLY_B, RecordState.UNKNOWN,
)  # fmt: skip
REORDERED, SHIFTED = RecordState.REORDERED, RecordState.SHIFTED

# The groups hold plain values: they become polars ``is_in`` lists and SQL text, where a value
# must stay a String (polars makes an Enum column of enum members).


def _values(*states: RecordState) -> tuple[str, ...]:
    return tuple(s.value for s in states)


#: Match of a pair of twin records (``MATCH``).
MATCHES = _values(SAME, DIFFERS, ONLY_A, ONLY_B, UNKNOWN)
#: State of a pair in its rank-step's alignment: a match, or reordered / shifted.
STATES = _values(*RecordState)
#: The record exists in one run only.
ONE_SIDED = _values(ONLY_A, ONLY_B)
#: Control flow differed.
STRUCTURAL = _values(ONLY_A, ONLY_B, REORDERED, SHIFTED)
#: A divergence (``unknown`` and ``same`` are not).
DIVERGENT = _values(DIFFERS, ONLY_A, ONLY_B, REORDERED, SHIFTED)
#: Matches a shifted call-site family turns into ``shifted``.
SHIFTABLE = _values(DIFFERS, ONLY_A, ONLY_B)
#: A call-site family: a call's key without its occurrence number.
FAMILY = ("microbatch", "phase", "module", "kind", "name")
#: Kinds holding the state a resume restores: compared first at a resume boundary step.
BOUNDARY_KINDS = ("param", "optimizer_state", "rng_state")
#: Kinds recorded where a run's capture starts (or reloads a checkpoint): the state before a step.
START_KINDS = ("state",)


def present(side: str) -> Expr:
    """Run ``side`` holds the record (``status`` is never null in a written record)."""
    return Not(IsNull(Col("status", side)))


def evidence(side: str | None = None) -> Expr:
    """The record holds a digest on ``side``: status ok and not a write-only destination
    (``side`` None: one run's record, unsuffixed columns)."""
    return All(Eq(Col("status", side), Lit("ok")), Not(Eq(Col("role"), Lit("dest"))))


#: The two digests are equal, as the integers (digest_hi, digest_lo) (null when a side has none).
TENSORS_EQUAL: Expr = All(
    Eq(Col("digest_hi", "a"), Col("digest_hi", "b")), Eq(Col("digest_lo", "a"), Col("digest_lo", "b"))
)
#: The call's non-tensor arguments are equal (null-safe: no arguments on both sides is equal).
ARGS_EQUAL: Expr = Same(Col("args_digest", "a"), Col("args_digest", "b"))
_VALUES_EQUAL = All(TENSORS_EQUAL, ARGS_EQUAL)
_BOTH = All(present("a"), present("b"))

#: The match of a pair of twins (one of MATCHES). Columns: status, digest_hi, digest_lo and
#: args_digest of each side, role of the pair.
MATCH: Expr = Case(
    (
        (Not(present("a")), Lit(ONLY_B)),
        (Not(present("b")), Lit(ONLY_A)),
        (Not(IsTrue(All(evidence("a"), evidence("b")))), Lit(UNKNOWN)),
        (_VALUES_EQUAL, Lit(SAME)),
    ),
    Lit(DIFFERS),
)

#: An aligned pair that is evidence a value differs: ``differs``, or a structural state whose
#: digests (both held) differ, or a one-sided record that holds a digest where it is. An
#: allocation, a view or a write-only destination more on one side changes no value. Columns:
#: ``state`` and the MATCH columns.
VALUE: Expr = Any(
    Eq(Col("state"), Lit(DIFFERS)),
    All(
        one_of(Col("state"), STRUCTURAL),
        Any(
            All(_BOTH, IsTrue(evidence("a")), IsTrue(evidence("b")), Not(IsTrue(_VALUES_EQUAL))),
            All(Not(_BOTH), Any(IsTrue(evidence("a")), IsTrue(evidence("b")))),
        ),
    ),
)

#: A record of the state a capture starts from that one run only holds: ``unknown`` in the
#: alignment (no evidence either way). Columns: ``match`` (the pair's MATCH) and ``kind``.
UNSTARTED: Expr = All(one_of(Col("match"), ONE_SIDED), one_of(Col("kind"), START_KINDS))

#: One run's record carries a hazard flag (a likely false root). Column: hazards (a list).
RECORD_HAZARD: Expr = NonEmpty(Col("hazards"))
#: Both runs hold the record and its call's non-tensor arguments differ.
ARGS_DIFFER: Expr = All(_BOTH, Not(ARGS_EQUAL))
#: A pair is under a hazard: either side's record carries one, and the call's arguments do not
#: differ (an argument difference is never a likely false root: hazards are about tensor bytes).
#: Columns: ``hazard`` of each side (RECORD_HAZARD, computed where the record is read), status
#: and args_digest of each side.
HAZARD: Expr = All(Any(IsTrue(Col("hazard", "a")), IsTrue(Col("hazard", "b"))), Not(ARGS_DIFFER))
#: One run's record holds a digest (``evidence`` of an unsuffixed record).
RECORD_EVIDENCE: Expr = evidence(None)

#: What a record contributes to its call's identity in the same-calls test: role, argument,
#: status, digest, and its call's arguments only where a digest was taken (a view's offset
#: into a bucket says nothing about numbers).
SIGNATURE: tuple[Expr, ...] = (
    Col("role"),
    Col("arg"),
    Col("status"),
    Col("digest_hi"),
    Col("digest_lo"),
    Case(((IsTrue(RECORD_EVIDENCE), Col("args_digest")),), Lit(None)),
)


def check_state(state: str) -> str:
    """``state`` when it is one of STATES; ValueError naming the known states otherwise."""
    if state not in STATES:
        raise ValueError(f"record state {state!r} is not one of {', '.join(STATES)} (detfp_analyze.rule.STATES)")
    return state
