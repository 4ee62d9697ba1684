"""A parsed Parquet footer against the contract: the ``ShardInfo`` of a shard, or its one-line error.

Checks, in order: the schema version key, the contract columns and types (once per distinct
schema: ``FooterValidator`` keeps the schemas it has seen), then from the column statistics:
nulls in non-nullable columns (those whose Parquet leaf can encode a null; a REQUIRED leaf
cannot), the rank column against the partition, and the step range (no negative step, none past
``MAX_STEP``). Every problem is a ``ShardError`` or ``SchemaVersionError`` whose one-line message
names the file. Used at open (``shard_scan``) and on a committed shard's first read
(``committed_footers``), so both give the same message.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from detfp_analyze.errors import SchemaVersionError, ShardError
from detfp_analyze.io.names import SHARD_NAME, shown_name
from detfp_analyze.io.shard_info import ShardInfo
from detfp_analyze.io.store import Location, name_of
from detfp_format import contract

if TYPE_CHECKING:
    import pyarrow as pa
    import pyarrow.parquet as pq

__all__ = ["FIX_SHARD", "MAX_STEP", "FooterValidator"]

#: Steps at or past this are refused: no job runs 2^62 steps, and step arithmetic must not overflow.
MAX_STEP = 1 << 62
FIX_SHARD = "delete it or re-run the capture"


@dataclass
class _SchemaCheck:
    """Result of checking one distinct Parquet schema (shared by all shards that have it)."""

    problem: str | None
    #: column name -> leaf column index, for the columns whose statistics are read.
    index: dict[str, int]


def _type_ok(actual: pa.DataType, expected: pa.DataType) -> bool:
    import pyarrow as pa

    # Other producers may pick the large/small variant of the same logical type.
    def norm(t: pa.DataType) -> pa.DataType:
        if pa.types.is_large_string(t):
            return pa.string()
        if pa.types.is_large_binary(t) or pa.types.is_binary_view(t):
            return pa.large_binary()
        if pa.types.is_string_view(t):
            return pa.string()
        if pa.types.is_large_list(t) or pa.types.is_list_view(t) or pa.types.is_large_list_view(t):
            return pa.list_(norm(t.value_type))
        if pa.types.is_list(t):
            return pa.list_(norm(t.value_type))
        if pa.types.is_binary(t):
            return pa.large_binary()
        return t

    return norm(actual).equals(norm(expected))


#: Columns whose footer min/max a ShardInfo needs (the rest are only checked for nulls).
_RANGE_COLUMNS = frozenset(("rank", "segment", "step"))


def _check_schema(table: str, md: pq.FileMetaData) -> _SchemaCheck:
    from detfp_format.arrowschema import arrow_schema

    try:
        actual = md.schema.to_arrow_schema()
    except Exception as exc:  # pyarrow raises several types for exotic footers
        return _SchemaCheck(f"footer schema unreadable ({type(exc).__name__})", {})
    expected = arrow_schema(table)
    missing = [f.name for f in expected if f.name not in actual.names]
    if missing:
        return _SchemaCheck(f"missing column(s) {', '.join(missing)} of table {table}", {})
    for f in expected:
        if actual.get_field_index(f.name) < 0:  # the name occurs more than once
            return _SchemaCheck(f"column {f.name} occurs more than once", {})
        got = actual.field(f.name).type
        if not _type_ok(got, f.type):
            return _SchemaCheck(f"column {f.name} has type {got}, the contract says {f.type}", {})
    # Statistics are read for the range columns, and for the null counts of non-nullable columns
    # whose leaf can encode a null at all: a leaf with maximum definition level 0 (a flat REQUIRED
    # column, as the capture writes every non-nullable scalar) holds no null by construction, so its
    # per-row-group null count says nothing more (the lists' leaves keep theirs checked).
    want = {c.name for c in contract.columns(table) if c.name in _RANGE_COLUMNS or not c.nullable}
    index = {}
    for i in range(md.num_columns):
        col = md.schema.column(i)
        if col.path in want and (col.path in _RANGE_COLUMNS or col.max_definition_level > 0):
            index[col.path] = i
    return _SchemaCheck(None, index)


def _file_segment(name: str) -> int:
    m = SHARD_NAME.fullmatch(name)
    return int(m.group(1)) if m else -1


def _shard_info(
    table: str,
    rank: int,
    path: Location,
    shown: str,
    md: pq.FileMetaData,
    check: _SchemaCheck,
    nullable: Mapping[str, bool],
) -> ShardInfo:
    lo: dict[str, Any] = {}
    hi: dict[str, Any] = {}
    no_stats: set[str] = set()
    for g in range(md.num_row_groups):
        rg = md.row_group(g)
        if rg.num_rows == 0:
            continue
        for name, i in check.index.items():
            st = rg.column(i).statistics
            if st is None:
                no_stats.add(name)
                continue
            if not nullable[name] and st.has_null_count and st.null_count:
                raise ShardError(f"{shown}: column {name} holds nulls, the contract does not allow them; {FIX_SHARD}")
            if name not in _RANGE_COLUMNS:
                continue  # only null counts are checked: decoding min/max costs ~12 us a column
            if not st.has_min_max:
                no_stats.add(name)
                continue
            lo[name] = st.min if name not in lo else min(lo[name], st.min)
            hi[name] = st.max if name not in hi else max(hi[name], st.max)
    if "rank" in lo and (lo["rank"] != rank or hi["rank"] != rank):
        held = str(lo["rank"]) if lo["rank"] == hi["rank"] else f"{lo['rank']}..{hi['rank']}"
        raise ShardError(
            f"{shown}: rank column holds {held} but the file is in partition rank={rank}; "
            f"move it to its rank's partition or re-run the capture"
        )
    if "step" in lo and (lo["step"] < 0 or hi["step"] >= MAX_STEP):
        bad = lo["step"] if lo["step"] < 0 else hi["step"]
        raise ShardError(
            f"{shown}: step column holds {bad}, outside 0..2^62; the shard is corrupt or not a detfp trace; {FIX_SHARD}"
        )
    if "segment" in lo and (lo["segment"] < 0 or hi["segment"] >= MAX_STEP):
        raise ShardError(f"{shown}: segment column holds {lo['segment']}, expected 0 or more; {FIX_SHARD}")
    segment = lo["segment"] if "segment" in lo and lo["segment"] == hi["segment"] else _file_segment(name_of(path))
    full = md.num_rows > 0 and "step" in lo and "step" not in no_stats
    m = SHARD_NAME.fullmatch(name_of(path))
    return ShardInfo(
        path=path,
        table=table,
        rank=rank,
        segment=int(segment),
        num_rows=md.num_rows,
        step_min=int(lo["step"]) if full else None,
        step_max=int(hi["step"]) if full else None,
        window=int(m.group(2)) if m else None,
    )


class FooterValidator:
    """The footer checks of ``shard_scan.scan_shards`` and ``committed_footers``, with the per-table cache of distinct schemas."""

    def __init__(self) -> None:
        self.checks: dict[str, list[tuple[pq.ParquetSchema, _SchemaCheck]]] = {}
        self.nullables = {t: {c.name: c.nullable for c in contract.columns(t)} for t in contract.TABLES}

    def info(self, table: str, rank: int, path: Location, shown: str, md: pq.FileMetaData | str) -> ShardInfo:
        """The ShardInfo of a parsed footer (``read_footer``'s result), or its one-line error."""
        if isinstance(md, str):
            raise ShardError(f"{shown}: not a Parquet file ({md}); {FIX_SHARD}")
        from detfp_format.arrowschema import SCHEMA_VERSION_KEY

        version = (md.metadata or {}).get(SCHEMA_VERSION_KEY)
        if version is not None and version != str(contract.SCHEMA_VERSION).encode():
            raise SchemaVersionError(
                f"{shown}: schema version {shown_name(version.decode(errors='replace'))[:40]} is not supported "
                f"(this detfp reads schema version {contract.SCHEMA_VERSION}); "
                "analyze it with the detfp release that wrote it"
            )
        # Shards of one writer share their schema: check each distinct schema once.
        known = self.checks.setdefault(table, [])
        check = next((c for s, c in known if s.equals(md.schema)), None)
        if check is None:
            check = _check_schema(table, md)
            known.append((md.schema, check))
        if check.problem is not None:
            raise ShardError(
                f"{shown}: {check.problem}; the shard was not written to this contract; delete it or re-run the capture"
            )
        return _shard_info(table, rank, path, shown, md, check, self.nullables[table])
