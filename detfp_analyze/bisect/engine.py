"""Where bisect's heavy stages run: the one engine seam of ``pipeline.bisect``.

An engine binds a pair of opened runs to its ``Stages``: the reads that grow with the trace
(each rank's first metric split; the per-(rank, step) rollups of both runs joined into candidate
steps, or the stored rollups' blocks when both runs wrote them; the group-wide test of a
collective's inputs on its peers), a ``prefetch`` of the rank-steps the walk is about to read,
and the two run objects (``a``, ``b``) the walk, verdicts and evidence read their small
per-rank slices from. ``LocalStages`` runs them here with polars (the default);
``detfp_analyze.spark`` runs them on Apache Spark. Everything else (scope, walk, verdicts,
diagnosis, report) is the same code for every engine, so a report does not depend on the
engine that produced it. ``LocalStages``' runs are ``held.HeldRun``s: its ``prefetch`` holds the
walk's first rank-steps in memory when they are few records in all (``reads.HOLD_ROWS``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, ClassVar, Protocol

import polars as pl

from detfp_analyze.bisect import blocks as _blocks
from detfp_analyze.bisect import evidence as _evidence
from detfp_analyze.bisect import held as _held
from detfp_analyze.bisect import narrow as _narrow
from detfp_analyze.bisect.blocks import Slice
from detfp_analyze.bisect.reads import HOLD_ROWS, ROLLUP_BATCH, chunks, collect_pair, densest, scan
from detfp_analyze.bisect.records import CallKey
from detfp_analyze.bisect.walk import Progress
from detfp_analyze.io import binding as _binding
from detfp_analyze.io.reader import Run

__all__ = ["Asks", "Engine", "LocalStages", "Stages", "local"]

#: (peer, step, call_hash, group peers) asks of the group-wide collective test.
Asks = Sequence[tuple[int, int, int, tuple[int, ...]]]


class Stages(Protocol):
    """The heavy stages of one bisect over runs ``a`` and ``b``."""

    # Read-only members (properties), so a frozen dataclass or a class attribute provides them.

    @property
    def a(self) -> Any:
        """What the walk, verdicts and evidence read run A through: ``scan(table, ranks, steps)``
        and every other attribute of an opened ``Run``, with ``scan_spans``."""
        ...

    @property
    def b(self) -> Any:
        """The same for run B."""
        ...

    @property
    def walk_batch(self) -> int | None:
        """Rank-steps per walk batch; None: the walk's own (``reads.walk_batch``, its memory bound)."""
        ...

    def metric_divergence(self, ranks: Sequence[int], lo: int, hi: int) -> pl.DataFrame:
        """``narrow.metric_divergence`` of the two runs' metrics over ``ranks`` and steps [lo, hi]."""
        ...

    def block_rollups(self, ranks: Sequence[int], lo: int, hi: int) -> tuple[pl.DataFrame, pl.DataFrame]:
        """Both runs' ``blocks.block_rollup`` rows over ``ranks`` and [lo, hi] (both stored rollups)."""
        ...

    def rollup_candidates(
        self, ranks: Sequence[int], lo: int, hi: int, progress: Progress | None, stage: str, errors: list[int]
    ) -> dict[int, list[int]]:
        """From the records: rank -> sorted steps in [lo, hi] whose ``narrow.step_rollup`` differ
        (``narrow.divergent_steps``); adds the [A, B] counts of digest errors to ``errors``."""
        ...

    def prefetch(self, cands: Mapping[int, Sequence[int]], slices: Mapping[tuple[int, int], Slice] | None) -> None:
        """The walk is about to read these rank-steps (rank -> steps) of both runs' records, the
        ones in ``slices`` (``blocks.slices``) only in part, the first pass on ``walk.FIRST_PASS_COLUMNS``."""
        ...

    def holds(self, cands: Mapping[int, Sequence[int]]) -> bool:
        """Whether ``prefetch`` of these candidates (rank -> steps) holds each rank's first step
        whole in memory: the walk then reads it without the stored rollups' slices."""
        ...

    def peer_inputs(self, asks: Asks) -> dict[CallKey, str]:
        """``evidence.peer_inputs``: whether a collective's inputs differ on each peer."""
        ...


#: An engine: opened runs A and B -> their stages.
Engine = Callable[[Run, Run], Stages]


@dataclass(frozen=True)
class LocalStages:
    """The stages with polars on this machine, reading the runs' shards directly."""

    #: Run A and run B: opened runs, held as ``held.HeldRun``s (a ``Run`` given is wrapped).
    a: Any
    b: Any
    #: The walk reads its batches from the shards as it goes: its own batch size.
    walk_batch: ClassVar[int | None] = None

    def __post_init__(self) -> None:
        for side in ("a", "b"):
            run = getattr(self, side)
            if not isinstance(run, _held.HeldRun):
                object.__setattr__(self, side, _held.HeldRun(run))

    def metric_divergence(self, ranks: Sequence[int], lo: int, hi: int) -> pl.DataFrame:
        return _narrow.metric_divergence(scan(self.a, "metrics", ranks, lo, hi), scan(self.b, "metrics", ranks, lo, hi))

    def block_rollups(self, ranks: Sequence[int], lo: int, hi: int) -> tuple[pl.DataFrame, pl.DataFrame]:
        return collect_pair(
            _blocks.block_rollup(scan(self.a, "rollups", ranks, lo, hi)),
            _blocks.block_rollup(scan(self.b, "rollups", ranks, lo, hi)),
        )

    def rollup_candidates(
        self, ranks: Sequence[int], lo: int, hi: int, progress: Progress | None, stage: str, errors: list[int]
    ) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        # Ranks in batches, streaming: memory is bounded by a batch's (rank, step) groups.
        batches = chunks(ranks, ROLLUP_BATCH)
        for i, batch in enumerate(batches):
            ra, rb = collect_pair(
                _narrow.step_rollup(scan(self.a, "records", batch, lo, hi)),
                _narrow.step_rollup(scan(self.b, "records", batch, lo, hi)),
            )
            # The step rollups are the commit lines' step folds (io.binding): what was read
            # must be what was committed.
            _binding.check_steps(self.a, "records", ra, _binding.Span(batch, lo, hi))
            _binding.check_steps(self.b, "records", rb, _binding.Span(batch, lo, hi))
            _narrow.add_candidates(ra, rb, out, errors)
            if progress:
                progress(stage, i + 1, len(batches))
        return out

    @cached_property
    def _densest(self) -> int:
        """The densest rank-step of either run (``reads.densest``: a pass over every shard, once)."""
        return densest(self.a.run, self.b.run)

    def holds(self, cands: Mapping[int, Sequence[int]]) -> bool:
        # Within the budget at the densest rank-step of either run (the shards' rows per step).
        n = sum(1 for steps in cands.values() if steps)
        return n > 0 and n * self._densest <= HOLD_ROWS

    def prefetch(self, cands: Mapping[int, Sequence[int]], slices: Mapping[tuple[int, int], Slice] | None) -> None:
        # Each rank's first candidate step, read once for every stage when they fit (the first
        # pass, the enrich read, the peers' inputs); else the walk reads as it goes.
        if self.holds(cands):
            _held.hold(self.a, self.b, {r: steps[0] for r, steps in cands.items() if steps})

    def peer_inputs(self, asks: Asks) -> dict[CallKey, str]:
        return _evidence.peer_inputs(self.a, self.b, asks)


def local(run_a: Run, run_b: Run) -> LocalStages:
    """The default engine: polars and the local (or mounted) file system."""
    return LocalStages(run_a, run_b)
