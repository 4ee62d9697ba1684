"""Which steps to compare, and the resume boundary.

A resumed run keeps the original step numbering but starts later: a run restored from a
checkpoint at step 5 holds steps 5.. while the uninterrupted run holds 0... Only the
overlapping steps can be compared, and the first thing to compare there is the state the
resume had to restore: parameters, optimizer state and RNG states recorded at the first
common step (``BOUNDARY_KINDS``). The walk gives those records priority at boundary
steps, so a resume that lost its RNG state shows as a ``source`` at kind ``rng_state`` on
the first resumed step even when other records of that step come earlier in the stream.

Boundary steps are the first common step when the runs start at different steps, plus
the start step of every appended segment (a resume written into the same run directory).
Step ranges come from shard footers (no data read) and fall back to a scan of the step
column when footers carry no statistics.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from operator import attrgetter

import polars as pl

from detfp_analyze import rule
from detfp_analyze.bisect.result import ResumeInfo
from detfp_analyze.io.reader import Run, ShardInfo
from detfp_analyze.rule.to_polars import names_for, to_polars

__all__ = ["BOUNDARY_KINDS", "boundary_counts", "boundary_steps", "plan_window", "step_range"]

#: Kinds holding the state a resume must restore (the rule's ordering puts them first at a boundary).
BOUNDARY_KINDS = rule.BOUNDARY_KINDS
_MATCH = to_polars(rule.MATCH, names_for("", "_b"))


_step_min, _step_max = attrgetter("step_min"), attrgetter("step_max")


def step_range(
    run: Run, ranks: Iterable[int], tables: Sequence[str] = ("records", "metrics")
) -> tuple[int, int] | None:
    """Inclusive (first, last) step captured by ``ranks`` of ``run`` over ``tables``; None when
    empty. Steps the run leaves out (``Run.excluded``: not held completely, with
    ``allow_incomplete``) are not in it: the range is what a comparison reads, per rank."""
    wanted = set(ranks)
    excluded = getattr(run, "excluded", {})
    cut = {r for r in wanted if r in excluded}
    if not cut:
        return _raw_range(run, wanted, tables)
    # The ranks with steps left out one by one (their shards' range less those steps at either
    # end: one pass over the shards, by rank), the others together.
    per: dict[int, list[ShardInfo]] = {r: [] for r in cut}
    for table in tables:
        for s in getattr(run, "shards", {}).get(table, ()):
            if s.rank in per:
                per[s.rank].append(s)
    spans = [_trimmed(_raw_range(run, [r], tables, per[r]), excluded[r]) for r in sorted(cut)]
    spans.append(_raw_range(run, wanted - cut, tables) if wanted - cut else None)
    held = [s for s in spans if s is not None]
    return (min(a for a, _ in held), max(b for _, b in held)) if held else None


def _trimmed(span: tuple[int, int] | None, ranges: Sequence[tuple[int, int | None]]) -> tuple[int, int] | None:
    """``span`` less the excluded ``ranges`` (inclusive; None: open-ended) at both ends; None when
    nothing is left. A range inside the span leaves the ends as they are (its steps are read as
    absent, and named in the notes)."""
    if span is None:
        return None
    lo, hi = span
    moved = True
    while moved and lo <= hi:
        moved = False
        for a, b in ranges:
            end = hi if b is None else b
            if a <= lo <= end:
                lo, moved = end + 1, True
            if a <= hi <= end:
                hi, moved = a - 1, True
    return (lo, hi) if lo <= hi else None


def _raw_range(
    run: Run, wanted: Iterable[int], tables: Sequence[str], mine: Sequence[ShardInfo] | None = None
) -> tuple[int, int] | None:
    """The step range of ``wanted``'s shards (footers; a scan where they lack statistics);
    ``mine``: those shards of ``tables`` already picked out."""
    wanted = set(wanted)
    lo: int | None = None
    hi: int | None = None
    every = wanted.issuperset(getattr(run, "ranks", ()))
    for table in tables:
        if mine is not None:
            shards = [s for s in mine if s.table == table]
        else:
            shards = getattr(run, "shards", {}).get(table, ())
            if not every:
                shards = [s for s in shards if s.rank in wanted]
        # Whole columns of the shards' step ranges (hundreds of thousands of shards at seed scale).
        firsts, lasts = list(map(_step_min, shards)), list(map(_step_max, shards))
        if None in firsts or None in lasts:
            got = (
                run.scan(table, ranks=sorted(wanted))
                .select(pl.col("step").min().alias("lo"), pl.col("step").max().alias("hi"))
                .collect()
            )
            pairs = [(got["lo"][0], got["hi"][0])]
        else:
            pairs = [(min(firsts), max(lasts))] if shards else []
        for a, b in pairs:
            if a is None or b is None:
                continue
            lo = a if lo is None else min(lo, a)
            hi = b if hi is None else max(hi, b)
    return None if lo is None or hi is None else (int(lo), int(hi))


def plan_window(
    range_a: tuple[int, int] | None, range_b: tuple[int, int] | None, user: tuple[int, int] | None
) -> tuple[tuple[int, int] | None, ResumeInfo]:
    """The inclusive step window to compare and the resume facts (boundary counts left at 0)."""
    start_a = range_a[0] if range_a else None
    start_b = range_b[0] if range_b else None
    if range_a is None or range_b is None:
        return None, ResumeInfo(False, start_a, start_b, None, note="a run has no captured step")
    lo, hi = max(range_a[0], range_b[0]), min(range_a[1], range_b[1])
    if user is not None:
        lo, hi = max(lo, user[0]), min(hi, user[1])
    resumed = start_a != start_b
    window = (lo, hi) if lo <= hi else None
    first_common = max(range_a[0], range_b[0]) if max(range_a[0], range_b[0]) <= min(range_a[1], range_b[1]) else None
    note = ""
    if resumed:
        later = "B" if start_b > start_a else "A"  # type: ignore[operator]
        note = (
            f"run {later} starts at step {max(start_a, start_b)} (resumed): only steps "  # type: ignore[type-var]
            f"{first_common}..{min(range_a[1], range_b[1])} are compared, boundary state first"
        )
    elif range_a[1] != range_b[1]:
        note = f"the runs end at different steps ({range_a[1]} vs {range_b[1]}): only common steps are compared"
    return window, ResumeInfo(resumed, start_a, start_b, first_common, note=note)


def boundary_steps(
    manifests_a: Mapping[int, Sequence[Mapping]], manifests_b: Mapping[int, Sequence[Mapping]], info: ResumeInfo
) -> tuple[int, ...]:
    """Steps whose boundary-state records the walk compares first (sorted)."""
    steps = set()
    if info.resumed and info.first_common_step is not None:
        steps.add(info.first_common_step)
    for manifests in (manifests_a, manifests_b):
        for segs in manifests.values():
            for m in segs:
                if m.get("segment", 0) > 0 and m.get("start_step") is not None:
                    steps.add(int(m["start_step"]))
    return tuple(sorted(steps))


#: The records columns ``boundary_counts`` reads.
BOUNDARY_COLUMNS = ("rank", "step", "kind", "key_hash", "role", "status", "digest_hi", "digest_lo", "args_digest")


def boundary_counts(records_a: pl.LazyFrame, records_b: pl.LazyFrame, step: int) -> tuple[int, int]:
    """(compared, differing) restored-state records at ``step``, matched by (rank, key_hash) with
    ``rule.MATCH``: a pair without evidence (``unknown``: skipped, a digest error) is not counted,
    a divergent one (``differs``, or a record on one side only) counts as differing.

    Restored state is what a resume must bring back: ``rng_state`` records and ``param`` /
    ``optimizer_state`` records with role ``input`` (as the optimizer received them)."""
    cols = ["rank", "key_hash", "role", "status", "digest_hi", "digest_lo", "args_digest"]

    # Only records that hold the restored state itself: RNG states at step start, and parameters
    # (and optimizer state, where captured) as the optimizer received them, before its update.
    # Post-update parameters and state already carry the step's own computation, so counting them
    # would blame the restore for any difference that the step introduced.
    restored = (pl.col("kind") == "rng_state") | (
        pl.col("kind").is_in(["param", "optimizer_state"]) & (pl.col("role") == "input")
    )

    def side(lf: pl.LazyFrame) -> pl.LazyFrame:
        return lf.filter((pl.col("step") == step) & restored).select(cols)

    j = side(records_a).join(side(records_b), on=["rank", "key_hash"], how="full", coalesce=True, suffix="_b")
    j = j.with_columns(pl.coalesce("role", "role_b").alias("role")).with_columns(_MATCH.alias("match"))
    j = j.filter(pl.col("match") != rule.UNKNOWN)
    got = j.select(pl.len().alias("n"), pl.col("match").is_in(rule.DIVERGENT).sum().alias("d")).collect()
    return int(got["n"][0]), int(got["d"][0] or 0)
