"""Per-rank Parquet shard writer: a background thread behind a bounded queue (pyarrow + stdlib, no torch).

Pipeline: ``write_window`` (training thread: cheap column-name checks, then a blocking
``put`` into a bounded queue, which is the backpressure) -> writer thread (key hashes,
null filling, Arrow conversion, one Parquet file per non-empty table) -> a dot-prefixed
temporary name -> ``os.replace`` onto ``contract.shard_relpath``. A process killed at any
moment (SIGKILL included) therefore leaves only complete shards under their final names;
readers ignore dot-prefixed leftovers.

Completeness (``commitlog``): the writer creates ``manifest/rank=R/segment-S.commits``
exclusively when it starts, appends a commit line for each window once all of its shards
are in place, and a close line when ``close`` has handled every window; the reader trusts
exactly the committed windows of a launch that closed cleanly.

A failed write (disk full, file-size limit, permissions, a value of the wrong type) disables
the writer: ``failed``/``error`` are set, a ``fail`` line goes to the commit log (its
descriptor stays open, so this works even where new files can no longer be created),
``on_error(msg)`` is called once, and later windows are dropped (counted in
``dropped_windows``); the close line then says ``incomplete`` and why. Nothing here ever raises into the training loop
after construction except on programming errors (unknown table or column), nothing ever
talks to other ranks, and every rank only touches its own ``rank=R`` partitions.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from detfp_format import _faults, commitlog, contract
from detfp_format import rollups as _rollups
from detfp_format.arrowschema import arrow_schema, parquet_options
from detfp_format.errors import RunExistsError, SchemaError
from detfp_format.indexed import Indexed, column_bounds, to_arrow
from detfp_format.rundir import clear_rank, existing_segments, prepare_run_dir

__all__ = ["ShardWriter", "clear_rank", "existing_segments", "prepare_run_dir", "write_manifest"]

#: Rows per row group of a records shard (a multiple of contract.ROLLUP_BLOCK).
RECORDS_ROW_GROUP = 4 * contract.ROLLUP_BLOCK
#: Shards of these tables with fewer rows are written uncompressed (see ShardWriter._write).
SMALL_TABLE_ROWS = 256
_PLAIN_WHEN_SMALL = frozenset({"events", "metrics", "rollups"})


# Columns the writer computes itself when a window omits them.
_DERIVED = ("rank", "segment", "call_hash", "key_hash")
_STOP = object()


def _atomic_write_bytes(path: Path, data: bytes, point: str = "manifest", index: int | None = None) -> None:
    """Write ``data`` under a dot-prefixed temporary name, then rename it onto ``path``.

    ``point``/``index`` name the fault points around the steps (``<point>-mid-write``, ...).
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            half = len(data) // 2
            f.write(data[:half])
            f.flush()
            _faults.hit(f"{point}-mid-write", index)
            f.write(data[half:])
        _faults.hit(f"{point}-before-rename", index)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _faults.hit(f"{point}-after-rename", index)


def write_manifest(run_dir: str | os.PathLike[str], manifest: Mapping[str, Any], *, create: bool = True) -> Path:
    """Write one rank's manifest atomically to ``manifest_relpath(rank, segment)``; returns its path.

    The manifest must have every ``contract.MANIFEST_KEYS`` key and no key outside those and
    ``contract.MANIFEST_OPTIONAL_KEYS`` (SchemaError otherwise); values
    must be JSON (NaN refused). JSON is written with sorted keys so that it is byte-stable.
    ``create=False``: the run directory must exist (a capture rewriting its manifest must not
    recreate a directory removed under it).
    """
    keys = set(manifest)
    missing = sorted(set(contract.MANIFEST_KEYS) - keys)
    unknown = sorted(keys - set(contract.MANIFEST_KEYS) - set(contract.MANIFEST_OPTIONAL_KEYS))
    if missing or unknown:
        raise SchemaError(f"manifest keys do not match the contract: missing {missing}, unknown {unknown}")
    path = Path(run_dir) / contract.manifest_relpath(int(manifest["rank"]), int(manifest["segment"]))
    if create:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
    _mkdirs(Path(run_dir), path.parent)
    text = json.dumps(dict(manifest), sort_keys=True, indent=2, allow_nan=False) + "\n"
    _atomic_write_bytes(path, text.encode("utf-8"))
    return path


#: Key hashes already computed, by key fields: the same call sites recur every step (the step is
#: not part of a key), so most records of a window hit. Bounded; flat tuples of plain values.
_CALL_MEMO: dict[tuple, tuple[str, int]] = {}
_KEY_MEMO: dict[tuple, int] = {}  # (call hash, role, arg) -> key hash
_MEMO_LIMIT = 1 << 18


