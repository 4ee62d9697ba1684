"""The per-rank record stream: context (step, microbatch, phase), counters, buffers and the flush.

Every source records through one ``Recorder``:

* ``record_call`` appends the records of one call (an op, a module boundary, a collective...)
  with the next ``seq`` numbers and the call's ``occurrence`` to the column buffer
  (``records``); each tensor's digest is started on its device (no host sync), staged as a
  snapshot, or deferred to a batch (``deferred.Waiting``), unless the version cache
  (``vcache``) holds the digest of the same (tensor, version), whose ``Slot`` is then shared;
  ``record_many`` does the same for the hundreds of single-tensor records of a step boundary;
* ``flush`` runs what waits, resolves every pending digest into two integers
  (``flush.resolve_slots``: at most two device-to-host copies per device), builds the columns
  (``records``, ``columns``) and hands one window to the ``ShardWriter``, whose thread computes
  the key hashes and writes Parquet.

The recorder never raises into training: its callers run their work in ``guard``, and any
exception ends in ``fail`` (a ``capture_error`` event, one warning, capture disabled).
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import torch

from detfp_capture import digest
from detfp_capture._config import CaptureConfig
from detfp_capture._digest.awaited import collective_result
from detfp_capture._digest.staging import Staging
from detfp_capture._recorder.args import ArgsColumn
from detfp_capture._recorder.call import Call, DumpRow, EventRow, MetricRow, RecordSpec, TensorArg
from detfp_capture._recorder.deferred import DEFER_BYTES, DEFER_MAX, Waiting
from detfp_capture._recorder.flush import DigestFindings, resolve_slots, window_tables
from detfp_capture._recorder.guard import Guard
from detfp_capture._recorder.hostconfig import NO_HAZARDS
from detfp_capture._recorder.hot import append_copy, append_counted, append_general
from detfp_capture._recorder.inflight import InFlight
from detfp_capture._recorder.records import WIDTH, RecordBuffer
from detfp_capture._recorder.seam import RecordPath, record_path
from detfp_capture._recorder.slot import Slot, dtype_str, gc_paused
from detfp_capture._recorder.subclass import append_flattened, flattens, has_subclass, scalar_copy
from detfp_capture._recorder.vcache import VersionCache
from detfp_format import contract

__all__ = ["Recorder"]

_stack_len = torch._C._len_torch_dispatch_stack
_stack_at = torch._C._get_dispatch_stack_at
_stack_pop = torch._C._pop_torch_dispatch_stack
_stack_push = torch._C._push_on_torch_dispatch_stack


class Recorder:
    """One rank's buffers, the context every record is stamped with, and its record path (``seam``)."""

    def __init__(
        self, cfg: CaptureConfig, writer: Any, *, rank: int, on_fail: Callable[[], None] | None,
        path: RecordPath | None = None,
    ) -> None:  # fmt: skip
        self.cfg = cfg
        self.path: RecordPath = record_path() if path is None else path
        self.writer = writer
        self.rank = rank
        self._on_fail = on_fail
        # Context.
        self.step = -1 if cfg.start_step is None else cfg.start_step
        self.microbatch = contract.NO_MICROBATCH
        self.phase = "step"
        self.in_step = False
        self.selected = False  # current step is selected for capture
        #: The session is closed: nothing records any more (a DDP comm hook outlives it).
        self.closed = False
        self.seq = 0
        self.occ: dict[tuple, int] = {}
        # Buffers: calls are tuples shared by their records (cheaper than stamping each record).
        self.records = RecordBuffer()
        self.metrics: list[MetricRow] = []
        self.events: list[EventRow] = []
        self.kernels: list = []  # call.KernelRow
        self.dumps: list = []  # call.DumpRow
        self.args = ArgsColumn(self.path.args_key)
        self.vcache = VersionCache(cfg.caps.sees_writes)
        self.waiting = Waiting(self.path.roots)
        #: Buffers an asynchronous collective is still writing: what reads them waits for it.
        self.inflight = InFlight()
        self.findings = DigestFindings()
        # Records produced on other threads (DDP comm-hook callbacks) wait here for the training
        # thread: (order key, fn); drained sorted by key at points where all of them are complete.
        self.foreign: deque[tuple[tuple, Callable[[], None]]] = deque()
        self.busy = False  # re-entrancy guard: the tracer's own tensor work is never recorded
        self.depth = 0
        self.mode: Any = None  # the session's dispatch mode while it is entered
        self._popped: Any = None
        self.failed = False
        #: Why capture stopped (set by ``fail``): the commit log's close line carries it.
        self.fail_reason: str | None = None
        #: The writer's failure was warned about (``check_writer``).
        self.warned_writer = False
        self.flushes = 0
        #: Step ends since the window began (the step-end flush policy: ``StepBoundaries.end``).
        self.window_steps = 0
        self.records_in_step = 0
        self.need_flush = False
        self._tensor_opts = cfg.rows.enabled or cfg.moments.enabled or cfg.dumps.enabled
        self._flush_at = cfg.flush_records
        self._flush_rows = cfg.flush_records * WIDTH  # the same, in RecordBuffer.rows values

    # ----------------------------------------------------------------------------- context
    @property
    def live(self) -> bool:
        """Records are being taken now: a selected step, capture not failed, session open."""
        return self.selected and not self.failed and not self.closed

    def begin_step(self, step: int, selected: bool) -> None:
        self.step = step
        self.in_step = True
        self.selected = selected
        self.phase = "forward"
        self.microbatch = contract.NO_MICROBATCH
        self.occ = {}
        self.records_in_step = 0
        # Parameters may have been updated through .data (no version bump): never reuse across steps.
        self.vcache.clear()

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

    def leave(self) -> None:
        if self.depth == 0:
            return
        self.depth -= 1
        if self.depth == 0:
            if self._popped is not None:
                _stack_push(self._popped)
                self._popped = None
            self.busy = False

    def guard(self, where: str, *args: Any, busy: bool = True) -> Guard:
        """``with rec.guard("what {}", x):`` -- see ``guard.Guard``."""
        return Guard(self, where, args, busy)

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
        try:
            version = t._version
        except Exception:  # inference tensors have no version counter
            version = None
        if version is not None and not fresh:
            hit = self.vcache.get(t, version, rows, moments)
            if hit is not None:
                return hit
        s = Slot(None)
        # Now, or when the collective still writing it completes (``inflight``).
        self.inflight.when_complete(t, lambda: self._start_late(t, s, rows, moments))
        if version is not None:
            self.vcache.put(t, s, version, rows, moments)
        return s

    def _start_late(self, t: torch.Tensor, s: Slot, rows: bool | int, moments: bool) -> None:
        """Start ``s``, the digest of ``t``, whose producer has completed."""
        t = collective_result(t)
        if rows is False and not moments and Staging.fits(t):
            self.waiting.stage([t], [s])  # staged, or digested now if it cannot be
        else:
            s.pending = digest.start(t, rows=rows, moments=moments, pointer_check=t.dtype is torch.int64)

    def complete(self, tensors: list[torch.Tensor]) -> None:
        """The program waited for the collective writing ``tensors``: what waits is taken now."""
        if self.inflight and not self.failed:
            with self.guard("completion of a collective"):
                self.inflight.completed(tensors)

    def run_deferred(self, staging: bool = True) -> None:
        """Start every digest waiting for a batch (the caller holds the busy state)."""
        self.waiting.run(staging)

    def settle(self) -> None:
        """Run deferred digests now (before a write the dispatch mode cannot see)."""
        if self.waiting.tensors:
            self.enter()
            try:
                self.waiting.run(staging=False)
            finally:
                self.leave()

    @property
    def holds_digests(self) -> bool:
        """Digests wait for a batch or are cached: a storage change must be looked at."""
        return bool(self.waiting.tensors) or bool(len(self.vcache))

    def before_write(self, ptrs: list[int] | None) -> None:
        """An op is about to write into these storages (None: unknown ones); the caller is busy.

        Digests waiting for a batch must see the values from before this write: those in the
        written storages are snapshotted now (all of them when a storage is unknown). Cached
        digests of other tensors over the written storages are dropped (``vcache``)."""
        waiting = self.waiting
        if waiting.tensors:
            if ptrs is None:
                waiting.run(staging=False)
            else:
                hit = [p for p in ptrs if p in waiting.storages]
                if hit:
                    waiting.evict(hit)
        self.vcache.drop_storages(ptrs)

    def storage_changing(self, ptr: int) -> None:
        """A storage is about to be freed or reallocated outside the dispatcher: what waits for a
        batch in it is snapshotted now, and cached digests over it are dropped."""
        self.enter()
        try:
            if ptr in self.waiting.storages:
                self.waiting.evict([ptr])
            self.vcache.drop_storages((ptr,))
        finally:
            self.leave()

    # ----------------------------------------------------------------------------- records
    def record_call(
        self, kind: str, name: str, module: str, phase: str, tensors: list[TensorArg], *,
        occurrence: int | None = None, args_src: tuple | None = None, compiled: bool = False,
        hazards: dict[int, tuple[str, ...]] | None = None, digest_it: bool = True, rows: bool | int | None = None,
        fresh: bool = False, defer: bool = False,
    ) -> Call:  # fmt: skip
        """Append one call's records; ``tensors`` = [(role, arg, tensor)]; returns the call. The
        hooks' calls (nothing asked per record) take the record path's ``record_plain``."""
        if hazards is None and occurrence is None and args_src is None and digest_it and rows is None and not defer:
            return self.path.record_plain(self, kind, name, module, phase, tensors, compiled, fresh)
        mb = self.microbatch
        if occurrence is None:  # self.occurrence, inlined (once per recorded call)
            key = (mb, phase, module, kind, name)
            occ = self.occ
            occurrence = occ.get(key, 0)
            occ[key] = occurrence + 1
        call = (self.step, mb, phase, module, kind, name, occurrence, args_src, compiled)
        if tensors:
            self.append_records(call, tensors, hazards=hazards, digest_it=digest_it, rows=rows, fresh=fresh, defer=defer)
        return call

    def append_records(
        self,
        call: Call,
        tensors: list[TensorArg],
        *,
        hazards: dict[int, tuple[str, ...]] | None = None,
        digest_it: bool = True,
        rows: bool | int | None = None,
        fresh: bool = False,
        defer: bool = False,
    ) -> None:
        """Append records to an open call. Three paths: counted only (views, write-only
        arguments), the hot path (no hazards, no per-record options: every op at level ops),
        and the general one (hazards, rows, moments, dumps); a call holding a tensor subclass
        takes ``subclass.append_flattened``, which records its parts through these paths."""
        if has_subclass(tensors):
            opts = dict(digest_it=digest_it, rows=rows, fresh=fresh, defer=defer)
            append_flattened(self, call, tensors, hazards, opts)
            if len(self.records.rows) >= self._flush_rows:
                self.need_flush = True
            return
        if not digest_it and not hazards:
            append_counted(self, call, tensors)  # views and metadata ops: counted, not digested
        elif rows is None and not hazards and not self._tensor_opts:
            self.path.append_plain(self, call, tensors, fresh, defer)
            if len(self.waiting.tensors) >= DEFER_MAX or self.waiting.nbytes >= DEFER_BYTES:
                self.waiting.run(staging=False)
        else:
            append_general(self, call, tensors, hazards, digest_it, rows, fresh)
        self.records_in_step += len(tensors)
        if len(self.records.rows) >= self._flush_rows:
            self.need_flush = True

    def _dump(self, row: DumpRow) -> None:
        """Keep a copy of ``row``'s tensor for the dumps table, once its producer completed."""
        copy = lambda: collective_result(row.tensor).detach().clone()  # noqa: E731
        self.inflight.when_complete(row.tensor, lambda: self.dumps.append(row._replace(tensor=copy())))

    def last_slot(self) -> Slot | None:
        """The Slot of the record appended last (None: none, or not digested)."""
        return self.records.last_slot()

    def append_copy(self, call: Call, item: TensorArg, src: torch.Tensor, source: Slot | None) -> bool:
        """Append the record of ``item``'s tensor, an exact copy of ``src`` whose digest is
        ``source``, sharing that digest (``hot.append_copy``); False, nothing appended, where
        that does not apply (per-record options, a subclass, no digest to share...)."""
        if self._tensor_opts or not append_copy(self, call, item, src, source):
            return False
        self.records_in_step += 1
        if len(self.records) >= self._flush_at:
            self.need_flush = True
        return True

    def record_many(self, specs: list[RecordSpec], *, fresh: bool = False) -> list[Call]:
        """Many single-tensor records at once, digests started as one batch (step boundaries).

        A spec whose ``call`` is None opens a new call (next occurrence). Returns the call of
        each record.
        """
        if self._tensor_opts:  # per-record options (rows, moments, dumps): the general path
            return [self._record_spec(sp, fresh) for sp in specs]
        calls: list[Call] = []
        i, n = 0, len(specs)
        while i < n:
            # Runs of plain tensors as one batch each; a tensor subclass (its parts, then its
            # whole: ``subclass``) through the general path, in order.
            j = i
            while j < n and not flattens(specs[j].tensor):
                j += 1
            if j > i:
                calls += self.path.append_batch(self, specs[i:j], fresh)
                self.records_in_step += j - i
            if j < n:
                calls.append(self._record_spec(specs[j], fresh))
                j += 1
            i = j
        if len(self.records) >= self._flush_at:
            self.need_flush = True
        return calls

    def _record_spec(self, sp: RecordSpec, fresh: bool) -> Call:
        """One spec of ``record_many`` through ``record_call`` / ``append_records``."""
        if sp.call is None:
            return self.record_call(sp.kind, sp.name, sp.module, sp.phase, [(sp.role, sp.arg, sp.tensor)], fresh=fresh)
        self.append_records(sp.call, [(sp.role, sp.arg, sp.tensor)], fresh=fresh)
        return sp.call

    def append_started(self, call: Call, items: Iterable[tuple[str, str, str, tuple, int, Slot]]) -> None:
        """Records whose digests were started elsewhere: [(role, arg, dtype, shape, numel, Slot)]."""
        n = 0
        for role, arg, dt, shape, numel, s in items:
            self.records.add(call, self.next_seq(), role, arg, dt, shape, numel, s, NO_HAZARDS)
            n += 1
        self.records_in_step += n

    def metric(self, name: str, value: Any) -> None:
        key = ("metric", self.microbatch, name)
        n = self.occ.get(key, 0)
        self.occ[key] = n + 1
        tensor = isinstance(value, torch.Tensor)
        dt = dtype_str(value.dtype) if tensor else type(value).__name__
        row = MetricRow(self.step, self.next_seq(), self.microbatch, name, n, value, dt)
        if not tensor:
            self.metrics.append(row)
            return

        # Once the collective writing it completed; 1-D: the flush concatenates them.
        self.inflight.when_complete(value, lambda: self.metrics.append(row._replace(value=scalar_copy(value))))

    def event(
        self, type_: str, name: str = "", module: str = "", count: int | None = None, detail: str | None = None
    ) -> None:
        self.events.append(EventRow(self.step, self.next_seq(), type_, name, module, count, detail))

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
        if self.in_step and self.inflight.waiting:
            # Records wait for a collective the program has not waited for yet: their window
            # is flushed once it has (or at the step end), never by waiting for it here.
            self.need_flush = True
            return
        self.need_flush = False
        self.window_steps = 0
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
                self.waiting.run()
                # Each distinct slot once, in first-record order (dict.fromkeys dedupes by
                # identity in C; Slots hash by identity).
                slots = [s for s in dict.fromkeys(records.slot) if s is not None and s.hi is None and s.extra is None]
                if slots:
                    resolve_slots(slots, self.path.resolve_rows)
                tables = window_tables(self, records, metrics, events, kernels, dumps)
        finally:
            self.leave()
        self.flushes += 1
        self.writer.write_window(tables)

    def flush_safely(self) -> None:
        """``flush``, unless capture has failed; a failure in it disables capture."""
        if self.failed:
            return
        with self.guard("flush", busy=False):
            self.flush()

    # ----------------------------------------------------------------------------- failure
    def fail(self, exc: BaseException, where: str) -> None:
        """Record a capture_error event, warn once, and disable capture (training continues)."""
        if self.failed:
            return
        self.failed = True
        detail = f"{where}: {type(exc).__name__}: {' '.join(str(exc).split())}"[:2000]
        self.fail_reason = f"capture disabled at step {self.step} after an internal error ({detail})"
        message = f"detfp capture disabled on rank {self.rank} after an internal error ({detail})"
        try:
            warnings.warn(message, RuntimeWarning, stacklevel=4)
        except Exception:
            # Warnings turned into errors (-W error, a test's filter): raising here would put
            # capture's failure into the training step, or abort it where C++ called us.
            print(f"warning: {message}", file=sys.stderr)
        # Keep what can be kept: records whose digests cannot be resolved are dropped, events are written.
        self.records, self.dumps, self.kernels = RecordBuffer(), [], []
        self.waiting.reset()
        self.inflight.reset()
        self.event("capture_error", type(exc).__name__, "", None, detail)
        self.event(
            "capture_disabled", "", "", None, "capture stopped after the error above; the training step continued"
        )
        with contextlib.suppress(Exception):
            self.flush()
        if self._on_fail is not None:
            with contextlib.suppress(Exception):
                self._on_fail()

    def check_writer(self) -> None:
        """At a step boundary: the writer thread failed (a full or read-only file system)?
        Then capture is disabled, with one warning; training goes on."""
        error = self.writer.error
        if error is not None and not self.failed:
            self.failed = True
            self.warned_writer = True
            warnings.warn(f"detfp capture disabled on rank {self.rank}: {error}", RuntimeWarning, stacklevel=4)
