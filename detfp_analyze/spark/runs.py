"""``SparkRun``: an opened run whose reads of the walk's rank-steps are served from parts fetched with Spark.

The walk, verdicts and evidence read a run through ``scan`` (and ``scan_spans``); on Spark each
read is served from parts fetched ahead (``fetch``: both runs of the pair in one job, a filter
on (rank, step) or (rank, step, seq span) pushed into the Parquet scan of only those ranks'
shards, only the columns asked for, collected as Arrow into polars) or fetched when first asked
for, one job per read. The walk's first pass needs only ``walk.FIRST_PASS_COLUMNS`` of every
candidate rank-step (``SparkStages.prefetch``), and only the block slices the stored rollups
narrow it to; the call-site and detail columns come back for the few calls a verdict names
(``scan_spans``). So the driver holds the narrow columns of the walk's rank-steps, not every column.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import polars as pl
import pyarrow as pa

from detfp_analyze.io.reader import Run, RunView, polars_schema
from detfp_analyze.spark import source as _source
from detfp_analyze.spark.runtime import spark_errors

__all__ = ["SparkRun"]

_ALL = -1  # cache key step for a whole rank (a scan without a step selection)
_EXTRA = (_source.FILE_COLUMN, _source.ROW_COLUMN)


def _steps(steps: Any) -> list[int] | None:
    if steps is None:
        return None
    if isinstance(steps, int):
        return [steps]
    return sorted({int(s) for s in steps})


def _keys_predicate(
    keys: Iterable[tuple[int, int]], spans: Mapping[tuple[int, int], tuple[int, int]] | None = None
) -> str:
    """Spark SQL predicate selecting exactly the (rank, step) ``keys`` (per step, its ranks) and the
    rows of ``spans``' (rank, step)s within their inclusive seq spans."""
    by_step: dict[int, list[int]] = {}
    for r, s in keys:
        by_step.setdefault(s, []).append(r)
    terms = [f"(step = {s} AND {_source.in_list('rank', sorted(rs))})" for s, rs in sorted(by_step.items())]
    terms += [
        f"(rank = {r} AND step = {s} AND seq BETWEEN {lo} AND {hi})"
        for (r, s), (lo, hi) in sorted((spans or {}).items())
    ]
    return " OR ".join(terms) or "false"


#: A cache's columns: a tuple of column names, or None for all of the table's.
Columns = tuple[str, ...] | None


