"""The trace contract as pyarrow schemas (pyarrow only: no torch, importable by both packages).

``contract.py`` spells column types as short strings so that it stays standard-library
only; this module turns them into ``pyarrow`` types once. Every field carries its
meaning as field metadata (``b"doc"``), and every schema carries
``detfp.schema_version`` and ``detfp.table`` as schema metadata, so a shard read on
its own (DuckDB, Spark, ``parquet-tools``) still says what it is.
"""

from __future__ import annotations

import functools

import pyarrow as pa

from detfp_capture import contract

__all__ = ["SCHEMA_VERSION_KEY", "TABLE_KEY", "arrow_schema", "arrow_type"]

#: Schema-metadata key holding the contract's SCHEMA_VERSION (as ASCII decimal).
SCHEMA_VERSION_KEY = b"detfp.schema_version"
#: Schema-metadata key holding the table name.
TABLE_KEY = b"detfp.table"

_TYPES: dict[str, pa.DataType] = {
    "int32": pa.int32(),
    "int64": pa.int64(),
    "uint64": pa.uint64(),
    "float64": pa.float64(),
    "bool": pa.bool_(),
    "string": pa.string(),
    "large_binary": pa.large_binary(),
    "list<int64>": pa.list_(pa.int64()),
    "list<string>": pa.list_(pa.string()),
}


def arrow_type(type_: str) -> pa.DataType:
    """The pyarrow type of a contract type string; ValueError names the known spellings."""
    try:
        return _TYPES[type_]
    except KeyError:
        raise ValueError(f"unknown contract type {type_!r}; known: {', '.join(_TYPES)}") from None


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
