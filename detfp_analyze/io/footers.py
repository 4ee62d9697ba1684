"""Shard discovery and footer validation for ``reader.open_run`` (metadata only, never data).

Pipeline: list ``<table>/rank=R/*.parquet`` (partition names must be ``rank=<decimal>``;
dot- and underscore-prefixed names are writer temporaries or markers and are skipped) ->
read each footer in a small thread pool (one open per file: the tail, then the footer,
parsed from memory), refusing one larger than ``MAX_FOOTER_BYTES`` before parsing it -> check
the schema version key, the contract columns and types (once per distinct schema), then from
the column statistics: nulls in non-nullable columns (those whose Parquet leaf can encode a
null; a REQUIRED leaf cannot), the rank column against the partition, and the step range (no
negative step, none past ``MAX_STEP``) -> one ``ShardInfo`` per file. Every problem is a ``ShardError`` or ``SchemaVersionError``
whose one-line message names the file.

Shards whose commit line states their size, steps and footer checksum (``commitlog.ShardFact``,
``committed``) skip the footer at open: their size is checked against the commit (``stat``), and
their ``ShardInfo`` comes from it. ``committed.FooterChecks`` checks such a shard's footer bytes
against the committed checksum when a read first selects it (a few microseconds, no parse); a
footer that differs is validated as above, so a damaged shard gives the same one-line error as
when every footer was parsed at open, and one that passes all the same differs from its commit:
also refused. A size that differs from the commit is refused at open, after the footer checks.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from detfp_analyze.errors import SchemaVersionError, ShardError
from detfp_analyze.io.footer_read import MAX_FOOTER_BYTES, read_footer
from detfp_analyze.io.store import Location, Store, name_of
from detfp_format import contract
from detfp_format.commitlog import ShardFact

if TYPE_CHECKING:
    import pyarrow as pa
    import pyarrow.parquet as pq

__all__ = [
    "MAX_FOOTER_BYTES",
    "MAX_STEP",
    "Committed",
    "CommittedShard",
    "ShardInfo",
    "committed_shard",
    "partition_rank",
    "partitions",
    "scan_shards",
    "shown_name",
    "visible",
]

#: Steps at or past this are refused: no job runs 2^62 steps, and step arithmetic must not overflow.
MAX_STEP = 1 << 62
FIX_SHARD = "delete it or re-run the capture"
_SHARD_NAME = re.compile(r"part-s(\d{5,})-w(\d{7,})\.parquet")


@dataclass(frozen=True)
class ShardInfo:
    """What one shard's footer says (no data read)."""

    #: The Parquet file: an absolute local path, or a URI on the run's file system (``io.store``).
    path: Location
    #: Table the shard belongs to.
    table: str
    #: Rank of its ``rank=R`` partition (checked against the rank column statistics).
    rank: int
    #: Segment of its rows (segment column statistics; the file name when statistics are absent).
    segment: int
    #: Number of rows.
    num_rows: int
    #: Smallest and largest step in the shard; None when the footer has no statistics.
    step_min: int | None
    step_max: int | None
    #: Flush window from the file name ``part-sSSSSS-wWWWWWWW.parquet``; None for other names.
    window: int | None = None
    #: The shard's footer checksum from its commit line when the footer was not parsed at open
    #: (``committed.FooterChecks`` checks it before the first read); None: validated from its footer.
    footer_crc32: int | None = None
    #: The file as one-line messages name it (set with ``footer_crc32``).
    shown: str | None = None


#: What a commit line states of one shard, flat (no object per shard: a seed-scale run holds
#: hundreds of thousands): its rows, size in bytes, first and last step, footer CRC-32
#: (``commitlog.ShardFact``), segment and window.
CommittedShard = tuple[int, int, int, int, int, int, int]
#: (table, rank, file name) -> the ``CommittedShard`` of every shard a commit line states, by the
#: name the capture gives it (``contract.shard_name``): a listed file is looked up by its name,
#: without parsing it. A file of another name is validated from its footer.
Committed = Mapping[tuple[str, int, str], CommittedShard]


def committed_shard(rows: int, fact: ShardFact, segment: int, window: int) -> CommittedShard:
    """The ``CommittedShard`` of a window's commit line's fact about one of its shards."""
    return (rows, fact.size, fact.step_min, fact.step_max, fact.footer_crc32, segment, window)


