"""The trace contract as pyarrow schemas (pyarrow only: no torch, imported by both packages).

``contract.py`` spells column types as short strings so that it stays standard-library
only; this module turns them into ``pyarrow`` types once. Every field carries its
meaning as field metadata (``b"doc"``), and every schema carries
``detfp.schema_version`` and ``detfp.table`` as schema metadata, so a shard read on
its own (DuckDB, Spark, ``parquet-tools``) still says what it is.
"""

from __future__ import annotations

import functools

import pyarrow as pa

from detfp_format import contract
from detfp_format.types import arrow_type as _arrow_type

__all__ = ["SCHEMA_VERSION_KEY", "TABLE_KEY", "arrow_schema", "arrow_type", "parquet_options"]

#: Schema-metadata key holding the contract's SCHEMA_VERSION (as ASCII decimal), as pyarrow's bytes.
SCHEMA_VERSION_KEY = contract.SCHEMA_VERSION_KEY.encode()
#: Schema-metadata key holding the table name.
TABLE_KEY = b"detfp.table"

def arrow_type(type_: str) -> pa.DataType:
    """The pyarrow type of a contract type string (``detfp_format.types``); ValueError names the
    known spellings."""
    return _arrow_type(type_)


@functools.cache
def arrow_schema(table: str) -> pa.Schema:
    """The pyarrow schema of ``table`` (cached: schemas are immutable)."""
    fields = [
        pa.field(c.name, arrow_type(c.type), nullable=c.nullable, metadata={b"doc": c.doc.encode("utf-8")})
        for c in contract.columns(table)
    ]
    return pa.schema(
        fields,
        metadata={SCHEMA_VERSION_KEY: str(contract.SCHEMA_VERSION).encode(), TABLE_KEY: table.encode()},
    )


#: Columns written with delta encoding: per-rank counters that grow by small steps down a shard
#: (``seq``: +1 per record within a window, in stream order), which dictionary encoding turns
#: into one distinct value per row.
_DELTA_COLUMNS = frozenset({"seq"})


@functools.cache
def parquet_options(table: str) -> dict:
    """Per-column Parquet encodings of ``table``'s shards (``pq.write_table`` keyword arguments).

    The on-disk encoding only: the values, the schema and the row order are unchanged, and
    every Parquet reader decodes them (pyarrow, polars, DuckDB, Spark 3.3+). Measured on the
    example's records tables (zstd): 36.5 -> 31.6 bytes per record at level boundaries, 20.2 ->
    15.6 at level ops (``benchmarks/trace_size.py``).

    * 64-bit hashes and digests (every ``uint64`` column) are plain: they are close to
      uniformly random, so a dictionary only adds its page and index bits until the writer
      gives up on it (at 1 MiB of dictionary).
    * ``seq`` is ``DELTA_BINARY_PACKED`` (see ``_DELTA_COLUMNS``).
    * Everything else keeps the default dictionary encoding (module paths, op names, args,
      dtypes, steps repeat on every row).
    """
    schema = arrow_schema(table)
    plain = [f.name for f in schema if f.type == pa.uint64()]
    delta = [f.name for f in schema if f.name in _DELTA_COLUMNS and pa.types.is_integer(f.type)]
    encoding = {**{c: "PLAIN" for c in plain}, **{c: "DELTA_BINARY_PACKED" for c in delta}}
    special = set(encoding)
    return {
        "use_dictionary": [f.name for f in schema if f.name not in special],
        "column_encoding": encoding,
    }