class SparkRun(RunView):
    """An opened ``Run`` whose ``scan`` serves (rank, step) parts of a table fetched from Spark.

    Every other attribute (label, manifests, ranks, tables, files, ...) is the run's. Parts come
    in cached per (table, columns) and (rank, step), for both runs of the pair at once (its
    ``twin``: the walk and the evidence read both runs with the same selection), one Spark job
    per fetch, and ``scan`` returns them as ``Run.scan`` does: the contract's columns and types
    (or the ``columns`` asked for), rows by rank, then file, then row. A scan is served by any
    cached part of its table holding the columns it asks for; ``scan_spans`` (a few calls'
    records, read in full) is one job for this run, not cached. ``jobs`` counts the fetches by table.
    """

    def __init__(self, spark: Any, run: Run, twin: SparkRun | None = None) -> None:
        super().__init__(run)
        self._spark = spark
        self._cache: dict[tuple[str, Columns], dict[tuple[int, int], pl.DataFrame]] = {}
        # Parts of (rank, step)s fetched only within a seq span: (lo, hi, rows), for scan_spans.
        self._spans: dict[tuple[str, Columns], dict[tuple[int, int], tuple[int, int, pl.DataFrame]]] = {}
        self._twin = twin
        self._lock: threading.Lock = twin._lock if twin is not None else threading.Lock()
        self.jobs: dict[str, int] = twin.jobs if twin is not None else {}
        if twin is not None:
            twin._twin = self

    def _pair(self) -> list[SparkRun]:
        return [self] if self._twin is None else [self, self._twin]

    def _read(
        self, run: Run, table: str, ranks: Sequence[int], cols: Columns, where: str, steps: Sequence[int] | None = None
    ) -> Any:
        """Spark DataFrame of ``run``'s ``table`` rows of ``ranks`` (and ``steps``, when given)
        matching the Spark SQL predicate ``where``: ``cols`` (None: all) with the provenance
        columns (only the columns asked for are decoded)."""
        return _source.table(self._spark, run, table, ranks, provenance=True, columns=cols, where=where, steps=steps)

    def _frame(self, got: pa.Table, table: str, cols: Columns, extra: tuple[str, ...]) -> pl.DataFrame:
        frame = pl.from_arrow(_source.to_contract(got, table, (*_EXTRA, *extra), cols))
        assert isinstance(frame, pl.DataFrame)
        return frame

    def fetch(
        self,
        table: str,
        ranks: Iterable[int] = (),
        keys: Iterable[tuple[int, int]] | None = None,
        columns: Sequence[str] | None = None,
        spans: Mapping[tuple[int, int], tuple[int, int]] | None = None,
    ) -> None:
        """Fetch into the cache, for this run and its twin in one Spark job (the caller holds
        ``_lock``), ``table``'s rows of whole ``ranks``, or of exactly the (rank, step) ``keys``
        and of ``spans``' (rank, step)s within their inclusive seq spans (both runs' rows in the
        span: a superset of what either run reads there): only ``columns`` (default all; rank
        and step always)."""
        from pyspark.sql import functions as F

        cols = _columns(table, columns)
        spans = dict(spans or {})
        keys = None if keys is None and not spans else sorted(set(keys or ()))
        ranks = sorted({k[0] for k in (*(keys or ()), *spans)} if keys is not None else set(ranks))
        schema = _schema(table, cols)
        empty = pl.DataFrame(schema=schema)
        wanted = keys if keys is not None else [(r, _ALL) for r in ranks]
        if not any(run._run.files(table, ranks) for run in self._pair()):  # nothing to read: no job
            for run in self._pair():
                run._cache.setdefault((table, cols), {}).update(dict.fromkeys(wanted, empty))
                run._spans.setdefault((table, cols), {}).update({k: (*v, empty) for k, v in spans.items()})
            return
        # Pushed into the Parquet scan: row groups outside these steps (and spans) are skipped.
        where = _source.in_list("rank", ranks) if keys is None else _keys_predicate(keys, spans)
        df = None
        # The (rank, step)s asked for: only the files of windows holding one of their steps.
        steps = None if keys is None else sorted({k[1] for k in (*keys, *spans)})
        for i, run in enumerate(self._pair()):
            side = self._read(run._run, table, ranks, cols, where, steps).withColumn("_side", F.lit(i))
            df = side if df is None else df.unionByName(side)
        with spark_errors(f"reading {table} of {self._run.label}"):
            got = df.toArrow()  # type: ignore[union-attr]
        self.jobs[table] = self.jobs.get(table, 0) + 1
        frame = self._frame(got, table, cols, ("_side",)).sort("_side", "rank", *_EXTRA)
        by = ("_side", "rank") if keys is None else ("_side", "rank", "step")
        parts = frame.partition_by(*by, as_dict=True)
        for i, run in enumerate(self._pair()):

            def part(k: tuple[int, ...], i: int = i) -> pl.DataFrame:
                got_part = parts.get((i, *k))
                return empty if got_part is None else got_part.drop("_side").cast(schema)  # type: ignore[arg-type]

            cache = run._cache.setdefault((table, cols), {})
            for k in wanted:
                cache[k] = part((k[0],) if keys is None else k)
            run._spans.setdefault((table, cols), {}).update({k: (lo, hi, part(k)) for k, (lo, hi) in spans.items()})

    def forget(self, table: str) -> None:
        """Drop the cached parts of ``table`` (every column set) for this run and its twin."""
        for run in self._pair():
            for k in [k for k in run._cache if k[0] == table]:
                del run._cache[k]
            for k in [k for k in run._spans if k[0] == table]:
                del run._spans[k]

    def _served(self, table: str, keys: Sequence[tuple[int, int]], cols: Columns) -> list[pl.DataFrame] | None:
        """The cached parts of ``keys`` from one cache of ``table`` holding ``cols``, or None."""
        for (t, have), cache in self._cache.items():
            fits = have is None or (cols is not None and set(cols) <= set(have))
            if t == table and fits and all(k in cache for k in keys):
                return [cache[k] for k in keys]
        return None

    def _served_spans(
        self, table: str, spans: Mapping[tuple[int, int], tuple[int, int]], cols: Columns
    ) -> list[pl.DataFrame] | None:
        """Each span's rows, in (rank, step) order, from cached parts (whole rank-steps, or spans
        holding it) with ``cols``, or None when one is not cached."""
        out = []
        for k, (lo, hi) in sorted(spans.items()):
            whole = self._served(table, [k], cols)
            if whole is not None:
                out.append(whole[0].filter(pl.col("seq").is_between(lo, hi)))
                continue
            held = [
                got
                for (t, have), cache in self._spans.items()
                if t == table and (have is None or (cols is not None and set(cols) <= set(have)))
                for got in [cache.get(k)]
                if got is not None and got[0] <= lo and hi <= got[1]
            ]
            if not held:
                return None
            out.append(held[0][2].filter(pl.col("seq").is_between(lo, hi)))
        return out

    def scan(
        self,
        table: str,
        ranks: Iterable[int] | int | None = None,
        steps: Any = None,
        columns: Sequence[str] | None = None,
    ) -> pl.LazyFrame:
        """As ``Run.scan``: ``table``'s rows of ``ranks`` (default all) and ``steps`` (default all)."""
        if ranks is None:
            wanted = sorted(self._run.ranks)
        else:
            wanted = sorted({int(r) for r in ([ranks] if isinstance(ranks, int) else ranks)})
        sel = _steps(steps)
        keys = [(r, s) for r in wanted for s in (sel if sel is not None else [_ALL])]
        cols = _columns(table, columns)
        with self._lock:
            parts = self._served(table, keys, cols)
            if parts is None:
                cache = self._cache.setdefault((table, cols), {})
                missing = [k for k in keys if k not in cache]
                if sel is None:
                    self.fetch(table, ranks={k[0] for k in missing}, columns=cols)
                else:
                    self.fetch(table, keys=missing, columns=cols)
                parts = [self._cache[(table, cols)][k] for k in keys]
        return self._lazy(table, [p for p in parts if p.height], columns)

    def scan_spans(
        self, table: str, spans: Mapping[tuple[int, int], tuple[int, int]], columns: Sequence[str] | None = None
    ) -> pl.LazyFrame:
        """As ``Run.scan_spans``: the rows of each (rank, step) within its inclusive seq span, in
        one Spark job for this run (a filter on (rank, step, seq) pushed into the Parquet scan)."""
        cols = _columns(table, columns)
        ranks = sorted({r for r, _ in spans})
        if not spans or not self._run.files(table, ranks):
            return self._lazy(table, [], columns)
        with self._lock:
            parts = self._served_spans(table, spans, cols)
        if parts is not None:  # already in (rank, step) order
            return self._lazy(table, [p for p in parts if p.height], columns, ordered=True)
        with self._lock, spark_errors(f"reading {table} of {self._run.label}"):
            steps = sorted({s for _, s in spans})
            got = self._read(self._run, table, ranks, cols, _keys_predicate((), spans), steps).toArrow()
            self.jobs[table] = self.jobs.get(table, 0) + 1
        # Run.scan_spans' order: by (rank, step), then file order.
        frame = self._frame(got, table, cols, ()).sort("rank", "step", *_EXTRA).cast(_schema(table, cols))  # type: ignore[arg-type]
        return self._lazy(table, [frame] if frame.height else [], columns)

    def _lazy(
        self, table: str, full: list[pl.DataFrame], columns: Sequence[str] | None, ordered: bool = False
    ) -> pl.LazyFrame:
        """Non-empty cached parts as one lazy frame in ``Run.scan``'s order (``ordered``: as they come) and columns."""
        if not full:
            lf = pl.LazyFrame(schema=polars_schema(table))
        else:
            frame = pl.concat(full, how="vertical") if len(full) > 1 else full[0]
            frame = frame if ordered or len(full) == 1 else frame.sort("rank", *_EXTRA)
            lf = frame.drop(_EXTRA).lazy()
        return lf if columns is None else lf.select(list(columns))


def _columns(table: str, columns: Sequence[str] | None) -> Columns:
    """A cache's columns for a read of ``columns`` (None: all): rank and step always, in contract order."""
    if columns is None:
        return None
    want = {"rank", "step", *columns}
    return tuple(c for c in polars_schema(table) if c in want)


def _schema(table: str, cols: Columns) -> dict[str, Any]:
    """The polars schema of a cached part: ``cols`` (None: all) and the provenance columns."""
    full = polars_schema(table)
    return {
        **{c: t for c, t in full.items() if cols is None or c in cols},
        _source.FILE_COLUMN: pl.String,
        _source.ROW_COLUMN: pl.Int64,
    }
