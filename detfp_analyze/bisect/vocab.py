"""The report's vocabularies: statuses, verdicts, patterns, causes, kinds of difference, levels.

Each is one ``StrEnum``, the single definition every consumer uses (a member is its value: JSON
and text reports print the value), with the tuple of its values beside it for membership tests
and messages (``check_*`` raise a ValueError naming the known values and where a new one is
added first); the tests name every consumer of a vocabulary that lacks a value
(``tests/unit/test_verdicts.py``). They are part of the JSON report: a new value bumps
``result.REPORT_VERSION``.
"""

from __future__ import annotations

from detfp_analyze._strenum import StrEnum

__all__ = [
    "CAUSES",
    "DIFF_KINDS",
    "LEVELS",
    "PATTERNS",
    "STATUSES",
    "VERDICTS",
    "Cause",
    "DiffKind",
    "Level",
    "Pattern",
    "Status",
    "Verdict",
    "check_cause",
    "check_diff_kind",
    "check_pattern",
    "check_status",
    "check_verdict",
]


class Status(StrEnum):
    """Outcome of a comparison."""

    IDENTICAL = "identical"
    DIVERGED = "diverged"
    #: An RNG state differs and no value or metric does (nothing drew from the generator in the
    #: compared steps).
    RNG_ONLY = "rng_only"
    #: Everything both runs hold matched, but a run ended before the other (a step that raised,
    #: a capture that never closed): not a pass unless the comparison allows an incomplete run.
    ENDED_EARLY = "ended_early"


class Verdict(StrEnum):
    """Verdict for a rank's first divergent record (docs/report.md explains each)."""

    ORIGIN = "origin"
    UNOBSERVED_PRODUCER = "unobserved_producer"
    SOURCE = "source"
    RECEIVER = "receiver"
    STRUCTURAL = "structural"
    METRIC_ONLY = "metric_only"


class Pattern(StrEnum):
    """Cross-rank pattern of the first divergences."""

    IDENTICAL = "identical"
    SINGLE_PROCESS = "single_process"
    ALL_RANKS_SAME_OP = "all_ranks_same_op"
    ALL_RANKS_SAME_SOURCE = "all_ranks_same_source"
    ALL_RANKS_DIFFERENT_OPS = "all_ranks_different_ops"
    RANK_SUBSET = "rank_subset"
    SINGLE_RANK = "single_rank"
    #: Every diverged rank's first difference is structural: other calls, not other values.
    CONTROL_FLOW = "control_flow"
    NO_ORIGIN = "no_origin"
    UNDETERMINED = "undetermined"


class Cause(StrEnum):
    """What the diagnosis names as the most likely cause (``cause.py`` weighs the evidence; docs/report.md)."""

    NONE = "none"
    ENDED_EARLY = "ended_early"
    STEP_OFFSET = "step_offset"
    RNG_STATE_ONLY = "rng_state_only"
    SETTING = "setting"
    UNINITIALIZED = "uninitialized"
    ARGUMENT = "argument"
    #: The first difference is of dtype, shape or layout (``DiffKind``): another computation.
    DTYPE = "dtype"
    SHAPE = "shape"
    LAYOUT = "layout"
    DATA = "data"
    RNG = "rng"
    RESTORE = "restore"
    OP = "op"
    COLLECTIVE = "collective"
    RANK_LOCAL = "rank_local"
    CONTROL_FLOW = "control_flow"
    UNCAPTURED = "uncaptured"
    UNDETERMINED = "undetermined"


class DiffKind(StrEnum):
    """Kind of difference of a first divergent record."""

    VALUES = "values"
    PERMUTATION = "permutation"
    ARGUMENTS = "arguments"
    #: The tensor's dtype differs (an autocast dtype, a cast): not a rounding of the same computation.
    DTYPE = "dtype"
    #: The tensor's shape differs (a size in the configuration, a reshape).
    SHAPE = "shape"
    #: A tensor subclass whose every part is equal differs as a whole: its non-tensor layout
    #: (a DTensor's placements or mesh) changed.
    LAYOUT = "layout"
    STRUCTURE = "structure"
    ERROR = "error"


class Level(StrEnum):
    """How deep the narrowing goes (each level includes the ones before)."""

    STEP = "step"
    PHASE = "phase"
    MODULE = "module"
    OP = "op"
    KERNEL = "kernel"


#: The values of each vocabulary, in definition order (plain strings).
STATUSES: tuple[str, ...] = tuple(s.value for s in Status)
VERDICTS: tuple[str, ...] = tuple(v.value for v in Verdict)
PATTERNS: tuple[str, ...] = tuple(p.value for p in Pattern)
CAUSES: tuple[str, ...] = tuple(c.value for c in Cause)
DIFF_KINDS: tuple[str, ...] = tuple(k.value for k in DiffKind)
LEVELS: tuple[str, ...] = tuple(lv.value for lv in Level)


def _check(value: str, known: tuple[str, ...], what: str, name: str) -> str:
    if value not in known:
        raise ValueError(
            f"{what} {value!r} is not one of {', '.join(known)} (detfp_analyze.bisect.vocab.{name}); "
            f"a new {what} is added there first, then to every consumer the tests name"
        )
    return value


def check_verdict(verdict: str) -> str:
    """``verdict`` when it is one of VERDICTS; ValueError naming the known verdicts otherwise."""
    return _check(verdict, VERDICTS, "verdict", "VERDICTS")


def check_status(status: str) -> str:
    """``status`` when it is one of STATUSES; ValueError naming the known statuses otherwise."""
    return _check(status, STATUSES, "status", "STATUSES")


def check_cause(cause: str) -> str:
    """``cause`` when it is one of CAUSES; ValueError naming the known causes otherwise."""
    return _check(cause, CAUSES, "cause", "CAUSES")


def check_pattern(pattern: str) -> str:
    """``pattern`` when it is one of PATTERNS; ValueError naming the known patterns otherwise."""
    return _check(pattern, PATTERNS, "pattern", "PATTERNS")


def check_diff_kind(kind: str) -> str:
    """``kind`` when it is one of DIFF_KINDS; ValueError naming the known kinds otherwise."""
    return _check(kind, DIFF_KINDS, "difference kind", "DIFF_KINDS")
