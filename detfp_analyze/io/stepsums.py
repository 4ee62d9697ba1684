"""Per (rank, step) folds of the records' rollups and the metrics, from the commit logs alone.

A launch written with ``commitlog.STEP_SUMS_VERSION`` (manifest key ``step_sums``) commits, with
each flush window, per step: its records' rollup (count, digest errors, key XOR, value XOR:
the fold of that window's rollups rows) and its metrics (count, sum of ``commitlog.metric_hash``
mod 2^64). The folds combine across windows and launches, so the bisect tells which (rank, step)s
differ between two runs from the commit logs ``open_run`` has already read, and reads the
rollups and metrics shards of those (rank, step)s only: an identical pair reads neither, and a
diverged rank's metrics are read at its first differing step only.

``from_logs`` keeps, at open, each (rank, segment)'s folds (None for a launch without them or with
a committed window whose line lacks them); ``pair`` answers for two runs only when both hold
them for every launch of the compared ranks, with nothing excluded and no completeness gap;
anything else is None and the bisect reads the shards as for older runs (same answer, slower).
Whether the bisect uses them at all is its caller's choice (``bisect.reads.ReadPaths``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from detfp_format import commitlog

__all__ = ["Sums", "from_logs", "held", "metric_reads", "mismatches", "pair", "record_reads", "shard_folds"]

#: (rank, step) -> commitlog.SUM_FIELDS values folded over the step's windows and launches.
Sums = dict[tuple[int, int], tuple[int, ...]]
_U64 = 1 << 64


def from_logs(
    manifests: Mapping[int, Sequence[Mapping[str, Any]]], logs: Mapping[tuple[int, int], Any]
) -> dict[tuple[int, int], dict[int, tuple[int, ...]] | None]:
    """(rank, segment) -> step -> folds over the segment's committed windows, or None when the
    launch did not write them (older writer) or a committed window's line lacks them."""
    out: dict[tuple[int, int], dict[int, tuple[int, ...]] | None] = {}
    for rank, ms in manifests.items():
        for m in ms:
            seg = m["segment"]
            log = logs.get((rank, seg))
            usable = (
                m.get("step_sums") == commitlog.STEP_SUMS_VERSION
                and isinstance(log, commitlog.LogState)
                and set(log.sums) == set(log.windows)
            )
            out[(rank, seg)] = _fold((log.sums[w] for w in sorted(log.sums)), {}) if usable else None
    return out


def _fold(parts: Any, into: dict[Any, tuple[int, ...]]) -> dict:
    """Fold step -> SUM_FIELDS mappings into ``into`` (by step)."""
    for part in parts:
        for step, v in part.items():
            _add(into, step, v)
    return into


def _add(into: dict[Any, tuple[int, ...]], k: Any, v: tuple[int, ...]) -> None:
    held = into.get(k)
    if held is None:
        into[k] = v
    else:
        n, e, kx, vx, mn, mh = v
        into[k] = (held[0] + n, held[1] + e, held[2] ^ kx, held[3] ^ vx, held[4] + mn, (held[5] + mh) % _U64)


def _folded(run: Any, ranks: Sequence[int], lo: int | None = None, hi: int | None = None) -> Sums | None:
    """(rank, step) -> folds of ``ranks`` over steps ``lo``..``hi`` (None: all), each launch's steps
    superseded by a later launch left out (as ``Run.scan`` leaves their rows out); None when a
    launch of those ranks holds no folds."""
    cut = {(r, s): c for r, s, c in run.supersession()}
    out: Sums = {}
    for r in ranks:
        for m in run.manifests.get(r, ()):
            part = run.step_sums.get((r, m["segment"]))
            if part is None:
                return None
            stop = cut.get((r, m["segment"]))
            for step, v in part.items():
                if (stop is None or step < stop) and (lo is None or lo <= step) and (hi is None or step <= hi):
                    _add(out, (r, step), v)
    return out


def _of(run: Any, ranks: Sequence[int], lo: int, hi: int) -> Sums | None:
    comp = run.completeness
    if comp is None or comp.gaps or run.excluded:
        return None
    return _folded(run, ranks, lo, hi)


def pair(run_a: Any, run_b: Any, ranks: Sequence[int], lo: int, hi: int) -> tuple[Sums, Sums] | None:
    """Both runs' folds of ``ranks`` over steps ``lo``..``hi``, or None when either run lacks
    them anywhere there (then the shards are read)."""
    a = _of(run_a, ranks, lo, hi)
    b = _of(run_b, ranks, lo, hi) if a is not None else None
    return None if a is None or b is None else (a, b)


