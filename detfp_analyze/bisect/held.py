"""``HeldRun``: an opened run whose records of the walk's first rank-steps are read once and held.

A late divergence on thousands of ranks makes the bisect read each diverged rank's step several
times over: the walk's first pass (narrow columns), the enrich read of the picked calls (their
call-site and detail columns), the same-calls test, a module output's twin, and the group-wide
test of a collective's inputs on every peer. Each read opens the rank's shard again, and at
2,432 ranks of small shards the opening, not the rows, is the cost (~0.13 ms a file). When the
first candidate step of every rank holds few records in all (``reads.HOLD_ROWS``), the local
engine reads them once, every column, both runs together (``hold``), and every later read of
exactly those rank-steps is served from memory: the same rows, columns, types and order as
``Run.scan`` / ``Run.scan_spans`` give (``tests/unit/test_held_run.py``), so the report does not
change. Any other read (another table, a rank-step not held, several steps at once) goes to
the run. Filled before the walk starts and only read after, so the walk's threads share it
without a lock.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import polars as pl

from detfp_analyze.bisect.reads import collect_pair
from detfp_analyze.io.reader import Run, RunView, polars_schema

__all__ = ["HeldRun", "hold"]

_TABLE = "records"


class HeldRun(RunView):
    """An opened ``Run`` (every attribute is the run's) whose ``scan`` and ``scan_spans`` of the
    held (rank, step)s of the records are served from memory."""

    def __init__(self, run: Run) -> None:
        super().__init__(run)
        #: step -> its held ranks' records, every column, by rank in file order (one frame a
        #: step: a read of many ranks is one filter, not a concatenation of a frame per rank).
        self._steps: dict[int, pl.DataFrame] = {}
        #: step -> the ranks held there (a rank without records at that step is held as none).
        self._ranks: dict[int, frozenset[int]] = {}

    @property
    def held(self) -> frozenset[tuple[int, int]]:
        """The (rank, step)s served from memory."""
        return frozenset((r, s) for s, rs in self._ranks.items() for r in rs)

    def _serves(self, keys: Iterable[tuple[int, int]]) -> bool:
        """Whether every one of ``keys`` is held (an empty read is the run's to answer)."""
        wanted = list(keys)
        return bool(wanted) and all(r in self._ranks.get(s, ()) for r, s in wanted)

    def _of(self, step: int, ranks: Sequence[int]) -> pl.LazyFrame:
        """The held records of ``ranks`` (sorted, all held) at ``step``, by rank in file order."""
        lf = self._steps[step].lazy()
        return lf if len(ranks) == len(self._ranks[step]) else lf.filter(pl.col("rank").is_in(list(ranks)))

    def scan(
        self,
        table: str,
        ranks: Iterable[int] | int | None = None,
        steps: Any = None,
        columns: Sequence[str] | None = None,
    ) -> pl.LazyFrame:
        """As ``Run.scan``; served from memory when it reads held rank-steps of one step."""
        step = _one_step(steps)
        if table == _TABLE and step is not None and ranks is not None:
            wanted = sorted({int(r) for r in ([ranks] if isinstance(ranks, int) else ranks)})
            if self._serves((r, step) for r in wanted):
                return _columns(self._of(step, wanted), columns)
        return self._run.scan(table, [ranks] if isinstance(ranks, int) else ranks, steps, columns)

    def scan_spans(
        self, table: str, spans: Mapping[tuple[int, int], tuple[int, int]], columns: Sequence[str] | None = None
    ) -> pl.LazyFrame:
        """As ``Run.scan_spans``; served from memory when every span's rank-step is held."""
        if table != _TABLE or not spans or not self._serves(spans):
            return self._run.scan_spans(table, spans, columns)
        by_step: dict[int, dict[int, tuple[int, int]]] = {}
        for (r, s), span in spans.items():
            by_step.setdefault(s, {})[r] = span
        parts = []
        for s, mine in sorted(by_step.items()):
            bounds = pl.LazyFrame(
                [(r, lo, hi) for r, (lo, hi) in sorted(mine.items())],
                schema={"rank": pl.Int32, "_lo": pl.Int64, "_hi": pl.Int64},
                orient="row",
            )
            parts.append(
                self._of(s, sorted(mine))
                .join(bounds, on="rank", how="inner", maintain_order="left")
                .filter(pl.col("seq").is_between(pl.col("_lo"), pl.col("_hi")))
                .drop("_lo", "_hi")
            )
        # Run.scan_spans' order: by (rank, step), each in file order.
        lf = parts[0] if len(parts) == 1 else pl.concat(parts).sort("rank", "step", maintain_order=True)
        return _columns(lf, columns)


def _one_step(steps: Any) -> int | None:
    """The step of a selection of exactly one step (an int, a one-step range or collection)."""
    if isinstance(steps, int):
        return steps
    if isinstance(steps, (range, list, tuple, set, frozenset)) and len(steps) == 1:
        return int(next(iter(steps)))
    return None


def _columns(lf: pl.LazyFrame, columns: Sequence[str] | None) -> pl.LazyFrame:
    return lf if columns is None else lf.select(list(columns))


def hold(a: HeldRun, b: HeldRun, keys: Mapping[int, int]) -> None:
    """Read the records of the (rank, step) ``keys`` (rank -> step) of both runs, every column,
    once (one scan per step, both runs' reads collected together), and hold them (steps held
    already are left as they are)."""
    by_step: dict[int, list[int]] = {}
    for r, s in keys.items():
        by_step.setdefault(int(s), []).append(int(r))
    by_step = {s: sorted(rs) for s, rs in sorted(by_step.items()) if s not in a._steps and s not in b._steps}
    if not by_step:
        return

    def read(run: HeldRun) -> pl.LazyFrame:
        parts = [run.run.scan(_TABLE, ranks=rs, steps=[s]) for s, rs in by_step.items()]
        return parts[0] if len(parts) == 1 else pl.concat(parts, how="vertical")

    got = collect_pair(read(a), read(b))
    empty = pl.DataFrame(schema=polars_schema(_TABLE))
    for run, frame in zip((a, b), got, strict=True):
        split = frame.partition_by("step", as_dict=True, maintain_order=True)
        for s, rs in by_step.items():
            run._steps[s] = split.get((s,), empty)
            run._ranks[s] = frozenset(rs)
