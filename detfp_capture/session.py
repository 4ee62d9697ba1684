"""``Session``: the capture layer that runs inside the user's training job, on every rank.

    session = Session("traces/a", level="ops")
    session.watch(model); session.watch_optimizer(optimizer)
    for step in range(start, n):
        with session.step(step):
            ... session.metric("loss", loss) ...
    session.close()

Levels: ``metrics`` (metric scalars, RNG states at step start, parameters at step end),
``boundaries`` (+ module inputs/outputs in forward, backward and recompute, torch.distributed
calls, DDP buckets and reduced gradients, the optimizer's params/grads/state), ``ops`` (+
every ATen op). The parts live in private modules: _config (options), _state (the record
stream and flushes), _steps (step and optimizer boundaries), _hooks (modules), _collectives,
_dispatch (ops), _hazards, _kernels.
Every hook catches its own exceptions: an error inside capture becomes a ``capture_error``
event and one warning, capture switches itself off, and the training step carries on.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
import warnings
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from detfp_capture._config import check_mapping, make_config
from detfp_capture._recorder.hazards import HazardTracker
from detfp_capture._recorder.recorder import Recorder
from detfp_capture._sources.modules import NODE_KEY, ModuleHooks
from detfp_capture._sources.steps import StepRecording
from detfp_capture.errors import ConfigError

__all__ = ["Session"]

#: close() waits for the writer thread to drain its queue as long as it makes progress; it gives
#: up only after this long without a single window written.
_CLOSE_TIMEOUT_S = 300.0


def _rank_world() -> tuple[int, int]:
    """Rank and world size: torch.distributed when initialized, else RANK/WORLD_SIZE, else 0/1."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except Exception:
        pass
    try:
        return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise ConfigError(
            f"RANK={os.environ.get('RANK')!r} WORLD_SIZE={os.environ.get('WORLD_SIZE')!r}: not integers; fix the launcher environment"
        ) from None