def shown_name(name: str) -> str:
    """A file name as it may appear in a one-line message: control characters and bytes that
    are not UTF-8 are escaped, so a hostile name cannot break the line or drive a terminal."""
    if name.isascii() and name.isprintable():  # the common case, unchanged: no C0 control, no DEL
        return name
    out = []
    for ch in name:
        code = ord(ch)
        if 0xDC80 <= code <= 0xDCFF:  # a byte os.listdir could not decode (surrogateescape)
            out.append(f"\\x{code - 0xDC00:02x}")
        elif code < 0x20 or 0x7F <= code < 0xA0 or 0xD800 <= code <= 0xDFFF:
            out.append(f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")
        else:
            out.append(ch)
    return "".join(out)


def partition_rank(name: str, where: str) -> int | None:
    """Rank of a ``rank=R`` directory name; None for names that are not partitions at all.

    A ``rank=`` name that is not a plain decimal (``rank=abc``, ``rank=01``, ``rank=-1``) is a
    ShardError: silently skipping it would hide a rank's data.
    """
    if not name.startswith("rank="):
        return None
    digits = name[len("rank=") :]
    if not (digits.isascii() and digits.isdigit()) or str(int(digits)) != digits:
        raise ShardError(
            f"{where}/{shown_name(name)}: partition name is not rank=<decimal rank> (no sign, no padding); "
            "rename or delete the directory"
        )
    return int(digits)


def partitions(entries: Iterable[Location], where: str) -> Iterator[tuple[int, Location, str]]:
    """(rank, location, name) of the ``rank=R`` partitions among a directory's ``entries``, in
    their order: hidden names (``visible``) and names that are not partitions are skipped, a bad
    ``rank=`` name is ``partition_rank``'s ShardError (``where``: the directory as shown)."""
    for loc in entries:
        name = name_of(loc)
        if visible(name) and (rank := partition_rank(name, where)) is not None:
            yield rank, loc, name


def visible(name: str) -> bool:
    """Readers skip writer temporaries (dot-prefixed) and Spark/Hadoop markers (underscore-prefixed)."""
    return not name.startswith((".", "_"))


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
    m = _SHARD_NAME.fullmatch(name)
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
    m = _SHARD_NAME.fullmatch(name_of(path))
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


#: Footers read per thread-pool task.
_FOOTER_CHUNK = 64


def _listdir(st: Store, path: Location, shown: str) -> list[Location]:
    """The entries of a directory by name, or a one-line ShardError naming it."""
    try:
        return st.listdir(path)
    except OSError as exc:
        raise ShardError(f"{shown}: cannot list the directory ({type(exc).__name__}); check permissions") from None


def _entries(st: Store, path: Location, shown: str) -> list[tuple[Location, str, int | None]]:
    """(entry, name, size) of a directory's visible Parquet entries by name (``_shard_like``);
    locally one listing and a ``stat`` per entry (links followed; thousands of shards per rank,
    each a Path built once); size -2 where ``_size`` must ask (a remote store)."""
    if not isinstance(path, Path):
        return [(f, n, -2) for f in _listdir(st, path, shown) if _shard_like(n := name_of(f))]
    try:
        names = sorted(filter(_shard_like, os.listdir(path)))
    except OSError as exc:
        raise ShardError(f"{shown}: cannot list the directory ({type(exc).__name__}); check permissions") from None
    out: list[tuple[Location, str, int | None]] = []
    # A child path from a name known to be one (a directory entry): pathlib's own fast route
    # (what iterdir uses), 10x cheaper than ``path / name``'s parse on hundreds of thousands of
    # shards; ``os.stat`` of a string, cheaper than a DirEntry's (the same call, links followed).
    child = getattr(path, "_make_child_relpath", path.joinpath)
    base = os.path.join(path, "")
    stat_of, regular = os.stat, stat.S_ISREG
    for name in names:
        try:
            info = stat_of(base + name)
            size = info.st_size if regular(info.st_mode) else None
        except (OSError, ValueError):
            size = None
        out.append((child(name), name, size))
    return out


def _shard_like(name: str) -> bool:
    """A visible Parquet file name: what ``scan_shards`` lists as a shard."""
    return visible(name) and name.endswith(".parquet")


def _size(st: Store, loc: Location) -> int | None:
    """The size of a regular file (links followed), None for anything else (as ``Path.is_file``);
    a remote file's from the run's one listing (-1 when the listing does not say: its footer is
    then parsed at open, committed or not)."""
    if not isinstance(loc, Path):
        if not st.is_file(loc):
            return None
        size = st.size(loc)
        return -1 if size is None else size
    try:
        info = os.stat(loc)
    except (OSError, ValueError):
        return None
    return info.st_size if stat.S_ISREG(info.st_mode) else None


def _partitions(
    st: Store, root: Location, label: str, ranks: set[int], world_size: int
) -> Iterator[tuple[str, int, Location, str]]:
    """(table, rank, directory, shown prefix) of every partition of ``ranks``, by table, then
    rank directory; a partition that is not a directory or outside the world size is refused."""
    for table in contract.TABLES:
        tdir = st.join(root, table)
        if not st.is_dir(tdir):
            continue
        for rank, rdir, rname in partitions(_listdir(st, tdir, f"{label}/{table}"), f"{label}/{table}"):
            if not st.is_dir(rdir):
                raise ShardError(
                    f"{label}/{table}/{rname}: not a directory (a file, a dangling link or a link loop); "
                    "delete it or re-run the capture"
                )
            if rank >= world_size:
                raise ShardError(
                    f"{label}/{table}/{rname}: rank {rank} is outside world size {world_size}; "
                    "delete the partition or check that it belongs to this run"
                )
            if rank in ranks:  # a rank without a manifest: tolerated (or refused) as a missing rank
                yield table, rank, rdir, f"{label}/{table}/{rname}/"


class _Validator:
    """The footer checks of ``scan_shards``, with the per-table cache of distinct schemas."""

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


def _stated(
    path: Location, table: str, rank: int, segment: int, num_rows: int, step_min: int | None, step_max: int | None,
    window: int, footer_crc32: int, shown: str,
) -> ShardInfo:  # fmt: skip
    """``ShardInfo(...)`` of a shard its commit line states, built without the frozen dataclass's
    ``__init__`` (an ``object.__setattr__`` per field: a fifth of a run's opening on hundreds of
    thousands of shards); the same object: equal, hashed and printed alike."""
    info = _new(ShardInfo)
    d = info.__dict__
    d["path"], d["table"], d["rank"], d["segment"], d["num_rows"] = path, table, rank, segment, num_rows
    d["step_min"], d["step_max"], d["window"], d["footer_crc32"], d["shown"] = (
        step_min, step_max, window, footer_crc32, shown
    )  # fmt: skip
    return info


_new = object.__new__
# _stated sets every field, in the dataclass's order (its repr and comparisons follow that order).
assert tuple(_stated(*range(10)).__dict__) == tuple(f.name for f in fields(ShardInfo))


def _fact(committed: Committed | None, table: str, rank: int, path: Location) -> CommittedShard | None:
    """What a commit line states of the window a parsed shard's name names (any zero padding)."""
    if not committed:
        return None
    m = _SHARD_NAME.fullmatch(name_of(path))
    return None if m is None else committed.get((table, rank, contract.shard_name(int(m.group(1)), int(m.group(2)))))


def scan_shards(
    root: Location,
    label: str,
    ranks: set[int],
    world_size: int,
    st: Store | None = None,
    committed: Committed | None = None,
) -> dict[str, tuple[ShardInfo, ...]]:
    """Every shard of ``ranks`` under ``root``, by table, sorted by (rank, name): validated from
    its footer, or, when ``committed`` states it and its size agrees, from its commit line (its
    footer is then checked on first read: ``committed.FooterChecks``). ``st``: the run's store
    (default: the local file system)."""
    st = st if st is not None else Store(Path(root), str(root))
    # Hundreds of thousands of shards per run: one pass, the per-file work kept to what each
    # needs; a shard its commit line states is described on the spot, the others (their place
    # kept in their table's list) once their footers are read below, in listing order.
    by_table: dict[str, list[ShardInfo | None]] = {}
    candidates: list[tuple[list[ShardInfo | None], int, str, int, Location, str, int]] = []
    stated = (committed or {}).get
    for table, rank, rdir, prefix in _partitions(st, root, label, ranks, world_size):
        infos = by_table.setdefault(table, [])
        for path, fname, size in _entries(st, rdir, prefix[:-1]):
            shown = prefix + shown_name(fname)
            if size == -2:
                size = _size(st, path)
            if size is None:  # silently skipping it would hide a shard
                raise ShardError(
                    f"{shown}: not a regular file (a directory, a dangling link or a link loop); {FIX_SHARD}"
                )
            got = stated((table, rank, fname))
            if got is not None and got[1] == size:
                rows, _, lo, hi, crc, segment, window = got
                infos.append(_stated(path, table, rank, segment, rows, lo if rows else None, hi if rows else None,
                                     window, crc, shown))  # fmt: skip
            else:
                candidates.append((infos, len(infos), table, rank, path, shown, size))
                infos.append(None)
    # Footers in chunks: one pool task per file costs more in task overhead than the
    # parsing it overlaps (measured on thousands of small shards). Results are consumed in
    # candidate order as they arrive, so checking them overlaps reading the next chunks.
    step = _FOOTER_CHUNK
    chunked = [[c[4] for c in candidates[j : j + step]] for j in range(0, len(candidates), step)]
    check = _Validator()
    with ThreadPoolExecutor(max_workers=min(8, (os.cpu_count() or 2) * 2)) as pool:
        footers = (md for part in pool.map(lambda ps: [read_footer(st, p) for p in ps], chunked) for md in part)
        for (infos, i, table, rank, path, shown, size), md in zip(candidates, footers, strict=True):
            infos[i] = info = check.info(table, rank, path, shown, md)
            got = _fact(committed, table, rank, path)
            # Other rows than committed: the completeness check's row_mismatch gap, as always.
            if (
                got is not None and 0 <= size != got[1] and info.num_rows == got[0]
            ):  # a usable footer, not the committed file
                raise ShardError(
                    f"{shown}: {size} bytes, its commit line says {got[1]}: the shard was truncated, "
                    f"rewritten or replaced after its window was committed; {FIX_SHARD}"
                )
    # Every place is filled in by now: from its commit line or its footer.
    return {t: cast(tuple[ShardInfo, ...], tuple(v)) for t, v in by_table.items() if v}
