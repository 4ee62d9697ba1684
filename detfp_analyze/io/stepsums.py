"""Per (rank, step) folds of the records' rollups and the metrics, from the commit logs alone.

A launch written with ``commitlog.STEP_SUMS_VERSION`` (manifest key ``step_sums``) commits, with
each flush window, per step: its records' rollup (count, digest errors, key XOR, value XOR:
the fold of that window's rollups rows) and its metrics (count, sum of ``commitlog.metric_hash``
mod 2^64). The folds combine across windows and launches, so the bisect tells which (rank, step)s
differ between two runs from the commit logs ``open_run`` has already read, and reads the
rollups and metrics shards of those (rank, step)s only: an identical pair reads neither.

``from_logs`` keeps, at open, each (rank, segment)'s folds (None for a launch without them or with
a committed window whose line lacks them); ``pair`` answers for two runs only when both hold
them for every launch of the compared ranks, with nothing excluded and no completeness gap;
anything else is None and the bisect reads the shards as for older runs (same answer, slower).
``DETFP_BISECT_SUMS=0`` ignores the folds (for benchmarks and tests comparing both paths).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from detfp_capture import commitlog

__all__ = ["Sums", "from_logs", "metric_ranks", "pair", "record_ranks"]

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


def _fold(parts: Any, into: dict[Any, tuple[int, ...]], key: Any = None, keep: Any = None) -> dict:
    """Fold step -> SUM_FIELDS mappings into ``into`` (keyed ``key(step)``; ``keep(step)`` filters)."""
    for part in parts:
        for step, (n, e, kx, vx, mn, mh) in part.items():
            if keep is not None and not keep(step):
                continue
            k = step if key is None else key(step)
            held = into.get(k)
            if held is None:
                into[k] = (n, e, kx, vx, mn, mh)
            else:
                into[k] = (held[0] + n, held[1] + e, held[2] ^ kx, held[3] ^ vx, held[4] + mn, (held[5] + mh) % _U64)
    return into


def _of(run: Any, ranks: Sequence[int], lo: int, hi: int) -> Sums | None:
    comp = run.completeness
    if comp is None or comp.gaps or run.excluded:
        return None
    held = run.step_sums
    cutoffs = run.supersession()
    cut = {(r, s): c for r, s, c in cutoffs}
    out: Sums = {}
    for r in ranks:
        for m in run.manifests.get(r, ()):
            seg = m["segment"]
            part = held.get((r, seg))
            if part is None:
                return None
            stop = cut.get((r, seg))
            _fold(
                [part],
                out,
                key=lambda s, r=r: (r, s),
                keep=lambda s, stop=stop: lo <= s <= hi and (stop is None or s < stop),
            )
    return out


def pair(run_a: Any, run_b: Any, ranks: Sequence[int], lo: int, hi: int) -> tuple[Sums, Sums] | None:
    """Both runs' folds of ``ranks`` over steps ``lo``..``hi``, or None when either run lacks
    them anywhere there (then the shards are read)."""
    if os.environ.get("DETFP_BISECT_SUMS", "1") == "0":
        return None
    a = _of(run_a, ranks, lo, hi)
    b = _of(run_b, ranks, lo, hi) if a is not None else None
    return None if a is None or b is None else (a, b)


def _differ(a: Sums, b: Sums, fields: slice) -> list[int]:
    """Ranks with a step whose ``fields`` differ (a step on one side only: against zeros)."""
    zero = (0,) * len(commitlog.SUM_FIELDS)
    return sorted({r for (r, s) in a.keys() | b.keys() if a.get((r, s), zero)[fields] != b.get((r, s), zero)[fields]})


def record_ranks(a: Sums, b: Sums) -> list[int]:
    """Ranks with a step whose records' rollup differs: the only ones whose rollups are read."""
    return _differ(a, b, slice(0, 4))


def metric_ranks(a: Sums, b: Sums) -> list[int]:
    """Ranks with a step whose metrics differ: the only ones whose metrics are read."""
    return _differ(a, b, slice(4, 6))
