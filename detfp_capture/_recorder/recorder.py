"""The per-rank record stream: context (step, microbatch, phase, module), counters and buffers.

Everything that captures goes through one ``Recorder``:

* ``record_call`` appends the records of one call (an op, a module boundary, a collective...)
  with the next ``seq`` numbers and the call's ``occurrence`` to the column buffer
  (``_records``); each tensor's digest is started on its device (no host sync), staged as a
  snapshot, or deferred to a batch (``_batching``), unless an identical (tensor, version) was
  already digested, in which case the earlier ``Slot`` is shared;
* ``flush`` runs what waits, resolves every pending digest (rows of batches in bulk with
  ``_resolve.resolve_rows``, the rest with ``_resolve.resolve_raw``: at most two device-to-host
  copies per device), builds the columns (``_tables``) and hands one window to the
  ``ShardWriter``, whose thread computes the key hashes and writes Parquet.

The recorder never raises into training: callers wrap it, and any exception ends in
``fail`` (a ``capture_error`` event, one warning, capture disabled).
"""

from __future__ import annotations

import contextlib
import threading
import warnings
import weakref
from collections import deque
from typing import Any

import torch

from detfp_capture import contract, digest
from detfp_capture._config import CaptureConfig
from detfp_capture._digest.batched import start_many
from detfp_capture._digest.staging import Staging
from detfp_capture._recorder import columns as _columns
from detfp_capture._recorder.deferred import _DTYPE_STR, Batching, Slot, dtype_str, gc_paused, storage_ptrs
from detfp_capture._recorder.flush import FlushTables
from detfp_capture._recorder.records import RecordBuffer

__all__ = ["Recorder", "Slot"]

_stack_len = torch._C._len_torch_dispatch_stack
_stack_at = torch._C._get_dispatch_stack_at
_stack_pop = torch._C._pop_torch_dispatch_stack
_stack_push = torch._C._push_on_torch_dispatch_stack

_NO_HAZARDS: tuple[str, ...] = ()
_VERSION_CACHE_LIMIT = 1 << 16
_INT64 = torch.int64
_TENSOR = torch.Tensor
_DEFER_MAX = 1024  # deferred digests per batch
_DEFER_BYTES = 64 << 20  # bytes of tensors kept alive by deferred digests before a batch runs


