"""From what the stages found to the result types: each rank's ``RankResult`` and its ``Divergence``s.

Inputs: the walk's ``Found`` per rank and the metric splits (``search``), a ``Verdict`` per
walked record (``verdict.resolve``), the dumps and kernels read for them (``evidence.gather``).
Each record's difference kind and size come from ``diffkind.classify``; at a level above op,
fields deeper than the level are left out. Nothing is read here but argument texts: of an
arguments difference, and of a compiled kernel (the ATen ops it fused).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TypedDict

from detfp_analyze import rule
from detfp_analyze.bisect import evidence as _evidence
from detfp_analyze.bisect.components import parts_of
from detfp_analyze.bisect.diffkind import classify
from detfp_analyze.bisect.records import Extract, Found
from detfp_analyze.bisect.result import LEVELS, Divergence, Kernels, RankResult, ValueDiff
from detfp_analyze.bisect.search import MetricSplit
from detfp_analyze.bisect.verdict import RankVerdicts, Verdict
from detfp_analyze.bisect.vocab import Level, Status
from detfp_analyze.io.reader import Run
from detfp_format.contract import INPUTLESS_KINDS, split_component

__all__ = ["divergence", "rank_results", "representative"]


def _args_texts(run_a: Run, run_b: Run, ex: Extract) -> tuple[str | None, str | None] | None:
    """The call's argument texts on both sides (the ``args`` table) for an arguments difference."""
    da, db = ex.details
    if da is None or db is None or ex.record.args_same:
        return None
    r = ex.record.rank

    def text(run: Run, digest: str | None) -> str | None:
        return _evidence.arg_texts(run, [r], [digest]).get(digest) if digest else ""

    return text(run_a, da.get("args_digest")), text(run_b, db.get("args_digest"))


#: A kernel record's fused ATen ops in its call's argument text (capture's ``aten=['add','mul']``).
_FUSED = re.compile(r"(?:^|; )aten=\[([^\]]*)\]")


def _fused(run_a: Run, run_b: Run, ex: Extract) -> tuple[str, ...]:
    """The ATen ops a compiled kernel fused, from its call's arguments (run A's, else B's)."""
    if ex.record.kind != "kernel":
        return ()
    for run, d in zip((run_a, run_b), ex.details, strict=True):
        digest = d.get("args_digest") if d is not None else None
        text = _evidence.arg_texts(run, [ex.record.rank], [digest]).get(digest) if digest else None
        m = _FUSED.search(text) if text else None
        if m is not None:
            return tuple(re.findall(r"'([^']*)'", m.group(1)))
    return ()


def divergence(run_a: Run, run_b: Run, ex: Extract, v: Verdict, ev: _evidence.Evidence, level: str) -> Divergence:
    """The report's Divergence of one walked record."""
    rec, key = ex.record, ex.record.key
    dumps = (ev.dumps_a[key], ev.dumps_b[key]) if key in ev.dumps_a and key in ev.dumps_b else None
    da, db = ex.details
    component = split_component(rec.arg)[1]
    parts = parts_of(ex)
    diff: ValueDiff = classify(
        rec.state,
        da,
        db,
        dumps,
        _args_texts(run_a, run_b, ex),
        tensors_same=rec.tensors_same,
        args_same=rec.args_same,
        dtypes=(rec.dtype_a, rec.dtype_b),
        shapes=(rec.shape_a, rec.shape_b),
        # The whole of a tensor subclass whose parts all match: only its layout can differ.
        layout=component is None and bool(parts) and all(c.state == rule.SAME for c in parts),
    )
    if component is not None:
        diff = replace(diff, component=component)
    kernels = None
    if ev.kernels_a is not None and ev.kernels_b is not None and (rec.call in ev.kernels_a or rec.call in ev.kernels_b):
        kernels = Kernels(ev.kernels_a.get(rec.call, ()), ev.kernels_b.get(rec.call, ()))
    deep = LEVELS.index(level)
    return Divergence(
        step=rec.step,
        microbatch=rec.microbatch,
        phase=rec.phase,
        module=rec.module if deep >= LEVELS.index("module") else None,  # type: ignore[arg-type]
        kind=rec.kind,
        # A parameter, batch or RNG state is named by its record, not by an op: keep that name at any level.
        op=rec.name if deep >= LEVELS.index(Level.OP) or rec.kind in INPUTLESS_KINDS else None,  # type: ignore[arg-type]
        occurrence=rec.occurrence,
        role=rec.role,
        arg=rec.arg,
        presence=rec.presence,
        verdict=v.verdict,
        diff_kind=diff.kind,
        hazards=ex.hazards,
        seq_a=rec.seq_a,
        seq_b=rec.seq_b,
        dtype=rec.dtype,
        shape=rec.shape,
        consumer=v.consumer,
        contradiction=v.contradiction,
        upstream=ex.upstream,
        group=v.group,
        group_ranks=v.group_ranks,
        peers_differing=v.peers_differing,
        kernels=kernels,
        diff=diff,
        explanation=v.explanation,
        depends_on=v.depends_on,
        component=component,
        components=parts,
        fused=_fused(run_a, run_b, ex),
    )


