"""Bisect's heavy stages on Apache Spark: ``engine(spark)`` for ``bisect(..., engine=...)``.

On Spark, one job each over both runs' validated shards (``source.table``):

* ``metric_divergence``: the first step per rank whose metrics differ bitwise
  (``narrow.metric_divergence``'s rule);
* ``block_rollups``: when both runs stored rollups (``bisect.blocks``), their window rows folded
  per (rank, step, block), as ``blocks.block_rollup`` does; the candidate steps and the walk's
  block slices are then computed on the driver from these few rows by the local code;
* ``rollup_candidates`` (runs without rollups): the per-(rank, step) rollups of both runs (record
  count, XOR of a hash of each key, XOR of a hash of each key with its status, digests and
  arguments digest, digest errors), their join and the steps where they differ
  (``narrow.divergent_steps``'s rule; Spark's xxhash64 in place of polars' hash on both sides:
  a rollup only pre-selects steps, the exact walk decides);
* ``peer_inputs``: the group-wide collective input test, the peers' inputs matched by key with
  ``rule.MATCH`` rendered to Spark SQL (``rule.to_sql``, dialect ``spark``).

Back on the driver: the rank-steps the walk reads. ``prefetch`` fetches every candidate
rank-step of both runs in one job (a filter on (step, rank) pushed into the Parquet scan of only
those ranks' shards, collected as Arrow into polars); ``SparkRun.scan`` serves the walk, the
verdicts and the evidence from that cache, and fetches anything else it is asked for (dumps,
kernels, argument texts, the discriminator's ranks) in one job per read, for both runs at once.
So a bisect costs a small, fixed number of Spark jobs, not one per rank or per slice, and the
walk, verdicts, diagnosis and report are the local engine's code: the report is byte-identical.
Driver memory: the candidate rank-steps of one walk (every column), as documented in docs/spark.md.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import polars as pl
import pyarrow as pa

from detfp_analyze import rule
from detfp_analyze.bisect import blocks as _blocks
from detfp_analyze.bisect import narrow as _narrow
from detfp_analyze.bisect.blocks import Slice
from detfp_analyze.bisect.records import CallKey
from detfp_analyze.bisect.walk import FIRST_PASS_COLUMNS, Progress
from detfp_analyze.io.reader import Run, polars_schema
from detfp_analyze.rule.to_sql import qualified, to_sql
from detfp_analyze.spark import source as _source
from detfp_analyze.spark.runtime import spark_errors

__all__ = ["SparkRun", "SparkStages", "engine"]

_ALL = -1  # cache key step for a whole rank (a scan without a step selection)
_EXTRA = (_source.FILE_COLUMN, _source.ROW_COLUMN)
_U64 = 1 << 64


def _signed(col: str) -> str:
    """Spark SQL: a uint64 column (decimal(20,0)) as the signed 64-bit integer with the same bits
    (bit_xor works on integers only)."""
    return f"CAST(IF({col} >= {1 << 63}, {col} - {_U64}, {col}) AS BIGINT)"


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
    terms = [f"(step = {s} AND rank IN ({', '.join(str(r) for r in sorted(rs))}))" for s, rs in sorted(by_step.items())]
    terms += [
        f"(rank = {r} AND step = {s} AND seq BETWEEN {lo} AND {hi})"
        for (r, s), (lo, hi) in sorted((spans or {}).items())
    ]
    return " OR ".join(terms) or "false"


#: A cache's columns: a tuple of column names, or None for all of the table's.
Columns = tuple[str, ...] | None


class SparkRun:
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
        self._spark, self._run = spark, run
        self._cache: dict[tuple[str, Columns], dict[tuple[int, int], pl.DataFrame]] = {}
        # Parts of (rank, step)s fetched only within a seq span: (lo, hi, rows), for scan_spans.
        self._spans: dict[tuple[str, Columns], dict[tuple[int, int], tuple[int, int, pl.DataFrame]]] = {}
        self._twin = twin
        self._lock = twin._lock if twin is not None else threading.Lock()
        self.jobs: dict[str, int] = twin.jobs if twin is not None else {}
        if twin is not None:
            twin._twin = self

    def __getattr__(self, name: str) -> Any:
        return getattr(self._run, name)

    def __repr__(self) -> str:
        return f"SparkRun({self._run!r})"

    @property
    def run(self) -> Run:
        """The opened run itself."""
        return self._run

    def _pair(self) -> list[SparkRun]:
        return [self] if self._twin is None else [self, self._twin]

    def _read(self, run: Run, table: str, ranks: Sequence[int], cols: Columns, where: Any) -> Any:
        """Spark DataFrame of ``run``'s ``table`` rows of ``ranks`` matching ``where``: ``cols``
        (None: all) with the provenance columns (only the columns asked for are decoded)."""
        side = _source.table(self._spark, run, table, ranks, provenance=True).where(where)
        return side if cols is None else side.select(*cols, *_EXTRA)

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
        where = F.col("rank").isin(ranks) if keys is None else F.expr(_keys_predicate(keys, spans))
        df = None
        for i, run in enumerate(self._pair()):
            side = self._read(run._run, table, ranks, cols, where).withColumn("_side", F.lit(i))
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
        from pyspark.sql import functions as F

        cols = _columns(table, columns)
        ranks = sorted({r for r, _ in spans})
        if not spans or not self._run.files(table, ranks):
            return self._lazy(table, [], columns)
        with self._lock:
            parts = self._served_spans(table, spans, cols)
        if parts is not None:  # already in (rank, step) order
            return self._lazy(table, [p for p in parts if p.height], columns, ordered=True)
        with self._lock, spark_errors(f"reading {table} of {self._run.label}"):
            got = self._read(self._run, table, ranks, cols, F.expr(_keys_predicate((), spans))).toArrow()
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


@dataclass
class SparkStages:
    """``bisect.engine.Stages`` on Spark for runs ``a`` and ``b`` (each a SparkRun)."""

    #: The Spark session the stages run on.
    spark: Any
    #: Run A and run B as SparkRun objects (what the walk, verdicts and evidence read).
    a: SparkRun
    b: SparkRun
    #: Spark jobs run so far by the stages, by stage (the runs' fetches are in ``a.jobs``).
    jobs: dict[str, int] = field(default_factory=dict)
    #: One walk batch: the walk's rank-steps are fetched ahead (``prefetch``) and held anyway, so
    #: its wider reads (the calls a verdict needs, the same-calls test, the call-site re-alignment)
    #: are one Spark job each per walk round, whatever the number of ranks.
    walk_batch: ClassVar[int | None] = 1 << 62

    def _collect(self, df: Any, stage: str, doing: str) -> pa.Table:
        with spark_errors(doing):
            got = df.toArrow()
        self.jobs[stage] = self.jobs.get(stage, 0) + 1
        return got

    def _frame(self, run: SparkRun, table: str, ranks: Sequence[int], lo: int, hi: int) -> Any:
        from pyspark.sql import functions as F

        df = _source.table(self.spark, run.run, table, ranks)
        return df.where(F.col("rank").isin(list(ranks)) & F.col("step").between(lo, hi))

    def metric_divergence(self, ranks: Sequence[int], lo: int, hi: int) -> pl.DataFrame:
        from pyspark.sql import Window
        from pyspark.sql import functions as F

        key = list(_narrow.METRIC_KEY)

        def side(run: SparkRun, sfx: str) -> Any:
            df = self._frame(run, "metrics", ranks, lo, hi)
            return df.select(*[F.col(c).alias(c + sfx) for c in (*key, "value", "bits")])

        a, b = side(self.a, "_a"), side(self.b, "_b")
        on = [a[f"{c}_a"].eqNullSafe(b[f"{c}_b"]) for c in key]
        j = a.join(b, on, "full").select(
            *[F.coalesce(f"{c}_a", f"{c}_b").alias(c) for c in key], "value_a", "value_b", "bits_a", "bits_b"
        )
        diff = j.where(F.col("bits_a").isNull() | F.col("bits_b").isNull() | (F.col("bits_a") != F.col("bits_b")))
        w = Window.partitionBy("rank").orderBy("step", "name", "microbatch", "occurrence")
        first = diff.withColumn("_n", F.row_number().over(w)).where("_n = 1")
        first = first.select(
            "rank",
            "step",
            "name",
            "value_a",
            "value_b",
            (F.col("bits_a").isNull() | F.col("bits_b").isNull()).alias("structural"),
        )
        got = self._collect(first, "metrics", "comparing metrics")
        schema = {
            "rank": pl.Int32,
            "step": pl.Int64,
            "name": pl.String,
            "value_a": pl.Float64,
            "value_b": pl.Float64,
            "structural": pl.Boolean,
        }
        out = pl.from_arrow(got)
        assert isinstance(out, pl.DataFrame)
        return out.cast(schema).select(list(schema)).sort("rank")  # type: ignore[arg-type]

    def block_rollups(self, ranks: Sequence[int], lo: int, hi: int) -> tuple[pl.DataFrame, pl.DataFrame]:
        from pyspark.sql import functions as F

        df = None
        for i, run in enumerate((self.a, self.b)):
            side = (
                self._frame(run, "rollups", ranks, lo, hi)
                .groupBy("rank", "step", "block")
                .agg(
                    F.sum("n").alias("n"),
                    F.sum("n_err").alias("n_err"),
                    *[F.expr(f"bit_xor({_signed(c)})").alias(c) for c in ("kx", "vx", "ox")],
                    F.bit_or("kinds").alias("kinds"),
                    F.min("seq").alias("seq_lo"),
                    F.max("seq_hi").alias("seq_hi"),
                )
            )
            side = side.withColumn("_side", F.lit(i))
            df = side if df is None else df.unionByName(side)
        got = pl.from_arrow(self._collect(df, "rollups", "folding the stored rollups"))
        assert isinstance(got, pl.DataFrame)
        # The local fold's column types, so both engines' rows compare and join alike.
        schema = _blocks.block_rollup(pl.LazyFrame(schema=polars_schema("rollups"))).collect_schema()
        got = got.with_columns(pl.col(c).reinterpret(signed=False) for c in ("kx", "vx", "ox"))
        out = [got.filter(pl.col("_side") == i).select(list(schema)).cast(dict(schema)) for i in (0, 1)]
        return out[0], out[1]

    def rollup_candidates(
        self, ranks: Sequence[int], lo: int, hi: int, progress: Progress | None, stage: str, errors: list[int]
    ) -> dict[int, list[int]]:
        from pyspark.sql import functions as F

        def rollup(run: SparkRun) -> Any:
            df = self._frame(run, "records", ranks, lo, hi)
            # Spark's hash skips nulls: each nullable part goes in with its null flag, so moving a
            # null from one column to another cannot leave the hash unchanged.
            parts = []
            for c in ("status", "digest_hi", "digest_lo", "args_digest"):
                parts += [F.col(c), F.col(c).isNull()]
            return df.groupBy("rank", "step").agg(
                F.count(F.lit(1)).alias("n"),
                F.bit_xor(F.xxhash64("key_hash")).alias("kx"),
                F.bit_xor(F.xxhash64("key_hash", *parts)).alias("vx"),
                F.sum((F.col("status") == "error").cast("BIGINT")).alias("n_err"),
            )

        ra, rb = rollup(self.a).alias("a"), rollup(self.b).alias("b")
        j = ra.join(rb, (F.col("a.rank") == F.col("b.rank")) & (F.col("a.step") == F.col("b.step")), "full")
        structural = (
            F.col("a.n").isNull()
            | F.col("b.n").isNull()
            | (F.col("a.n") != F.col("b.n"))
            | (F.col("a.kx") != F.col("b.kx"))
        )
        differs = structural | (F.col("a.vx") != F.col("b.vx"))
        err_a, err_b = F.coalesce(F.col("a.n_err"), F.lit(0)), F.coalesce(F.col("b.n_err"), F.lit(0))
        rows = j.where(differs | (err_a + err_b > 0)).select(
            F.coalesce("a.rank", "b.rank").alias("rank"),
            F.coalesce("a.step", "b.step").alias("step"),
            differs.alias("differs"),
            err_a.alias("err_a"),
            err_b.alias("err_b"),
        )
        got = self._collect(rows, "rollups", "rolling up records").to_pylist()
        out: dict[int, list[int]] = {}
        for r in sorted(got, key=lambda x: (x["rank"], x["step"])):
            errors[0] += int(r["err_a"])
            errors[1] += int(r["err_b"])
            if r["differs"]:
                out.setdefault(int(r["rank"]), []).append(int(r["step"]))
        if progress:
            progress(stage, 1, 1)
        return out

    def prefetch(self, cands: Mapping[int, Sequence[int]], slices: Mapping[tuple[int, int], Slice] | None) -> None:
        keys = [(int(r), int(s)) for r, ss in cands.items() for s in ss]
        # A sliced rank-step is read in part on each side: one span covering both sides' slices.
        cut = {
            k: (min(c.seq_a[0], c.seq_b[0]), max(c.seq_a[1], c.seq_b[1]))
            for k, c in (slices or {}).items()
            if k in set(keys)
        }
        with self.a._lock:
            # A new walk: the previous one's rank-steps are done with (driver memory stays one walk).
            self.a.forget("records")
            if keys:
                # Only the columns the walk's first pass reads: its wider reads are a few calls'.
                whole = [k for k in keys if k not in cut]
                self.a.fetch("records", keys=whole, columns=FIRST_PASS_COLUMNS, spans=cut)

    def peer_inputs(self, asks: Sequence[tuple[int, int, int, tuple[int, ...]]]) -> dict[CallKey, str]:
        from pyspark.sql import functions as F

        peers = sorted({p for _, _, _, g in asks for p in g})
        have = set(self.a.ranks) & set(self.b.ranks)
        sel = [p for p in peers if p in have]
        if not sel:
            return {}
        steps = sorted({s for _, s, _, _ in asks})
        hashes = sorted({h for _, _, h, _ in asks})
        cols = ["rank", "step", "call_hash", "key_hash", "role", "status", "digest_hi", "digest_lo", "args_digest"]

        def side(run: SparkRun, alias: str) -> Any:
            df = _source.table(self.spark, run.run, "records", sel)
            df = df.where(
                F.col("rank").isin(sel)
                & F.col("step").isin(steps)
                # uint64 literals as SQL text: Spark reads them as exact decimals (no Python int overflow).
                & F.expr(f"call_hash IN ({', '.join(str(h) for h in hashes)})")
                & (F.col("role") == "input")
            )
            return df.select(cols).alias(alias)

        a, b = side(self.a, "a"), side(self.b, "b")
        on = [F.col(f"a.{c}") == F.col(f"b.{c}") for c in ("rank", "step", "call_hash", "key_hash")]
        j = a.join(b, on, "full")
        # rule.MATCH in Spark SQL: the same definition bisect's polars alignment renders.
        match = F.expr(to_sql(rule.MATCH, qualified, "spark"))
        differs = match.isin(list(rule.DIVERGENT))
        g = j.groupBy(
            F.coalesce("a.rank", "b.rank").alias("rank"),
            F.coalesce("a.step", "b.step").alias("step"),
            F.coalesce("a.call_hash", "b.call_hash").alias("call_hash"),
        ).agg(F.max(differs.cast("INT")).alias("d"))
        got = self._collect(g, "peer_inputs", "testing a collective's inputs on its peers").to_pylist()
        return {
            CallKey(int(r["rank"]), int(r["step"]), int(r["call_hash"])): rule.DIFFERS if r["d"] else rule.SAME
            for r in got
        }


def engine(spark: Any) -> Any:
    """A bisect engine (``bisect(a, b, engine=engine(spark))``) whose heavy stages run on ``spark``."""

    def bind(run_a: Run, run_b: Run) -> SparkStages:
        a = SparkRun(spark, run_a)
        return SparkStages(spark, a, SparkRun(spark, run_b, twin=a))

    return bind
