"""Open a detfp run directory: the one place a run's metadata is read, in one order (no torch).

``open_run`` sequences every read of a run before its data:

1. the directory: it exists and is one (``_root``);
2. the run index, the reader's cache (``runindex.load``): when it is current, it answers steps 3
   and 4 with the values they would parse;
3. the manifests (``manifests.read_manifests``: size-limited JSON, keys, versions, world size,
   ranks) -> the job's shape (``_shape``: one world size, no rank outside it, missing ranks);
4. the commit logs (``commit_logs.read_logs``) -> the shards their lines state
   (``commit_logs.committed_shards``) and the step folds (``stepsums.from_logs``); a local run
   whose index was not current then has it filled with what steps 3 and 4 parsed
   (``runindex.fill``, by the digests of the bytes parsed), so the next open reads it in bulk;
5. the shards (``shard_scan.scan_shards``): each from its commit line when one states it, else
   from its footer (Parquet magic, footer size, contract columns and types, statistics);
6. completeness (``completeness.check``): each launch's commit log against the shards on disk;
   an incomplete run is refused unless ``allow_incomplete``;

-> a frozen ``Run`` (``io.run``) whose ``scan`` reads tables lazily. Only footers, manifests and
commit logs are read, so validating thousands of shards costs milliseconds each and never reads
data. Every file access goes through ``io.store`` (local paths, or a URI / an explicit
``filesystem=`` read through pyarrow's file systems). Every error is a typed
``detfp_analyze.errors`` error whose one-line message names the file, the problem and the fix.

``index_run`` (``detfp-analyze index``) is steps 1, 3 and 4 with the index written: a pre-warm of
the cache the first ``open_run`` fills anyway.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from detfp_analyze import _gcpause
from detfp_analyze.errors import DetfpError, IncompleteRunError, ManifestError, MissingRankError, NotARunError
from detfp_analyze.io import completeness as _completeness
from detfp_analyze.io import runindex as _runindex
from detfp_analyze.io.commit_logs import committed_shards, read_logs
from detfp_analyze.io.committed_footers import FooterChecks
from detfp_analyze.io.manifests import FIX_RUN, MAX_MANIFEST_BYTES, read_manifests
from detfp_analyze.io.names import shown_name
from detfp_analyze.io.run import Run, RunView, Steps, polars_schema
from detfp_analyze.io.shard_info import ShardInfo
from detfp_analyze.io.shard_scan import scan_shards
from detfp_analyze.io.stepsums import from_logs
from detfp_analyze.io.store import Location, Store, store
from detfp_analyze.ranks import rank_list

# Run, RunView, ShardInfo, Steps and polars_schema are defined in ``io.run`` / ``io.shard_info``
# and named here too: ``detfp_analyze.io.reader`` is where users have always imported them from.
__all__ = [
    "MAX_MANIFEST_BYTES",
    "Run",
    "RunView",
    "ShardInfo",
    "Steps",
    "as_run",
    "index_run",
    "open_run",
    "polars_schema",
]


def open_run(
    path: str | os.PathLike[str],
    *,
    allow_missing_ranks: bool = False,
    allow_incomplete: bool = False,
    filesystem: Any = None,
    use_index: bool = True,
) -> Run:
    """Validate a run directory and return a ``Run`` (nothing but footers, manifests and commit logs is read).

    ``path``: a local directory, a ``file:`` URI, or a URI of another file system pyarrow reads
    (``s3://``, ``s3a://``, ``gs://``, ``hdfs://``: credentials and endpoints as pyarrow takes them,
    see docs/spark.md); with ``filesystem`` (a ``pyarrow.fs.FileSystem``), a path inside it.
    Raises NotARunError, ManifestError, SchemaVersionError, MissingRankError (unless
    ``allow_missing_ranks``: then the absent ranks are listed in ``Run.missing_ranks``),
    DuplicateRankError, ShardError or IncompleteRunError (unless ``allow_incomplete``: then
    ``Run.completeness`` lists the gaps, shards that were never committed are left out, and
    ``scan`` leaves out the steps not held completely); each message is one line naming the
    file, the problem and the fix. A file system that cannot be read (network, credentials) is a
    NotARunError naming the run. ``use_index``: take the manifests and commit logs from the run
    index when it is current, and fill it when it is not (``io.runindex``, a cache: the same
    ``Run`` either way); False: parse the files and write nothing.
    """
    label = shown_name(os.fspath(path))
    st = store(path, label, filesystem)  # file:// URIs are local paths (io.uri)
    try:
        with _gcpause.paused():  # hundreds of thousands of shard objects, none in a cycle
            return _open(st, st.root, label, allow_missing_ranks, allow_incomplete, use_index)
    except OSError as exc:  # not a typed error: a remote file system failing (network, credentials)
        if st.local:
            raise
        raise st.unreachable(exc) from None


@dataclass(frozen=True)
class _Shape:
    """The job the manifests describe (step 3)."""

    world_size: int
    #: Ranks with a manifest, sorted; the ranks of 0..world_size-1 without one.
    ranks: tuple[int, ...]
    missing: tuple[int, ...]
    #: rank -> its manifests sorted by segment.
    manifests: dict[int, tuple[dict, ...]]


def _open(
    st: Store, root: Location, label: str, allow_missing_ranks: bool, allow_incomplete: bool, use_index: bool
) -> Run:
    resolved = _root(st, root, label)
    values, shape = _metadata(st, root, resolved, label, allow_missing_ranks, use_index)
    # Commit logs first: shards whose commit line states them are not parsed now (footers).
    shards = scan_shards(resolved, label, set(shape.ranks), shape.world_size, st, values.committed)
    comp = _completeness.check(label, shape.manifests, shards, values.logs)
    if comp.gaps and not allow_incomplete:
        raise IncompleteRunError(_completeness.refusal(label, comp))
    if comp.dropped:
        shards = {t: tuple(s for s in v if s.path not in comp.dropped) for t, v in shards.items()}
    return Run(
        path=resolved,
        label=label,
        world_size=shape.world_size,
        ranks=shape.ranks,
        missing_ranks=shape.missing,
        manifests=MappingProxyType(shape.manifests),
        tables=frozenset(t for t, v in shards.items() if v),
        shards=MappingProxyType(shards),
        completeness=comp,
        excluded=MappingProxyType(dict(comp.excluded) if allow_incomplete else {}),
        store=None if st.local else st,
        footer_checks=FooterChecks(st),
        step_sums=values.folds,
        indexed=isinstance(values, _Cached),
    )


def _root(st: Store, root: Location, label: str) -> Location:
    """Step 1: the run's directory, resolved (a remote one as given), or a one-line NotARunError."""
    if isinstance(root, Path):
        if not root.exists():
            what = "a dangling symbolic link or a link loop" if root.is_symlink() else "no such directory"
            raise NotARunError(f"{label}: {what}; {FIX_RUN}")
        if not root.is_dir():
            raise NotARunError(f"{label}: not a directory; {FIX_RUN}")
        return root.resolve()
    if (kind := st.kind(root)) != "dir":
        raise NotARunError(f"{label}: {'no such directory' if kind == 'missing' else 'not a directory'}; {FIX_RUN}")
    return root


