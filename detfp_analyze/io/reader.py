"""Open a detfp run directory: validate it cheaply, then scan its tables lazily (no torch).

Pipeline of ``open_run``: manifests (``manifest/rank=R/segment-S.json``: size-limited JSON,
keys, versions, world size, ranks) -> shard footers (``footers``: Parquet magic, footer
size, contract columns and types, and, from the column statistics, the rank column against
the partition, nulls in non-nullable columns, and each shard's step range) -> completeness
(``completeness``: each launch's commit log against the shards on disk) -> a frozen
``Run``. Only footers, manifests and commit logs are read, in a small thread pool, so
validating thousands of shards costs milliseconds each and never reads data. Dot- and
underscore-prefixed files (the writer's temporaries, ``_SUCCESS``) and non-Parquet names
are ignored.

``Run.scan`` returns a polars LazyFrame over the chosen shards: rank selection prunes
files, step selection prunes files by their footer step range and pushes the predicate
down to row groups, rows of a (rank, step) that a later segment (a resume appended to the
same directory) captured again are dropped, and so are rows of steps the run does not
hold completely (only when opened with ``allow_incomplete``; otherwise such a run is
refused). Every error is a typed ``detfp_analyze.errors`` error whose one-line message
names the file, the problem and the fix.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import polars as pl

from detfp_analyze.errors import (
    DuplicateRankError,
    IncompleteRunError,
    ManifestError,
    MissingRankError,
    NotARunError,
    SchemaVersionError,
)
from detfp_analyze.io import completeness as _completeness
from detfp_analyze.io.footers import ShardInfo, partition_rank, scan_shards, shown_name, visible
from detfp_analyze.io.uri import local_path
from detfp_analyze.ranks import rank_list
from detfp_capture import contract

__all__ = ["MAX_MANIFEST_BYTES", "Run", "ShardInfo", "Steps", "as_run", "open_run", "polars_schema"]

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
#: Manifests larger than this are refused before parsing (a real one is a few KiB; the largest
#: part, the command line, is bounded by the OS at about 2 MiB).
MAX_MANIFEST_BYTES = 4 << 20
_FIX_RUN = "pass the directory given to detfp_capture.Session(...) or --out"


def polars_schema(table: str) -> pl.Schema:
    """The polars schema of a contract table (column order as in the contract)."""
    return pl.Schema({c.name: _POLARS_TYPES[c.type] for c in contract.columns(table)})


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
    #: table -> its shards, sorted by (rank, file name); only ranks with a manifest, and none the
    #: completeness check dropped (never committed, or not what their window committed).
    shards: Mapping[str, tuple[ShardInfo, ...]] = field(repr=False)
    #: What the commit logs say against what is on disk (gaps, per-segment status).
    completeness: _completeness.Completeness | None = field(default=None, repr=False)
    #: rank -> inclusive step ranges (last None: open-ended) whose rows ``scan`` leaves out: steps
    #: this run (or, after ``completeness.restrict_pair``, the run it is compared with) does not
    #: hold completely. Empty unless opened with ``allow_incomplete``.
    excluded: Mapping[int, _completeness.StepRanges] = field(default_factory=lambda: MappingProxyType({}), repr=False)

    def __repr__(self) -> str:
        # Short on purpose: the manifests of thousands of ranks are one attribute away.
        missing = f", missing ranks {rank_list(self.missing_ranks)}" if self.missing_ranks else ""
        return (
            f"Run({self.label!r}: world size {self.world_size}, ranks {rank_list(self.ranks)}{missing}, "
            f"tables {', '.join(sorted(self.tables)) or '-'})"
        )

    def manifest(self, rank: int | None = None) -> dict:
        """The latest segment's manifest of ``rank`` (default: the lowest rank present)."""
        r = self.ranks[0] if rank is None else rank
        if r not in self.manifests:
            raise MissingRankError(
                f"{self.label}: rank {r} is not in this run (ranks present: {rank_list(self.ranks)}); pick one of those"
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

    def exclusions(self) -> tuple[tuple[int, int, int | None], ...]:
        """(rank, first_step, last_step) triples (last None: open-ended) whose rows ``scan`` leaves
        out because they are not held completely; for readers that bypass ``scan``. Sorted."""
        return tuple((r, lo, hi) for r, ranges in sorted(self.excluded.items()) for lo, hi in ranges)

    def scan(
        self,
        table: str,
        ranks: Iterable[int] | None = None,
        steps: Steps | None = None,
        columns: Sequence[str] | None = None,
    ) -> pl.LazyFrame:
        """Lazy frame of ``table`` with exactly the contract's columns and types.

        ``ranks`` selects partitions (files); ``steps`` prunes files by their step range
        and filters rows (pushed down to row groups). Rows come in file order: by rank,
        then segment and flush window, then write order (``seq`` increasing within a
        (rank, segment)). Rows of a (rank, step) captured again by a later segment are
        dropped. An absent table gives an empty frame of the same schema. ``columns``: only
        these (in this order); the reader pushes the projection down anyway, but an engine that
        fetches rows from elsewhere (``detfp_analyze.spark``) then fetches only these.
        """
        lf = self._scan(table, ranks, steps)
        return lf if columns is None else lf.select(list(columns))

    def scan_spans(
        self, table: str, spans: Mapping[tuple[int, int], tuple[int, int]], columns: Sequence[str] | None = None
    ) -> pl.LazyFrame:
        """``scan`` of each (rank, step) of ``spans`` only within its inclusive ``seq`` span, in
        (rank, step) order (one scan per span, so the row groups' seq statistics skip the rest of
        its file). No spans: an empty frame."""
        parts = [
            self._scan(table, [r], [s]).filter(pl.col("seq").is_between(lo, hi))
            for (r, s), (lo, hi) in sorted(spans.items())
        ]
        lf = pl.concat(parts) if len(parts) > 1 else parts[0] if parts else pl.LazyFrame(schema=polars_schema(table))
        return lf if columns is None else lf.select(list(columns))

    def _scan(self, table: str, ranks: Iterable[int] | None, steps: Steps | None) -> pl.LazyFrame:
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
        excluded = self._excluded_expr({s.rank for s in shards})
        if excluded is not None:
            lf = lf.filter(~excluded)
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
        return _completeness.cutoffs(self.manifests)

    def _excluded_expr(self, ranks: set[int]) -> pl.Expr | None:
        """Predicate true on rows of steps not held completely (None when nothing is excluded)."""
        expr: pl.Expr | None = None
        for rank, ranges in self.excluded.items():
            if rank not in ranks:
                continue
            for lo, hi in ranges:
                term = pl.col("step") >= lo if hi is None else pl.col("step").is_between(lo, hi)
                term = (pl.col("rank") == rank) & term
                expr = term if expr is None else expr | term
        return expr

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


# ------------------------------------------------------------------- manifests
#: World sizes above this are refused: no job has a million ranks, and the reader enumerates them.
_MAX_WORLD = 1 << 20
#: Manifest keys that hold JSON objects, and the one that holds a list of strings.
_OBJECT_KEYS = ("parallel", "groups", "versions", "host", "determinism", "env", "git", "capture")


def _listdir(path: Path, shown: str) -> list[Path]:
    try:
        return sorted(path.iterdir(), key=lambda p: p.name)
    except OSError as exc:
        raise ManifestError(f"{shown}: cannot list the directory ({type(exc).__name__}); check permissions") from None


def _read_manifests(root: Path, label: str) -> dict[int, dict[int, dict]]:
    mroot = root / contract.MANIFEST_DIR
    if not mroot.is_dir():
        raise NotARunError(f"{label}: not a detfp run (no {contract.MANIFEST_DIR}/ directory); {_FIX_RUN}")
    found: dict[int, dict[int, dict]] = {}
    for rdir in _listdir(mroot, f"{label}/{contract.MANIFEST_DIR}"):
        if not visible(rdir.name):
            continue
        rank = partition_rank(rdir.name, f"{label}/{contract.MANIFEST_DIR}")
        if rank is None:
            continue
        rshown = f"{label}/{contract.MANIFEST_DIR}/{rdir.name}"
        if not rdir.is_dir():
            raise ManifestError(f"{rshown}: not a directory (a file, a dangling link or a link loop); delete it")
        for mfile in _listdir(rdir, rshown):
            name = mfile.name
            if not visible(name) or not (name.startswith("segment-") and name.endswith(".json")):
                continue
            digits = name[len("segment-") : -len(".json")]
            shown = f"{rshown}/{shown_name(name)}"
            if not (digits.isascii() and digits.isdigit()):
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


def _read_limited(path: Path, shown: str) -> bytes:
    """The manifest's bytes, refusing anything that is not a regular file or is too large to be one."""
    try:
        with open(path, "rb") as f:
            if not os.path.isfile(path):
                raise ManifestError(f"{shown}: not a regular file; delete it or re-run the capture")
            data = f.read(MAX_MANIFEST_BYTES + 1)
    except OSError as exc:
        raise ManifestError(
            f"{shown}: unreadable ({type(exc).__name__}: a dangling link, a link loop or no permission); "
            "check the file or re-run the capture"
        ) from None
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestError(
            f"{shown}: larger than {MAX_MANIFEST_BYTES >> 20} MiB, far beyond any manifest; "
            "it was not written by detfp, restore the file or re-run the capture"
        )
    return data


def _load_manifest(path: Path, shown: str) -> dict:
    data = _read_limited(path, shown)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ManifestError(f"{shown}: not UTF-8 text; restore the file or re-run the capture") from None
    try:
        manifest = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ManifestError(
            f"{shown}: not valid JSON ({exc.msg} at line {exc.lineno}); restore the file or re-run the capture"
        ) from None
    except RecursionError:
        raise ManifestError(f"{shown}: JSON nested too deeply; restore the file or re-run the capture") from None
    except ValueError as exc:  # e.g. an integer of thousands of digits
        reason = " ".join(str(exc).split())[:80]
        raise ManifestError(f"{shown}: not valid JSON ({reason}); restore the file or re-run the capture") from None
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
        if manifest[key] != want or isinstance(manifest[key], bool):
            raise SchemaVersionError(
                f"{shown}: {key} {_short(manifest[key])} is not supported (this detfp reads {key} {want}); "
                "analyze it with the detfp release that wrote it, or re-run the capture with this one"
            )
    for key, top in (("rank", _MAX_WORLD), ("world_size", _MAX_WORLD + 1), ("segment", 1 << 31)):
        v = manifest[key]
        if not isinstance(v, int) or isinstance(v, bool) or not (1 if key == "world_size" else 0) <= v < top:
            raise ManifestError(
                f"{shown}: {key} is {_short(v)}, expected an integer in "
                f"{1 if key == 'world_size' else 0}..{top - 1}; re-run the capture"
            )
    start = manifest["start_step"]
    if start is not None and (not isinstance(start, int) or isinstance(start, bool) or not 0 <= start < (1 << 62)):
        raise ManifestError(
            f"{shown}: start_step is {_short(start)}, expected a non-negative integer or null; re-run the capture"
        )
    for key in _OBJECT_KEYS:
        if not isinstance(manifest[key], dict):
            raise ManifestError(
                f"{shown}: {key} is {_short(manifest[key])}, expected a JSON object; restore the file or re-run the capture"
            )
    groups = manifest["groups"]
    if not all(isinstance(v, list) and all(_is_rank(x, manifest["world_size"]) for x in v) for v in groups.values()):
        raise ManifestError(
            f"{shown}: groups must map names to lists of ranks below world_size {manifest['world_size']}; "
            "restore the file or re-run the capture"
        )
    if not isinstance(manifest["command"], list) or not all(isinstance(x, str) for x in manifest["command"]):
        raise ManifestError(f"{shown}: command must be a list of strings; restore the file or re-run the capture")
    if not isinstance(manifest["digest_algorithm"], str):
        raise ManifestError(f"{shown}: digest_algorithm must be a string; restore the file or re-run the capture")
    return manifest


def _is_rank(x: Any, world_size: int) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < world_size


def _short(value: Any) -> str:
    """A JSON value for a one-line message: at most 40 characters, no control characters."""
    text = shown_name(json.dumps(value, ensure_ascii=False)[:60])
    return text if len(text) <= 40 else text[:37] + "..."


def open_run(path: str | os.PathLike[str], *, allow_missing_ranks: bool = False, allow_incomplete: bool = False) -> Run:
    """Validate a run directory and return a ``Run`` (nothing but footers, manifests and commit logs is read).

    Raises NotARunError, ManifestError, SchemaVersionError, MissingRankError (unless
    ``allow_missing_ranks``: then the absent ranks are listed in ``Run.missing_ranks``),
    DuplicateRankError, ShardError or IncompleteRunError (unless ``allow_incomplete``: then
    ``Run.completeness`` lists the gaps, shards that were never committed are left out, and
    ``scan`` leaves out the steps not held completely); each message is one line naming the
    file, the problem and the fix.
    """
    label = shown_name(os.fspath(path))
    root = Path(local_path(os.fspath(path), label))  # file:// URIs are local paths (io.uri)
    if not root.exists():
        what = "a dangling symbolic link or a link loop" if root.is_symlink() else "no such directory"
        raise NotARunError(f"{label}: {what}; {_FIX_RUN}")
    if not root.is_dir():
        raise NotARunError(f"{label}: not a directory; {_FIX_RUN}")
    found = _read_manifests(root, label)
    sizes: dict[int, list[int]] = {}
    for rank, per_rank in found.items():
        for m in per_rank.values():
            sizes.setdefault(m["world_size"], []).append(rank)
    if len(sizes) > 1:
        parts = "; ".join(f"world_size {ws} on rank(s) {rank_list(rs)}" for ws, rs in sorted(sizes.items()))
        raise ManifestError(
            f"{label}: manifests disagree ({parts}); one run directory holds one job, "
            "move the other job's ranks to their own directory"
        )
    world_size = next(iter(sizes))
    outside = sorted(r for r in found if r >= world_size)
    if outside:
        raise ManifestError(
            f"{label}: manifests for rank(s) {rank_list(outside)} outside world size {world_size}; "
            "remove them or check that they belong to this run"
        )
    missing = tuple(r for r in range(world_size) if r not in found)
    if missing and not allow_missing_ranks:
        raise MissingRankError(
            f"{label}: missing rank(s) {rank_list(missing)} of world size {world_size} (no manifest); "
            "pass allow_missing_ranks=True (--allow-missing-ranks) to analyze the ranks present"
        )
    ranks = tuple(sorted(found))
    shards = scan_shards(root.resolve(), label, set(ranks), world_size)
    manifests = {r: tuple(found[r][s] for s in sorted(found[r])) for r in ranks}
    comp = _completeness.check(root.resolve(), label, manifests, shards)
    if comp.gaps and not allow_incomplete:
        raise IncompleteRunError(_completeness.refusal(label, comp))
    if comp.dropped:
        shards = {t: tuple(s for s in v if s.path not in comp.dropped) for t, v in shards.items()}
    return Run(
        path=root.resolve(),
        label=label,
        world_size=world_size,
        ranks=ranks,
        missing_ranks=missing,
        manifests=MappingProxyType(manifests),
        tables=frozenset(t for t, v in shards.items() if v),
        shards=MappingProxyType(shards),
        completeness=comp,
        excluded=MappingProxyType(dict(comp.excluded) if allow_incomplete else {}),
    )


def as_run(run: Run | str | os.PathLike[str], *, allow_missing_ranks: bool = False) -> Run:
    """``run`` itself when it is a ``Run``, else ``open_run(run)``: public entry points take either."""
    return run if isinstance(run, Run) else open_run(run, allow_missing_ranks=allow_missing_ranks)
