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

Back on the driver: the rank-steps the walk reads, through ``SparkRun`` (``runs``): ``prefetch``
fetches the first pass's columns (``walk.FIRST_PASS_COLUMNS``) of every candidate rank-step of
both runs in one job, only the block slice where the stored rollups narrow a step
(``blocks.slices``); the call-site and detail columns of the few calls a verdict needs, a
re-read, the evidence (dumps, kernels, argument texts, the discriminator's ranks) are one job
per read, and the walk on Spark is one batch (``walk_batch``). So a bisect costs a small, fixed
number of Spark jobs, not one per rank, batch or slice, and the walk, verdicts, diagnosis and
report are the local engine's code: the report is byte-identical. Driver memory: the narrow
columns of one walk's rank-steps (or slices), as documented in docs/spark.md.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import polars as pl
import pyarrow as pa

from detfp_analyze import rule
from detfp_analyze.bisect import blocks as _blocks
from detfp_analyze.bisect import evidence as _evidence
from detfp_analyze.bisect import narrow as _narrow
from detfp_analyze.bisect.blocks import Slice
from detfp_analyze.bisect.records import CallKey
from detfp_analyze.bisect.walk import FIRST_PASS_COLUMNS, Progress
from detfp_analyze.io.reader import Run, polars_schema
from detfp_analyze.rule.to_sql import qualified, to_sql
from detfp_analyze.spark import source as _source
from detfp_analyze.spark.runs import SparkRun
from detfp_analyze.spark.runtime import spark_errors

__all__ = ["SparkRun", "SparkStages", "engine"]

_U64 = 1 << 64


def _signed(col: str) -> str:
    """Spark SQL: a uint64 column (decimal(20,0)) as the signed 64-bit integer with the same bits
    (bit_xor works on integers only)."""
    return f"CAST(IF({col} >= {1 << 63}, {col} - {_U64}, {col}) AS BIGINT)"


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

    def _frame(
        self, run: SparkRun, table: str, ranks: Sequence[int], lo: int, hi: int, columns: Sequence[str] | None = None
    ) -> Any:
        """``table`` of ``run``: ``columns`` (default all) of the rows of ``ranks`` and steps ``lo..hi``."""
        where = f"{_source.in_list('rank', ranks)} AND step BETWEEN {int(lo)} AND {int(hi)}"
        return _source.table(self.spark, run.run, table, ranks, columns=columns, where=where, steps=range(lo, hi + 1))

    def metric_divergence(self, ranks: Sequence[int], lo: int, hi: int) -> pl.DataFrame:
        from pyspark.sql import functions as F

        key = list(_narrow.METRIC_KEY)

        def side(run: SparkRun, sfx: str) -> Any:
            df = self._frame(run, "metrics", ranks, lo, hi)
            return df.selectExpr(*[f"`{c}` AS `{c}{sfx}`" for c in (*key, "value", "bits")])

        a, b = side(self.a, "_a"), side(self.b, "_b")
        on = F.expr(" AND ".join(f"`{c}_a` <=> `{c}_b`" for c in key))
        j = a.join(b, on, "full").selectExpr(
            *[f"coalesce(`{c}_a`, `{c}_b`) AS `{c}`" for c in key], "value_a", "value_b", "bits_a", "bits_b"
        )
        diff = j.where("bits_a IS NULL OR bits_b IS NULL OR bits_a != bits_b")
        first = diff.selectExpr(
            "*", "row_number() OVER (PARTITION BY rank ORDER BY step, name, microbatch, occurrence) AS _n"
        ).where("_n = 1")
        first = first.selectExpr(
            "rank", "step", "name", "value_a", "value_b", "bits_a IS NULL OR bits_b IS NULL AS structural"
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

        aggs = (
            "sum(n) AS n",
            "sum(n_err) AS n_err",
            *[f"bit_xor({_signed(c)}) AS {c}" for c in ("kx", "vx", "ox")],
            "bit_or(kinds) AS kinds",
            "min(seq) AS seq_lo",
            "max(seq_hi) AS seq_hi",
        )
        df = None
        for i, run in enumerate((self.a, self.b)):
            side = (
                self._frame(run, "rollups", ranks, lo, hi)
                .groupBy("rank", "step", "block")
                .agg(*[F.expr(x) for x in aggs])
            )
            side = side.withColumn("_side", F.lit(i))
            df = side if df is None else df.unionByName(side)
        got = pl.from_arrow(self._collect(df, "rollups", "folding the stored rollups"))
        assert isinstance(got, pl.DataFrame)
        # The local fold's column types, so both engines' rows compare and join alike.
        schema = _blocks.block_rollup(pl.LazyFrame(schema=polars_schema("rollups"))).collect_schema()
        got = got.with_columns(pl.col(c).reinterpret(signed=False) for c in ("kx", "vx", "ox"))
        out = [got.filter(pl.col("_side") == i).select(list(schema)).cast(schema) for i in (0, 1)]
        return out[0], out[1]

    def rollup_candidates(
        self, ranks: Sequence[int], lo: int, hi: int, progress: Progress | None, stage: str, errors: list[int]
    ) -> dict[int, list[int]]:
        from pyspark.sql import functions as F

        # Spark's hash skips nulls: each nullable part goes in with its null flag, so moving a
        # null from one column to another cannot leave the hash unchanged.
        parts = ", ".join(f"{c}, {c} IS NULL" for c in ("status", "digest_hi", "digest_lo", "args_digest"))
        aggs = (
            "count(1) AS n",
            "bit_xor(xxhash64(key_hash)) AS kx",
            f"bit_xor(xxhash64(key_hash, {parts})) AS vx",
            "sum(CAST(status = 'error' AS BIGINT)) AS n_err",
        )

        def rollup(run: SparkRun) -> Any:
            df = self._frame(run, "records", ranks, lo, hi, columns=_narrow.ROLLUP_COLUMNS)
            return df.groupBy("rank", "step").agg(*[F.expr(x) for x in aggs])

        ra, rb = rollup(self.a).alias("a"), rollup(self.b).alias("b")
        j = ra.join(rb, F.expr("a.rank = b.rank AND a.step = b.step"), "full")
        structural = "a.n IS NULL OR b.n IS NULL OR a.n != b.n OR a.kx != b.kx"
        differs = f"({structural} OR a.vx != b.vx)"
        err_a, err_b = "coalesce(a.n_err, 0)", "coalesce(b.n_err, 0)"
        rows = j.where(f"{differs} OR {err_a} + {err_b} > 0").selectExpr(
            "coalesce(a.rank, b.rank) AS rank",
            "coalesce(a.step, b.step) AS step",
            f"{differs} AS differs",
            f"{err_a} AS err_a",
            f"{err_b} AS err_b",
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

    def holds(self, cands: Mapping[int, Sequence[int]]) -> bool:
        return False  # the prefetch fetches the first pass's columns, narrowed by the slices

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

        sel, steps, hashes = _evidence.asked(self.a, self.b, asks)
        if not sel:
            return {}
        cols = list(_evidence.PEER_COLUMNS)

        where = " AND ".join(
            (
                _source.in_list("rank", sel),
                _source.in_list("step", steps),
                # uint64 literals as SQL text: Spark reads them as exact decimals (no Python int overflow).
                _source.in_list("call_hash", hashes),
                "role = 'input'",
            )
        )

        def side(run: SparkRun, alias: str) -> Any:
            return _source.table(self.spark, run.run, "records", sel, columns=cols, where=where).alias(alias)

        a, b = side(self.a, "a"), side(self.b, "b")
        on = F.expr(" AND ".join(f"a.{c} = b.{c}" for c in ("rank", "step", "call_hash", "key_hash")))
        j = a.join(b, on, "full")
        # rule.MATCH in Spark SQL: the same definition bisect's polars alignment renders.
        match = to_sql(rule.MATCH, qualified, "spark")
        divergent = ", ".join(f"'{m}'" for m in rule.DIVERGENT)
        g = (
            j.selectExpr(
                "coalesce(a.rank, b.rank) AS rank",
                "coalesce(a.step, b.step) AS step",
                "coalesce(a.call_hash, b.call_hash) AS call_hash",
                f"CAST(({match}) IN ({divergent}) AS INT) AS d",
            )
            .groupBy("rank", "step", "call_hash")
            .agg(F.expr("max(d) AS d"))
        )
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
