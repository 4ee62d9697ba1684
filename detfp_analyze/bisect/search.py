"""The step search: from a scope to each rank's first divergence, reading as little as possible.

1. ``narrow.metric_divergence``: each rank's first step whose metrics differ bitwise; the last
   such step bounds the search (a loss is a checksum of everything before it);
2. ``rollup_candidates``: per (rank, step) rollups over narrow columns, ranks in batches,
   streaming: the steps whose rollups differ are the candidates; when both runs stored rollups
   (``blocks``), the same rollups come from those few rows instead, and each candidate step
   without a structural difference is narrowed to the slice of blocks that differ; with the
   commit logs' step folds (``io.stepsums``), only the metrics of each rank's first differing
   step and the blocks of the differing steps up to the bound are read (``reads.ReadPaths``
   says which of these two shortcuts the search may take);
3. ``walk``: each rank's candidates in order, up to the bound, then past it only for the ranks
   where no value differs yet;
4. what was passed over, and the digest errors, become notes; a resumed pair gets its boundary
   counts (``resume.boundary_counts``).

The reads that grow with the trace (1, 2) run on an engine's ``Stages`` (``engine``: polars
here by default, or Apache Spark), which is told the rank-steps each walk will read
(``prefetch``); the walk itself reads the stages' runs and is the same code for every engine.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import polars as pl

from detfp_analyze.bisect import blocks as _blocks
from detfp_analyze.bisect import narrow as _narrow
from detfp_analyze.bisect import resume as _resume
from detfp_analyze.bisect.engine import LocalStages, Stages
from detfp_analyze.bisect.reads import ReadPaths, scan
from detfp_analyze.bisect.records import Found
from detfp_analyze.bisect.result import ResumeInfo
from detfp_analyze.bisect.scope import Scope
from detfp_analyze.bisect.walk import Progress, walk
from detfp_analyze.io import binding as _binding
from detfp_analyze.io import stepsums as _stepsums
from detfp_analyze.io.reader import Run

__all__ = ["MetricSplit", "Search", "rollup_candidates", "search"]


@dataclass(frozen=True)
class MetricSplit:
    """A rank's first step whose metrics differ bitwise."""

    step: int
    #: The first differing metric of that step, by name, and both values (None on a missing side).
    name: str
    value_a: float | None
    value_b: float | None


@dataclass(frozen=True)
class Search:
    """What the step search found."""

    #: rank -> its first divergence, for ranks where a value differs.
    found: dict[int, Found]
    #: rank -> its first metric split, for ranks whose metrics differ.
    metrics: dict[int, MetricSplit]
    #: The scope's resume facts, with the boundary counts filled in.
    resume: ResumeInfo
    #: Digest errors (passed over, no evidence) and ranks identical because nothing changed a value.
    notes: tuple[str, ...]


def rollup_candidates(
    stages: Stages, ranks: Sequence[int], lo: int, hi: int, progress: Progress | None, stage: str,
    errors: list[int], stored: tuple[pl.DataFrame, pl.DataFrame] | None = None,
    sums: tuple[_stepsums.Sums, _stepsums.Sums] | None = None,
) -> dict[int, list[int]]:  # fmt: skip
    """rank -> candidate steps (sorted) whose rollups differ, over [lo, hi]; accumulates in
    ``errors`` the [A, B] counts of records whose digest failed (no evidence). ``stored``: both
    runs' ``blocks.block_rollup`` rows, used instead of reading the records (``stages``);
    ``sums``: both runs' committed step folds (``io.stepsums``), used instead of either."""
    if sums is None and stored is None:
        return stages.rollup_candidates(ranks, lo, hi, progress, stage, errors)
    out: dict[int, list[int]] = {}
    if sums is not None:
        ra, rb = (_stepsums.rollup_rows(s, ranks, lo, hi) for s in sums)
        # Only the (rank, step)s whose folds differ can be candidates: the rest of the job's
        # rank-steps leave the comparison here, their digest errors counted first.
        errors[0] += int(ra["n_err"].sum() or 0)
        errors[1] += int(rb["n_err"].sum() or 0)
        keep = _stepsums.differing(ra, rb)
        ra, rb = (r.join(keep, on=["rank", "step"], how="semi", maintain_order="left") for r in (ra, rb))
        _narrow.add_candidates(ra, rb, out, [0, 0])
    else:
        assert stored is not None
        ba, bb = (b.filter(pl.col("rank").is_in(list(ranks)) & pl.col("step").is_between(lo, hi)) for b in stored)
        _narrow.add_candidates(_blocks.step_rollup(ba), _blocks.step_rollup(bb), out, errors)
    if progress:
        progress(stage, 1, 1)
    return out


