"""Open a detfp run directory: validate it cheaply, then scan its tables lazily (no torch).

Pipeline of ``open_run``: manifests (``manifest/rank=R/segment-S.json``: JSON, keys,
versions, world size, ranks) -> shard footers (``<table>/rank=R/*.parquet``: Parquet
magic, contract columns and types, and, from the column statistics, the rank column
against the partition, nulls in non-nullable columns, and each shard's step range) ->
a frozen ``Run``. Only footers are read, in a small thread pool, so validating thousands
of shards costs milliseconds each and never reads data. Dot- and underscore-prefixed
files (the writer's temporaries, ``_SUCCESS``) and non-Parquet names are ignored.

``Run.scan`` returns a polars LazyFrame over the chosen shards: rank selection prunes
files, step selection prunes files by their footer step range and pushes the predicate
down to row groups, and rows of a (rank, step) that a later segment (a resume appended
to the same directory) captured again are dropped. Every error is a typed
``detfp_analyze.errors`` error whose one-line message names the file, the problem and
the fix.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from detfp_analyze.errors import (
    DuplicateRankError,
    ManifestError,
    MissingRankError,
    NotARunError,
    SchemaVersionError,
    ShardError,
)
from detfp_capture import contract
from detfp_capture.arrowschema import SCHEMA_VERSION_KEY, arrow_schema

__all__ = ["Run", "ShardInfo", "Steps", "as_run", "open_run", "polars_schema"]

#: A step selection: one step, a ``range`` (``range(3, 7)`` is steps 3..6), or any collection of steps.
Steps = int | range | Iterable[int]

_POLARS_TYPES: dict[str, pl.DataType] = {
    "int32": pl.Int32(),
    "int64": pl.Int64(),
    "uint64": pl.UInt64(),
    "float64": pl.Float64(),
    "bool": pl.Boolean(),
    "string": pl.String(),
    "large_binary": pl.Binary(),
    "list<int64>": pl.List(pl.Int64()),
    "list<string>": pl.List(pl.String()),
}
_FIX_SHARD = "delete it or re-run the capture"
_FIX_RUN = "pass the directory given to detfp_capture.Session(...) or --out"


def polars_schema(table: str) -> pl.Schema:
    """The polars schema of a contract table (column order as in the contract)."""
    return pl.Schema({c.name: _POLARS_TYPES[c.type] for c in contract.columns(table)})


@dataclass(frozen=True)
class ShardInfo:
    """What one shard's footer says (no data read)."""

    #: Absolute path of the Parquet file.
    path: Path
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