class _Cached(_runindex.Indexed):
    """Steps 3 and 4's values as a current run index held them."""


def _metadata(
    st: Store, root: Location, resolved: Location, label: str, allow_missing_ranks: bool, use_index: bool
) -> tuple[_runindex.Indexed, _Shape]:
    """Steps 2-4: the manifests, commit logs, step folds and committed shards, from the index
    when it is current, else parsed (and the index filled); the job's shape either way."""
    cached = _runindex.load(st, resolved, label) if use_index else None
    if cached is not None:
        values: _runindex.Indexed = _Cached(cached.manifests, cached.logs, cached.folds, cached.committed)
        return values, _shape(values.manifests, label, allow_missing_ranks)
    # The cache is filled for a local run only (it lives beside the run or in the user's cache).
    reading = _runindex.Hashing(st) if use_index and st.local and isinstance(resolved, Path) else st
    found = read_manifests(reading, root, label)
    shape = _shape(found, label, allow_missing_ranks)
    logs = read_logs(reading, resolved, label, shape.manifests)
    values = _runindex.Indexed(found, logs, from_logs(shape.manifests, logs), committed_shards(shape.manifests, logs))
    if isinstance(reading, _runindex.Hashing) and isinstance(resolved, Path):
        # A cache never fails an open: a run whose index can be written nowhere (OSError), whose
        # manifests hold a value JSON cannot state (ValueError), or whose manifest tree changed
        # under the listing (a typed error) is opened as it always was.
        with contextlib.suppress(OSError, ValueError, DetfpError):
            _runindex.fill(reading, resolved, label, values)
    return values, shape