class Recorder(Batching, FlushTables):
    """Buffers of one rank's stream plus the context every record is stamped with."""

    def __init__(self, cfg: CaptureConfig, writer: Any, *, rank: int, on_fail: Any) -> None:
        self.cfg = cfg
        self.writer = writer
        self.rank = rank
        self._on_fail = on_fail
        # Context.
        self.step = -1 if cfg.start_step is None else cfg.start_step
        self.microbatch = contract.NO_MICROBATCH
        self.phase = "step"
        self.in_step = False
        self.selected = False  # current step is selected for capture
        self.seq = 0
        self.occ: dict[tuple, int] = {}
        # Buffers: calls are tuples shared by their records (cheaper than stamping each record).
        self.records = RecordBuffer()
        self.metrics: list[tuple] = []
        self.events: list[tuple] = []
        self.kernels: list[tuple] = []
        self.dumps: list[tuple] = []
        # Argument digests whose text this segment has written (the args table), and the rows
        # a flush adds to it.
        self.args_written: set[str] = set()
        self.args_rows: dict[str, list] | None = None
        # Slot keyed by id(tensor): reuse digests of unchanged tensors (Slot.matches).
        self.vcache: dict[int, Slot] = {}
        # Level ops: (tensor, Slot, version) of the tensors the last op wrote, cached at the version
        # they had inside the dispatcher; the bump comes later, above it (_dispatch.promote).
        self.written: list[tuple] = []
        # Level ops: storage data pointer -> ids cached in vcache over it, so a write through any
        # alias drops them (_dispatch.before_write). None below level ops: no mode sees writes.
        self.vstor: dict[int, list[int]] | None = {} if cfg.depth >= 2 else None
        # Records produced on other threads (DDP comm-hook callbacks) wait here for the training
        # thread: (order key, fn); drained sorted by key at points where all of them are complete.
        self.foreign: deque[tuple] = deque()
        # Level ops: (Slot, tensor, version) whose digest waits for the next batch.
        # Parallel lists (no object per entry: see _records): tensor (None once evicted), its
        # Slot, and the version it was recorded at (None: not checked).
        self.deferred: list[torch.Tensor | None] = []
        self.deferred_slots: list[Slot] = []
        self.deferred_versions: list[int | None] = []
        # ... and its data address then: a storage freed or reallocated since (FSDP frees its
        # unsharded parameters with storage.resize_(0), unseen by the dispatcher) moves it.
        self.deferred_addrs: list[int] = []
        self.deferred_bytes = 0
        # Storage data pointer -> index (or indices) of deferred tensors in it: only a write into
        # one of them needs those digests taken first.
        self.deferred_storages: dict[int, Any] = {}
        # Snapshots of boundary tensors waiting for their batch digest, per device.
        self.staging: dict[torch.device, Staging] = {}
        self.lock = threading.Lock()
        # Forward module-output digests per (microbatch, module, arg) for the recompute check.
        self.forward_outputs: dict[tuple, set[str]] = {}
        self.recompute_checks: list[tuple] = []
        self.busy = False  # re-entrancy guard: the tracer's own tensor work is never recorded
        self.depth = 0
        self.mode: Any = None  # the session's dispatch mode while it is entered
        self._popped: Any = None
        self.failed = False
        #: Why capture stopped (set by ``fail``): the commit log's close line carries it.
        self.fail_reason: str | None = None
        self.flushes = 0
        self.records_in_step = 0
        self.need_flush = False
        self._tensor_opts = cfg.rows.enabled or cfg.moments.enabled or cfg.dumps.enabled
        self._flush_at = cfg.flush_records

    # ----------------------------------------------------------------------------- context
    def begin_step(self, step: int, selected: bool) -> None:
        self.step = step
        self.in_step = True
        self.selected = selected
        self.phase = "forward"
        self.microbatch = contract.NO_MICROBATCH
        self.occ = {}
        self.records_in_step = 0
        # Parameters may have been updated through .data (no version bump): never reuse across steps.
        self.clear_vcache()

    def clear_vcache(self) -> None:
        # The slots live on in the buffered records until the flush; their weak references
        # (one object each) need not.
        for s in self.vcache.values():
            s.ref = None
        self.vcache.clear()
        if self.vstor is not None:
            self.vstor.clear()

    def _alias(self, t: torch.Tensor, key: int, ptr: int | None = None) -> None:
        """Index a vcache entry by its storage (level ops; see ``vstor``; ``ptr``: its storage's
        data pointer when the caller has it): a wrapper subclass by its inner tensors' (a write
        through ``dtensor._local_tensor`` moves no counter of the DTensor). One that cannot be
        indexed is not cached: nothing could drop it."""
        ptrs = (ptr,) if ptr is not None else storage_ptrs(t)
        if ptrs is None:
            self.vcache.pop(key, None)
            return
        vstor = self.vstor
        for ptr in ptrs:
            ids = vstor.get(ptr)
            if ids is None:
                vstor[ptr] = [key]
            else:
                ids.append(key)

    def enter(self) -> None:
        """Start the tracer's own work: set ``busy`` and take the dispatch mode off the stack
        (so digest ops neither get recorded nor pay for a trip through the mode)."""
        if self.depth == 0:
            self.busy = True
            m = self.mode
            if m is not None:
                n = _stack_len()
                if n and _stack_at(n - 1) is m:
                    self._popped = _stack_pop(None)
        self.depth += 1

    def on_any_thread(self) -> contextlib.AbstractContextManager:
        """Guard for tracer work that may run on any thread (a collective's completion callback
        runs on a backend thread, or inline on the training thread when the work had already
        finished): where the session's dispatch mode is on this thread's stack, take it off
        (``enter``) so the tracer's own ops are never recorded; elsewhere nothing can record
        them, and ``busy`` (read by the training thread) must not change."""
        m = self.mode
        if m is None or not any(_stack_at(i) is m for i in range(_stack_len())):
            return contextlib.nullcontext()
        return self._entered()

    @contextlib.contextmanager
    def _entered(self) -> Any:
        self.enter()
        try:
            yield
        finally:
            self.leave()

    def leave(self) -> None:
        if self.depth == 0:
            return
        self.depth -= 1
        if self.depth == 0:
            if self._popped is not None:
                _stack_push(self._popped)
                self._popped = None
            self.busy = False

    def next_seq(self) -> int:
        s = self.seq
        self.seq = s + 1
        return s

    def occurrence(self, phase: str, module: str, kind: str, name: str) -> int:
        key = (self.microbatch, phase, module, kind, name)
        n = self.occ.get(key, 0)
        self.occ[key] = n + 1
        return n

    # ----------------------------------------------------------------------------- digests
    def slot(self, t: torch.Tensor, rows: bool | int = False, moments: bool = False, fresh: bool = False) -> Slot:
        """Start (or reuse) the digest of ``t``'s current contents.

        ``fresh``: the tensor may have changed without its version counter moving yet (an in-place
        op seen from inside the dispatcher, a collective writing from C++, ``.data`` updates):
        digest it again. The new digest is still cached under the current version: if the version
        then moves (the in-place case), the entry simply never matches again.
        """
        key = id(t)
        try:
            version = t._version
        except Exception:  # inference tensors have no version counter
            version = None
        if version is not None and not fresh:
            hit = self.vcache.get(key)
            if hit is not None and hit.matches(t, version, rows, moments):
                return hit
        if rows is False and not moments and Staging.fits(t):
            s = Slot(None)
            self._stage_many([t], [s])  # staged, or digested now if it cannot be
        else:
            s = Slot(digest.start(t, rows=rows, moments=moments, pointer_check=t.dtype is torch.int64))
        if version is not None:
            if len(self.vcache) >= _VERSION_CACHE_LIMIT:
                self.clear_vcache()
            with contextlib.suppress(TypeError):  # some tensor subclasses refuse weak references
                s.ref = weakref.ref(t)
                s.version, s.opt_rows, s.opt_moments = version, rows, moments
                self.vcache[key] = s
                if self.vstor is not None:
                    self._alias(t, key)
        return s

    # ----------------------------------------------------------------------------- records
    def record_call(
        self,
        kind: str,
        name: str,
        module: str,
        phase: str,
        tensors: list[tuple[str, str, torch.Tensor]],
        *,
        occurrence: int | None = None,
        args_src: Any = None,
        compiled: bool = False,
        hazards: dict[int, tuple[str, ...]] | None = None,
        digest_it: bool = True,
        rows: bool | int | None = None,
        fresh: bool = False,
        defer: bool = False,
    ) -> tuple:
        """Append one call's records; ``tensors`` = [(role, arg, tensor)]; returns the call tuple."""
        if occurrence is None:
            occurrence = self.occurrence(phase, module, kind, name)
        call = (self.step, self.microbatch, phase, module, kind, name, occurrence, args_src, compiled)
        if tensors:
            self.append_records(
                call, tensors, hazards=hazards, digest_it=digest_it, rows=rows, fresh=fresh, defer=defer
            )
        return call

    def append_records(
        self,
        call: tuple,
        tensors: list[tuple[str, str, torch.Tensor]],
        *,
        hazards: dict[int, tuple[str, ...]] | None = None,
        digest_it: bool = True,
        rows: bool | int | None = None,
        fresh: bool = False,
        defer: bool = False,
    ) -> None:
        out = self.records
        if not digest_it and not hazards:
            # Views and metadata ops: counted, not digested (and never dumped).
            add = out.add
            seq = self.seq
            for role, arg, t in tensors:
                dt = t.dtype
                add(
                    call,
                    seq,
                    role,
                    arg,
                    _DTYPE_STR.get(dt) or dtype_str(dt),
                    tuple(t.shape),
                    t.numel(),
                    None,
                    _NO_HAZARDS,
                )
                seq += 1
            self.seq = seq
        elif rows is None and not hazards and not self._tensor_opts:
            # The hot path (every op at level ops): no per-record options, cache lookups inlined.
            cache = self.vcache
            vstor = self.vstor
            start = digest.start
            deferred = self.deferred
            dstor = self.deferred_storages
            fits = Staging.fits
            stage_t: list | None = None
            stage_s: list = []
            add = out.add
            seq = self.seq
            for role, arg, t in tensors:
                key = id(t)
                try:
                    version = t._version
                except Exception:  # inference tensors have no version counter
                    version = None
                s = None
                if version is not None and not fresh:
                    hit = cache.get(key)
                    if (
                        hit is not None
                        and hit.version == version
                        and hit.ref() is t
                        and not (hit.opt_rows or hit.opt_moments)
                    ):
                        s = hit
                dt = t.dtype
                if s is None:
                    nb = t.numel() * dt.itemsize
                    ptr = None  # the storage's data pointer, where it is looked up anyway
                    if defer and version is not None and dt is not _INT64 and type(t) is _TENSOR:
                        # Level ops sees every write, so the digest can wait for a batch (run
                        # before the next writing op, collective or flush): one GEMM for many.
                        # The version check is a safety net; a just-written tensor's version is
                        # bumped after we return (above the dispatcher), so it is not checked.
                        s = Slot(None)
                        ptr = t.untyped_storage().data_ptr()
                        same = dstor.get(ptr)
                        if same is None:
                            dstor[ptr] = len(deferred)
                        elif same.__class__ is int:
                            dstor[ptr] = [same, len(deferred)]
                        else:
                            same.append(len(deferred))
                        deferred.append(t)
                        self.deferred_slots.append(s)
                        self.deferred_versions.append(None if fresh else version)
                        self.deferred_addrs.append(t.data_ptr())
                        self.deferred_bytes += nb
                    elif fits(t):
                        # Boundaries (no dispatch mode sees writes): a snapshot copy, digested in a
                        # batch; the call's tensors are snapshotted together below.
                        s = Slot(None)
                        if stage_t is None:
                            stage_t, stage_s = [t], [s]
                        else:
                            stage_t.append(t)
                            stage_s.append(s)
                    else:
                        s = Slot(start(t, pointer_check=dt is _INT64))
                    if version is not None:
                        if len(cache) >= _VERSION_CACHE_LIMIT:
                            self.clear_vcache()
                        try:  # a plain try: cheaper than contextlib.suppress on this hot path
                            s.ref = weakref.ref(t)
                            s.version = version
                            cache[key] = s
                        except TypeError:  # some tensor subclasses refuse weak references
                            pass
                        else:
                            if vstor is not None:
                                self._alias(t, key, ptr)
                add(
                    call, seq, role, arg, _DTYPE_STR.get(dt) or dtype_str(dt), tuple(t.shape), t.numel(), s, _NO_HAZARDS
                )
                seq += 1
            self.seq = seq
            if stage_t is not None:
                self._stage_many(stage_t, stage_s)
            if len(deferred) >= _DEFER_MAX or self.deferred_bytes >= _DEFER_BYTES:
                self.run_deferred(staging=False)
        else:
            cfg = self.cfg
            name, module = call[5], call[3]
            if rows is None:
                rows = cfg.rows.arg if cfg.rows.enabled and cfg.rows.wants(name, module) else False
            mom = cfg.moments.enabled and cfg.moments.wants(name, module)
            dump = cfg.dumps.enabled and cfg.dumps.wants(name, module)
            for i, (role, arg, t) in enumerate(tensors):
                hz = hazards.get(i, _NO_HAZARDS) if hazards else _NO_HAZARDS
                s = self.slot(t, rows, mom, fresh) if digest_it else None
                seq = self.next_seq()
                out.add(call, seq, role, arg, dtype_str(t.dtype), tuple(t.shape), t.numel(), s, hz)
                if dump:
                    self.dumps.append((call, seq, role, arg, t.detach().clone()))
        self.records_in_step += len(tensors)
        if len(out) >= self._flush_at:
            self.need_flush = True

    def record_many(self, specs: list[tuple], *, fresh: bool = False) -> list[tuple]:
        """Many single-tensor records at once, digests started as one batch (step boundaries).

        ``specs``: [(call or None, kind, name, module, phase, role, arg, tensor)]; a None call opens
        a new call (next occurrence). Returns the call of each record.
        """
        if self._tensor_opts:  # per-record options (rows, moments, dumps): the general path
            calls = []
            for call, kind, name, module, phase, role, arg, t in specs:
                if call is None:
                    call = self.record_call(kind, name, module, phase, [(role, arg, t)], fresh=fresh)
                else:
                    self.append_records(call, [(role, arg, t)], fresh=fresh)
                calls.append(call)
            return calls
        cache = self.vcache
        slots: list[Slot | None] = [None] * len(specs)
        versions: list[int | None] = []
        missing = []
        for i, sp in enumerate(specs):
            t = sp[7]
            try:
                version = t._version
            except Exception:
                version = None
            versions.append(version)
            if version is not None and not fresh:
                hit = cache.get(id(t))
                if hit is not None and hit.matches(t, version, False, False):
                    slots[i] = hit
                    continue
            missing.append(i)
        if missing:
            new = [Slot(None) for _ in missing]
            with gc_paused():
                start_many([specs[i][7] for i in missing], new, reuse=True)  # a step boundary: repeats
            ref = weakref.ref
            for i, s in zip(missing, new, strict=True):
                slots[i] = s
                t = specs[i][7]
                if versions[i] is not None:
                    try:  # a plain try: cheaper than contextlib.suppress on this hot path
                        s.ref = ref(t)
                        s.version = versions[i]
                        cache[id(t)] = s
                    except TypeError:  # some tensor subclasses refuse weak references
                        pass
                    else:
                        if self.vstor is not None:
                            self._alias(t, id(t))
        # The records (occurrence, seq and dtype text inlined: hundreds per optimizer step).
        calls = []
        out = self.records
        add = out.add
        occ_map = self.occ
        step, mb = self.step, self.microbatch
        seq = self.seq
        for sp, s in zip(specs, slots, strict=True):
            call, kind, name, module, phase, role, arg, t = sp
            if call is None:
                key = (mb, phase, module, kind, name)
                occ = occ_map.get(key, 0)
                occ_map[key] = occ + 1
                call = (step, mb, phase, module, kind, name, occ, None, False)
            dt = t.dtype
            add(call, seq, role, arg, _DTYPE_STR.get(dt) or dtype_str(dt), tuple(t.shape), t.numel(), s, _NO_HAZARDS)
            seq += 1
            calls.append(call)
        self.seq = seq
        self.records_in_step += len(specs)
        if len(out) >= self._flush_at:
            self.need_flush = True
        return calls

    def append_started(self, call: tuple, items: list[tuple]) -> None:
        """Records whose digests were started elsewhere: [(role, arg, dtype, shape, numel, Slot)]."""
        for role, arg, dt, shape, numel, s in items:
            self.records.add(call, self.next_seq(), role, arg, dt, shape, numel, s, _NO_HAZARDS)
        self.records_in_step += len(items)

    def record_values(
        self, kind: str, phase: str, module: str, values: list[tuple[str, str, torch.Tensor]], role: str = "value"
    ) -> None:
        """Records of inputless kinds: one call per name (param, grad, rng_state, probe...)."""
        for name, arg, t in values:
            self.record_call(kind, name, module, phase, [(role, arg, t)])

    def metric(self, name: str, value: Any) -> None:
        key = ("metric", self.microbatch, name)
        n = self.occ.get(key, 0)
        self.occ[key] = n + 1
        if isinstance(value, torch.Tensor):
            v: Any = value.detach().reshape(1).clone()  # 1-D: the flush concatenates them
            dt = dtype_str(value.dtype)
        else:
            v = value
            dt = type(value).__name__
        self.metrics.append((self.step, self.next_seq(), self.microbatch, name, n, v, dt))

    def event(
        self, type_: str, name: str = "", module: str = "", count: int | None = None, detail: str | None = None
    ) -> None:
        self.events.append((self.step, self.next_seq(), type_, name, module, count, detail))

    def drain_foreign(self) -> None:
        """Move records produced on other threads into the stream (training thread only)."""
        items = []
        while self.foreign:
            items.append(self.foreign.popleft())
        # Completion order varies between runs (backend threads): append in issue order.
        items.sort(key=lambda kv: kv[0])
        for _, fn in items:
            fn()

    # ----------------------------------------------------------------------------- flush
    def flush(self) -> None:
        """Resolve pending digests (one resolve) and hand one window to the writer."""
        self.need_flush = False
        if not self.in_step:
            # Inside a step, foreign records join the stream at deterministic points (end of
            # backward, optimizer, step end), never wherever a flush happens to fall.
            self.drain_foreign()
        records, metrics, events, kernels, dumps = self.records, self.metrics, self.events, self.kernels, self.dumps
        self.records, self.metrics, self.events, self.kernels, self.dumps = RecordBuffer(), [], [], [], []
        if not (len(records) or metrics or events or kernels or dumps):
            return
        self.enter()
        try:
            # A flush allocates tens of thousands of objects that die when it ends (gc_paused).
            with gc_paused():
                self.run_deferred()
                # Each distinct slot once, in first-record order (dict.fromkeys dedupes by
                # identity in C; Slots hash by identity).
                slots = [s for s in dict.fromkeys(records.slot) if s is not None and s.fp is None]
                if slots:
                    self._resolve(slots)
                tables: dict[str, dict[str, list]] = {}
                self.args_rows = None
                tables["records"] = self._record_columns(records)
                if self.args_rows is not None:
                    tables["args"] = self.args_rows
                tables["metrics"] = _columns.metric_columns(metrics)
                if kernels:
                    tables["kernels"] = _columns.kernel_columns(kernels, self.next_seq)
                # Resolving records can add events (recompute mismatches, pointer-like tables): same window.
                tables["events"] = _columns.event_columns(events + self.events)
                self.events = []
                if dumps:
                    tables["dumps"] = _columns.dump_columns(dumps)
        finally:
            self.leave()
        self.flushes += 1
        self.writer.write_window(tables)

    # ----------------------------------------------------------------------------- failure
    def fail(self, exc: BaseException, where: str) -> None:
        """Record a capture_error event, warn once, and disable capture (training continues)."""
        if self.failed:
            return
        self.failed = True
        detail = f"{where}: {type(exc).__name__}: {' '.join(str(exc).split())}"[:2000]
        self.fail_reason = f"capture disabled at step {self.step} after an internal error ({detail})"
        warnings.warn(
            f"detfp capture disabled on rank {self.rank} after an internal error ({detail})",
            RuntimeWarning,
            stacklevel=3,
        )
        # Keep what can be kept: records whose digests cannot be resolved are dropped, events are written.
        self.records, self.dumps, self.kernels = RecordBuffer(), [], []
        self._reset_deferred()
        self.event("capture_error", type(exc).__name__, "", None, detail)
        self.event(
            "capture_disabled", "", "", None, "capture stopped after the error above; the training step continued"
        )
        with contextlib.suppress(Exception):
            self.flush()
        if self._on_fail is not None:
            with contextlib.suppress(Exception):
                self._on_fail()
