"""What a comparison of two runs covers: the ranks, the common step window, the resume boundaries.

``plan(run_a, run_b)`` decides it once for every engine: bisect walks exactly this scope, and the
SQL comparison views (``detfp_analyze.sql``) get the same ranks, window and boundary steps as
private tables, so ``first_divergence`` and ``bisect`` compare the same records. ``check`` raises
the errors of a scope with nothing to compare. Step ranges come from shard footers (``resume``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from detfp_analyze.bisect import resume as _resume
from detfp_analyze.bisect.result import ResumeInfo
from detfp_analyze.errors import IncomparableError, SelectionError
from detfp_analyze.io import held_steps as _held_steps
from detfp_analyze.io.reader import Run
from detfp_analyze.ranks import format_ranks

__all__ = ["Scope", "check", "norm_steps", "plan"]


@dataclass(frozen=True)
class Scope:
    """The ranks and steps two runs are compared on."""

    #: Ranks in both runs (and among those asked for) that hold a record or metric in either run.
    ranks: tuple[int, ...]
    #: Asked-for ranks in both runs that hold nothing in either (left out, named in the notes).
    empty: tuple[int, ...]
    #: Ranks present in one run only (not compared).
    one_sided: tuple[int, ...]
    #: Inclusive step range each run holds on the compared ranks (None: nothing).
    range_a: tuple[int, int] | None
    range_b: tuple[int, int] | None
    #: Inclusive step window compared: the common steps, intersected with the asked-for steps.
    window: tuple[int, int] | None
    #: How the runs line up (resumed or not); boundary counts are filled in later by bisect.
    resume: ResumeInfo
    #: Steps whose restored state (``rule.BOUNDARY_KINDS``) is compared first, sorted.
    boundary: tuple[int, ...]


def norm_steps(steps: Any) -> tuple[int, int] | None:
    """An inclusive (first, last) pair from None, an int, a range or a pair (SelectionError otherwise)."""
    if steps is None:
        return None
    if isinstance(steps, int):
        return steps, steps
    if isinstance(steps, range):
        if len(steps) == 0:
            raise SelectionError(f"step range {steps} is empty; pass e.g. steps=(3, 5)")
        return min(steps), max(steps)
    vals = [int(s) for s in steps]
    if len(vals) != 2 or vals[0] > vals[1]:
        raise SelectionError(f"steps={steps!r} is not an inclusive (first, last) pair; pass e.g. steps=(3, 5)")
    return vals[0], vals[1]


def compared_ranks(run_a: Run, run_b: Run, ranks: Iterable[int] | None) -> tuple[list[int], list[int]]:
    """(ranks in both runs, ranks in one run only), among ``ranks`` when given (SelectionError
    for a rank in neither run)."""
    both = sorted(set(run_a.ranks) & set(run_b.ranks))
    one = sorted(set(run_a.ranks) ^ set(run_b.ranks))
    if ranks is None:
        return both, one
    wanted = sorted({int(r) for r in ranks})
    unknown = [r for r in wanted if r not in run_a.ranks and r not in run_b.ranks]
    if unknown:
        have = format_ranks(sorted(set(run_a.ranks) | set(run_b.ranks)))
        raise SelectionError(
            f"{run_a.label} vs {run_b.label}: rank(s) {format_ranks(unknown)} are in neither run "
            f"(ranks present: {have}); pick ranks from those"
        )
    return [r for r in wanted if r in both], [r for r in wanted if r in one]


def plan(
    run_a: Run,
    run_b: Run,
    *,
    ranks: Iterable[int] | None = None,
    steps: tuple[int, int] | None = None,
    compared: tuple[list[int], list[int]] | None = None,
) -> Scope:
    """The scope of comparing ``run_a`` with ``run_b`` on ``ranks`` (default all) and ``steps``
    (an inclusive pair, ``norm_steps``). ``compared``: ``compared_ranks``' answer when the caller
    already has it. Raises only SelectionError; ``check`` says whether there is anything to compare."""
    both, one_sided = compared if compared is not None else compared_ranks(run_a, run_b, ranks)
    held = (_held_steps.held_ranks(run_a, both) | _held_steps.held_ranks(run_b, both)) if both else set()
    kept = [r for r in both if r in held]
    range_a = _resume.step_range(run_a, kept)
    range_b = _resume.step_range(run_b, kept)
    window, info = _resume.plan_window(range_a, range_b, steps)
    boundary = _resume.boundary_steps(run_a.manifests, run_b.manifests, info) if window is not None and kept else ()
    return Scope(
        ranks=tuple(kept),
        empty=tuple(r for r in both if r not in held),
        one_sided=tuple(one_sided),
        range_a=range_a,
        range_b=range_b,
        window=window,
        resume=info,
        boundary=tuple(boundary),
    )


def check(scope: Scope, run_a: Run, run_b: Run) -> None:
    """IncomparableError when the scope compares nothing: no rank holds anything, one run holds
    nothing on the compared ranks, or the runs share no step in the window."""
    if scope.empty and not scope.ranks:
        raise IncomparableError(
            f"{run_a.label} vs {run_b.label}: neither run holds a record or metric on rank(s) "
            f"{format_ranks(scope.empty)}; there is nothing to compare (check the captures with "
            "detfp-analyze summary)"
        )
    range_a, range_b = scope.range_a, scope.range_b
    if scope.ranks and (range_a is None) != (range_b is None):
        empty, other = (run_a, run_b) if range_a is None else (run_b, run_a)
        raise IncomparableError(
            f"{empty.label} holds no record or metric on rank(s) {format_ranks(scope.ranks)} while "
            f"{other.label} does: there is nothing of it to compare (check the capture with detfp-analyze summary)"
        )
    if scope.window is None and range_a is not None and range_b is not None:
        raise IncomparableError(
            f"{run_a.label} (steps {range_a[0]}-{range_a[1]}) and {run_b.label} (steps {range_b[0]}-{range_b[1]}) "
            "share no step in the selected window; pick overlapping runs or --steps"
        )