def _shape(found: Mapping[int, Mapping[int, dict]], label: str, allow_missing_ranks: bool) -> _Shape:
    """Step 3's checks across manifests: one world size, no rank outside it, no missing rank
    (unless ``allow_missing_ranks``)."""
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
    return _Shape(world_size, ranks, missing, {r: tuple(found[r][s] for s in sorted(found[r])) for r in ranks})


def as_run(run: Run | str | os.PathLike[str], *, allow_missing_ranks: bool = False) -> Run:
    """``run`` itself when it is a ``Run``, else ``open_run(run)``: public entry points take either
    (a run on an explicit pyarrow file system: pass ``open_run(path, filesystem=fs)``)."""
    return run if isinstance(run, Run) else open_run(run, allow_missing_ranks=allow_missing_ranks)


def index_run(path: str | os.PathLike[str], *, check: bool = False) -> _runindex.Written | None:
    """``detfp-analyze index``: parse a local run's manifests and commit logs as ``open_run`` does
    and (re)write its index, the cache ``open_run`` consults (a pre-warm: the first ``open_run``
    fills it anyway); with ``check``, only say whether a current one exists (None: none, or a
    stale or damaged one). Raises the typed errors ``open_run`` raises for the run's manifests
    and commit logs (NotARunError, ManifestError, SchemaVersionError, ...), and NotARunError for
    a remote run, one that changed while it was read, or one whose index can be written nowhere."""
    label = shown_name(os.fspath(path))
    st = store(path, label, None)
    root = st.root
    if not st.local or not isinstance(root, Path):
        raise NotARunError(f"{label}: a run index is built for local runs only; copy the run to a local directory")
    if not root.is_dir():
        raise NotARunError(f"{label}: no such directory; {FIX_RUN}")
    root = root.resolve()
    if check:
        d = _runindex.locate(root)
        got = _runindex.load(st, root, label) if d is not None else None
        return None if got is None or d is None else _runindex.Written(d, 0, 0, got.folds.frame.height)
    reading = _runindex.Hashing(st)
    found = read_manifests(reading, root, label)
    manifests = {r: tuple(found[r][s] for s in sorted(found[r])) for r in sorted(found)}
    logs = read_logs(reading, root, label, manifests)
    for err in logs.values():
        if isinstance(err, Exception):
            raise err
    values = _runindex.Indexed(found, logs, from_logs(manifests, logs), committed_shards(manifests, logs))
    try:
        written = _runindex.fill(reading, root, label, values)
    except OSError as exc:
        raise NotARunError(
            f"{label}: the index can be written neither beside the run nor in {_runindex.cache_dir(root)} "
            f"({type(exc).__name__}); set XDG_CACHE_HOME to a writable directory"
        ) from None
    if written is None:
        raise NotARunError(
            f"{label}: the run changed while it was indexed; run detfp-analyze index again once it is written"
        )
    return written
