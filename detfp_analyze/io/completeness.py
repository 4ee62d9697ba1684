"""Completeness of a run: what its commit logs promise, against what is on disk (metadata only).

Pipeline of ``check`` (called by ``reader.open_run``): for each (rank, segment) with a manifest,
its commit log as ``commit_logs.read_logs`` read it (the format is in
``detfp_format.commitlog``) -> compare the committed windows with the shard files seen in
the footers (table, window, row count) -> ``Gap``s -> the steps each gap makes untrustworthy,
clipped to the steps no later segment supersedes -> a frozen ``Completeness``: the gaps that
matter, the shard files that must not be read (never committed, or not what was committed),
and per rank the excluded step ranges.

A (rank, segment) is ``complete`` when its log has a clean close line and every committed
window's shards are on disk with the committed row counts; ``legacy`` when it has neither a
log nor a manifest that promises one (runs written before the contract: trusted as they are,
and said so); ``incomplete`` otherwise. A launch that never closed (killed, crashed) keeps
the steps before the last step it committed: rows of one step never come after rows of the
next, so a step is finished once a later one has begun.

Reading the logs is ``commit_logs``; limiting two opened runs to the steps both hold completely
is ``held_steps``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from detfp_analyze.io.commit_logs import Logs
from detfp_analyze.io.shard_info import ShardInfo
from detfp_analyze.io.store import Location, name_of
from detfp_format import commitlog

__all__ = [
    "GAP_KINDS",
    "Completeness",
    "Gap",
    "SegmentState",
    "StepRanges",
    "check",
    "cutoffs",
    "format_steps",
    "merge_ranges",
    "refusal",
]

#: Kinds of gap, each a way a run can hold less than it claims (docs/reliability.md).
GAP_KINDS = (
    "missing_shard",  # a committed window's shard of a table is not on disk
    "row_mismatch",  # a shard holds another number of rows than its window committed
    "uncommitted_window",  # a shard of a window the log never committed (written, not committed)
    "not_closed",  # the launch never wrote its close line (killed, crashed, still running)
    "closed_incomplete",  # the launch closed, saying records were lost (disk full, capture error)
    "missing_commit_log",  # the manifest promises a commit log that is not there
    "damaged_commit_log",  # lines of the commit log cannot be read
    "no_data",  # a legacy rank with a manifest and not a single shard
)
#: Inclusive step ranges (first, last); last None: every later step.
StepRanges = tuple[tuple[int, int | None], ...]
_FIX = "pass --allow-incomplete (allow_incomplete=True) to use only the steps held completely"


@dataclass(frozen=True)
class Gap:
    """One way a (rank, segment) holds less than it should."""

    #: One of GAP_KINDS.
    kind: str
    rank: int
    segment: int
    #: Table concerned (None when the gap is not about one table).
    table: str | None
    #: Flush window concerned (None when the gap is not about one window).
    window: int | None
    #: First step whose rows cannot be trusted on this rank because of the gap (None: no step).
    first_step: int | None
    #: Last such step; None with ``first_step`` set: that step and every later one.
    last_step: int | None
    #: One line for humans: what is missing and, where known, why.
    detail: str

    def sort_key(self) -> tuple:
        return (self.rank, self.segment, -1 if self.window is None else self.window, self.kind, self.detail)

    def steps(self) -> str:
        """'steps 3-5', 'steps 5 and later' or '' (no step affected)."""
        if self.first_step is None:
            return ""
        return format_steps(((self.first_step, self.last_step),))

    def to_json_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "rank": self.rank,
            "segment": self.segment,
            "table": self.table,
            "window": self.window,
            "first_step": self.first_step,
            "last_step": self.last_step,
            "detail": self.detail,
        }


@dataclass(frozen=True)
class SegmentState:
    """Completeness of one process launch of one rank."""

    rank: int
    segment: int
    #: "complete", "incomplete" or "legacy" (no commit log: written before the contract).
    status: str
    #: Windows the commit log committed (0 for legacy).
    windows: int
    #: The commit log's close line was read.
    closed: bool


@dataclass(frozen=True)
class Completeness:
    """What ``check`` found for a whole run."""

    #: Every (rank, segment) with a manifest, sorted.
    segments: tuple[SegmentState, ...]
    #: Gaps that leave steps untrustworthy, or say the log is damaged, sorted by (rank, segment, window).
    gaps: tuple[Gap, ...]
    #: Shard files that must not be read: never committed, or not what their window committed.
    dropped: frozenset[Location]
    #: rank -> step ranges whose rows cannot be trusted (merged, sorted).
    excluded: Mapping[int, StepRanges]

    @property
    def complete(self) -> bool:
        """No gap (legacy segments count as complete: their completeness cannot be checked)."""
        return not self.gaps

    @property
    def legacy_ranks(self) -> tuple[int, ...]:
        """Ranks with at least one legacy segment."""
        return tuple(sorted({s.rank for s in self.segments if s.status == "legacy"}))

    def rank_status(self, rank: int) -> str:
        """'complete', 'incomplete' or 'legacy' for one rank (incomplete wins, then legacy)."""
        states = {s.status for s in self.segments if s.rank == rank}
        if any(g.rank == rank for g in self.gaps):
            return "incomplete"
        return "legacy" if "legacy" in states else "complete"


def format_steps(ranges: StepRanges) -> str:
    """'steps 3-5, 9 and later' for excluded ranges."""
    parts = []
    for lo, hi in ranges:
        parts.append(f"{lo} and later" if hi is None else (str(lo) if lo == hi else f"{lo}-{hi}"))
    return ("step " if len(ranges) == 1 and ranges[0][1] == ranges[0][0] else "steps ") + ", ".join(parts)


def cutoffs(manifests: Mapping[int, Sequence[Mapping[str, Any]]]) -> dict[tuple[int, int], int]:
    """(rank, segment) -> first step a later segment of that rank captured again (docs/trace-format.md §3).

    ``manifests``: rank -> its manifests sorted by segment.
    """
    out: dict[tuple[int, int], int] = {}
    for rank, ms in manifests.items():
        later: int | None = None
        for m in reversed(ms):
            if later is not None:
                out[(rank, m["segment"])] = later
            start = m.get("start_step")
            if start is not None:
                later = start if later is None else min(later, start)
    return out


@dataclass
class _Segment:
    """Working state of one (rank, segment) while it is judged."""

    rank: int
    segment: int
    start: int | None
    log: commitlog.LogState | None
    files: dict[int | None, list[ShardInfo]]  # window -> shards (None: a name without a window)
    gaps: list[Gap]
    dropped: list[Location]

    def gap(
        self, kind: str, table: str | None, window: int | None, first: int | None, last: int | None, detail: str
    ) -> None:
        """Note a gap of this (rank, segment) (``Gap``'s fields but the rank and segment)."""
        self.gaps.append(Gap(kind, self.rank, self.segment, table, window, first, last, detail))


def _start(seg: _Segment, earlier_last: int | None) -> int:
    """First step this launch could have written: its start step, else just after earlier segments."""
    if seg.start is not None:
        return seg.start
    return 0 if earlier_last is None else earlier_last + 1


def _file_steps(files: Iterable[ShardInfo]) -> tuple[int | None, int | None]:
    lo = [f.step_min for f in files if f.step_min is not None]
    hi = [f.step_max for f in files if f.step_max is not None]
    return (min(lo) if lo else None), (max(hi) if hi else None)


def _judge_logged(seg: _Segment, earlier_last: int | None) -> None:
    """Gaps of a segment that has a commit log."""
    log = seg.log
    assert log is not None
    r, s = seg.rank, seg.segment
    name = commitlog.commit_log_relpath(r, s).rsplit("/", 1)[1]
    if log.bad_lines and not (log.torn_tail and log.bad_lines == 1 and log.close is None):
        why = f" (window {log.contradictions[0]}'s rows differ from its step folds)" if log.contradictions else ""
        seg.gap(
            "damaged_commit_log",
            None,
            None,
            None,
            None,
            f"{log.bad_lines} line(s) of {name} cannot be read{why}; windows they committed are not trusted",
        )
    committed = log.windows
    for w, (rows, span) in sorted(committed.items()):
        on_disk = {f.table: f for f in seg.files.get(w, ())}
        lo, hi = (None, None) if span is None else span
        for table, n in sorted(rows.items()):
            if n == 0:
                continue
            f = on_disk.get(table)
            if f is None:
                seg.gap(
                    "missing_shard",
                    table,
                    w,
                    lo,
                    hi,
                    f"{table} window {w} was committed with {n} row(s) but its shard is missing",
                )
            elif f.num_rows != n:
                seg.dropped.append(f.path)
                seg.gap(
                    "row_mismatch",
                    table,
                    w,
                    lo,
                    hi,
                    f"{table} window {w} holds {f.num_rows} row(s), its commit says {n}",
                )
        for table, f in sorted(on_disk.items()):
            if rows.get(table, 0) == 0:
                seg.dropped.append(f.path)
                flo, fhi = _file_steps([f])
                seg.gap(
                    "uncommitted_window", table, w, flo, fhi, f"{table} window {w} has a shard its commit does not list"
                )
    spans = {w: span for w, (_, span) in committed.items() if span is not None}
    last = max((hi for _, hi in spans.values()), default=None)
    n_windows = max(committed, default=-1) + 1
    if log.close is not None:
        n_windows = max(n_windows, log.close[0])
    # Window None (names without one) first: None and numbers do not compare.
    for wn in sorted((k for k in seg.files if k is None or k not in committed), key=lambda k: -1 if k is None else k):
        files = seg.files[wn]
        seg.dropped.extend(f.path for f in files)
        flo, fhi = _file_steps(files)
        if flo is None:  # no statistics: from the last committed step on
            flo, fhi = (last if last is not None else _start(seg, earlier_last)), None
        for f in files:
            what = f"{f.table} window {wn}" if wn is not None else f"{f.table} shard {name_of(f.path)}"
            seg.gap("uncommitted_window", f.table, wn, flo, fhi, f"{what} was written but never committed")
    # Windows below the count with neither a commit line nor a file: one gap per run of them
    # (walked over the windows present, never over the count, which a damaged log could inflate).
    present = sorted(
        {w for w in committed if w < n_windows} | {w for w in seg.files if w is not None and w < n_windows}
    )
    holes, prev = [], -1
    for w in [*present, n_windows]:
        if w > prev + 1:
            holes.append((prev + 1, w - 1))
        prev = w
    for first, last_w in holes:
        below = [spans[k][1] for k in spans if k < first]
        above = [spans[k][0] for k in spans if k > last_w]
        lo = max(below) if below else _start(seg, earlier_last)
        what = f"window {first} has" if first == last_w else f"windows {first}-{last_w} have"
        seg.gap("uncommitted_window", None, first, lo, min(above) if above else None, f"{what} no commit line")
    tail = last if last is not None else _start(seg, earlier_last)
    if log.close is None:
        what = {0: "no window committed", 1: "window 0 committed"}.get(
            n_windows, f"windows 0-{n_windows - 1} committed"
        )
        seg.gap(
            "not_closed", None, None, tail, None, f"the capture never closed ({what}; killed, crashed or still running)"
        )
    elif log.close[1] != "ok":
        why = log.close[2] or (log.failure[1] if log.failure else "no reason given")
        seg.gap(
            "closed_incomplete",
            None,
            log.failure[0] if log.failure else None,
            tail,
            None,
            f"the capture closed incomplete: {why}",
        )


def check(
    label: str,
    manifests: Mapping[int, Sequence[Mapping[str, Any]]],
    shards: Mapping[str, Sequence[ShardInfo]],
    logs: Logs,
) -> Completeness:
    """Judge every (rank, segment) of a run from its commit log (``logs``: as
    ``commit_logs.read_logs`` read them; an error kept there is raised here), manifest and shard
    footers."""
    by_seg: dict[tuple[int, int], dict[int | None, list[ShardInfo]]] = {}
    for infos in shards.values():
        for f in infos:
            by_seg.setdefault((f.rank, f.segment), {}).setdefault(f.window, []).append(f)
    cut = cutoffs(manifests)
    states: list[SegmentState] = []
    gaps: list[Gap] = []
    dropped: list[Location] = []
    excluded: dict[int, list[tuple[int, int | None]]] = {}
    for rank, ms in sorted(manifests.items()):
        earlier_last: int | None = None
        legacy_files = 0
        all_legacy = True
        for m in ms:
            s = m["segment"]
            got = logs[(rank, s)]
            if isinstance(got, Exception):
                raise got
            log = got
            files = by_seg.get((rank, s), {})
            seg = _Segment(rank, s, m.get("start_step"), log, files, [], [])
            if log is None and m.get("commit_log") is None:
                states.append(SegmentState(rank, s, "legacy", 0, False))
                legacy_files += sum(len(v) for v in files.values())
            else:
                all_legacy = False
                if log is None:
                    seg.dropped.extend(f.path for v in files.values() for f in v)
                    seg.gaps.append(
                        Gap(
                            "missing_commit_log",
                            rank,
                            s,
                            None,
                            None,
                            _start(seg, earlier_last),
                            None,
                            "the manifest promises a commit log but segment-"
                            f"{s:05d}.commits is missing: nothing of this launch can be trusted",
                        )
                    )
                else:
                    _judge_logged(seg, earlier_last)
                windows = 0 if log is None else len(log.windows)
                closed = log is not None and log.close is not None
                states.append(SegmentState(rank, s, "incomplete" if seg.gaps else "complete", windows, closed))
            hi_seen = [f.step_max for v in files.values() for f in v if f.step_max is not None]
            if hi_seen:
                earlier_last = max(hi_seen) if earlier_last is None else max(earlier_last, *hi_seen)
            limit = cut.get((rank, s))
            for g in seg.gaps:
                if g.first_step is None:
                    gaps.append(g)  # a damaged log line: reported, excludes nothing by itself
                    continue
                hi = g.last_step if limit is None else min(limit - 1, g.last_step if g.last_step is not None else limit)
                if hi is not None and hi < g.first_step:
                    continue  # superseded by a later segment: the resumed launch captured those steps again
                gaps.append(dataclasses.replace(g, last_step=hi))
                excluded.setdefault(rank, []).append((g.first_step, hi))
            dropped.extend(seg.dropped)
        if all_legacy and legacy_files == 0:
            gaps.append(
                Gap(
                    "no_data",
                    rank,
                    ms[-1]["segment"],
                    None,
                    None,
                    0,
                    None,
                    "legacy run (no commit log) and this rank has a manifest but not a single shard",
                )
            )
            excluded.setdefault(rank, []).append((0, None))
    gaps.sort(key=Gap.sort_key)
    merged = {r: merge_ranges(v) for r, v in sorted(excluded.items())}
    return Completeness(tuple(states), tuple(gaps), frozenset(dropped), MappingProxyType(merged))


def merge_ranges(ranges: Iterable[tuple[int, int | None]]) -> StepRanges:
    out: list[list[Any]] = []
    for lo, hi in sorted(ranges, key=lambda x: x[0]):
        if out and (out[-1][1] is None or lo <= out[-1][1] + 1):
            if out[-1][1] is not None:
                out[-1][1] = None if hi is None else max(out[-1][1], hi)
            continue
        out.append([lo, hi])
    return tuple((lo, hi) for lo, hi in out)


def refusal(label: str, comp: Completeness) -> str:
    """The one-line message of an incomplete run opened without ``allow_incomplete``."""
    g = comp.gaps[0]
    more = len(comp.gaps) - 1
    steps = g.steps()
    return (
        f"{label}: incomplete trace: rank {g.rank} segment {g.segment}: {g.detail}"
        + (f" ({steps} not held completely)" if steps else "")
        + (f"; and {more} more gap(s) (detfp-analyze certify lists them)" if more else "")
        + f"; {_FIX}"
    )
