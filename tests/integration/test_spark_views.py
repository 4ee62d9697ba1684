"""The documented SQL views on Spark (``detfp_analyze.spark.connect``), one run read alike by
Spark, DuckDB and polars.

The views come from the same ``.sql`` files as DuckDB's, the rule's fragments rendered for Spark
and the rest rewritten by ``spark.dialect`` (its translations are pinned in
``tests/unit/test_spark_dialect.py``); queries over them give DuckDB's rows (uint64 columns back
as uint64), including ``first_divergence``, the record bisect names. Reading a run directory table
by table with the contract's read rule (``contract.READ_RULE``: partition inference off), Spark,
DuckDB and polars see the same rows with the contract's types, and Spark infers no second
``rank`` (the cause of its ``COLUMN_ALREADY_EXISTS`` warning). All share one SparkSession. That
``import detfp_analyze`` loads no pyspark is ``tests/unit/test_import_hygiene.py``'s.
"""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path

import duckdb
import polars as pl
import pytest
from typer.testing import CliRunner

from detfp_analyze.cli import app
from detfp_analyze.errors import QueryError
from detfp_analyze.spark.dialect import translate
from detfp_analyze.sql import connect as duck_connect
from detfp_analyze.sql import query as duck_query
from detfp_format import contract

pytestmark = pytest.mark.timeout(600)
SAMPLES = Path(__file__).resolve().parents[2] / "sample_traces"
A, B = SAMPLES / "data_rank/a", SAMPLES / "data_rank/b"

QUERIES = {
    "pairs": "SELECT rank, step, key_hash, match, digest_a, digest_b FROM pairs ORDER BY rank, step, key_hash, role, arg",
    "step_summary": "SELECT * FROM step_summary ORDER BY rank, step",
    "metric_pairs": "SELECT * FROM metric_pairs ORDER BY rank, step, name, microbatch, occurrence",
    "first_divergence": "SELECT rank, step, key_hash, next_step, next_key_hash FROM first_divergence ORDER BY rank",
}


@pytest.fixture(scope="module")
def views(spark):
    """Both engines' views over the pair: the Spark session's temporary views, a DuckDB connection."""
    from detfp_analyze.spark import connect

    names = connect(spark, A, B)
    assert {"a_records", "b_records", "pairs", "first_divergence", "step_summary", "metric_pairs"} <= set(names)
    with duck_connect(A, B) as con:
        yield con


@pytest.mark.parametrize(
    "view", ["pairs", "step_summary", "metric_pairs", pytest.param("first_divergence", marks=pytest.mark.slow)]
)  # first_divergence: ~20 window and join stages, a minute or more on a loaded 2-core machine
def test_views_give_duckdbs_rows(spark, views, view):
    from detfp_analyze.spark import query

    q = QUERIES[view]
    duck = duck_query(views, q)
    got = query(spark, q)
    assert got.num_rows and got.to_pylist() == duck.to_pylist(), q


def test_hex_digest_covers_the_unsigned_range(spark):
    top = translate("SELECT printf('%016x%016x', h, l) AS d FROM t")
    values = "VALUES (CAST(18446744073709551615 AS DECIMAL(20,0)), CAST(10 AS DECIMAL(20,0))) AS t(h, l)"
    assert spark.sql(top.replace("FROM t", f"FROM {values}")).collect()[0]["d"] == "ffffffffffffffff000000000000000a"


def test_query_errors_are_one_line(spark):
    from detfp_analyze.spark import connect, query

    connect(spark, A)
    with pytest.raises(QueryError, match=r"^query failed: \[TABLE_OR_VIEW_NOT_FOUND\]") as e:
        query(spark, "SELECT * FROM no_such_view")
    assert "\n" not in str(e.value)
    with pytest.raises(QueryError, match="only queries run on the Spark engine"):
        query(spark, "CREATE TABLE t AS SELECT 1")


def test_sql_command_on_spark_prints_the_local_engines_output(spark):
    """One run (its views register faster than a pair's): the command's plumbing, same bytes."""
    q = "SELECT rank, step, name, value, bits FROM a_metrics ORDER BY rank, step, name, occurrence"
    local = CliRunner().invoke(app, ["sql", str(A), q, "--format", "json"])
    got = CliRunner().invoke(app, ["sql", str(A), q, "--format", "json", "--engine", "spark"])
    assert local.exit_code == 0 and (got.exit_code, got.stdout) == (0, local.stdout)


_SPARK_NAMES = {"INT": "int", "BIGINT": "bigint", "DECIMAL(20,0)": "decimal(20,0)", "DOUBLE": "double",
                "BOOLEAN": "boolean", "STRING": "string", "BINARY": "binary", "ARRAY<BIGINT>": "array<bigint>",
                "ARRAY<STRING>": "array<string>"}  # fmt: skip
_POLARS_NAMES = {"int32": "Int32", "int64": "Int64", "uint64": "UInt64", "float64": "Float64", "bool": "Boolean",
                 "string": "String", "large_binary": "Binary", "list<int64>": "List(Int64)",
                 "list<string>": "List(String)"}  # fmt: skip
_DUCK_NAMES = {"int32": "INTEGER", "int64": "BIGINT", "uint64": "UBIGINT", "float64": "DOUBLE", "bool": "BOOLEAN",
               "string": "VARCHAR", "large_binary": "BLOB", "list<int64>": "BIGINT[]", "list<string>": "VARCHAR[]"}  # fmt: skip


def _canon(v):
    if isinstance(v, Decimal):
        return int(v)
    if isinstance(v, (bytes, bytearray)):
        return bytes(v)
    if isinstance(v, list):
        return [_canon(x) for x in v]
    return v


@pytest.mark.parametrize("table", ["records", "metrics"])
def test_spark_duckdb_polars_read_a_run_alike(spark, table):
    """The contract's read rule, as a user writes it for each engine, on a run directory."""
    from detfp_format.types import spark_type

    root = SAMPLES / "ops/a" / table
    cols = [c.name for c in contract.columns(table)]
    types = {c.name: c.type for c in contract.columns(table)}
    glob = str(root / "*" / "*.parquet")
    sp = spark.read.option("recursiveFileLookup", "true").parquet(str(root))
    # No inferred partition column: the files' own rank is the only one (no COLUMN_ALREADY_EXISTS).
    assert sp.columns == cols
    assert {f.name: f.dataType.simpleString() for f in sp.schema.fields} == {
        c.name: _SPARK_NAMES[spark_type(c.type)] for c in contract.columns(table)
    }
    pf = pl.scan_parquet(glob, hive_partitioning=False).collect()
    assert pf.columns == cols
    assert {k: str(v) for k, v in pf.schema.items()} == {k: _POLARS_NAMES[t] for k, t in types.items()}
    dk = duckdb.sql(f"SELECT * FROM read_parquet('{glob}', hive_partitioning = false)")
    assert dk.columns == cols
    assert [str(t) for t in dk.types] == [_DUCK_NAMES[types[c]] for c in cols]
    rows_pl = sorted(tuple(_canon(v) for v in r) for r in pf.rows())
    rows_dk = sorted(tuple(_canon(v) for v in r) for r in dk.fetchall())
    rows_sp = sorted(tuple(_canon(v) for v in r) for r in sp.collect())
    assert len(rows_pl) >= 10 and rows_pl == rows_dk == rows_sp