class _MetricFields(TypedDict, total=False):
    """RankResult's metric fields, set together when a rank's metrics split."""

    metric_step: int
    metric_name: str
    metric_a: float | None
    metric_b: float | None


def rank_results(
    run_a: Run,
    run_b: Run,
    compared: Sequence[int],
    found: Mapping[int, Found],
    metrics: Mapping[int, MetricSplit],
    verdicts: Mapping[int, RankVerdicts],
    ev: _evidence.Evidence,
    level: str,
) -> tuple[tuple[RankResult, ...], tuple[str, ...]]:
    """One RankResult per compared rank (sorted), and notes on metrics that split before any record."""
    out, notes = [], []
    for r in sorted(compared):
        m = metrics.get(r)
        mkw: _MetricFields = (
            {}
            if m is None
            else {"metric_step": m.step, "metric_name": m.name, "metric_a": m.value_a, "metric_b": m.value_b}
        )
        f = found.get(r)
        if f is None:
            out.append(
                RankResult(r, Status.DIVERGED, m.step, **mkw)
                if m is not None
                else RankResult(r, Status.IDENTICAL, None)
            )
            continue
        if level == Level.STEP:  # no verdicts: the step of the rank's first divergence (past a false root)
            s = (f.next_clean or f.first).record.step
            out.append(RankResult(r, Status.DIVERGED, min(s, m.step) if m else s, record_step=s, **mkw))
            continue
        v = verdicts[r]
        first = divergence(run_a, run_b, f.first, v.first, ev, level)
        nxt = None
        if f.next_clean is not None and v.next_clean is not None:
            nxt = divergence(run_a, run_b, f.next_clean, v.next_clean, ev, level)
        # A likely false root followed by a clean divergence: the rank diverges where the evidence
        # does (the false root stays in the report as ``first``).
        step = nxt.step if first.hazards and nxt is not None else first.step
        out.append(RankResult(r, Status.DIVERGED, step, record_step=step, first=first, next_clean=nxt, **mkw))
        if m is not None and m.step < step:
            notes.append(
                f"rank {r}: metric {m.name} differs at step {m.step}, before any record (step {step}): widen the capture"
            )
    return tuple(out), tuple(notes)


def representative(ranks: Sequence[RankResult], origin_ranks: Sequence[int]) -> RankResult | None:
    """The rank whose difference the report shows: the lowest origin rank, else the lowest
    diverged rank with a located record (None when there is none)."""
    rep = next((rr for rr in ranks if rr.rank in origin_ranks), None)
    if rep is None:
        rep = next((rr for rr in ranks if rr.effective is not None), None)
    return rep if rep is not None and rep.effective is not None else None
