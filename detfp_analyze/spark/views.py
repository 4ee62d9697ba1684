"""The documented SQL views on Spark: ``connect(spark, a, b=None)`` and ``query(spark, sql)``.

Pipeline: open and validate each run on the driver (``reader.open_run``: the same one-line errors
as the local engine) -> one private source view per run and table (``_a_records_src``:
``source.table`` over exactly the validated shards, contract columns plus ``shard``) -> the
views of the same ``.sql`` files DuckDB's ``connect`` loads (``run.sql``, ``union_*.sql``,
``compare.sql``, ``first_divergence.sql`` with bisect's scope as private views), their rule
fragments rendered for Spark and their DuckDB syntax rewritten by ``dialect.translate``. All are
session-scoped temporary views: nothing is written to a catalog, and reading stays lazy.

Differences from DuckDB's views, by design: uint64 columns are ``decimal(20,0)`` (exact; Spark
has no unsigned type) and column comments live in the ``.sql`` files only.
"""

from __future__ import annotations

import os
import re
from typing import Any

import pyarrow as pa

from detfp_analyze.bisect.scope import plan
from detfp_analyze.errors import QueryError
from detfp_analyze.io.held_steps import restrict_pair
from detfp_analyze.io.reader import Run, open_run
from detfp_analyze.spark import source as _source
from detfp_analyze.spark.dialect import translate
from detfp_analyze.spark.runtime import spark_errors
from detfp_analyze.sql.views import view_docs
from detfp_format import contract

__all__ = ["connect", "query", "view_names"]


def _as_run(x: Any, allow_missing_ranks: bool, allow_incomplete: bool) -> Run:
    if isinstance(x, Run):
        return x
    return open_run(x, allow_missing_ranks=allow_missing_ranks, allow_incomplete=allow_incomplete)


def _values(column: str, sql_type: str, values: Any) -> str:
    vals = sorted(set(values))
    if not vals:
        return f"SELECT CAST(NULL AS {sql_type}) AS {column} WHERE false"
    return f"SELECT CAST(x AS {sql_type}) AS {column} FROM VALUES {', '.join(f'({v})' for v in vals)} AS t(x)"


def _scope_sql(run_a: Run, run_b: Run) -> list[str]:
    """Bisect's scope of the pair as private views (as the DuckDB connection's ``_scope_*``)."""
    scope = plan(run_a, run_b)
    lo, hi = scope.window if scope.window is not None else ("NULL", "NULL")
    return [
        f"CREATE OR REPLACE TEMPORARY VIEW _scope_ranks AS {_values('rank', 'INT', scope.ranks)}",
        f"CREATE OR REPLACE TEMPORARY VIEW _scope_window AS SELECT CAST({lo} AS BIGINT) AS lo, CAST({hi} AS BIGINT) AS hi",
        f"CREATE OR REPLACE TEMPORARY VIEW _scope_boundary AS {_values('step', 'BIGINT', scope.boundary)}",
    ]


def view_names(two_runs: bool) -> tuple[str, ...]:
    """The public views ``connect`` registers (one run or two), sorted."""
    files = ["run.sql", "union_ab.sql" if two_runs else "union_a.sql"]
    names = [v.name for v in view_docs(files[0], "a")] + [v.name for v in view_docs(files[1], "a")]
    if two_runs:
        names += [v.name for v in view_docs("run.sql", "b")]
        names += [v.name for f in ("compare.sql", "first_divergence.sql") for v in view_docs(f, "a")]
    return tuple(sorted(n for n in names if not n.startswith("_")))


def connect(
    spark: Any,
    a: str | os.PathLike[str] | Run,
    b: str | os.PathLike[str] | Run | None = None,
    *,
    allow_missing_ranks: bool = False,
    allow_incomplete: bool = False,
) -> tuple[str, ...]:
    """Register the documented views over run ``a`` (and ``b``) as temporary views of ``spark``.

    The views and their columns are those of ``detfp_analyze.sql.connect`` (docs/sql.md):
    ``a_records``, ``a_metrics``, ... and ``records``, ``metrics``, ``events``; with two runs also
    ``b_*``, ``pairs``, ``metric_pairs``, ``step_summary`` and ``first_divergence``. Returns the
    public view names. Raises the reader's typed errors for unusable runs, EngineError when Spark fails.
    """
    runs = {"a": _as_run(a, allow_missing_ranks, allow_incomplete)}
    if b is not None:
        runs["b"] = _as_run(b, allow_missing_ranks, allow_incomplete)
        runs["a"], runs["b"], _ = restrict_pair(runs["a"], runs["b"])
    statements: list[str] = []
    with spark_errors("registering the views"):
        for tag, run in runs.items():
            for table in contract.TABLES:
                df = _source.table(spark, run, table, provenance=True).drop(_source.ROW_COLUMN)
                df.createOrReplaceTempView(f"_{tag}_{table}_src")
            statements += [v.sql for v in view_docs("run.sql", tag, "spark")]
        statements += [v.sql for v in view_docs("union_ab.sql" if b is not None else "union_a.sql", "a", "spark")]
        if b is not None:
            statements += [v.sql for v in view_docs("compare.sql", "a", "spark")]
            statements += _scope_sql(runs["a"], runs["b"])
            statements += [v.sql for v in view_docs("first_divergence.sql", "a", "spark")]
        for sql in statements:
            spark.sql(translate(sql))
    return view_names(b is not None)


#: The first word of a statement ``query`` runs: queries only (Spark runs commands when they are parsed).
_READING = re.compile(r"^\s*(\(\s*)*(SELECT|WITH|VALUES|FROM|TABLE|SHOW|DESCRIBE|DESC|EXPLAIN)\b", re.IGNORECASE)
_WRITING = re.compile(
    r"\b(INSERT|CREATE|DROP|ALTER|DELETE|UPDATE|MERGE|ADD|LOAD|CACHE|SET|RESET|REFRESH|TRUNCATE)\b", re.IGNORECASE
)


def query(spark: Any, sql: str, allow_file_access: bool = False) -> pa.Table:
    """Run one query over the views of ``connect`` and return an Arrow table (uint64 columns as
    exact decimals). A failing query raises QueryError with Spark's one-line reason. Unless
    ``allow_file_access``, only queries run (no statement that writes, caches or configures), and
    ``parquet.`/path``` style reads of other files are off (``spark.sql.runSQLOnFiles``)."""
    if not allow_file_access:
        if not _READING.match(sql) or _WRITING.search(re.sub(r"'[^']*'", "''", sql)):
            raise QueryError(
                "query refused: only queries run on the Spark engine (SELECT, WITH, ...), not statements that "
                "write, cache or configure; pass --allow-file-access (allow_file_access=True) to lift this"
            )
        spark.conf.set("spark.sql.runSQLOnFiles", "false")
    with spark_errors("running the query", query=True):
        return _unsigned(spark.sql(sql).toArrow())


def _unsigned(t: pa.Table) -> pa.Table:
    """decimal(20,0) columns (Spark's spelling of the contract's uint64) back to uint64, as DuckDB
    returns them; a column with values outside uint64 (a difference, a sum) stays decimal."""
    for i, f in enumerate(t.schema):
        if pa.types.is_decimal(f.type) and f.type.scale == 0 and f.type.precision == 20:
            try:
                t = t.set_column(i, pa.field(f.name, pa.uint64()), t.column(i).cast(pa.uint64()))
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
                continue
    return t
