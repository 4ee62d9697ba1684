"""``bisect``: where two runs stopped being bitwise identical, rank by rank, and why.

The pipeline, each stage a module of this package handing the next a typed value, numbered once
here (``STAGES``; docs/report.md, docs/architecture.md and the package's docstring number theirs
from it, which tests/unit/test_bisect_stages.py checks):

1. comparable: ``io.envdiff`` (digests of different versions always raise IncomparableError; other
   blocking manifest differences unless forced);
2. scope: the compared ranks, the common step window, the resume boundaries (``scope.plan``);
3. search: metrics bound the steps, per-(rank, step) rollups pick candidate steps, and the
   exact walk finds each rank's first divergence (``search``: ``narrow``, ``walk`` over
   ``align`` with ``detfp_analyze.rule``) as a ``records.Found``;
4. verdicts: origin, source, receiver, ... with the group-wide and cross-rank tests (``verdict``);
5. evidence and assembly: dumps and kernels for the named records, the kind and size of each
   difference (``evidence``, ``diffkind``, ``assemble``);
6. diagnosis: the evidence beyond the ranks (``clues``: where a run ended, repeated
   uninitialized reads, an RNG-state-only difference, a step offset), the cross-rank pattern
   (``diagnose``), the most likely cause weighed from all of it with the environment diff
   (``cause``), and the discriminator view of the origin op.

Memory stays bounded by two walk batches of rank-steps; time by the steps up to the first
divergence (steps after every rank's metric divergence are read only where needed).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, cast

from detfp_analyze import _gcpause
from detfp_analyze.bisect import assemble as _assemble
from detfp_analyze.bisect import cause as _cause
from detfp_analyze.bisect import clues as _clues
from detfp_analyze.bisect import evidence as _evidence
from detfp_analyze.bisect import scope as _scope
from detfp_analyze.bisect import settings as _settings
from detfp_analyze.bisect.diagnose import diagnose
from detfp_analyze.bisect.engine import Engine, local
from detfp_analyze.bisect.reads import ReadPaths
from detfp_analyze.bisect.result import LEVELS, BisectResult, Diagnosis, Window
from detfp_analyze.bisect.search import search
from detfp_analyze.bisect.verdict import resolve
from detfp_analyze.bisect.vocab import Level, Pattern, Status
from detfp_analyze.bisect.walk import Progress
from detfp_analyze.errors import IncomparableError, SelectionError
from detfp_analyze.io import held_steps as _held_steps
from detfp_analyze.io.envdiff import check_comparable, check_digests, drop_keys, env_diff
from detfp_analyze.io.reader import Run, as_run
from detfp_analyze.ranks import format_ranks

__all__ = ["BisectResult", "Progress", "ReadPaths", "bisect"]

#: The stages in order, each numbered by its place here (1-based) wherever they are listed.
STAGES = ("comparable", "scope", "search", "verdicts", "evidence", "diagnosis")


def bisect(
    run_a: Run | str,
    run_b: Run | str,
    *,
    ranks: Iterable[int] | None = None,
    steps: Any = None,
    level: str = "op",  # a plain default: help() and the signature show the value
    force: bool = False,
    ignore_env: Sequence[str] = (),
    progress: Progress | None = None,
    engine: Engine | None = None,
    reads: ReadPaths | None = None,
    allow_incomplete: bool = False,
) -> BisectResult:
    """Find, per rank, the first record where ``run_a`` and ``run_b`` differ, and why.

    ``run_a``/``run_b``: opened runs (``reader.open_run``) or run directories. ``ranks``: ranks to compare
    (default: every rank in both). ``steps``: inclusive (first, last) pair, an int or a range.
    ``level``: step | phase | module | op | kernel (how deep to narrow). ``force``: compare
    even when the manifests say the comparison is meaningless. ``ignore_env``: shell globs of
    manifest keys left out of the environment diff (``host.*``; see ``envdiff.drop_keys``), listed
    in ``notes``. ``progress``: optional callback. ``engine``: where the heavy stages run
    (``engine.local``, the default, or ``detfp_analyze.spark.engine(spark)``); the result is the same.
    ``reads``: which summaries the capture stored the search may read instead of the records
    (``reads.ReadPaths``; default: every one both runs hold); the result is the same.
    ``allow_incomplete``: a run that ended before the other (a step that raised, a capture that
    never closed) with nothing differing before its end is ``identical`` over the steps both hold
    (the ending is still reported), not status ``ended_early``.
    Raises IncomparableError (blocking manifest difference, no common step) and
    SelectionError (bad ranks/steps/level).
    """
    # Thousands of diverged ranks make millions of rows and records, none in a cycle (_gcpause).
    with _gcpause.paused():
        return _bisect(run_a, run_b, ranks, steps, level, force, ignore_env, progress, engine, reads, allow_incomplete)


def _bisect(
    run_a: Run | str,
    run_b: Run | str,
    ranks: Iterable[int] | None,
    steps: Any,
    level: str,
    force: bool,
    ignore_env: Sequence[str],
    progress: Progress | None,
    engine: Engine | None,
    reads: ReadPaths | None,
    allow_incomplete: bool,
) -> BisectResult:
    if level not in LEVELS:
        raise SelectionError(f"level {level!r} is not one of {', '.join(LEVELS)}; pick one of those")
    run_a, run_b = as_run(run_a), as_run(run_b)
    user_steps = _scope.norm_steps(steps)
    if run_a.path == run_b.path:  # trivially identical: almost certainly a mistyped command line
        raise IncomparableError(f"{run_a.label} and {run_b.label} are the same run directory; compare two runs")
    # 1. Comparable? Only the steps both runs hold completely are compared (allow_incomplete).
    run_a, run_b, incomplete = _held_steps.restrict_pair(run_a, run_b)
    both, one_sided = _scope.compared_ranks(run_a, run_b, ranks)
    check_digests(run_a, run_b)  # before anything forced or ignored: other versions never compare
    diffs, ignored = drop_keys(env_diff(run_a, run_b, ranks=both or None), ignore_env)
    check_comparable(diffs, label_a=run_a.label, label_b=run_b.label, force=force)
    # 2. Scope.
    scope = _scope.plan(run_a, run_b, steps=user_steps, compared=(both, one_sided))
    _scope.check(scope, run_a, run_b)
    notes = [*incomplete, *_scope_notes(scope, run_a, run_b, ignored)]
    # 3. Search: each rank's first divergence; from here on every read goes through the engine.
    stages = (engine or local)(run_a, run_b)
    # The engine's views of the runs (a HeldRun, a SparkRun): every attribute of an opened Run.
    run_a, run_b = cast(Run, stages.a), cast(Run, stages.b)
    found = search(run_a, run_b, scope, progress, stages, reads)
    notes += found.notes
    # 4. Verdicts, 5. evidence and assembly.
    verdicts = resolve(run_a, run_b, found.found, scope, stages.peer_inputs)
    ev = _evidence.gather(run_a, run_b, found.found, level)
    notes += ev.notes
    ordered, more = _assemble.rank_results(run_a, run_b, scope.ranks, found.found, found.metrics, verdicts, ev, level)
    notes += more
    # 6. Diagnosis: the evidence beyond the ranks, the pattern, then the cause weighed from all of it.
    # A rank with nothing left to compare (a run killed before its first commit there) still ended.
    ends = _clues.endings(run_a, run_b, (*scope.ranks, *scope.empty), ordered)
    ordered, trimmed = _cause.trim_endings(ordered, ends)
    notes += trimmed
    hazard_reads = _clues.hazard_reads(run_a, run_b, ordered)
    ordered = _cause.confirm_hazards(ordered, hazard_reads)
    parallel = {r: dict(run_a.manifest(r).get("parallel") or {}) for r in scope.ranks}
    diag = diagnose(ordered, parallel)
    if level == Level.STEP and diag.pattern != Pattern.IDENTICAL:
        why = "depth step narrows to the step only, without verdicts; rerun with --depth op for verdicts and a pattern"
        diag = Diagnosis(Pattern.UNDETERMINED, (), why)
    diverged = [rr for rr in ordered if rr.status == Status.DIVERGED]
    rng_only = _clues.rng_only(run_a, run_b, ordered, scope.window)
    status = Status.RNG_ONLY if rng_only else Status.DIVERGED if diverged else Status.IDENTICAL
    if status == Status.IDENTICAL and ends and not allow_incomplete:
        status = Status.ENDED_EARLY  # what both hold matched, but a run that died is not a pass
    capture = (_clues.capture_of(run_a, scope.ranks), _clues.capture_of(run_b, scope.ranks))
    offset = _clues.step_offset(run_a, run_b, ordered, scope.range_a, scope.range_b) if diverged else None
    first = min((rr.step for rr in diverged if rr.step is not None), default=None)
    clues = _cause.Clues(
        settings=_clues.settings_at(run_a, run_b, scope.ranks, _settings.settings(diffs), first),
        endings=ends,
        offset=offset,
        rng_only=rng_only,
        window=scope.window,
        capture_a=capture[0],
        capture_b=capture[1],
        resume_step=scope.resume.first_common_step if scope.resume.resumed else None,
        calls=_clues.forward_calls(run_a, run_b, ordered) if diverged else None,
    )
    diag = _cause.weigh(diag, ordered, clues, status, hazard_reads)
    disc = None
    if diag.origin_ranks and level in (Level.OP, Level.KERNEL):
        disc = _evidence.discriminator(run_a, run_b, ordered, diag)
    rep = _assemble.representative(ordered, diag.origin_ranks)
    first_step = min((min(x for x in (rr.step, rr.metric_step) if x is not None) for rr in diverged), default=None)
    return BisectResult(
        label_a=run_a.label,
        label_b=run_b.label,
        status=status,
        env_diff=diffs,
        first_step=first_step,
        ranks=ordered,
        diagnosis=diag,
        diff=rep.effective.diff if rep and rep.effective else None,
        diff_rank=rep.rank if rep else None,
        window=Window(
            scope.window,
            scope.range_a,
            scope.range_b,
            scope.ranks,
            run_a.missing_ranks,
            run_b.missing_ranks,
            scope.one_sided,
            level,
            *capture,
        ),
        resume=found.resume if offset is None else _clues.with_offset(found.resume, offset),
        discriminator=disc,
        notes=tuple(sorted(set(notes))),
        complete=not any(r.completeness is not None and r.completeness.gaps for r in (run_a, run_b)),
        endings=ends,
    )


def _scope_notes(scope: _scope.Scope, run_a: Run, run_b: Run, ignored: Sequence[str]) -> list[str]:
    """What the scope tolerated or left out, for the report's notes."""
    notes = []
    if ignored:
        notes.append(f"environment differences ignored as asked: {', '.join(ignored)}")
    if scope.empty:
        notes.append(f"ranks {format_ranks(scope.empty)} hold no record or metric in either run and were not compared")
    if run_a.missing_ranks or run_b.missing_ranks:
        notes.append(
            f"missing ranks tolerated: A {format_ranks(run_a.missing_ranks) or 'none'}, "
            f"B {format_ranks(run_b.missing_ranks) or 'none'}"
        )
    if scope.one_sided:
        notes.append(f"ranks {format_ranks(scope.one_sided)} exist in one run only and were not compared")
    return notes