class Session(StepRecording):
    """Per-rank fingerprint capture of a training run (see docs/capture.md).

    Args:
        out_dir: run directory (shared by all ranks; each writes its own ``rank=R`` partitions).
        level: ``"metrics"``, ``"boundaries"`` or ``"ops"``.
        steps: steps to capture, e.g. ``"3-5,9"`` or ``"10-"`` (default all).
        ranks: ranks that capture, e.g. ``"0,4-7"`` (default all); other ranks write nothing.
        modules: regex of module paths whose boundaries and ops are recorded (default all).
        rows: row digests: True (dim-0 rows of every record), an int chunk size, or a regex
            of record names/modules.
        moments: float64 sum/absmax/NaN/Inf counts: True or a regex of record names/modules.
        dumps: regex of record names/modules whose tensors are also stored as raw bytes.
        kernels: steps whose device kernels (CPU: innermost profiler events) are recorded per op.
        poison: fill tensors born from ``empty*`` with a per-run byte pattern (level ops).
        append: continue an existing run directory as a new segment (a resumed run).
        overwrite: replace what this rank wrote into ``out_dir`` before (refused when the
            directory holds something that is not a detfp run; exclusive with ``append``).
        parallel: this rank's parallel coordinates for the manifest, e.g. ``{"dp": 1, "tp": 0}``.
        group_names: logical name -> ProcessGroup, used to name collectives (``"tp"``, ``"dp"``).
        flush_records: resolve digests and write a window every this many records (bounds memory).
        views: also digest view and metadata-only ops (default: counted, not digested).
        start_step: first step of this launch for the manifest (default: the first ``step(n)``).
    """

    def __init__(
        self,
        out_dir: str | os.PathLike[str],
        level: str = "metrics",
        *,
        steps: Any = None,
        ranks: Any = None,
        modules: Any = None,
        rows: Any = False,
        moments: Any = False,
        dumps: Any = None,
        kernels: Any = None,
        poison: bool = False,
        append: bool = False,
        overwrite: bool = False,
        parallel: dict[str, Any] | None = None,
        group_names: dict[str, Any] | None = None,
        flush_records: int = 65536,
        views: bool = False,
        start_step: int | None = None,
    ) -> None:
        self._cfg = cfg = make_config(
            level,
            steps=steps,
            ranks=ranks,
            modules=modules,
            rows=rows,
            moments=moments,
            dumps=dumps,
            kernels=kernels,
            poison=poison,
            append=append,
            flush_records=flush_records,
            views=views,
            start_step=start_step,
        )
        if overwrite and append:
            raise ConfigError("overwrite=True and append=True contradict each other; pass one of them")
        self._parallel = check_mapping(parallel, "parallel")
        self._group_names = check_mapping(group_names, "group_names")
        self._depth = cfg.depth
        self.out_dir = Path(out_dir)
        self.rank, self.world_size = _rank_world()
        self._closed = False
        self._inert = cfg.ranks is not None and self.rank not in cfg.ranks
        self._compiled_depth = 0
        self._saw_compiled = False
        self._bwd_queued = False  # an end-of-backward callback is queued for the running backward
        self._kernel_range: Any = None
        self._kernels: Any = None
        self._hazard: HazardTracker | None = None
        self._collectives: Any = None
        self._mode: Any = None
        self._mode_entered = False
        self._models: list[Any] = []
        self._param_names: dict[int, str] = {}
        self._opt_handles: list[Any] = []
        self._patched: list[tuple[Any, str, Any]] = []
        self._groups_changed = False
        self._first_step: int | None = start_step
        # Launcher mode: the step that begins at the next forward (or optimizer step), and
        # whether the running step has seen an optimizer step (a trailing one has not).
        self._auto_next: int | None = None
        self._grads_seen = False  # the optimizer read gradients this step (see CollectiveTracer.step_end)
        self._regions_scans = 0  # step begins that looked for modules compiled in place
        self._auto_stepped = False
        # The determinism settings last seen at a step begin (the manifest holds the first).
        self._settings: dict[str, Any] | None = None
        self._autocast_seen = False  # an autocast region was entered while the session was open
        self._bookkeeping = 0  # inside DDP's own work around the forward (level ops skips its ops)
        self._step_selected = False
        self._seen_step = False  # a step() has begun (for the outside-a-step warning)
        self._outside_warned: set[tuple[str, str]] = set()
        self._primary_opt: Any = None
        self._opt_stepped = False
        self._last_flush = time.monotonic()
        self._warned_writer = False
        if self._inert:
            return
        from detfp_capture import writer as _writer
        from detfp_capture.manifest import collect_manifest

        try:
            self.segment = _writer.prepare_run_dir(
                self.out_dir, self.rank, append=append, overwrite=overwrite, world_size=self.world_size
            )
            self._writer = _writer.ShardWriter(self.out_dir, self.rank, self.segment, on_error=self._writer_failed)
        except OSError as exc:  # read-only, full or vanished file system: the job must still run
            self._disable_at_start(exc)
            return
        self._writer_error: str | None = None
        self._rec = Recorder(cfg, self._writer, rank=self.rank, on_fail=self._on_fail)
        self._hooks = ModuleHooks(self)
        if cfg.depth >= 1 or cfg.poison:
            poison_byte = None
            if cfg.poison:
                # Per run (the directory differs between the two runs), never zero.
                d = hashlib.blake2b(str(self.out_dir.resolve()).encode(), digest_size=1).digest()[0]
                poison_byte = d or 0xA5
            self._hazard = HazardTracker(self._rec, poison_byte)
        self._manifest = collect_manifest(
            rank=self.rank,
            world_size=self.world_size,
            segment=self.segment,
            start_step=start_step,
            parallel=self._parallel,
            groups={},
            capture=cfg.describe(),
        )
        try:
            self._write_manifest()
        except OSError as exc:
            self._writer.mark_incomplete(f"the manifest could not be written: {type(exc).__name__}: {exc}")
            self._writer.close(timeout=_CLOSE_TIMEOUT_S)
            self._disable_at_start(exc)
            return
        if cfg.depth >= 1:
            from detfp_capture._sources.collectives import CollectiveTracer

            self._collectives = CollectiveTracer(self)
            self._collectives.install()
            self._patch_ddp()
            for name in self._group_names:
                self._collectives.name_of(self._group_names[name])
        if cfg.depth >= 2:
            from detfp_capture._sources.dispatch import CaptureMode

            self._mode = CaptureMode(self)
            self._patch_syncs()
            self._patch_autocast()
            self._patch_storage_resize()

    # ================================================================== public API
    def watch(self, model: torch.nn.Module) -> torch.nn.Module:
        """Record ``model``'s boundaries (level boundaries+) and parameters; returns the model."""
        if self._inert or self._closed:
            return model
        try:
            self._name_params(model)
            self._models.append(weakref.ref(model))
            self._hooks.watch(model)  # level metrics: the root only (its input is the batch)
            if self._depth >= 1:
                self._maybe_hook_ddp(model)
        except Exception as exc:
            self._rec.fail(exc, "watch()")
        return model

    def watch_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Record params and grads before ``optimizer.step()`` and params and state after it."""
        if self._inert or self._closed:
            return optimizer
        if self._depth >= 1:
            self._opt_handles.append(optimizer.register_step_pre_hook(lambda opt, a, k: self._opt_pre(opt)))
            self._opt_handles.append(optimizer.register_step_post_hook(lambda opt, a, k: self._opt_post(opt)))
        return optimizer

    def watch_all(self) -> None:
        """Record the boundaries of every module that runs forward and was not watched, named
        from the root module of its forward (as the launcher does): models built after this call."""
        if self._inert or self._closed or self._depth < 1 or self._hooks.global_mode:
            return
        self._hooks.install_global()

    @contextlib.contextmanager
    def step(self, n: int) -> Iterator[None]:
        """Everything inside belongs to absolute step ``n`` (a resumed run keeps the numbering)."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ConfigError(f"step({n!r}): expected a non-negative int, the absolute training step")
        self._begin_step(n)
        try:
            yield
        finally:
            self._end_step()

    @contextlib.contextmanager
    def microbatch(self, i: int) -> Iterator[None]:
        """Records inside carry microbatch ``i`` (gradient accumulation, pipeline microbatches)."""
        if isinstance(i, bool) or not isinstance(i, int) or i < 0:
            raise ConfigError(f"microbatch({i!r}): expected a non-negative int")
        if self._inert or self._closed:
            yield
            return
        prev = self._rec.microbatch
        self._rec.microbatch = i
        if self._rec.in_step and self._rec.phase == "step":
            self._rec.phase = "forward"  # the previous microbatch's backward has ended
        try:
            yield
        finally:
            self._rec.microbatch = prev

    def metric(self, name: str, value: Any) -> None:
        """Record a scalar (tensor or number) exactly: float64 value plus raw bits, no host sync now."""
        if not isinstance(name, str) or not name:
            raise ConfigError(f"metric name {name!r}: expected a non-empty string")
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise ConfigError(
                    f"metric {name!r}: expected a scalar, got a tensor of shape {tuple(value.shape)}; use probe() for tensors"
                )
        elif not isinstance(value, (int, float)):
            raise ConfigError(f"metric {name!r}: expected a number or a one-element tensor, got {type(value).__name__}")
        self._note_outside_step("metric", name)
        if not self._live_value():
            return
        rec = self._rec
        rec.enter()
        try:
            rec.metric(name, value)
        except Exception as exc:
            rec.fail(exc, f"metric({name!r})")
        finally:
            rec.leave()

    def probe(self, name: str, tensor: torch.Tensor, rows: bool | int = False) -> None:
        """Fingerprint ``tensor`` here as kind ``probe`` (calls the dispatcher cannot see: fused kernels, MoE maps)."""
        if not isinstance(name, str) or not name:
            raise ConfigError(f"probe name {name!r}: expected a non-empty string")
        if not isinstance(tensor, torch.Tensor):
            raise ConfigError(f"probe {name!r}: expected a tensor, got {type(tensor).__name__}")
        if torch.compiler.is_compiling():
            return
        self._note_outside_step("probe", name)
        if not self._live_value():
            return
        rec = self._rec
        rec.enter()
        try:
            module, phase = self._context()
            hz = self._hazard.flag_all([tensor]) if self._hazard is not None and self._hazard.active else None
            rec.record_call(
                "probe", name, module, phase, [("value", "value", tensor)], hazards=hz, rows=rows or None, fresh=True
            )
        except Exception as exc:
            rec.fail(exc, f"probe({name!r})")
        finally:
            rec.leave()
        if rec.need_flush:
            self._flush_safely()

    def close(self) -> None:
        """Finish the current step, flush, restore everything patched, and write the manifest."""
        if self._closed:
            return
        if self._inert:
            self._closed = True
            return
        try:
            if self._rec.in_step:
                if self._primary_opt is not None and not self._auto_stepped and self._rec.selected:
                    # Launcher mode: forwards after the last optimizer step (an evaluation) form
                    # a step no optimizer step ended; the analysis leaves it out.
                    self._rec.event(
                        "partial_step",
                        "",
                        "",
                        None,
                        f"step {self._rec.step} ended at close without an optimizer step (an evaluation or a "
                        "trailing forward); it is not compared",
                    )
                self._end_step()
            self._flush_safely()
        finally:
            self._closed = True
            self._teardown()
            with contextlib.suppress(Exception):
                self._write_manifest()
            if self._rec.failed and self._rec.fail_reason:
                # Records the writer never saw were dropped: the commit log's close line says so.
                self._writer.mark_incomplete(self._rec.fail_reason)
            self._close_writer()
            if self._writer.error and not self._warned_writer:
                warnings.warn(f"detfp: trace writer failed: {self._writer.error}", RuntimeWarning, stacklevel=2)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ================================================================== steps
    def _close_writer(self) -> None:
        """Wait for the writer to write every flushed window: a slow disk under load only delays
        close (data the user flushed is never dropped for time); a writer that makes no progress
        for ``_CLOSE_TIMEOUT_S`` (a hung filesystem) must not hang the end of training: give up,
        saying how many windows are missing (the writer thread, a daemon, dies with the process)."""
        w = self._writer
        last = None
        while not w.close(timeout=_CLOSE_TIMEOUT_S):
            progress = (w.windows_written, w.dropped_windows, w.files_written)
            if progress == last:
                missing = w.windows_queued - w.windows_written - w.dropped_windows
                warnings.warn(
                    f"detfp: trace writer of rank {self.rank} made no progress for {_CLOSE_TIMEOUT_S:.0f} s; "
                    f"gave up with {missing} flushed window(s) not written: the trace of this rank is "
                    "truncated (check the file system of the trace directory)",
                    RuntimeWarning,
                    stacklevel=3,
                )
                return
            last = progress

    # ================================================================== helpers used by the parts
    @staticmethod
    def _named_params(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        """(FQN, parameter) of a watched model, as its own code names them (a DDP wrapper is
        transparent); a wrapper that swaps parameters in (FSDP2's DTensors) is named as it is now."""
        base = (
            model.module
            if isinstance(getattr(model, "module", None), torch.nn.Module)
            and type(model).__name__ == "DistributedDataParallel"
            else model
        )
        return base.named_parameters(remove_duplicate=True)

    def _name_params(self, model: torch.nn.Module) -> None:
        for name, p in self._named_params(model):
            self._param_names.setdefault(id(p), name)

    def _maybe_hook_ddp(self, model: Any) -> None:
        if self._collectives is None:
            return
        try:
            from torch.nn.parallel import DistributedDataParallel
        except Exception:
            return
        if isinstance(model, DistributedDataParallel):
            self._collectives.hook_ddp(model, self._param_names)

    def _patch_ddp(self) -> None:
        """While the session is open, wrap DistributedDataParallel's forward and its bookkeeping.

        * ``forward``: a DDP wrapped around a watched module, whichever was created first, gets
          the recording comm hook at its first forward (before any backward): its C++ reducer
          issues the gradient all-reduce unseen by the collective wrappers. (A class patch,
          not a global module hook, which would make torch.compile warn about every module.)
        * ``_pre_forward``/``_post_forward`` (level ops): DDP's own work around the model's
          forward (rebuilding its buckets after the first iteration, syncing buffers) is not
          the model's computation, and when it happens depends on the process (a resumed run
          rebuilds one step later): its ops are not recorded. Digests waiting for a batch are
          taken before it, and cached ones dropped after it (it writes buffers unseen).
        """
        try:
            from torch.nn.parallel import DistributedDataParallel as DDP
        except Exception:
            return
        paths = self._hooks.paths
        hooked = self._collectives.ddp_hooked
        session = self
        rec = self._rec

        def wrap_forward(orig: Any) -> Any:
            def forward(ddp: Any, *a: Any, **k: Any) -> Any:
                if (
                    id(ddp) not in hooked
                    and id(getattr(ddp, "module", None)) in paths
                    and not session._closed
                    and not torch.compiler.is_compiling()
                ):
                    try:
                        session._name_params(ddp)
                        session._maybe_hook_ddp(ddp)
                    except Exception as exc:
                        rec.fail(exc, "hooking a DistributedDataParallel wrapper")
                return orig(ddp, *a, **k)

            forward.__wrapped__ = orig  # type: ignore[attr-defined]
            return forward

        def wrap_bookkeeping(orig: Any) -> Any:
            def bookkeeping(ddp: Any, *a: Any, **k: Any) -> Any:
                if not rec.selected or rec.failed:
                    return orig(ddp, *a, **k)
                rec.settle()
                session._bookkeeping += 1
                try:
                    return orig(ddp, *a, **k)
                finally:
                    session._bookkeeping -= 1
                    rec.clear_vcache()

            bookkeeping.__wrapped__ = orig  # type: ignore[attr-defined]
            return bookkeeping

        self._patch(DDP, "forward", wrap_forward)
        if self._depth >= 2:
            self._patch(DDP, "_pre_forward", wrap_bookkeeping)
            self._patch(DDP, "_post_forward", wrap_bookkeeping)

    def _on_root(self, module: torch.nn.Module) -> None:
        """Launcher mode: a module ran forward as a root for the first time."""
        if module in [r() for r in self._models]:
            return
        self._name_params(module)
        self._models.append(weakref.ref(module))
        self._maybe_hook_ddp(module)

    def _context(self) -> tuple[str, str]:
        """(module path, phase) of a record made now."""
        stack = self._hooks.stack
        if stack and stack[-1][2] == "recompute":
            return stack[-1][1], "recompute"
        node = torch._C._current_autograd_node()
        if node is not None:
            self._note_backward()
            # Without module hooks (level metrics) a checkpoint re-forward is told by grad mode:
            # autograd runs nodes with it off (no create_graph), checkpoint turns it on to recompute.
            if torch.is_grad_enabled() or "CheckpointFunction" in node.name():
                return node.metadata.get(NODE_KEY, ""), "recompute"
            return node.metadata.get(NODE_KEY, ""), "backward"
        if stack:
            return stack[-1][1], stack[-1][2]
        return "", self._rec.phase

    def _note_backward(self) -> None:
        """Inside a backward: have the phase leave ``backward``-time context when it ends."""
        if self._bwd_queued:
            return
        try:
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_ended)
            self._bwd_queued = True
        except Exception:  # not in a backward after all
            pass

    def _backward_ended(self) -> None:
        """Engine callback at the end of a backward: DDP bucket records join the stream (in
        bucket order), and records made after it (a loss all-reduce) get phase ``step``."""
        self._bwd_queued = False
        rec = self._rec
        try:  # an exception here would surface in the user's backward()
            if self._collectives is not None:
                self._collectives.wait_buckets()
            if rec.in_step and rec.phase == "forward":
                rec.phase = "step"
            if not self._live():
                return
            rec.enter()
            try:
                rec.drain_foreign()
            finally:
                rec.leave()
        except Exception as exc:
            rec.fail(exc, "end of backward")

    def _note_outside_step(self, kind: str, name: str) -> None:
        """Say once per (kind, name) where a metric or probe made outside ``session.step()`` went.

        It is filed under the last step when that step was captured (a loss logged right after
        the step block belongs to it), and dropped before the first step or after an uncaptured one.
        """
        if self._inert or self._closed or self._rec.in_step or (kind, name) in self._outside_warned:
            return
        self._outside_warned.add((kind, name))
        if self._step_selected:
            where = f"filed under step {self._rec.step}, the last step"
        elif self._seen_step:
            where = f"not recorded: the last step ({self._rec.step}) is not captured"
        else:
            where = "not recorded: no step has begun yet"
        warnings.warn(
            f"detfp: {kind} {name!r} on rank {self.rank} was made outside session.step(): {where}; "
            f"make it inside 'with session.step(n):' to file it under step n",
            RuntimeWarning,
            stacklevel=3,
        )

    def _hazards_for(self, tensors: list[torch.Tensor]) -> dict[int, tuple[str, ...]] | None:
        return self._hazard.flag_all(tensors) if self._hazard is not None else None

    @property
    def _hazards_on(self) -> bool:
        return self._hazard is not None and self._hazard.active

    def _live(self) -> bool:
        return not self._inert and not self._closed and not self._rec.failed and self._rec.selected

    def _live_value(self) -> bool:
        # Metrics and probes right after a step block still belong to that step.
        return not self._inert and not self._closed and not self._rec.failed and self._step_selected

    def _flush_safely(self) -> None:
        rec = self._rec
        if rec.failed:
            return
        try:
            rec.flush()
        except Exception as exc:
            rec.fail(exc, "flush")

    def _on_fail(self) -> None:
        if self._mode_entered:
            # Leaving the mode from inside one of its own callbacks is unsafe; it passes ops through from now on.
            pass
        if self._kernels is not None:
            with contextlib.suppress(Exception):
                self._kernels.stop(discard=True)
            self._kernels = self._kernel_range = None

    def _disable_at_start(self, exc: OSError) -> None:
        """The run directory cannot be written at all: capture nothing, warn once, train on."""
        self._inert = True
        warnings.warn(
            f"detfp capture disabled on rank {self.rank}: cannot write the trace to {self.out_dir} "
            f"({type(exc).__name__}: {' '.join(str(exc).split())}); training continues without capture",
            RuntimeWarning,
            stacklevel=3,
        )

    def _writer_failed(self, msg: str) -> None:
        self._writer_error = msg  # called on the writer thread; acted upon at the next step boundary

    def _disable_for_writer(self) -> None:
        if not self._rec.failed:
            self._rec.failed = True
            self._warned_writer = True
            warnings.warn(
                f"detfp capture disabled on rank {self.rank}: {self._writer_error}", RuntimeWarning, stacklevel=3
            )

    def _write_manifest(self) -> None:
        from detfp_capture import writer as _writer

        groups = dict(self._collectives.groups) if self._collectives is not None else {}
        self._manifest["groups"] = {k: list(v) for k, v in sorted(groups.items())}
        _writer.write_manifest(self.out_dir, self._manifest, create=False)

    def _write_manifest_safely(self) -> None:
        try:
            self._write_manifest()
        except Exception as exc:
            self._rec.fail(exc, "writing the manifest")

    def _patch(self, owner: Any, name: str, make: Any) -> None:
        orig = getattr(owner, name, None)
        if orig is None:
            return
        new = make(orig)
        self._patched.append((owner, name, orig, new))
        setattr(owner, name, new)

    def _patch_syncs(self) -> None:
        """Observe explicit synchronizations: they end the nonblocking_pending hazard."""
        hz = self._hazard

        def wrap(orig: Any) -> Any:
            def synced(*a: Any, **k: Any) -> Any:
                r = orig(*a, **k)
                if hz is not None:
                    hz.synchronized()
                return r

            synced.__wrapped__ = orig  # type: ignore[attr-defined]
            return synced

        self._patch(torch.cuda, "synchronize", wrap)
        if hasattr(torch.cuda, "Stream"):
            self._patch(torch.cuda.Stream, "synchronize", wrap)
        if hasattr(torch.cuda, "Event"):
            self._patch(torch.cuda.Event, "synchronize", wrap)

    def _patch_autocast(self) -> None:
        """Note that the job uses autocast (``CaptureMode._call`` then keeps each op's autocast
        state as it would be without the mode; until then that check costs nothing)."""
        session = self

        def wrap(orig: Any) -> Any:
            def enter(ctx: Any, *a: Any, **k: Any) -> Any:
                session._autocast_seen = True
                return orig(ctx, *a, **k)

            enter.__wrapped__ = orig  # type: ignore[attr-defined]
            return enter

        self._patch(torch.amp.autocast_mode.autocast, "__enter__", wrap)
        if torch.is_autocast_enabled() or torch.is_autocast_enabled("cpu"):
            self._autocast_seen = True  # the session was opened inside an autocast region

    def _patch_storage_resize(self) -> None:
        """Observe storage resizes, which no dispatch mode sees: FSDP (and ZeRO-3) free the
        unsharded parameters with ``storage.resize_(0)`` after a module's forward and allocate
        them again before its backward. Digests still waiting for a batch over that storage are
        taken first (reading it afterwards would read freed memory), and cached digests over it
        are dropped (its next contents are new)."""
        rec = self._rec

        def wrap(orig: Any) -> Any:
            def resize_(storage: Any, *a: Any, **k: Any) -> Any:
                if not rec.busy and rec.selected and not rec.failed and (rec.deferred or rec.vcache):
                    try:
                        ptr = storage.data_ptr()
                    except Exception:  # a fake or functional storage (torch.compile tracing): no data
                        ptr = None
                    if ptr:
                        try:
                            rec.storage_changing(ptr)
                        except Exception as exc:
                            rec.fail(exc, "storage resize")
                return orig(storage, *a, **k)

            resize_.__wrapped__ = orig  # type: ignore[attr-defined]
            return resize_

        self._patch(torch.UntypedStorage, "resize_", wrap)

    def _teardown(self) -> None:
        if self._mode_entered:
            self._mode_entered = False
            self._rec.mode = None
            with contextlib.suppress(Exception):
                self._mode.__exit__(None, None, None)
        if self._kernels is not None:
            with contextlib.suppress(Exception):
                self._kernels.stop(discard=True)
            self._kernels = self._kernel_range = None
        if self._collectives is not None:
            self._collectives.uninstall()
        self._hooks.remove()
        for h in self._opt_handles:
            h.remove()
        self._opt_handles.clear()
        for owner, name, orig, new in reversed(self._patched):
            if getattr(owner, name, None) is new:  # another session may have wrapped it since
                setattr(owner, name, orig)
        self._patched.clear()

    # ================================================================== launcher mode
    def _install_auto(self) -> None:
        """No-code-change mode: global module hooks; steps counted by optimizer.step() calls."""
        if self._inert:
            return
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        self._hooks.install_global()  # level metrics: roots only
        self._opt_handles.append(register_optimizer_step_pre_hook(lambda opt, a, k: self._auto_pre(opt)))
        self._opt_handles.append(register_optimizer_step_post_hook(lambda opt, a, k: self._auto_post(opt)))
        # Step --start-step begins at the first forward (or optimizer step), not at launch: the
        # script has seeded its RNGs and set its determinism flags by then.
        self._auto_next = self._cfg.start_step or 0

    def _auto_touch(self) -> None:
        """Launcher mode: begin the pending step (first forward, collective or optimizer step of it)."""
        n, self._auto_next = self._auto_next, None
        if n is not None and not self._closed:
            self._auto_stepped = False
            self._begin_step(n)

    def _auto_pre(self, opt: Any) -> None:
        if self._primary_opt is None:
            self._primary_opt = weakref.ref(opt)
        if self._auto_next is not None:
            self._auto_touch()
        if self._depth >= 1:
            self._opt_pre(opt)

    def _auto_post(self, opt: Any) -> None:
        if self._depth >= 1:
            self._opt_post(opt)
        if self._closed or self._primary_opt is None or self._primary_opt() is not opt:
            return
        n = self._rec.step + 1
        self._auto_stepped = True
        self._end_step()
        self._auto_next = n  # begins at the next forward: no trailing step after the last one