def _fill_hashes(table: str, cols: dict[str, Any], n: int) -> None:
    """Compute call_hash/key_hash from the key columns when the window omitted them (an
    ``Indexed`` set of call columns sharing one index: the call hashes once per call)."""
    names = {c.name for c in contract.columns(table)}
    need_call = "call_hash" in names and "call_hash" not in cols
    need_key = "key_hash" in names and "key_hash" not in cols
    if not (need_call or need_key):
        return
    fields = [cols[k] for k in ("microbatch", "phase", "module", "kind", "name", "occurrence")]
    index = fields[0].index if isinstance(fields[0], Indexed) else None
    by_call = all(isinstance(f, Indexed) and f.index is index for f in fields)
    if not by_call:
        index = None
        fields = [f.expand() if isinstance(f, Indexed) else f for f in fields]
    cmemo, kmemo = _CALL_MEMO, _KEY_MEMO
    if len(cmemo) >= _MEMO_LIMIT:
        cmemo.clear()
    if len(kmemo) >= _MEMO_LIMIT:
        kmemo.clear()
    cget, kget = cmemo.get, kmemo.get
    calls: list[tuple[str, int]] = []  # (call key, its hash) per row, or per call when by_call
    for ct in zip(*(f.values if by_call else f for f in fields), strict=True):
        hit = cget(ct)
        if hit is None:
            ck = contract.call_key(*ct)
            hit = cmemo[ct] = (ck, contract.key_hash(ck))
        calls.append(hit)
    per_call = [h for _, h in calls]
    if need_call:
        cols["call_hash"] = per_call if index is None else Indexed(per_call, index)
    if need_key:
        # A table with key_hash also has role and arg (the key's last two fields). The lookups
        # run as C-level maps over the rows (the keys recur every step: nearly all hit); the
        # few misses are computed after, in row order.
        role, arg = cols["role"], cols["arg"]  # as long as the index (``_check_columns``)
        hashes = per_call if index is None else list(map(per_call.__getitem__, index))
        # (zip's tuple is reused when get keeps no reference: no tuple per row, no collection.)
        key_hashes = list(map(kget, zip(hashes, role, arg, strict=True)))
        if None in key_hashes:
            for i, h in enumerate(key_hashes):
                if h is None:
                    key = (hashes[i], role[i], arg[i])
                    h = kget(key)  # an earlier row of the same key missed
                    if h is None:
                        ck = calls[i if index is None else index[i]][0]
                        h = kmemo[key] = contract.key_hash(contract.record_key(ck, role[i], arg[i]))
                    key_hashes[i] = h
        cols["key_hash"] = key_hashes


def build_table(table: str, cols: Mapping[str, Sequence[Any]], rank: int, segment: int) -> pa.Table:
    """Turn one table's columnar Python lists into an Arrow table of the contract schema.

    Fills ``rank``/``segment`` (constants of this writer), ``call_hash``/``key_hash`` (from
    the key columns) and absent nullable columns (nulls). Raises SchemaError on an unknown or
    missing column, ragged lengths, or a null in a non-nullable column; pyarrow's errors on
    values of the wrong type propagate.
    """
    schema = arrow_schema(table)
    # The capture hands over lists it never touches again: no copy of those (columns are only
    # read below; derived ones are new lists).
    data = {k: v if type(v) is list or isinstance(v, Indexed) else list(v) for k, v in cols.items()}
    n = _check_columns(table, data)
    if n == 0:
        return schema.empty_table()
    _fill_hashes(table, data, n)
    # The writer's constants and the absent nullable columns as Arrow arrays made whole (a
    # Python list of n equal values costs a conversion per row).
    for name, value in (("rank", rank), ("segment", segment)):
        if name not in data and name in schema.names:
            data[name] = pa.repeat(pa.scalar(value, schema.field(name).type), n)
    for f in schema:
        if f.name not in data:
            data[f.name] = pa.nulls(n, f.type)
    indices: dict[int, pa.Array] = {}
    t = pa.Table.from_pydict({f.name: to_arrow(data[f.name], f.type, indices) for f in schema}, schema=schema)
    for f in schema:
        if not f.nullable and t.column(f.name).null_count:
            raise SchemaError(f"{table}.{f.name}: null in a non-nullable column")
    return t


def _metric_columns(built: Sequence[tuple[str, pa.Table, Any]]) -> dict[str, list] | None:
    """The columns ``commitlog.step_sums`` folds of a window's built metrics table (plain ints and
    text as written: the built table, not the caller's lists, whatever types those held)."""
    t = next((t for name, t, _ in built if name == "metrics"), None)
    if t is None or not t.num_rows:
        return None
    return {c: t.column(c).to_pylist() for c in ("step", "microbatch", "name", "occurrence", "bits")}


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


