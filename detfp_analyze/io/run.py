"""An opened run: ``Run``, what ``reader.open_run`` validated, and its lazy scans (no torch).

``Run.scan`` returns a polars LazyFrame over the chosen shards: rank selection prunes
files, step selection prunes files by their footer step range and pushes the predicate
down to row groups, rows of a (rank, step) that a later segment (a resume appended to the
same directory) captured again are dropped, and so are rows of steps the run does not
hold completely (only when opened with ``allow_incomplete``; otherwise such a run is
refused). A committed shard's footer is checked against its commit line before the first
read that selects it (``committed_footers``). ``RunView`` is an opened run as an engine serves
its reads.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from types import MappingProxyType
from typing import Any

import polars as pl

from detfp_analyze.errors import MissingRankError
from detfp_analyze.io import completeness as _completeness
from detfp_analyze.io import stepsums as _stepsums
from detfp_analyze.io.committed_footers import FooterChecks
from detfp_analyze.io.shard_info import ShardInfo
from detfp_analyze.io.store import Location, Store
from detfp_analyze.ranks import rank_list
from detfp_format import contract
from detfp_format.types import polars_type

__all__ = ["Run", "RunView", "Steps", "polars_schema"]

#: A step selection: one step, a ``range`` (``range(3, 7)`` is steps 3..6), or any collection of steps.
Steps = int | range | Iterable[int]


def polars_schema(table: str) -> pl.Schema:
    """The polars schema of a contract table (column order as in the contract)."""
    return pl.Schema({c.name: polars_type(c.type) for c in contract.columns(table)})


# eq=False: identity equality and hashing, so a Run can key caches (its mappings are unhashable).
@dataclass(frozen=True, eq=False)
class Run:
    """A validated run directory. Build it with ``reader.open_run``; all data access is lazy."""

    #: Resolved path of the run directory; for a run on another file system, its URI (as given).
    path: Location
    #: The path as the user gave it: used in messages and reports so they are byte-stable.
    label: str
    #: Number of ranks of the job (equal in every manifest).
    world_size: int
    #: Ranks that have a manifest, sorted.
    ranks: tuple[int, ...]
    #: Ranks of 0..world_size-1 without a manifest (non-empty only with allow_missing_ranks=True).
    missing_ranks: tuple[int, ...]
    #: rank -> its manifests sorted by segment.
    manifests: Mapping[int, tuple[dict, ...]]
    #: Tables with at least one shard.
    tables: frozenset[str]
    #: table -> its shards, sorted by (rank, file name); only ranks with a manifest, and none the
    #: completeness check dropped (never committed, or not what their window committed).
    shards: Mapping[str, tuple[ShardInfo, ...]] = field(repr=False)
    #: What the commit logs say against what is on disk (gaps, per-segment status).
    completeness: _completeness.Completeness | None = field(default=None, repr=False)
    #: rank -> inclusive step ranges (last None: open-ended) whose rows ``scan`` leaves out: steps
    #: this run (or, after ``held_steps.restrict_pair``, the run it is compared with) does not
    #: hold completely. Empty unless opened with ``allow_incomplete``.
    excluded: Mapping[int, _completeness.StepRanges] = field(default_factory=lambda: MappingProxyType({}), repr=False)
    #: The file system the run is read from (``detfp_analyze.io.store``); None: the local one.
    store: Store | None = field(default=None, repr=False)
    #: Footers of shards taken from their commit lines, checked on first read (``committed_footers``).
    footer_checks: FooterChecks = field(default_factory=FooterChecks, repr=False)
    #: The step folds its commit lines state, per (rank, segment, step) (``stepsums.Folds``).
    step_sums: _stepsums.Folds = field(default_factory=lambda: _stepsums.from_logs({}, {}), repr=False)
    #: The manifests and commit logs were taken from a verified run index (``io.runindex``, the reader's cache).
    indexed: bool = field(default=False, repr=False)

    def __repr__(self) -> str:
        # Short on purpose: the manifests of thousands of ranks are one attribute away.
        missing = f", missing ranks {rank_list(self.missing_ranks)}" if self.missing_ranks else ""
        return (
            f"Run({self.label!r}: world size {self.world_size}, ranks {rank_list(self.ranks)}{missing}, "
            f"tables {', '.join(sorted(self.tables)) or '-'})"
        )

    def manifest(self, rank: int | None = None) -> dict:
        """The latest segment's manifest of ``rank`` (default: the lowest rank present)."""
        r = self.ranks[0] if rank is None else rank
        if r not in self.manifests:
            raise MissingRankError(
                f"{self.label}: rank {r} is not in this run (ranks present: {rank_list(self.ranks)}); pick one of those"
            )
        return self.manifests[r][-1]

    def segments(self, rank: int) -> tuple[int, ...]:
        """Segments (process launches) of ``rank``, sorted."""
        return tuple(m["segment"] for m in self.manifests.get(rank, ()))

    def files(self, table: str, ranks: Iterable[int] | None = None, steps: Steps | None = None) -> list[Location]:
        """Every shard path of ``table`` for ``ranks`` (default all), sorted by rank then file name:
        ``Path``s of a local run, URIs (``s3a://b/run/records/rank=0/...``) of a remote one.
        ``steps``: only the shards whose flush window holds one of them (as ``scan`` prunes; the
        rows of other steps in those files are still there).

        Raw files: rows superseded by a later segment are still in them (see ``supersession``).
        """
        contract.columns(table)  # KeyError naming the known tables
        wanted = _rank_set(ranks)
        shards = tuple(s for s in self.shards.get(table, ()) if wanted is None or s.rank in wanted)
        if steps is not None:
            shards = _in_steps(shards, steps)
        self.footer_checks.verify(shards)
        return [s.path for s in shards]

    def supersession(self) -> tuple[tuple[int, int, int], ...]:
        """(rank, segment, first_step) triples: rows of that rank and segment with step >= first_step
        were captured again by a later segment (a resume appended to the run) and are ignored by ``scan``.

        For readers that bypass ``scan`` (SQL over ``files``). Sorted; empty for single-segment runs.
        """
        return tuple(sorted((r, s, c) for (r, s), c in self._cutoffs.items()))

    def exclusions(self) -> tuple[tuple[int, int, int | None], ...]:
        """(rank, first_step, last_step) triples (last None: open-ended) whose rows ``scan`` leaves
        out because they are not held completely; for readers that bypass ``scan``. Sorted."""
        return tuple((r, lo, hi) for r, ranges in sorted(self.excluded.items()) for lo, hi in ranges)

    def scan(
        self,
        table: str,
        ranks: Iterable[int] | None = None,
        steps: Steps | None = None,
        columns: Sequence[str] | None = None,
    ) -> pl.LazyFrame:
        """Lazy frame of ``table`` with exactly the contract's columns and types.

        ``ranks`` selects partitions (files); ``steps`` prunes files by their step range
        and filters rows (pushed down to row groups). Rows come in file order: by rank,
        then segment and flush window, then write order (``seq`` increasing within a
        (rank, segment)). Rows of a (rank, step) captured again by a later segment are
        dropped. An absent table gives an empty frame of the same schema. ``columns``: only
        these (in this order); the reader pushes the projection down anyway, but an engine that
        fetches rows from elsewhere (``detfp_analyze.spark``) then fetches only these.
        """
        lf = self._scan(table, ranks, steps)
        return lf if columns is None else lf.select(list(columns))

    def scan_spans(
        self, table: str, spans: Mapping[tuple[int, int], tuple[int, int]], columns: Sequence[str] | None = None
    ) -> pl.LazyFrame:
        """``scan`` of each (rank, step) of ``spans`` only within its inclusive ``seq`` span, in
        (rank, step) order (one scan per step, bounded by its spans' seq range, so the row groups'
        seq statistics skip the rest of each file). No spans: an empty frame."""
        # One scan per step, of the ranks with a span there (shards by rank, then file: the rows
        # come by rank, in file order). Its seq bounds prune row groups as one scan per span did;
        # a join on the ranks' own bounds then keeps exactly each span (a scan per span costs a
        # plan and a file list each, which a walk batch paid for every rank).
        by_step: dict[int, dict[int, tuple[int, int]]] = {}
        for (r, s), span in spans.items():
            by_step.setdefault(s, {})[r] = span
        parts = []
        for s, mine in sorted(by_step.items()):
            lo, hi = min(v[0] for v in mine.values()), max(v[1] for v in mine.values())
            lf = self._scan(table, sorted(mine), [s]).filter(pl.col("seq").is_between(lo, hi))
            if any(v != (lo, hi) for v in mine.values()):
                bounds = pl.LazyFrame(
                    [(r, a, b) for r, (a, b) in mine.items()],
                    schema={"rank": pl.Int32, "_lo": pl.Int64, "_hi": pl.Int64},
                    orient="row",
                )
                lf = (
                    lf.join(bounds, on="rank", how="inner", maintain_order="left")
                    .filter(pl.col("seq").is_between(pl.col("_lo"), pl.col("_hi")))
                    .drop("_lo", "_hi")
                )
            parts.append(lf)
        if not parts:
            lf = pl.LazyFrame(schema=polars_schema(table))
        elif len(parts) == 1:
            lf = parts[0]
        else:  # (rank, step) order, each in file order
            lf = pl.concat(parts).sort("rank", "step", maintain_order=True)
        return lf if columns is None else lf.select(list(columns))

    def _scan(self, table: str, ranks: Iterable[int] | None, steps: Steps | None) -> pl.LazyFrame:
        schema = polars_schema(table)
        shards = self._select(table, ranks, steps)
        self.footer_checks.verify(shards)
        if not shards:
            return pl.LazyFrame(schema=schema)
        if self.store is None or self.store.local:
            lf = pl.scan_parquet(
                [str(s.path) for s in shards],
                schema=schema,
                hive_partitioning=False,
                glob=False,
                extra_columns="ignore",
            ).select(list(schema))
        else:
            # Through pyarrow's file system: polars pushes the projection and the predicates below
            # into the dataset scan (columns and row groups pruned at the source, as scan_parquet does).
            from detfp_format.arrowschema import arrow_schema  # pyarrow: remote runs only

            dataset = self.store.dataset(arrow_schema(table), [str(s.path) for s in shards])
            lf = pl.scan_pyarrow_dataset(dataset).select(list(schema)).cast(schema)
        if steps is not None:
            lf = lf.filter(_step_predicate(steps))
        dropped = self._superseded({s.rank for s in shards})
        if dropped is not None:
            lf = lf.filter(~dropped)
        excluded = self._excluded_expr({s.rank for s in shards})
        if excluded is not None:
            lf = lf.filter(~excluded)
        return lf

    # -------------------------------------------------------------- internals
    def _select(self, table: str, ranks: Iterable[int] | None, steps: Steps | None) -> list[ShardInfo]:
        contract.columns(table)  # KeyError naming the known tables
        shards = self.shards.get(table, ())
        wanted = _rank_set(ranks)
        if wanted is not None:
            # The walk selects a few ranks at a time among a run's hundreds of thousands of
            # shards: their positions by rank, kept in the run's order (positions sorted).
            at = self._positions.get(table, {})
            shards = tuple(shards[i] for i in sorted(i for r in wanted for i in at.get(r, ())))
        if steps is not None:
            shards = _in_steps(shards, steps)
        cutoffs = self._cutoffs
        # A shard entirely past the start of a later segment holds only superseded rows.
        return [s for s in shards if s.step_min is None or s.step_min < cutoffs.get((s.rank, s.segment), _INF)]

    @cached_property
    def _positions(self) -> dict[str, dict[int, list[int]]]:
        """table -> rank -> positions of its shards in ``shards[table]`` (once per Run)."""
        out: dict[str, dict[int, list[int]]] = {}
        for table, shards in self.shards.items():
            at: dict[int, list[int]] = out.setdefault(table, {})
            for i, s in enumerate(shards):
                at.setdefault(s.rank, []).append(i)
        return out

    @cached_property
    def _cutoffs(self) -> dict[tuple[int, int], int]:
        """(rank, segment) -> first step a later segment of that rank captured again. Once per
        Run (its manifests never change), not twice per scan: the walk scans per rank."""
        return _completeness.cutoffs(self.manifests)

    def _excluded_expr(self, ranks: set[int]) -> pl.Expr | None:
        """Predicate true on rows of steps not held completely (None when nothing is excluded)."""
        expr: pl.Expr | None = None
        for rank, ranges in self.excluded.items():
            if rank not in ranks:
                continue
            for lo, hi in ranges:
                term = pl.col("step") >= lo if hi is None else pl.col("step").is_between(lo, hi)
                term = (pl.col("rank") == rank) & term
                expr = term if expr is None else expr | term
        return expr

    def _superseded(self, ranks: set[int]) -> pl.Expr | None:
        """Predicate true on rows superseded by a later segment (None when nothing is)."""
        by_pair: dict[tuple[int, int], list[int]] = {}
        for (rank, segment), cutoff in self._cutoffs.items():
            if rank in ranks:
                by_pair.setdefault((segment, cutoff), []).append(rank)
        if not by_pair:
            return None
        expr: pl.Expr | None = None
        for (segment, cutoff), pair_ranks in sorted(by_pair.items()):
            term = (pl.col("segment") == segment) & (pl.col("step") >= cutoff)
            # Resumes usually happen on every rank at the same step: one term covers them all.
            if set(pair_ranks) != ranks:
                term = term & pl.col("rank").is_in(sorted(pair_ranks))
            expr = term if expr is None else expr | term
        return expr


