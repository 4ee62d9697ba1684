"""Per-rank Parquet shard writer: a background thread behind a bounded queue (pyarrow + stdlib, no torch).

Pipeline: ``write_window`` (training thread: cheap column-name checks, then a blocking
``put`` into a bounded queue, which is the backpressure) -> writer thread (key hashes,
null filling, Arrow conversion, one Parquet file per non-empty table) -> a dot-prefixed
temporary name -> ``os.replace`` onto ``contract.shard_relpath``. A process killed at any
moment (SIGKILL included) therefore leaves only complete shards under their final names;
readers ignore dot-prefixed leftovers.

A failed write (disk full, permissions, a value of the wrong type) disables the writer:
``failed``/``error`` are set, ``on_error(msg)`` is called once, and later windows are
dropped (counted in ``dropped_windows``). Nothing here ever raises into the training loop
after construction except on programming errors (unknown table or column), nothing ever
talks to other ranks, and every rank only touches its own ``rank=R`` partitions.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shutil
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from detfp_capture import contract
from detfp_capture.arrowschema import arrow_schema
from detfp_capture.errors import RunExistsError, SchemaError

__all__ = ["ShardWriter", "clear_rank", "existing_segments", "prepare_run_dir", "write_manifest"]

# Columns the writer computes itself when a window omits them.
_DERIVED = ("rank", "segment", "call_hash", "key_hash")
_STOP = object()


def existing_segments(run_dir: str | os.PathLike[str], rank: int) -> list[int]:
    """Segments this rank already wrote into ``run_dir`` (from its manifests and shard names), sorted.

    Looks only at this rank's own partitions, so ranks never need to coordinate.
    """
    root = Path(run_dir)
    found: set[int] = set()
    mdir = root / contract.MANIFEST_DIR / f"rank={rank}"
    if mdir.is_dir():
        for p in mdir.glob("segment-*.json"):
            digits = p.stem.removeprefix("segment-")
            if digits.isdigit():
                found.add(int(digits))
    # Shards without a manifest (a launch killed before writing it) still occupy their segment.
    for table in contract.TABLES:
        sdir = root / table / f"rank={rank}"
        if sdir.is_dir():
            for p in sdir.glob("part-s*-w*.parquet"):
                digits = p.name[len("part-s") :].split("-", 1)[0]
                if digits.isdigit():
                    found.add(int(digits))
    return sorted(found)


def prepare_run_dir(
    run_dir: str | os.PathLike[str],
    rank: int,
    *,
    append: bool,
    overwrite: bool = False,
    world_size: int | None = None,
) -> int:
    """Create ``run_dir`` if needed and return the segment this launch of ``rank`` writes.

    Create-only: if this rank already wrote into ``run_dir`` and ``append`` is false, raise
    RunExistsError. With ``append``, return one past the highest existing segment (0 when none).
    With ``overwrite``, first delete what this rank wrote there before (see ``clear_rank``).
    """
    root = Path(run_dir)
    if root.exists() and not root.is_dir():
        raise RunExistsError(f"{root}: exists and is not a directory; choose another run directory")
    if overwrite:
        clear_rank(root, rank, world_size)
    root.mkdir(parents=True, exist_ok=True)
    segments = existing_segments(root, rank)
    if not segments:
        return 0
    if not append:
        raise RunExistsError(
            f"{root}: already holds a trace for rank {rank} (segment {segments[-1]}); "
            "choose a new run directory, pass overwrite=True (--overwrite) to replace it, or append=True "
            "(--append) to continue it as a resumed run"
        )
    return segments[-1] + 1


def clear_rank(run_dir: str | os.PathLike[str], rank: int, world_size: int | None = None) -> None:
    """Delete ``rank``'s partitions (manifests and shards) from an earlier run in ``run_dir``.

    Refuses (RunExistsError) a non-empty directory that holds no detfp run, so a mistyped path
    never deletes anything else. Each rank deletes only its own ``rank=R`` partitions, so the
    ranks of a job never race; rank 0 also deletes ranks at or beyond ``world_size`` (left by an
    earlier, larger job), which no rank of this job writes.
    """
    root = Path(run_dir)
    if not root.is_dir():
        return
    ours = {contract.MANIFEST_DIR, *contract.TABLES}
    entries = [p for p in root.iterdir() if not p.name.startswith(".")]
    if entries and not any(p.name in ours and p.is_dir() for p in entries):
        raise RunExistsError(
            f"{root}: is not a detfp run directory (no {contract.MANIFEST_DIR}/ or table folders); refusing to "
            "overwrite it; choose an empty or new run directory"
        )
    for sub in sorted(ours):
        base = root / sub
        if not base.is_dir():
            continue
        for part in base.iterdir():
            r = part.name.removeprefix("rank=")
            if not (part.is_dir() and part.name.startswith("rank=") and r.isdigit()):
                continue
            if int(r) == rank or (rank == 0 and world_size is not None and int(r) >= world_size):
                shutil.rmtree(part)


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_manifest(run_dir: str | os.PathLike[str], manifest: Mapping[str, Any]) -> Path:
    """Write one rank's manifest atomically to ``manifest_relpath(rank, segment)``; returns its path.

    The manifest must have exactly ``contract.MANIFEST_KEYS`` (SchemaError otherwise); values
    must be JSON (NaN refused). JSON is written with sorted keys so that it is byte-stable.
    """
    keys = set(manifest)
    missing = sorted(set(contract.MANIFEST_KEYS) - keys)
    unknown = sorted(keys - set(contract.MANIFEST_KEYS))
    if missing or unknown:
        raise SchemaError(f"manifest keys do not match the contract: missing {missing}, unknown {unknown}")
    path = Path(run_dir) / contract.manifest_relpath(int(manifest["rank"]), int(manifest["segment"]))
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(dict(manifest), sort_keys=True, indent=2, allow_nan=False) + "\n"
    _atomic_write_bytes(path, text.encode("utf-8"))
    return path


#: Key hashes already computed, by key fields: the same call sites recur every step (the step is
#: not part of a key), so most records of a window hit. Bounded; flat tuples of plain values.
_CALL_MEMO: dict[tuple, tuple[str, int]] = {}
_KEY_MEMO: dict[tuple, int] = {}  # (call hash, role, arg) -> key hash
_MEMO_LIMIT = 1 << 18


def _fill_hashes(table: str, cols: dict[str, list], n: int) -> None:
    """Compute call_hash/key_hash from the key columns when the window omitted them."""
    names = {c.name for c in contract.columns(table)}
    need_call = "call_hash" in names and "call_hash" not in cols
    need_key = "key_hash" in names and "key_hash" not in cols
    if not (need_call or need_key):
        return
    mb, ph, mod, kind, name, occ = (cols[k] for k in ("microbatch", "phase", "module", "kind", "name", "occurrence"))
    role, arg = (cols.get("role"), cols.get("arg")) if need_key else (None, None)
    cmemo, kmemo = _CALL_MEMO, _KEY_MEMO
    if len(cmemo) >= _MEMO_LIMIT:
        cmemo.clear()
    if len(kmemo) >= _MEMO_LIMIT:
        kmemo.clear()
    call_hashes: list[int] = []
    key_hashes: list[int] = []
    cget, kget = cmemo.get, kmemo.get
    for ct in zip(mb, ph, mod, kind, name, occ, strict=True):
        hit = cget(ct)
        if hit is None:
            ck = contract.call_key(*ct)
            hit = cmemo[ct] = (ck, contract.key_hash(ck))
        call_hashes.append(hit[1])
    if need_key:
        keys = zip(mb, ph, mod, kind, name, occ, strict=True)
        for ct, r, a, ch in zip(keys, role, arg, call_hashes, strict=True):
            h = kget((ch, r, a))
            if h is None:
                h = kmemo[(ch, r, a)] = contract.key_hash(contract.record_key(cmemo[ct][0], r, a))
            key_hashes.append(h)
    if need_call:
        cols["call_hash"] = call_hashes
    if need_key:
        cols["key_hash"] = key_hashes


def build_table(table: str, cols: Mapping[str, Sequence[Any]], rank: int, segment: int) -> pa.Table:
    """Turn one table's columnar Python lists into an Arrow table of the contract schema.

    Fills ``rank``/``segment`` (constants of this writer), ``call_hash``/``key_hash`` (from
    the key columns) and absent nullable columns (nulls). Raises SchemaError on an unknown or
    missing column, ragged lengths, or a null in a non-nullable column; pyarrow's errors on
    values of the wrong type propagate.
    """
    schema = arrow_schema(table)
    data = {k: list(v) for k, v in cols.items()}
    n = _check_columns(table, data)
    if n == 0:
        return schema.empty_table()
    data.setdefault("rank", [rank] * n)
    data.setdefault("segment", [segment] * n)
    _fill_hashes(table, data, n)
    for c in contract.columns(table):
        if c.name not in data:
            data[c.name] = [None] * n
    t = pa.Table.from_pydict({f.name: data[f.name] for f in schema}, schema=schema)
    for f in schema:
        if not f.nullable and t.column(f.name).null_count:
            raise SchemaError(f"{table}.{f.name}: null in a non-nullable column")
    return t


def _check_columns(table: str, data: Mapping[str, Sequence[Any]]) -> int:
    """Validate column names and lengths of one table of a window; return its row count."""
    known = {c.name: c for c in contract.columns(table)}
    if not data:
        return 0
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise SchemaError(f"{table}: unknown column(s) {unknown}; the contract's columns are {list(known)}")
    missing = sorted(c.name for c in known.values() if not c.nullable and c.name not in data and c.name not in _DERIVED)
    if missing:
        raise SchemaError(f"{table}: missing non-nullable column(s) {missing}")
    lengths = {len(v) for v in data.values()}
    if len(lengths) > 1:
        raise SchemaError(f"{table}: columns have different lengths {sorted(lengths)}")
    return lengths.pop() if lengths else 0


class ShardWriter:
    """Writes one rank's flush windows as Parquet shards from a background thread.

    ``write_window`` blocks when ``max_pending_windows`` windows are already queued, so a
    slow disk slows training down instead of growing memory without bound.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        rank: int,
        segment: int,
        *,
        max_pending_windows: int = 4,
        on_error: Callable[[str], None] | None = None,
        compression: str = "zstd",
    ) -> None:
        if max_pending_windows < 1:
            raise ValueError("max_pending_windows must be >= 1")
        self.run_dir = Path(run_dir)
        self.rank = int(rank)
        self.segment = int(segment)
        #: True once a write failed; the writer then drops every later window.
        self.failed = False
        #: One line saying why the writer failed (None while healthy).
        self.error: str | None = None
        #: Windows queued, written (at least one file or nothing to write), dropped after a failure.
        self.windows_queued = 0
        self.windows_written = 0
        self.dropped_windows = 0
        #: Rows and files written so far (by the writer thread).
        self.rows_written = 0
        self.files_written = 0
        self._on_error = on_error
        self._compression = compression
        self._next_window = 0
        self._closed = False
        self._stop_queued = False
        self._lock = threading.Lock()
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max_pending_windows)
        # Daemon: a training process that exits without close() must not hang on its tracer.
        self._thread = threading.Thread(target=self._run, name=f"detfp-writer-rank{self.rank}", daemon=True)
        self._thread.start()

    # ----------------------------------------------------------------- training thread
    def write_window(self, tables: Mapping[str, Mapping[str, Sequence[Any]]]) -> int | None:
        """Queue one flush window (table -> column name -> list); returns its window number.

        The writer takes ownership of the lists: do not mutate them after the call. Returns
        None (and drops the window) once the writer has failed. Raises SchemaError on an
        unknown table or column or ragged columns: those are bugs in the caller.
        """
        for table, cols in tables.items():
            if table not in contract.TABLES:
                raise SchemaError(f"unknown table {table!r}; the contract's tables are {list(contract.TABLES)}")
            _check_columns(table, cols)
        with self._lock:
            if self._closed:
                raise SchemaError("write_window after close()")
            if self.failed:
                self.dropped_windows += 1
                return None
            window = self._next_window
            self._next_window += 1
            self.windows_queued += 1
        self._queue.put((window, tables))
        return window

    def close(self, timeout: float | None = None) -> bool:
        """Drain the queue and stop the thread; True when everything queued was handled in time."""
        with self._lock:
            self._closed = True
            need_stop = not self._stop_queued
        if need_stop:  # a close() that timed out before queueing the stop retries it
            try:
                self._queue.put(_STOP, timeout=timeout)
            except queue.Full:
                return False
            self._stop_queued = True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ writer thread
    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            window, tables = item
            if self.failed:
                with self._lock:
                    self.dropped_windows += 1
                continue
            try:
                self._write(window, tables)
            except Exception as exc:  # any failure disables capture; training must go on
                self._fail(
                    f"rank {self.rank}: writing window {window} to {self.run_dir} failed: "
                    f"{type(exc).__name__}: {' '.join(str(exc).split())}"
                )

    def _write(self, window: int, tables: Mapping[str, Mapping[str, Sequence[Any]]]) -> None:
        for table in sorted(tables):
            t = build_table(table, tables[table], self.rank, self.segment)
            if t.num_rows == 0:
                continue
            path = self.run_dir / contract.shard_relpath(table, self.rank, self.segment, window)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            try:
                pq.write_table(t, tmp, compression=self._compression)
                os.replace(tmp, path)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
            self.rows_written += t.num_rows
            self.files_written += 1
        self.windows_written += 1

    def _fail(self, message: str) -> None:
        with self._lock:
            if self.failed:
                return
            self.failed = True
            self.error = message
            self.dropped_windows += 1
        if self._on_error is not None:
            # A broken callback must not kill the writer thread.
            with contextlib.suppress(Exception):
                self._on_error(message)
