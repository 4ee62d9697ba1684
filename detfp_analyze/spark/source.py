"""One table of one opened run as a Spark DataFrame, and Spark's rows back as contract frames.

``table(spark, run, name, ranks)`` reads exactly the shards the reader validated (``Run.files``:
the driver checked manifests, footers and commit logs first, so bad input fails with the
reader's one-line errors before any Spark job), local paths as ``file:`` URIs so a cluster whose
default file system is HDFS still reads them, other URIs unchanged. Partition inference is off
(``recursiveFileLookup``, ``contract.READ_RULE``): the ``rank=R`` directories are for pruning,
the ``rank`` column in every file is the rank, so Spark neither adds a second ``rank`` nor warns
``COLUMN_ALREADY_EXISTS``. The rows a later segment captured again, and steps not held
completely, are dropped with the DuckDB views' SQL predicates (``detfp_analyze.sql.views``), so
every engine sees the rows ``Run.scan`` gives.

Types: Spark has no unsigned 64-bit integer; uint64 columns (digests, key hashes, metric bits)
are ``decimal(20,0)``, exact. ``to_contract`` turns fetched rows back into the contract's Arrow
types (uint64 again), so frames from Spark equal frames from polars bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import pyarrow as pa

from detfp_analyze.io.uri import spark_uri
from detfp_analyze.sql.views import _excluded, _superseded
from detfp_format import contract
from detfp_format.arrowschema import arrow_schema
from detfp_format.types import spark_type

__all__ = ["FILE_COLUMN", "ROW_COLUMN", "in_list", "spark_schema_ddl", "table", "to_contract"]

#: Provenance columns ``table(..., provenance=True)`` adds: the shard's path and the row's index in
#: it (together: the file order ``Run.scan`` returns rows in).
FILE_COLUMN = "shard"
ROW_COLUMN = "_row"


def in_list(column: str, values: Iterable[int]) -> str:
    """Spark SQL text of ``column IN (values)`` for integers; ``false`` for none, where Spark's
    grammar has no empty list (a stage asked about no ranks selects no rows, as polars' ``is_in``)."""
    items = ", ".join(str(int(v)) for v in values)
    return f"{column} IN ({items})" if items else "false"


def spark_schema_ddl(name: str) -> str:
    """The Spark DDL schema of contract table ``name`` (``rank INT, ...``)."""
    return ", ".join(f"`{c.name}` {spark_type(c.type)}" for c in contract.columns(name))


def table(
    spark: Any,
    run: Any,
    name: str,
    ranks: Iterable[int] | None = None,
    *,
    provenance: bool = False,
    columns: Sequence[str] | None = None,
    where: str | None = None,
    steps: Any = None,
) -> Any:
    """DataFrame of table ``name`` of ``run`` (only the shards of ``ranks``, default all): the
    contract's columns (typed by ``detfp_format.types``; only ``columns``, in the contract's order,
    when given),
    rows as ``run.scan`` gives them (superseded and excluded rows dropped) that match the Spark
    SQL predicate ``where`` (default all; ``steps``, the steps ``where`` keeps, when known: only
    the shards whose window holds one are handed to Spark, which pays for every file it
    opens, a few tens of milliseconds each in local mode); with ``provenance`` also ``shard`` (the file's path, as
    a local path where it is one) and ``_row`` (the row's index in it).

    Built from SQL text, in a fixed handful of calls to the JVM: each Column made in Python is a
    py4j round trip of its own (and each list element another), which a bisect of many ranks paid
    thousands of times."""
    files = run.files(name, ranks, steps)
    if not files:
        df = spark.createDataFrame([], spark_schema_ddl(name))
    else:
        # The schema is given, not inferred: no footer-reading job, and uint64 as exact decimals.
        reader = spark.read.schema(spark_schema_ddl(name)).option("recursiveFileLookup", "true")
        df = _parquet(spark, reader, [spark_uri(str(f)) for f in files])
    drop = " OR ".join(t for t in (_superseded(run), _excluded(run)) if t and files)
    keep = " AND ".join(f"({t})" for t in (f"NOT ({drop})" if drop else "", where or "") if t)
    if keep:
        # Before the projection: ``where`` may name a column not asked for (a span's seq).
        df = df.where(keep)
    sel = [f"`{c.name}`" for c in contract.columns(name) if columns is None or c.name in columns]
    if provenance:
        # file:/x/y -> /x/y: the same provenance text as the DuckDB views for a local run.
        sel += (
            [
                f"regexp_replace(_metadata.file_path, '^file:(//)?', '') AS {FILE_COLUMN}",
                f"_metadata.row_index AS {ROW_COLUMN}",
            ]
            if files
            else [f"CAST(NULL AS STRING) AS {FILE_COLUMN}", f"CAST(NULL AS BIGINT) AS {ROW_COLUMN}"]
        )
    if columns is None and not provenance:
        return df  # the given schema's columns are the contract's, in its order
    return df.selectExpr(*sel)


def _parquet(spark: Any, reader: Any, paths: list[str]) -> Any:
    """``reader.parquet(*paths)`` in a fixed number of py4j round trips. pyspark hands a list to
    the JVM one element per round trip (2,600 of them in a Spark bisect of 64 ranks); here the
    paths cross as one string, split on the JVM side at NUL (in no path or URI), into the String
    array of ``DataFrameReader.parquet``'s Java varargs form. A session without a py4j gateway
    (Spark Connect) sends its plan in one message anyway: the plain call."""
    jreader = getattr(reader, "_jreader", None)
    if jreader is None:
        return reader.parquet(*paths)
    split = spark.sparkContext._jvm.java.util.regex.Pattern.compile("\\x00")
    return reader._df(jreader.parquet(split.split("\x00".join(paths))))


def to_contract(t: pa.Table, name: str, extra: tuple[str, ...] = (), columns: Sequence[str] | None = None) -> pa.Table:
    """Rows fetched from ``table`` (``DataFrame.toArrow``) in the contract's Arrow types: decimal(20,0)
    back to uint64, and so on; only ``columns`` (default all) of the contract's, in its order;
    ``extra`` columns are kept as they are, after the contract's."""
    schema = arrow_schema(name)
    fields = [f for f in schema if columns is None or f.name in columns]
    arrays = [t.column(f.name).cast(f.type) for f in fields]
    for x in extra:
        arrays.append(t.column(x))
        fields.append(t.schema.field(x))
    return pa.Table.from_arrays(arrays, schema=pa.schema(fields))