def _mkdirs(root: Path, target: Path) -> None:
    """Create ``target`` and its parents below ``root``, never ``root`` itself: a run directory
    removed mid-run must make writes fail, not be recreated holding a headless trace."""
    here = root
    for part in target.relative_to(root).parts:
        here = here / part
        here.mkdir(exist_ok=True)


def _open_log(run_dir: Path, rank: int, segment: int) -> commitlog.CommitLog:
    """Create this launch's commit log (exclusively) and write its open line."""
    path = run_dir / commitlog.commit_log_relpath(rank, segment)
    _mkdirs(run_dir, path.parent)
    try:
        log = commitlog.CommitLog(path)
    except FileExistsError:
        raise RunExistsError(
            f"{run_dir}: rank {rank} segment {segment} is already being written by another launch "
            f"({path.name} exists); choose a new run directory, or pass append=True (--append) to continue it"
        ) from None
    try:
        log.append({"t": "open", "version": commitlog.COMMIT_LOG_VERSION, "rank": rank, "segment": segment})
    except BaseException:
        log.close()
        raise
    return log


class ShardWriter:
    """Writes one rank's flush windows as Parquet shards from a background thread.

    ``write_window`` blocks when ``max_pending_windows`` windows are already queued, so a
    slow disk slows training down instead of growing memory without bound: at most
    ``max_pending_windows`` queued windows plus the one being written are alive at once.
    ``rollups``: also write each window's rollups table (``rollups.window_rollups``); the caller
    then says so in its manifest (``contract.ROLLUP_VERSION`` under the key ``rollups``).
    ``shard_facts``: each commit line carries its shards' sizes, step ranges and footer checksums
    (``commitlog.ShardFact``; manifest key ``shard_facts``); False only writes runs as older
    writers did, for tests of that path. ``step_sums`` (with ``rollups``): each commit line
    carries its steps' rollup and metrics folds (``commitlog.step_sums``; manifest key
    ``step_sums``), so a reader compares two runs' steps without reading their shards; False
    writes runs as older writers did.
    Creating it creates the commit log exclusively (RunExistsError when this rank and segment
    already have one; OSError when the directory cannot be written).
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
        commit_log: bool = True,
        rollups: bool = False,
        shard_facts: bool = True,
        step_sums: bool = True,
    ) -> None:
        if max_pending_windows < 1:
            raise ValueError("max_pending_windows must be >= 1")
        self.run_dir = Path(run_dir)
        self.rank = int(rank)
        self.segment = int(segment)
        #: The commit log (None with ``commit_log=False``: a legacy run, for tests of old readers' data).
        self._log: commitlog.CommitLog | None = None
        if commit_log:
            self.run_dir.mkdir(parents=True, exist_ok=True)  # the start of the launch: later writes never recreate it
            self._log = _open_log(self.run_dir, self.rank, self.segment)
        #: Why the trace of this launch is incomplete although the writer did not fail (set by the session).
        self._incomplete: str | None = None
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
        #: Windows handed over and not yet handled (queued, being written, or blocked in the
        #: handover), and the most there ever were: at most ``max_pending_windows + 2``.
        self.pending = 0
        self.peak_pending = 0
        self._on_error = on_error
        self._compression = compression
        self._shard_facts = shard_facts
        self._step_sums = step_sums and rollups
        #: Each records shard gets its rollups shard (``contract.ROLLUP_VERSION``); None: a run
        #: written as older writers did (the manifest then has no ``rollups`` key).
        self._positions: _rollups.Positions | None = _rollups.Positions() if rollups else None
        self._next_window = 0
        self._failed_window = 0
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
            self.pending += 1
            self.peak_pending = max(self.peak_pending, self.pending)
        self._queue.put((window, tables))
        return window

    def mark_incomplete(self, reason: str) -> None:
        """The session lost records the writer never saw (capture disabled after an error): the
        close line will say ``incomplete`` with ``reason``. Call before ``close``."""
        with self._lock:
            if self._incomplete is None:
                self._incomplete = " ".join(reason.split())[:2000]

    def close(self, timeout: float | None = None) -> bool:
        """Drain the queue, write the close line and stop the thread; True when everything
        queued was handled in time."""
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
                self._close_log()
                return
            window, tables = item
            del item
            if self.failed:
                with self._lock:
                    self.dropped_windows += 1
                    self.pending -= 1
                continue
            try:
                self._failed_window = window
                self._write(window, tables)
            except Exception as exc:  # any failure disables capture; training must go on
                self._fail(
                    f"rank {self.rank}: writing window {window} to {self.run_dir} failed: "
                    f"{type(exc).__name__}: {' '.join(str(exc).split())}"
                )
            del tables  # free the window before waiting for the next one
            with self._lock:
                self.pending -= 1

    def _write(self, window: int, tables: Mapping[str, Mapping[str, Sequence[Any]]]) -> None:
        _faults.hit("window-start", window)
        rows: dict[str, int] = {}
        facts: dict[str, list[int]] = {}
        lo: int | None = None
        hi: int | None = None
        built = [
            (table, build_table(table, tables[table], self.rank, self.segment), tables[table])
            for table in sorted(tables)
        ]
        rollup_cols = None
        if self._positions is not None:
            rec = next((t for name, t, _ in built if name == "records"), None)
            if rec is not None and rec.num_rows:
                rollup_cols = _rollups.window_rollups(rec, self._positions)
                built.append(("rollups", build_table("rollups", rollup_cols, self.rank, self.segment), rollup_cols))
        for table, t, cols in built:
            if t.num_rows == 0:
                continue
            t_lo, t_hi = column_bounds(cols["step"])  # plain ints: cheaper than an Arrow kernel
            lo = t_lo if lo is None else min(lo, t_lo)
            hi = t_hi if hi is None else max(hi, t_hi)
            path = self.run_dir / contract.shard_relpath(table, self.rank, self.segment, window)
            _mkdirs(self.run_dir, path.parent)
            # Serialized in memory first: the file is then written in plain writes (a file-size
            # limit or a full disk fails the write, never leaves a file under its final name).
            # Records in row groups of a few rollup blocks: a reader of one block skips the rest
            # by the row groups' seq statistics.
            sink = pa.BufferOutputStream()
            rg = RECORDS_ROW_GROUP if table == "records" else None
            # A window's few events, metrics or rollups are stored uncompressed: zstd's
            # per-column setup (~0.3 ms a file) costs more than it saves there (the files come
            # out smaller without it); records and argument texts compress, whatever their size.
            comp = "none" if table in _PLAIN_WHEN_SMALL and t.num_rows < SMALL_TABLE_ROWS else self._compression
            pq.write_table(t, sink, compression=comp, row_group_size=rg, **parquet_options(table))
            data = sink.getvalue().to_pybytes()
            _atomic_write_bytes(path, data, "shard", window)
            # Size, steps and footer checksum in the commit line: a reader trusts the shard by its
            # size and checks the footer's bytes only when it reads the shard (commitlog.ShardFact).
            facts[table] = list(commitlog.shard_fact(data, t_lo, t_hi))
            rows[table] = t.num_rows
            self.rows_written += t.num_rows
            self.files_written += 1
        _faults.hit("commit-before", window)
        if self._log is not None:
            record = {
                "t": "window",
                "window": window,
                "rows": rows,
                "steps": None if lo is None else [lo, hi],
            }
            if self._shard_facts:
                record["shards"] = facts
            if self._step_sums:
                record["sums"] = commitlog.step_sums(rollup_cols, _metric_columns(built))
            self._log.append(record, half=lambda: _faults.hit("commit-mid-write", window))
        _faults.hit("commit-after", window)
        self.windows_written += 1

    def _close_log(self) -> None:
        """The close line: every window was handled; ``ok`` unless a window was lost."""
        log = self._log
        if log is None:
            return
        with self._lock:
            reason = self.error or self._incomplete
            if reason is None and self.dropped_windows:
                reason = f"{self.dropped_windows} window(s) were dropped"
            n = self._next_window
        try:
            _faults.hit("close-before")
            record = {"t": "close", "windows": n, "status": "ok" if reason is None else "incomplete", "reason": reason}
            log.append(record, half=lambda: _faults.hit("close-mid-write"))
            _faults.hit("close-after")
        except OSError:
            pass  # no close line: readers see a launch that never closed, which is still the truth
        finally:
            log.close()

    def _fail(self, message: str) -> None:
        with self._lock:
            if self.failed:
                return
            self.failed = True
            self.error = message
            self.dropped_windows += 1
        if self._log is not None:
            # The log's descriptor is open already: this line usually lands even when no new
            # file can be created (read-only or removed directory, file-size limit).
            with contextlib.suppress(Exception):
                self._log.append({"t": "fail", "window": self._failed_window, "reason": message[:2000]})
        if self._on_error is not None:
            # A broken callback must not kill the writer thread.
            with contextlib.suppress(Exception):
                self._on_error(message)