def _bind_metrics(runs: tuple[Run, Run], splits: Sequence[tuple[int, int]]) -> None:
    """The metrics rows of each rank's first differing step ((rank, step) pairs: the values the
    report names) against the metrics folds of those steps (``io.binding.check_metrics``; a read of
    a few rows per rank, from the shards the metric reads just opened)."""
    if not splits:
        return
    by_step: dict[int, list[int]] = {}
    for r, s in splits:
        by_step.setdefault(s, []).append(r)
    for run in runs:
        if not any(_stepsums.usable(run, r) for r, _ in splits):
            continue
        cols = _binding.METRIC_COLUMNS
        parts = [run.scan("metrics", ranks=rs, steps=[s], columns=cols) for s, rs in sorted(by_step.items())]
        _binding.check_metrics(run, pl.concat(parts).collect(), list(splits))


def _stored_blocks(
    st: Stages,
    rollups: bool,
    sums: tuple[_stepsums.Sums, _stepsums.Sums] | None,
    ranks: Sequence[int],
    lo: int,
    hi: int,
) -> tuple[pl.DataFrame, pl.DataFrame] | None:
    """Both runs' stored rollups' blocks of ``ranks`` over [lo, hi] (None without stored rollups):
    with folds, only of the (rank, step)s whose folds differ (None when none does)."""
    if not rollups:
        return None
    read = (ranks, lo, hi) if sums is None else _stepsums.record_reads(*sums, ranks=ranks, lo=lo, hi=hi)
    if not read:
        return None
    blocks = st.block_rollups(*read)
    # The blocks' step rollups are the commit lines' step folds: what was read must be what was
    # committed (io.binding; a slice's records are then checked against these blocks).
    for run, side in zip((st.a, st.b), blocks, strict=True):
        _binding.check_steps(run, "rollups", _blocks.step_rollup(side), _binding.Span(*read))
    return blocks


def _candidates(
    st: Stages,
    rollups: bool,
    sums: tuple[_stepsums.Sums, _stepsums.Sums] | None,
    ranks: Sequence[int],
    lo: int,
    hi: int,
    progress: Progress | None,
    stage: str,
    errors: list[int],
) -> tuple[dict[int, list[int]], dict[tuple[int, int], _blocks.Slice] | None]:
    """The candidate steps of ``ranks`` over [lo, hi] (``rollup_candidates``) and the slices the
    stored rollups' blocks cut them to (None: the walk reads whole steps). With folds, the
    candidates come from the folds and only the (rank, step)s whose folds differ have blocks
    worth reading, and none at all when the engine holds every rank's first candidate step
    whole (``Stages.holds``): a slice would only narrow reads served from memory."""
    if sums is not None:
        cands = rollup_candidates(st, ranks, lo, hi, progress, stage, errors, None, sums)
        stored = None if st.holds(cands) else _stored_blocks(st, rollups, sums, ranks, lo, hi)
    else:
        stored = _stored_blocks(st, rollups, sums, ranks, lo, hi)
        cands = rollup_candidates(st, ranks, lo, hi, progress, stage, errors, stored, sums)
    return cands, (_blocks.slices(*stored, cands) if stored is not None else None)