def _differ(a: Sums, b: Sums, fields: slice) -> list[tuple[int, int]]:
    """(rank, step)s whose ``fields`` differ (a step on one side only: against zeros), sorted."""
    zero = (0,) * len(commitlog.SUM_FIELDS)
    return sorted(k for k in a.keys() | b.keys() if a.get(k, zero)[fields] != b.get(k, zero)[fields])


def _reads(pairs: list[tuple[int, int]]) -> tuple[list[int], int, int] | None:
    """The ranks of ``pairs`` and the step range covering them: what a read of those needs."""
    if not pairs:
        return None
    steps = [s for _, s in pairs]
    return sorted({r for r, _ in pairs}), min(steps), max(steps)


def record_reads(
    a: Sums, b: Sums, ranks: Sequence[int] | None = None, lo: int | None = None, hi: int | None = None
) -> tuple[list[int], int, int] | None:
    """(ranks, first step, last step) of the (rank, step)s whose records' rollup differs, among
    ``ranks`` and steps ``lo``..``hi`` when given: the only rollups read (the candidate steps are
    among them); None when none differs."""
    want = None if ranks is None else set(ranks)
    pairs = [
        (r, s)
        for r, s in _differ(a, b, slice(0, 4))
        if (want is None or r in want) and (lo is None or s >= lo) and (hi is None or s <= hi)
    ]
    return _reads(pairs)


def metric_reads(a: Sums, b: Sums) -> tuple[list[int], int, int] | None:
    """(ranks, first step, last step) covering each rank's first step whose metrics differ: the
    only metrics read (a rank's first split is its first such step, the folds of the steps before
    it being equal); None when none differs."""
    firsts: dict[int, int] = {}
    for r, s in _differ(a, b, slice(4, 6)):  # sorted: a rank's first pair is its first step
        firsts.setdefault(r, s)
    return _reads(sorted(firsts.items()))


def held(run: Any) -> tuple[list[int], Sums]:
    """The ranks whose every launch holds step folds and has no completeness gap, and their
    folds over every step (superseded steps left out)."""
    gaps = {g.rank for g in run.completeness.gaps} if run.completeness is not None else set()
    ranks = [
        r
        for r in run.ranks
        if r not in gaps and all(run.step_sums.get((r, m["segment"])) is not None for m in run.manifests[r])
    ]
    return ranks, _folded(run, ranks) or {}


def shard_folds(run: Any, ranks: Sequence[int]) -> Sums:
    """The same folds computed from the rollups and metrics shards of ``ranks`` (what ``held``
    must equal): one pass over the rollups table, and one hash per metric row."""
    import polars as pl

    out: dict[tuple[int, int], list[int]] = {}
    roll = (
        run.scan("rollups", ranks=ranks)
        .group_by("rank", "step")
        .agg(pl.col("n").sum(), pl.col("n_err").sum(), pl.col("kx").bitwise_xor(), pl.col("vx").bitwise_xor())
        .collect()
    )
    for r, s, n, e, kx, vx in roll.select("rank", "step", "n", "n_err", "kx", "vx").iter_rows():
        out[(r, s)] = [n, e, kx, vx, 0, 0]
    met = run.scan("metrics", ranks=ranks, columns=("rank", "step", "microbatch", "name", "occurrence", "bits"))
    for r, s, mb, name, occ, bits in met.collect().iter_rows():
        acc = out.setdefault((r, s), [0] * len(commitlog.SUM_FIELDS))
        acc[4] += 1
        acc[5] = (acc[5] + commitlog.metric_hash(mb, name, occ, bits)) % _U64
    return {k: tuple(v) for k, v in out.items()}


def mismatches(run: Any) -> list[tuple[int, int, str]]:
    """(rank, step, table) wherever a rank's committed folds differ from its shards' (``held``
    against ``shard_folds``), sorted: shards rewritten after their commit, or a faulty writer.
    The bisect trusts the folds; ``certify`` checks them with this."""
    ranks, committed = held(run)
    if not ranks:
        return []
    shards = shard_folds(run, ranks)
    zero = (0,) * len(commitlog.SUM_FIELDS)
    out = []
    for key in sorted(committed.keys() | shards.keys()):
        c, s = committed.get(key, zero), shards.get(key, zero)
        if c[:4] != s[:4]:
            out.append((*key, "rollups"))
        if c[4:] != s[4:]:
            out.append((*key, "metrics"))
    return out
