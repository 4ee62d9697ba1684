"""One map of the contract's column types, rendered for every engine that reads or writes shards.

``contract.py`` spells a column's type as a short string (``"int64"``, ``"list<string>"``) so it
stays standard-library only. This table is the only place that says what each spelling is in
pyarrow (the writer, the reader, Spark's Arrow batches), polars (the analysis frames), DuckDB (the
SQL views) and Spark SQL (the Spark engine's schemas), so the four can never disagree on a column.

Spark has no unsigned 64-bit integer: ``uint64`` digests travel as ``DECIMAL(20,0)``, which holds
every value exactly (the Spark engine converts back to ``uint64`` at its edge).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

__all__ = ["TYPES", "TypeSpelling", "arrow_type", "duckdb_type", "polars_type", "spark_type"]


@dataclass(frozen=True)
class TypeSpelling:
    """One contract type in each engine's words."""

    #: pyarrow factory names, outermost first: ``("list_", "int64")`` is ``pa.list_(pa.int64())``.
    arrow: tuple[str, ...]
    #: polars data-type class names, outermost first: ``("List", "Int64")``.
    polars: tuple[str, ...]
    #: DuckDB SQL type.
    duckdb: str
    #: Spark SQL type.
    spark: str


#: Contract type string -> its spelling in each engine.
TYPES: dict[str, TypeSpelling] = {
    "int32": TypeSpelling(("int32",), ("Int32",), "INTEGER", "INT"),
    "int64": TypeSpelling(("int64",), ("Int64",), "BIGINT", "BIGINT"),
    "uint64": TypeSpelling(("uint64",), ("UInt64",), "UBIGINT", "DECIMAL(20,0)"),
    "float64": TypeSpelling(("float64",), ("Float64",), "DOUBLE", "DOUBLE"),
    "bool": TypeSpelling(("bool_",), ("Boolean",), "BOOLEAN", "BOOLEAN"),
    "string": TypeSpelling(("string",), ("String",), "VARCHAR", "STRING"),
    "large_binary": TypeSpelling(("large_binary",), ("Binary",), "BLOB", "BINARY"),
    "list<int64>": TypeSpelling(("list_", "int64"), ("List", "Int64"), "BIGINT[]", "ARRAY<BIGINT>"),
    "list<string>": TypeSpelling(("list_", "string"), ("List", "String"), "VARCHAR[]", "ARRAY<STRING>"),
}


def _spelling(type_: str) -> TypeSpelling:
    try:
        return TYPES[type_]
    except KeyError:
        raise ValueError(f"unknown contract type {type_!r}; known: {', '.join(TYPES)}") from None


def _build(module: str, names: tuple[str, ...]) -> Any:
    # Imported here, not at the top: the capture never needs polars, the analysis never pyarrow's
    # writer, and this module must load with neither.
    mod = importlib.import_module(module)
    value = getattr(mod, names[-1])()
    for name in reversed(names[:-1]):
        value = getattr(mod, name)(value)
    return value


def arrow_type(type_: str) -> Any:
    """The ``pyarrow.DataType`` of a contract type string; ValueError names the known spellings."""
    return _build("pyarrow", _spelling(type_).arrow)


def polars_type(type_: str) -> Any:
    """The ``polars`` data type of a contract type string."""
    return _build("polars", _spelling(type_).polars)


def duckdb_type(type_: str) -> str:
    """The DuckDB SQL type of a contract type string."""
    return _spelling(type_).duckdb


def spark_type(type_: str) -> str:
    """The Spark SQL type of a contract type string."""
    return _spelling(type_).spark