def search(
    run_a: Run,
    run_b: Run,
    scope: Scope,
    progress: Progress | None = None,
    stages: Stages | None = None,
    reads: ReadPaths | None = None,
) -> Search:
    """Each compared rank's first divergence and first metric split within ``scope``; the heavy
    reads run on ``stages`` (``engine``; default: polars here), the walk reads ``stages.a``/``.b``.
    ``reads``: the shortcuts past the records it may take (default: all, ``ReadPaths()``)."""
    reads = reads if reads is not None else ReadPaths()
    st = stages if stages is not None else LocalStages(run_a, run_b)
    run_a, run_b = st.a, st.b
    compared = list(scope.ranks)
    if scope.window is None or not compared:
        return Search({}, {}, scope.resume, ())
    lo, hi = scope.window
    rollups = reads.stored_rollups and _blocks.available(run_a, run_b, compared)
    # Committed step folds (io.stepsums) say which ranks' metrics and rollups differ at all:
    # only those are read (an identical pair reads neither).
    sums = _stepsums.pair(run_a, run_b, compared, lo, hi) if rollups and reads.step_sums else None
    m_read = (compared, lo, hi) if sums is None else _stepsums.metric_reads(*sums)
    m = st.metric_divergence(*m_read).to_dicts() if m_read else []
    metrics = {int(r["rank"]): MetricSplit(int(r["step"]), r["name"], r["value_a"], r["value_b"]) for r in m}
    # The rows behind the answer are what was committed: the splits the reads found, and where
    # both runs hold folds (used for the reads or not), the steps the folds say differ first.
    firsts = {(r, s.step) for r, s in metrics.items()}
    folds = sums if sums is not None else _stepsums.pair(run_a, run_b, compared, lo, hi)
    if folds is not None:
        firsts.update(_stepsums.metric_firsts(*folds).items())
    _bind_metrics((run_a, run_b), sorted(firsts))
    # The first differing record cannot come after the step where every metric split, unless
    # the capture missed it: search up to that bound first, the rest only where needed.
    bound = min(max(max((s.step for s in metrics.values()), default=hi), lo), hi)
    errors = [0, 0]
    # Up to the bound first: the steps after it are read only for the ranks the walk leaves open.
    cands, sl = _candidates(st, rollups, sums, compared, lo, bound, progress, "steps", errors)
    # Every level walks: a candidate step may hold only no-evidence differences (a digest error
    # on one side, records under hazards), which only the walk can tell.
    st.prefetch(cands, sl)
    found = walk(run_a, run_b, cands, scope.boundary, progress, slices=sl, batch_size=st.walk_batch)
    if bound < hi:
        rest = [r for r in compared if r not in found or found[r].passed]
        if rest:
            more, sl = _candidates(st, rollups, sums, rest, bound + 1, hi, progress, "steps (after metrics)", errors)
            st.prefetch(more, sl)
            found = walk(run_a, run_b, more, scope.boundary, progress, found, slices=sl, batch_size=st.walk_batch)
    notes = []
    if errors[0] or errors[1]:
        notes.append(
            f"records that could not be digested (status error): A {errors[0]}, B {errors[1]}; they are no "
            "evidence either way and were left out of the comparison (see certify)"
        )
    notes += _passed_notes(found)
    info = scope.resume
    s = info.first_common_step
    if info.resumed and s is not None and s <= hi:
        n, d = _resume.boundary_counts(
            scan(run_a, "records", compared, s, s, _resume.BOUNDARY_COLUMNS),
            scan(run_b, "records", compared, s, s, _resume.BOUNDARY_COLUMNS),
            s,
        )
        info = replace(info, first_common_step=s, boundary_compared=n, boundary_differing=d)
    return Search({r: f for r, f in found.items() if not f.passed}, metrics, info, tuple(notes))


def _passed_notes(found: Mapping[int, Found]) -> list[str]:
    """Why each rank where no value differs is identical although records differ."""
    notes = []
    for r, f in sorted(found.items()):
        if not f.passed:
            continue
        rec = f.first.record
        where = f"from step {rec.step} {rec.name} ({rec.kind}) in {rec.module or '<root>'}"
        if f.first.passed == "hazards":
            notes.append(
                f"rank {r}: differences only under hazards ({', '.join(f.first.hazards) or 'hazard'}), {where}: "
                "likely false roots, and no clean difference follows them"
            )
        else:
            notes.append(
                f"rank {r}: calls in another order or number, {where}, with every record's value equal: a "
                "control-flow difference that changed no value (framework bookkeeping), not a divergence"
            )
    return notes