_INF = float("inf")


def _rank_set(ranks: Iterable[int] | int | None) -> set[int] | None:
    """The ranks a ``files``/``scan`` selection names (one rank or several); None: all."""
    return None if ranks is None else {int(r) for r in ([ranks] if isinstance(ranks, int) else ranks)}


def _step_bounds(steps: Steps) -> tuple[float, float]:
    if isinstance(steps, int):
        return steps, steps
    if isinstance(steps, range):
        return (steps.start, steps.stop - 1) if steps.step == 1 else (min(steps, default=0), max(steps, default=-1))
    values = [int(s) for s in steps]
    return (min(values), max(values)) if values else (0, -1)


def _in_steps(shards: Sequence[ShardInfo], steps: Steps) -> tuple[ShardInfo, ...]:
    """The shards whose window's step range meets ``steps``' bounds (a shard without one: kept)."""
    lo, hi = _step_bounds(steps)
    return tuple(
        s for s in shards if s.step_min is None or s.step_max is None or (s.step_max >= lo and s.step_min <= hi)
    )


def _step_predicate(steps: Steps) -> pl.Expr:
    if isinstance(steps, int):
        return pl.col("step") == steps
    if isinstance(steps, range) and steps.step == 1:
        return pl.col("step").is_between(steps.start, steps.stop - 1)
    return pl.col("step").is_in(sorted({int(s) for s in steps}))


class RunView:
    """An opened run as an engine serves its reads (``bisect.held.HeldRun``,
    ``spark.runs.SparkRun``): the subclass answers ``scan`` and ``scan_spans`` its own way, every
    other attribute is the run's."""

    def __init__(self, run: Run) -> None:
        self._run = run

    def __getattr__(self, name: str) -> Any:
        return getattr(self._run, name)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._run!r})"

    @property
    def run(self) -> Run:
        """The opened run itself."""
        return self._run