# eq=False: identity equality and hashing, so a Run can key caches (its mappings are unhashable).
@dataclass(frozen=True, eq=False)
class Run:
    """A validated run directory. Build it with ``open_run``; all data access is lazy."""

    #: Resolved path of the run directory.
    path: Path
    #: The path as the user gave it: used in messages and reports so they are byte-stable.
    label: str
    #: Number of ranks of the job (equal in every manifest).
    world_size: int
    #: Ranks that have a manifest, sorted.
    ranks: tuple[int, ...]
    #: Ranks of 0..world_size-1 without a manifest (non-empty only with allow_missing_ranks=True).
    missing_ranks: tuple[int, ...]
    #: rank -> its manifests sorted by segment.
    manifests: Mapping[int, tuple[dict, ...]]
    #: Tables with at least one shard.
    tables: frozenset[str]
    #: table -> its shards, sorted by (rank, file name); only ranks with a manifest.
    shards: Mapping[str, tuple[ShardInfo, ...]] = field(repr=False)

    def __repr__(self) -> str:
        # Short on purpose: the manifests of thousands of ranks are one attribute away.
        missing = f", missing ranks {_ranges(self.missing_ranks)}" if self.missing_ranks else ""
        return (
            f"Run({self.label!r}: world size {self.world_size}, ranks {_ranges(self.ranks)}{missing}, "
            f"tables {', '.join(sorted(self.tables)) or '-'})"
        )

    def manifest(self, rank: int | None = None) -> dict:
        """The latest segment's manifest of ``rank`` (default: the lowest rank present)."""
        r = self.ranks[0] if rank is None else rank
        if r not in self.manifests:
            raise MissingRankError(
                f"{self.label}: rank {r} is not in this run (ranks present: {_ranges(self.ranks)}); pick one of those"
            )
        return self.manifests[r][-1]

    def segments(self, rank: int) -> tuple[int, ...]:
        """Segments (process launches) of ``rank``, sorted."""
        return tuple(m["segment"] for m in self.manifests.get(rank, ()))

    def files(self, table: str, ranks: Iterable[int] | None = None) -> list[Path]:
        """Every shard path of ``table`` for ``ranks`` (default all), sorted by rank then file name.

        Raw files: rows superseded by a later segment are still in them (see ``supersession``).
        """
        contract.columns(table)  # KeyError naming the known tables
        wanted = None if ranks is None else {int(r) for r in ([ranks] if isinstance(ranks, int) else ranks)}
        return [s.path for s in self.shards.get(table, ()) if wanted is None or s.rank in wanted]

    def supersession(self) -> tuple[tuple[int, int, int], ...]:
        """(rank, segment, first_step) triples: rows of that rank and segment with step >= first_step
        were captured again by a later segment (a resume appended to the run) and are ignored by ``scan``.

        For readers that bypass ``scan`` (SQL over ``files``). Sorted; empty for single-segment runs.
        """
        return tuple(sorted((r, s, c) for (r, s), c in self._cutoffs().items()))

    def scan(self, table: str, ranks: Iterable[int] | None = None, steps: Steps | None = None) -> pl.LazyFrame:
        """Lazy frame of ``table`` with exactly the contract's columns and types.

        ``ranks`` selects partitions (files); ``steps`` prunes files by their step range
        and filters rows (pushed down to row groups). Rows come in file order: by rank,
        then segment and flush window, then write order (``seq`` increasing within a
        (rank, segment)). Rows of a (rank, step) captured again by a later segment are
        dropped. An absent table gives an empty frame of the same schema.
        """
        schema = polars_schema(table)
        shards = self._select(table, ranks, steps)
        if not shards:
            return pl.LazyFrame(schema=schema)
        lf = pl.scan_parquet(
            [str(s.path) for s in shards],
            schema=schema,
            hive_partitioning=False,
            glob=False,
            extra_columns="ignore",
        ).select(list(schema))
        if steps is not None:
            lf = lf.filter(_step_predicate(steps))
        dropped = self._superseded({s.rank for s in shards})
        if dropped is not None:
            lf = lf.filter(~dropped)
        return lf

    # -------------------------------------------------------------- internals
    def _select(self, table: str, ranks: Iterable[int] | None, steps: Steps | None) -> list[ShardInfo]:
        contract.columns(table)  # KeyError naming the known tables
        shards = self.shards.get(table, ())
        if ranks is not None:
            wanted = {int(r) for r in ([ranks] if isinstance(ranks, int) else ranks)}
            shards = tuple(s for s in shards if s.rank in wanted)
        if steps is not None:
            lo, hi = _step_bounds(steps)
            shards = tuple(
                s for s in shards if s.step_min is None or s.step_max is None or (s.step_max >= lo and s.step_min <= hi)
            )
        cutoffs = self._cutoffs()
        # A shard entirely past the start of a later segment holds only superseded rows.
        return [s for s in shards if s.step_min is None or s.step_min < cutoffs.get((s.rank, s.segment), _INF)]

    def _cutoffs(self) -> dict[tuple[int, int], int]:
        """(rank, segment) -> first step a later segment of that rank captured again."""
        out: dict[tuple[int, int], int] = {}
        for rank, manifests in self.manifests.items():
            later: int | None = None
            for m in reversed(manifests):
                if later is not None:
                    out[(rank, m["segment"])] = later
                start = m.get("start_step")
                if start is not None:
                    later = start if later is None else min(later, start)
        return out

    def _superseded(self, ranks: set[int]) -> pl.Expr | None:
        """Predicate true on rows superseded by a later segment (None when nothing is)."""
        by_pair: dict[tuple[int, int], list[int]] = {}
        for (rank, segment), cutoff in self._cutoffs().items():
            if rank in ranks:
                by_pair.setdefault((segment, cutoff), []).append(rank)
        if not by_pair:
            return None
        expr: pl.Expr | None = None
        for (segment, cutoff), pair_ranks in sorted(by_pair.items()):
            term = (pl.col("segment") == segment) & (pl.col("step") >= cutoff)
            # Resumes usually happen on every rank at the same step: one term covers them all.
            if set(pair_ranks) != ranks:
                term = term & pl.col("rank").is_in(sorted(pair_ranks))
            expr = term if expr is None else expr | term
        return expr


_INF = float("inf")


