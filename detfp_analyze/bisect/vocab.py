"""The report's vocabularies: statuses, verdicts, patterns, causes, kinds of difference, levels.

Each is one tuple, the single definition every consumer checks against (``check_*`` raise a
ValueError naming the known values and where a new one is added first); the tests name every
consumer of a vocabulary that lacks a value (``tests/unit/test_verdicts.py``). They are part of
the JSON report: a new value bumps ``result.REPORT_VERSION``.
"""

from __future__ import annotations

__all__ = [
    "CAUSES",
    "DIFF_KINDS",
    "LEVELS",
    "PATTERNS",
    "STATUSES",
    "VERDICTS",
    "check_cause",
    "check_diff_kind",
    "check_pattern",
    "check_status",
    "check_verdict",
]

#: Outcomes of a comparison: ``rng_only`` when an RNG state differs and no value or metric does
#: (nothing drew from the generator in the compared steps).
STATUSES = ("identical", "diverged", "rng_only")
#: Verdicts for a rank's first divergent record (docs/report.md explains each).
VERDICTS = ("origin", "unobserved_producer", "source", "receiver", "structural", "metric_only")
#: Cross-rank patterns.
PATTERNS = (
    "identical",
    "single_process",
    "all_ranks_same_op",
    "all_ranks_same_source",
    "all_ranks_different_ops",
    "rank_subset",
    "single_rank",
    "no_origin",
    "undetermined",
)
#: What the diagnosis names as the most likely cause (``cause.py`` weighs the evidence; docs/report.md).
CAUSES = (
    "none", "ended_early", "step_offset", "rng_state_only", "setting", "uninitialized", "argument", "data", "rng",
    "restore", "op", "collective", "rank_local", "control_flow", "uncaptured", "undetermined",
)  # fmt: skip
#: Kinds of difference.
DIFF_KINDS = ("values", "permutation", "arguments", "structure", "error")
#: How deep the narrowing goes (each level includes the ones before).
LEVELS = ("step", "phase", "module", "op", "kernel")


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
