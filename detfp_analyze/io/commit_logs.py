"""A run's commit logs, read and parsed for ``reader.open_run`` (``manifest/rank=R/segment-S.commits``).

Each (rank, segment) with a manifest has, since the commit-log contract, a log saying which flush
windows it committed (rows per table, step span, the shards' facts, the step folds; the format is
in ``detfp_format.commitlog``). ``read_logs`` reads every one with a size limit through the run's
store, keeping a read error to be raised where the reader always raised it (after the shards'
own errors); ``committed_shards`` flattens the shard facts the lines state, so the shard scan
describes those shards without parsing their footers.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from detfp_analyze.errors import ManifestError, SchemaVersionError
from detfp_analyze.io.shard_info import Committed, CommittedShard, committed_shard
from detfp_analyze.io.store import Location, Store, name_of
from detfp_format import commitlog, contract

__all__ = ["Logs", "committed_shards", "read_logs"]


def _read_log(st: Store, path: Location, shown: str, manifest: Mapping[str, Any]) -> commitlog.LogState | None:
    """The parsed commit log, or None when there is none (legacy or lost: the caller decides)."""
    promised = manifest.get("commit_log")
    if promised is not None and (not isinstance(promised, int) or isinstance(promised, bool) or promised < 1):
        raise ManifestError(
            f"{shown}: commit_log is {json.dumps(promised)[:40]}, expected a positive integer; re-run the capture"
        )
    if isinstance(promised, int) and promised > commitlog.COMMIT_LOG_VERSION:
        raise SchemaVersionError(
            f"{shown}: commit_log version {promised} is not supported (this detfp reads "
            f"{commitlog.COMMIT_LOG_VERSION}); analyze it with the detfp release that wrote it"
        )
    try:
        data = st.read_limited(path, commitlog.COMMIT_LOG_MAX_BYTES)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ManifestError(
            f"{shown}: commit log {name_of(path)} unreadable ({type(exc).__name__}); check permissions"
        ) from None
    if data is None:  # a pipe, a device, a directory: never opened (a pipe would block the read)
        raise ManifestError(
            f"{shown}: commit log {name_of(path)} is not a regular file; delete it or re-run the capture"
        )
    if len(data) > commitlog.COMMIT_LOG_MAX_BYTES:
        raise ManifestError(
            f"{shown}: commit log {name_of(path)} is larger than {commitlog.COMMIT_LOG_MAX_BYTES >> 20} MiB; "
            "it is not a detfp commit log, delete it or re-run the capture"
        )
    state = commitlog.parse(data)
    if state.version is not None and state.version > commitlog.COMMIT_LOG_VERSION:
        raise SchemaVersionError(
            f"{shown}: commit log version {state.version} is not supported (this detfp reads "
            f"{commitlog.COMMIT_LOG_VERSION}); analyze it with the detfp release that wrote it"
        )
    return state


#: (rank, segment) -> its parsed commit log (None: none), or the error reading it raised.
Logs = Mapping[tuple[int, int], "commitlog.LogState | Exception | None"]


def read_logs(st: Store, root: Location, label: str, manifests: Mapping[int, Sequence[Mapping[str, Any]]]) -> Logs:
    """Every (rank, segment)'s commit log, read before the shards are scanned; an error is kept,
    not raised, so ``check`` raises it where it always did (after the shards' own errors)."""
    out: dict[tuple[int, int], commitlog.LogState | Exception | None] = {}
    for rank, ms in sorted(manifests.items()):
        for m in ms:
            s = m["segment"]
            shown = f"{label}/manifest/rank={rank}/segment-{s:05d}.json"
            try:
                out[(rank, s)] = _read_log(
                    st, st.join(root, *commitlog.commit_log_relpath(rank, s).split("/")), shown, m
                )
            except (ManifestError, SchemaVersionError) as exc:
                out[(rank, s)] = exc
    return out


def committed_shards(manifests: Mapping[int, Sequence[Mapping[str, Any]]], logs: Logs) -> Committed:
    """(table, rank, file name) -> ``CommittedShard`` of every shard a commit line states
    (launches whose manifest says ``shard_facts`` is this reader's ``SHARD_FACTS_VERSION``)."""
    out: dict[tuple[str, int, str], CommittedShard] = {}
    for rank, ms in manifests.items():
        for m in ms:
            segment = m["segment"]
            log = logs.get((rank, segment))
            if m.get("shard_facts") != commitlog.SHARD_FACTS_VERSION or not isinstance(log, commitlog.LogState):
                continue
            for w, facts in log.shards.items():
                rows, name = log.windows[w][0], contract.shard_name(segment, w)
                for table, fact in facts.items():
                    out[(table, rank, name)] = committed_shard(rows[table], fact, segment, w)
    return out