def _step_bounds(steps: Steps) -> tuple[float, float]:
    if isinstance(steps, int):
        return steps, steps
    if isinstance(steps, range):
        return (steps.start, steps.stop - 1) if steps.step == 1 else (min(steps, default=0), max(steps, default=-1))
    values = [int(s) for s in steps]
    return (min(values), max(values)) if values else (0, -1)


def _step_predicate(steps: Steps) -> pl.Expr:
    if isinstance(steps, int):
        return pl.col("step") == steps
    if isinstance(steps, range) and steps.step == 1:
        return pl.col("step").is_between(steps.start, steps.stop - 1)
    return pl.col("step").is_in(sorted({int(s) for s in steps}))


def _ranges(values: Iterable[int]) -> str:
    """'0-3, 5, 7-8' for a set of ints (short messages for thousands of ranks)."""
    vs = sorted(set(values))
    parts: list[str] = []
    i = 0
    while i < len(vs):
        j = i
        while j + 1 < len(vs) and vs[j + 1] == vs[j] + 1:
            j += 1
        parts.append(str(vs[i]) if i == j else f"{vs[i]}-{vs[j]}")
        i = j + 1
    return ", ".join(parts) if parts else "none"


def _partition_rank(name: str) -> int | None:
    if not name.startswith("rank="):
        return None
    digits = name[len("rank=") :]
    return int(digits) if digits.isdigit() else None


def _visible(name: str) -> bool:
    # Writer temporaries are dot-prefixed; Spark/Hadoop markers are underscore-prefixed.
    return not name.startswith((".", "_"))


# ------------------------------------------------------------------- manifests
def _read_manifests(root: Path, label: str) -> dict[int, dict[int, dict]]:
    mroot = root / contract.MANIFEST_DIR
    if not mroot.is_dir():
        raise NotARunError(f"{label}: not a detfp run (no {contract.MANIFEST_DIR}/ directory); {_FIX_RUN}")
    found: dict[int, dict[int, dict]] = {}
    for rdir in sorted(mroot.iterdir()):
        rank = _partition_rank(rdir.name)
        if rank is None or not rdir.is_dir():
            continue
        for mfile in sorted(rdir.iterdir()):
            name = mfile.name
            if not _visible(name) or not (name.startswith("segment-") and name.endswith(".json")):
                continue
            digits = name[len("segment-") : -len(".json")]
            shown = f"{label}/{contract.MANIFEST_DIR}/{rdir.name}/{name}"
            if not digits.isdigit():
                raise ManifestError(f"{shown}: file name is not segment-<number>.json; rename or delete it")
            segment = int(digits)
            manifest = _load_manifest(mfile, shown)
            if manifest["rank"] != rank or manifest["segment"] != segment:
                raise ManifestError(
                    f"{shown}: says rank {manifest['rank']} segment {manifest['segment']} but its path says "
                    f"rank {rank} segment {segment}; move it to "
                    f"{contract.manifest_relpath(manifest['rank'], manifest['segment'])} or re-run the capture"
                )
            per_rank = found.setdefault(rank, {})
            if segment in per_rank:
                raise DuplicateRankError(
                    f"{shown}: a second manifest for rank {rank} segment {segment}; delete the stray copy"
                )
            per_rank[segment] = manifest
    if not found:
        raise NotARunError(
            f"{label}: not a detfp run (no {contract.MANIFEST_DIR}/rank=N/segment-N.json files); {_FIX_RUN}"
        )
    return found


def _load_manifest(path: Path, shown: str) -> dict:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ManifestError(
            f"{shown}: unreadable ({type(exc).__name__}); check permissions or re-run the capture"
        ) from None
    try:
        manifest = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ManifestError(
            f"{shown}: not valid JSON ({exc.msg} at line {exc.lineno}); restore the file or re-run the capture"
        ) from None
    if not isinstance(manifest, dict):
        raise ManifestError(f"{shown}: not a JSON object; restore the file or re-run the capture")
    missing = [k for k in contract.MANIFEST_KEYS if k not in manifest]
    if missing:
        raise ManifestError(
            f"{shown}: missing key(s) {', '.join(missing)}; the file was not written by a detfp capture "
            "of this schema, re-run the capture"
        )
    for key in ("schema_version", "digest_version"):
        want = contract.SCHEMA_VERSION if key == "schema_version" else contract.DIGEST_VERSION
        if manifest[key] != want:
            raise SchemaVersionError(
                f"{shown}: {key} {manifest[key]!r} is not supported (this detfp reads {key} {want}); "
                "analyze it with the detfp release that wrote it, or re-run the capture with this one"
            )
    for key in ("rank", "world_size", "segment"):
        v = manifest[key]
        if not isinstance(v, int) or isinstance(v, bool) or v < (1 if key == "world_size" else 0):
            raise ManifestError(f"{shown}: {key} is {v!r}, expected a non-negative integer; re-run the capture")
    start = manifest["start_step"]
    if start is not None and (not isinstance(start, int) or isinstance(start, bool)):
        raise ManifestError(f"{shown}: start_step is {start!r}, expected an integer or null; re-run the capture")
    return manifest


