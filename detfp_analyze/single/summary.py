"""What a run holds: ranks, segments, steps, capture levels, row counts, hazards, environment.

``summarize(run)`` is a pure function of an opened ``Run``: it reads the ``step``, ``kind``,
``status``, ``hazards``, ``type`` and ``name`` columns through ``Run.scan`` (so rows
superseded by a resumed segment are not counted) and the manifests, and returns a frozen
``RunSummary``. ``format_summary`` renders it as byte-stable plain text and
``summary_dict`` as JSON-ready data; only the CLI prints. Completeness is shown per rank (from
the commit logs: complete, incomplete and why, or legacy); counts cover every committed row,
including steps an incomplete launch may not hold completely. Environment facts are taken from
each rank's latest manifest; a fact that differs between ranks is shown with the ranks
holding each value, so a single summary already shows a rank with a different setting.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from types import MappingProxyType
from typing import Any, cast

import polars as pl

from detfp_analyze.io.reader import Run, as_run
from detfp_analyze.ranks import rank_list
from detfp_format import contract

__all__ = ["RunSummary", "SegmentSummary", "format_summary", "summarize", "summary_dict"]

# Manifest sections shown as environment facts (flattened to "section.key").
_ENV_SECTIONS = ("versions", "determinism", "env", "git")


@dataclass(frozen=True)
class SegmentSummary:
    """One process launch (segment) as seen across ranks."""

    #: Segment number (0 first launch, +1 per appended resume).
    segment: int
    #: Ranks that have this segment, as a compact range string ("0-7").
    ranks: str
    #: Distinct start steps of the segment over those ranks (None: not recorded).
    start_steps: tuple[int | None, ...]


@dataclass(frozen=True)
class RunSummary:
    """Everything ``detfp-analyze summary`` shows. Counts exclude superseded rows."""

    #: The run path as the user gave it.
    label: str
    #: World size from the manifests.
    world_size: int
    #: Ranks present / missing (missing only with allow_missing_ranks), as range strings.
    ranks: str
    missing_ranks: str
    #: Segments (process launches), sorted.
    segments: tuple[SegmentSummary, ...]
    #: Smallest and largest step over all tables; None when the run holds no rows.
    first_step: int | None
    last_step: int | None
    #: Distinct capture levels of the manifests (capture.level), sorted.
    levels: tuple[str, ...]
    #: Rows per table, in contract order (every table, 0 when absent).
    tables: tuple[tuple[str, int], ...]
    #: records per kind / per status / per hazard flag, sorted by name.
    kinds: tuple[tuple[str, int], ...]
    statuses: tuple[tuple[str, int], ...]
    hazards: tuple[tuple[str, int], ...]
    #: events per type, sorted by name.
    events: tuple[tuple[str, int], ...]
    #: Distinct metric names, sorted.
    metrics: tuple[str, ...]
    #: Environment facts ("versions.torch", "determinism.cudnn_benchmark", "env.NCCL_ALGO", "git.commit"),
    #: sorted by name; a value differing between ranks reads "a (ranks 0-3); b (ranks 4-7)".
    environment: tuple[tuple[str, str], ...]
    #: Completeness per rank: (ranks as a range string, "complete" | "legacy (...)" | "incomplete: ..."),
    #: ranks with the same status folded together, in rank order.
    completeness: tuple[tuple[str, str], ...] = ()


def _render(value: Any) -> str:
    """A JSON value as one stable line (null for None, true/false for booleans)."""
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True)


def _counts(df: pl.DataFrame, column: str) -> tuple[tuple[str, int], ...]:
    if df.height == 0:
        return ()
    g = df.group_by(column).len().sort(column)
    return tuple((str(k), int(n)) for k, n in g.iter_rows())


def _environment(manifests: Mapping[int, dict]) -> tuple[tuple[str, str], ...]:
    facts: dict[str, dict[str, list[int]]] = {}
    for rank, m in sorted(manifests.items()):
        flat: dict[str, Any] = {}
        for section in _ENV_SECTIONS:
            value = m.get(section)
            if isinstance(value, Mapping):
                for k, v in value.items():
                    flat[f"{section}.{k}"] = v
        for section in ("host",):
            for k in ("device_count", "devices", "cpu"):
                if isinstance(m.get(section), Mapping) and k in m[section]:
                    flat[f"host.{k}"] = m[section][k]
        for k, v in flat.items():
            facts.setdefault(k, {}).setdefault(_render(v), []).append(rank)
    all_ranks = sorted(manifests)
    out = []
    for key in sorted(facts):
        values = facts[key]
        if len(values) == 1 and next(iter(values.values())) == all_ranks:
            out.append((key, next(iter(values))))
        else:
            # Absent on some ranks counts as a distinct value: an env var set on half the ranks matters.
            seen = {r for rs in values.values() for r in rs}
            if len(seen) < len(all_ranks):
                values = {**values, "(unset)": [r for r in all_ranks if r not in seen]}
            parts = sorted(values.items(), key=lambda kv: (min(kv[1]), kv[0]))
            out.append((key, "; ".join(f"{v} (ranks {rank_list(rs)})" for v, rs in parts)))
    return tuple(out)


def _completeness(run: Run) -> tuple[tuple[str, str], ...]:
    comp = run.completeness
    if comp is None:
        return ()
    by_status: dict[str, list[int]] = {}
    for rank in run.ranks:
        status = comp.rank_status(rank)
        if status == "legacy":
            status = "legacy (no commit log: written before the completeness contract, not verified)"
        elif status == "incomplete":
            parts = []
            for g in comp.gaps:
                if g.rank == rank:
                    steps = g.steps()
                    parts.append(f"{g.kind} (segment {g.segment}{', ' + steps if steps else ''})")
            status = "incomplete: " + "; ".join(parts)
        by_status.setdefault(status, []).append(rank)
    return tuple((rank_list(rs), st) for st, rs in sorted(by_status.items(), key=lambda kv: kv[1][0]))


def summarize(run: Run | str | os.PathLike[str]) -> RunSummary:
    """Summarize a run (a ``Run`` or a run directory; reads a few columns of every table; see RunSummary)."""
    run = as_run(run)
    completeness = _completeness(run)
    run = dataclasses.replace(run, excluded=MappingProxyType({}))  # count every committed row
    records = run.scan("records").select("step", "kind", "status", "hazards").collect()
    metrics = run.scan("metrics").select("step", "name").collect()
    events = run.scan("events").select("step", "type").collect()
    others = {t: run.scan(t).select("step").collect() for t in ("kernels", "dumps", "args")}
    frames = {"records": records, "metrics": metrics, "events": events, **others}
    steps = pl.concat([f.select("step") for f in frames.values()])
    by_segment: dict[int, list[tuple[int, int | None]]] = {}
    for rank, manifests in run.manifests.items():
        for m in manifests:
            by_segment.setdefault(m["segment"], []).append((rank, m["start_step"]))
    segments = tuple(
        SegmentSummary(
            segment=s,
            ranks=rank_list([r for r, _ in pairs]),
            start_steps=tuple(sorted({st for _, st in pairs}, key=lambda v: (v is not None, v or 0))),
        )
        for s, pairs in sorted(by_segment.items())
    )
    levels = sorted(
        {str(m["capture"].get("level")) for ms in run.manifests.values() for m in ms if isinstance(m["capture"], dict)}
    )
    hazards = records.select(pl.col("hazards").explode()).drop_nulls() if records.height else records
    return RunSummary(
        label=run.label,
        world_size=run.world_size,
        ranks=rank_list(run.ranks),
        missing_ranks=rank_list(run.missing_ranks),
        segments=segments,
        # Series.min/max are typed as any Python literal; step is an integer column.
        first_step=cast("int | None", steps["step"].min()),
        last_step=cast("int | None", steps["step"].max()),
        levels=tuple(levels),
        # rollups is an index over records (what bisect reads first), not data a summary lists.
        tables=tuple((t, frames[t].height) for t in contract.TABLES if t in frames),
        kinds=_counts(records, "kind"),
        statuses=_counts(records, "status"),
        hazards=_counts(hazards, "hazards") if hazards.height else (),
        events=_counts(events, "type"),
        metrics=tuple(sorted(set(metrics["name"].to_list()))),
        environment=_environment({r: ms[-1] for r, ms in run.manifests.items()}),
        completeness=completeness,
    )


def summary_dict(summary: RunSummary) -> dict[str, Any]:
    """JSON-ready form of a summary (pairs become objects, keys keep their sorted order)."""
    d = asdict(summary)
    for key in ("tables", "kinds", "statuses", "hazards", "events", "environment", "completeness"):
        d[key] = dict(getattr(summary, key))
    # Tuples become lists, exactly as a JSON reader will see them.
    return json.loads(json.dumps(d))


def _block(title: str, pairs: tuple[tuple[str, Any], ...]) -> list[str]:
    if not pairs:
        return [f"{title}: none"]
    width = max(len(k) for k, _ in pairs)
    return [f"{title}:"] + [f"  {k.ljust(width)}  {v}" for k, v in pairs]


def format_summary(summary: RunSummary) -> str:
    """Plain-text rendering, byte-stable (sorted, no timestamps); ends with a newline."""
    s = summary
    steps = "none" if s.first_step is None else f"{s.first_step}-{s.last_step}"
    seg_lines = [
        f"  {g.segment}  ranks {g.ranks}, start step " + ", ".join("-" if v is None else str(v) for v in g.start_steps)
        for g in s.segments
    ]
    lines = [
        f"run: {s.label}",
        f"world size: {s.world_size}",
        f"ranks: {s.ranks} (missing: {s.missing_ranks})",
        *_block(
            "completeness",
            tuple((f"rank {r}" if "-" not in r and "," not in r else f"ranks {r}", v) for r, v in s.completeness),
        ),
        "segments:",
        *seg_lines,
        f"steps: {steps}",
        f"capture levels: {', '.join(s.levels) or 'none'}",
        *_block("rows per table", s.tables),
        *_block("records per kind", s.kinds),
        *_block("records per status", s.statuses),
        *_block("records with hazard", s.hazards),
        *_block("events per type", s.events),
        f"metrics: {', '.join(s.metrics) or 'none'}",
        *_block("environment", s.environment),
    ]
    return "\n".join(lines) + "\n"