# ---------------------------------------------------------------------- shards
@dataclass
class _SchemaCheck:
    """Result of checking one distinct Parquet schema (shared by all shards that have it)."""

    problem: str | None
    #: column name -> leaf column index, for the columns whose statistics are read.
    index: dict[str, int]


def _type_ok(actual: pa.DataType, expected: pa.DataType) -> bool:
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


def _check_schema(table: str, md: pq.FileMetaData) -> _SchemaCheck:
    try:
        actual = md.schema.to_arrow_schema()
    except Exception as exc:  # pyarrow raises several types for exotic footers
        return _SchemaCheck(f"footer schema unreadable ({type(exc).__name__})", {})
    expected = arrow_schema(table)
    missing = [f.name for f in expected if f.name not in actual.names]
    if missing:
        return _SchemaCheck(f"missing column(s) {', '.join(missing)} of table {table}", {})
    for f in expected:
        got = actual.field(f.name).type
        if not _type_ok(got, f.type):
            return _SchemaCheck(f"column {f.name} has type {got}, the contract says {f.type}", {})
    paths = [md.schema.column(i).path for i in range(md.num_columns)]
    want = {c.name for c in contract.columns(table) if c.name in ("rank", "segment", "step") or not c.nullable}
    index = {p: i for i, p in enumerate(paths) if p in want}
    return _SchemaCheck(None, index)


def _read_footer(path: Path) -> pq.FileMetaData | str:
    try:
        return pq.read_metadata(path)
    except Exception as exc:  # ArrowInvalid, OSError, ...: all mean "not usable Parquet"
        return " ".join(str(exc).split())[:160] or type(exc).__name__


def _file_segment(name: str) -> int:
    if name.startswith("part-s"):
        digits = name[len("part-s") :].split("-", 1)[0]
        if digits.isdigit():
            return int(digits)
    return -1


#: Columns whose footer min/max a ShardInfo needs (the rest are only checked for nulls).
_RANGE_COLUMNS = frozenset(("rank", "segment", "step"))


def _shard_info(
    table: str,
    rank: int,
    path: Path,
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
                raise ShardError(f"{shown}: column {name} holds nulls, the contract does not allow them; {_FIX_SHARD}")
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
    segment = lo["segment"] if "segment" in lo and lo["segment"] == hi["segment"] else _file_segment(path.name)
    full = md.num_rows > 0 and "step" in lo and "step" not in no_stats
    return ShardInfo(
        path=path,
        table=table,
        rank=rank,
        segment=int(segment),
        num_rows=md.num_rows,
        step_min=int(lo["step"]) if full else None,
        step_max=int(hi["step"]) if full else None,
    )


#: Footers read per thread-pool task.
_FOOTER_CHUNK = 64


def _scan_shards(root: Path, label: str, ranks: set[int], world_size: int) -> dict[str, tuple[ShardInfo, ...]]:
    candidates: list[tuple[str, int, Path, str]] = []
    for table in contract.TABLES:
        tdir = root / table
        if not tdir.is_dir():
            continue
        for rdir in sorted(tdir.iterdir(), key=lambda p: p.name):
            rank = _partition_rank(rdir.name)
            if rank is None or not rdir.is_dir():
                continue
            if rank >= world_size:
                raise ShardError(
                    f"{label}/{table}/{rdir.name}: rank {rank} is outside world size {world_size}; "
                    "delete the partition or check that it belongs to this run"
                )
            if rank not in ranks:  # a rank without a manifest: tolerated (or refused) as a missing rank
                continue
            for f in sorted(rdir.iterdir(), key=lambda p: p.name):
                if _visible(f.name) and f.name.endswith(".parquet") and f.is_file():
                    candidates.append((table, rank, f, f"{label}/{table}/{rdir.name}/{f.name}"))
    # Footers in chunks: one pool task per file costs more in task overhead than the
    # parsing it overlaps (measured on thousands of small shards). Results are consumed in
    # candidate order as they arrive, so checking them overlaps reading the next chunks.
    step = _FOOTER_CHUNK
    chunked = [[c[2] for c in candidates[i : i + step]] for i in range(0, len(candidates), step)]
    nullables = {t: {c.name: c.nullable for c in contract.columns(t)} for t in contract.TABLES}
    checks: dict[str, list[tuple[pq.ParquetSchema, _SchemaCheck]]] = {}
    out: dict[str, list[ShardInfo]] = {}
    with ThreadPoolExecutor(max_workers=min(8, (os.cpu_count() or 2) * 2)) as pool:
        footers = (md for part in pool.map(lambda ps: [_read_footer(p) for p in ps], chunked) for md in part)
        for (table, rank, path, shown), md in zip(candidates, footers, strict=True):
            if isinstance(md, str):
                raise ShardError(f"{shown}: not a Parquet file ({md}); {_FIX_SHARD}")
            version = (md.metadata or {}).get(SCHEMA_VERSION_KEY)
            if version is not None and version != str(contract.SCHEMA_VERSION).encode():
                raise SchemaVersionError(
                    f"{shown}: schema version {version.decode(errors='replace')} is not supported (this detfp reads "
                    f"schema version {contract.SCHEMA_VERSION}); analyze it with the detfp release that wrote it"
                )
            # Shards of one writer share their schema: check each distinct schema once.
            known = checks.setdefault(table, [])
            check = next((c for s, c in known if s.equals(md.schema)), None)
            if check is None:
                check = _check_schema(table, md)
                known.append((md.schema, check))
            if check.problem is not None:
                raise ShardError(
                    f"{shown}: {check.problem}; the shard was not written to this contract; delete it or re-run the capture"
                )
            out.setdefault(table, []).append(_shard_info(table, rank, path, shown, md, check, nullables[table]))
    return {t: tuple(v) for t, v in out.items()}


def open_run(path: str | os.PathLike[str], *, allow_missing_ranks: bool = False) -> Run:
    """Validate a run directory and return a ``Run`` (nothing but footers and manifests is read).

    Raises NotARunError, ManifestError, SchemaVersionError, MissingRankError (unless
    ``allow_missing_ranks``: then the absent ranks are listed in ``Run.missing_ranks``),
    DuplicateRankError or ShardError; each message is one line naming the file, the
    problem and the fix.
    """
    label = os.fspath(path)
    root = Path(label)
    if not root.exists():
        raise NotARunError(f"{label}: no such directory; {_FIX_RUN}")
    if not root.is_dir():
        raise NotARunError(f"{label}: not a directory; {_FIX_RUN}")
    found = _read_manifests(root, label)
    sizes: dict[int, list[int]] = {}
    for rank, per_rank in found.items():
        for m in per_rank.values():
            sizes.setdefault(m["world_size"], []).append(rank)
    if len(sizes) > 1:
        parts = "; ".join(f"world_size {ws} on rank(s) {_ranges(rs)}" for ws, rs in sorted(sizes.items()))
        raise ManifestError(
            f"{label}: manifests disagree ({parts}); one run directory holds one job, "
            "move the other job's ranks to their own directory"
        )
    world_size = next(iter(sizes))
    outside = sorted(r for r in found if r >= world_size)
    if outside:
        raise ManifestError(
            f"{label}: manifests for rank(s) {_ranges(outside)} outside world size {world_size}; "
            "remove them or check that they belong to this run"
        )
    missing = tuple(r for r in range(world_size) if r not in found)
    if missing and not allow_missing_ranks:
        raise MissingRankError(
            f"{label}: missing rank(s) {_ranges(missing)} of world size {world_size} (no manifest); "
            "pass allow_missing_ranks=True (--allow-missing-ranks) to analyze the ranks present"
        )
    ranks = tuple(sorted(found))
    shards = _scan_shards(root.resolve(), label, set(ranks), world_size)
    manifests = {r: tuple(found[r][s] for s in sorted(found[r])) for r in ranks}
    return Run(
        path=root.resolve(),
        label=label,
        world_size=world_size,
        ranks=ranks,
        missing_ranks=missing,
        manifests=MappingProxyType(manifests),
        tables=frozenset(t for t, v in shards.items() if v),
        shards=MappingProxyType(shards),
    )


def as_run(run: Run | str | os.PathLike[str], *, allow_missing_ranks: bool = False) -> Run:
    """``run`` itself when it is a ``Run``, else ``open_run(run)``: public entry points take either."""
    return run if isinstance(run, Run) else open_run(run, allow_missing_ranks=allow_missing_ranks)
