"""``Session``: the capture layer that runs inside the user's training job, on every rank.

    session = Session("traces/a", level="ops")
    session.watch(model); session.watch_optimizer(optimizer)
    for step in range(start, n):
        with session.step(step):
            ... session.metric("loss", loss) ...
    session.close()

Levels (``_config.LEVEL_CAPABILITIES`` says what each turns on): ``metrics`` (metric scalars,
RNG states at step start, parameters at step end), ``boundaries`` (+ module inputs/outputs in
forward, backward and recompute, torch.distributed calls, DDP's reduced gradients, the
optimizer's params/grads/state), ``ops`` (+ every ATen op).

The Session is a facade: it validates the options, opens the run directory and the writer,
builds the ``Recorder`` (``_recorder``) and a ``CaptureContext`` that it hands to each record
source (``_sources``: module hooks, the dispatch mode, the collective wrappers, DDP's comm hook,
the step and optimizer boundaries, the launcher's step counting), and takes everything down at
``close``. Every source runs its work in the recorder's guard: an error inside capture becomes a
``capture_error`` event and one warning, capture switches itself off, and the training step
carries on.

A step that raises (``with session.step(n):`` left by an exception) is marked with a
``partial_step`` event naming the exception: its records stop where the script did, and the
analysis says the run ended there instead of calling the missing rest a control-flow
difference. A session the script never closes (it died between ``session = Session(...)`` and
``session.close()``) is closed at interpreter exit, so what it captured is kept as with the
``with`` form.
"""

from __future__ import annotations

import atexit
import contextlib
import inspect
import os
import warnings
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from detfp_capture._config import check_mapping, make_config
from detfp_capture._extension import Extension, SessionParts
from detfp_capture._options import CaptureOptions, option_fields, options_doc, session_signature
from detfp_capture._placement import RankPart, env_place
from detfp_capture._recorder.hazards import HazardTracker, poison_pattern
from detfp_capture._recorder.manifest import RunManifest
from detfp_capture._recorder.recorder import Recorder
from detfp_capture._sources.context import CaptureContext, PendingStep, Place, Scope, WatchedModels
from detfp_capture._sources.patches import Patches
from detfp_capture._sources.steps import StepBoundaries
from detfp_capture._sources.wiring import install_sources
from detfp_capture.errors import CaptureError, ConfigError
from detfp_capture.manifest import resumed_config

__all__ = ["Session"]

#: close() waits for the writer thread to drain its queue as long as it makes progress; it gives
#: up only after this long without a single window written.
_CLOSE_TIMEOUT_S = 300.0
#: Sessions opened and not closed yet, closed at interpreter exit (weak: a session nobody holds
#: is not kept alive by this). Process state by nature: exit is per process.
_OPEN: weakref.WeakSet[Session] = weakref.WeakSet()


@atexit.register
def _close_at_exit() -> None:
    """Close what the script left open (it died, or never called close()): the windows it
    captured are written and committed instead of lost."""
    for session in sorted(_OPEN, key=id):
        with contextlib.suppress(Exception):
            session.close()


class Session:
    """Per-rank fingerprint capture of a training run (see docs/capture.md).

    Args:
        out_dir: run directory (shared by all ranks; each writes its own ``rank=R`` partitions).
        extension: a caller's part in the session (``_extension.Extension``; the launcher's).

    Options (``_options.CaptureOptions``, where each is spelled once; ``level`` may be positional):
    """

    def __init__(
        self, out_dir: str | os.PathLike[str], level: str = "metrics", *, extension: Extension | None = None, **options: Any
    ) -> None:
        # The signature and docstring list every option (made from CaptureOptions below the class).
        try:
            opts = CaptureOptions(level=level, **options)
        except TypeError:
            unknown = sorted(set(options) - {f.name for f in option_fields()})
            raise TypeError(f"Session() got unknown option(s) {', '.join(unknown)}; see help(Session)") from None
        self._cfg = cfg = make_config(opts)
        if opts.overwrite and opts.append:
            raise ConfigError("overwrite=True and append=True contradict each other; pass one of them")
        self._parallel = check_mapping(opts.parallel, "parallel")
        self._group_names = check_mapping(opts.group_names, "group_names")
        self.out_dir = Path(out_dir)
        self._place = place = Place(*env_place())
        self._closed = False
        self._ext = extension
        # Open this rank's part only once the rank is known (``_placement``): never in user code.
        awaiting = extension is not None and extension.awaits_rank()
        self._inert = not awaiting and cfg.ranks is not None and self.rank not in cfg.ranks
        self._outside_warned: set[tuple[str, str]] = set()
        self._steps: StepBoundaries | None = None
        self._opt_handles: list[Any] = []
        if self._inert:
            return
        # Every digest this session starts uses its version (one version per trace); a second live
        # session of this process with another version is refused here.
        from detfp_capture._digest import versions

        try:
            versions.hold(self, cfg.digest_version)
        except CaptureError as exc:
            raise ConfigError(str(exc)) from None
        self._rec = rec = Recorder(cfg, None, rank=self.rank, on_fail=self._on_fail)
        start_step = opts.start_step
        self._manifest = RunManifest(self.out_dir, rec, start_step)
        self._part = RankPart(
            self.out_dir,
            rec,
            self._manifest,
            place,
            awaiting=awaiting,
            followed=extension is not None and extension.followed,
            append=opts.append,
            overwrite=opts.overwrite,
            ranks=cfg.ranks,
            fields={"start_step": start_step, "parallel": self._parallel, "capture": cfg.describe()},
            digest_version=lambda segment: self._digest_version_for(segment, opts.digest_version),
        )
        if not awaiting:
            try:
                self._part.open()
            except OSError as exc:  # read-only, full or vanished file system: the job must still run
                self._disable_at_start(exc)
                return
            except ConfigError:
                self._release_digest_version()
                raise
        # The poison pattern is per run (the directory differs between the two runs): docs/capture.md, poison.
        pattern = poison_pattern(str(self.out_dir.resolve())) if cfg.poison else None
        hazards = HazardTracker(rec, pattern) if cfg.caps.hazards or cfg.poison else None
        self._ctx = ctx = CaptureContext(
            cfg=cfg,
            caps=cfg.caps,
            place=place,
            rec=rec,
            scope=Scope(rec, cfg.modules),
            hazards=hazards,
            models=WatchedModels(),
            pending_step=PendingStep(),
            patches=Patches(),
            group_names=self._group_names,
        )
        src = install_sources(
            ctx,
            manifest=self._manifest,
            group_names=self._group_names,
            on_root=self._on_root,
            learn_place=self._learn_place,
        )
        self._hooks, self._stage_inference, self._steps = src.hooks, src.stage_inference, src.steps
        self._tracer: Any = src.tracer
        self._ddp: Any = src.ddp
        if extension is not None:
            extension.attach(SessionParts(ctx=ctx, steps=src.steps, hooks=src.hooks, part=self._part))
        _OPEN.add(self)

    rank = property(lambda self: self._place.rank, doc="This process's rank (see ``_placement``).")
    world_size = property(lambda self: self._place.world_size, doc="The world size (see ``_placement``).")
    _writer = property(lambda self: self._part.writer, doc="This rank's shard writer; None until its part opens.")

    # ================================================================== public API
    def watch(self, model: torch.nn.Module) -> torch.nn.Module:
        """Record ``model``'s boundaries (level boundaries+) and parameters; returns the model."""
        if self._inert or self._closed:
            return model
        with self._rec.guard("watch()", busy=False):
            self._ctx.models.add(model)
            self._boundaries().start.watch(model)
            self._hooks.watch(model)  # level metrics: the root only (its input is the batch)
            self._stage_inference.maybe_install()
            if self._ddp is not None:
                self._ddp.maybe_hook(model)
        return model

    def watch_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Record params and grads before ``optimizer.step()`` and params and state after it."""
        if self._inert or self._closed:
            return optimizer
        steps = self._boundaries()
        steps.start.watch_optimizer(optimizer)  # never raises
        if self._ctx.caps.optimizer:
            self._opt_handles.append(optimizer.register_step_pre_hook(steps.optimizer_pre))
            self._opt_handles.append(optimizer.register_step_post_hook(lambda opt, a, k: steps.optimizer_post(opt)))
        return optimizer

    def watch_all(self) -> None:
        """Record the boundaries of every module that runs forward and was not watched, named
        from the root module of its forward (as the launcher does): models built after this call."""
        if self._inert or self._closed or not self._ctx.caps.module_boundaries or self._hooks.global_mode:
            return
        self._hooks.install_global()

    @contextlib.contextmanager
    def step(self, n: int) -> Iterator[None]:
        """Everything inside belongs to absolute step ``n`` (a resumed run keeps the numbering)."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ConfigError(f"step({n!r}): expected a non-negative int, the absolute training step")
        steps = self._steps
        if steps is not None:
            steps.begin(n)
        try:
            yield
        except BaseException as exc:
            if steps is not None and not self._closed:
                steps.raised(n, exc)
            raise
        finally:
            if steps is not None:
                steps.end()

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
        if isinstance(value, torch.Tensor) and value.numel() != 1:
            raise ConfigError(
                f"metric {name!r}: expected a scalar, got a tensor of shape {tuple(value.shape)}; use probe() for tensors"
            )
        if not isinstance(value, torch.Tensor | int | float):
            raise ConfigError(f"metric {name!r}: expected a number or a one-element tensor, got {type(value).__name__}")
        if torch.compiler.is_compiling():
            return  # traced into compiled code: read no capture state (see ModuleHooks.pre)
        self._note_outside_step("metric", name)
        if not self._live_value():
            return
        with self._rec.guard("metric({!r})", name):
            self._rec.metric(name, value)

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
        with rec.guard("probe({!r})", name):
            module, phase = self._ctx.scope.where()
            hz = self._ctx.hazards
            flags = hz.flag_all([tensor]) if hz is not None and hz.active else None
            rec.record_call(
                "probe", name, module, phase, [("value", "value", tensor)], hazards=flags, rows=rows or None, fresh=True
            )
        if rec.need_flush:
            rec.flush_safely()

    def close(self) -> None:
        """Finish the current step, flush, restore everything patched, and write the manifest."""
        if self._closed:
            return
        _OPEN.discard(self)
        if self._inert:
            self._closed = True
            return
        rec = self._rec
        if not rec.closed:
            self._learn_place(closing=True)  # a part still waiting for its rank opens now, or never
        if self._writer is None:  # never opened: its rank was not known, or ranks= leaves it out
            self._closed = rec.closed = True
            self._release_digest_version()  # else held until the session is garbage
            self._teardown()
            return
        try:
            if rec.in_step:
                if self._ext is not None:
                    self._ext.close_trailing()
                self._boundaries().end()
            rec.flush_safely()
        finally:
            self._closed = rec.closed = True
            self._release_digest_version()
            self._teardown()
            with contextlib.suppress(Exception):
                self._manifest.write()
            if rec.failed and rec.fail_reason:
                # Records the writer never saw were dropped: the commit log's close line says so.
                self._writer.mark_incomplete(rec.fail_reason)
            self._part.close_writer(_CLOSE_TIMEOUT_S)
            if self._writer.error and not rec.warned_writer:
                warnings.warn(f"detfp: trace writer failed: {self._writer.error}", RuntimeWarning, stacklevel=2)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ================================================================== internals
    def _learn_place(self, closing: bool = False) -> None:
        """At a step begin and at close: the rank and world size from the process group once it
        appears, and a part waiting for its rank opened (``_placement.RankPart.learn``)."""
        rec = self._rec
        try:
            why = self._part.learn(closing)
        except (OSError, CaptureError) as exc:
            why = f"cannot write the trace to {self.out_dir} ({type(exc).__name__}: {' '.join(str(exc).split())})"
        if why is None:
            return
        if self._writer is not None:  # opened under a rank the group contradicts: stop (close says why)
            rec.failed = True
            rec.fail_reason = why
            warnings.warn(f"detfp capture disabled on rank {self.rank}: {why}", RuntimeWarning, stacklevel=4)
            return
        # Never opened: nothing records from now on; close() restores what is patched (not now:
        # this runs inside a hook whose registry torch may be iterating).
        rec.closed = True
        rec.selected = False
        if why:
            warnings.warn(f"detfp capture off in process {os.getpid()}: {why}", RuntimeWarning, stacklevel=4)

    def _note_outside_step(self, kind: str, name: str) -> None:
        """Say once per (kind, name) where a metric or probe made outside ``session.step()`` went.

        It is filed under the last step when that step was captured (a loss logged right after
        the step block belongs to it), and dropped before the first step or after an uncaptured one.
        """
        if self._inert or self._closed or self._rec.in_step or (kind, name) in self._outside_warned:
            return
        self._outside_warned.add((kind, name))
        steps = self._boundaries()
        if steps.selected:
            where = f"filed under step {self._rec.step}, the last step"
        elif steps.seen:
            where = f"not recorded: the last step ({self._rec.step}) is not captured"
        else:
            where = "not recorded: no step has begun yet"
        warnings.warn(
            f"detfp: {kind} {name!r} on rank {self.rank} was made outside session.step(): {where}; "
            f"make it inside 'with session.step(n):' to file it under step n",
            RuntimeWarning,
            stacklevel=3,
        )

    def _flush_safely(self) -> None:
        """Flush now (tests and benchmarks; capture flushes by itself at step ends)."""
        self._rec.flush_safely()

    def _live_value(self) -> bool:  # metrics and probes right after a step block still belong to it
        return not self._inert and not self._closed and not self._rec.failed and self._boundaries().selected

    def _on_root(self, module: torch.nn.Module) -> None:
        """Global hooks (launcher, ``watch_all``): a module ran forward as a root for the first time."""
        models = self._ctx.models
        if module in models:
            return
        models.add(module)
        self._boundaries().start.watch(module)
        if self._ddp is not None:
            self._ddp.maybe_hook(module)

    def _on_fail(self) -> None:
        """Capture failed (``Recorder.fail``): the profiler stops (the dispatch mode, which cannot
        be left from inside its own callbacks, passes ops through from now on)."""
        if self._steps is not None:
            self._steps.stop_kernels()

    def _digest_version_for(self, segment: int, asked: int | None) -> int:
        """The digest version of this rank's part, now that its segment is known: a launch
        appended to a run keeps the run's version (``manifest.resumed_config``; ConfigError when
        another was asked for), and this session then holds that one."""
        cfg = self._cfg
        if segment:
            resumed = resumed_config(cfg, asked, self.out_dir, self.rank, segment)
            if resumed is not cfg:
                from detfp_capture._digest import versions

                self._release_digest_version()
                try:
                    versions.hold(self, resumed.digest_version)
                except CaptureError as exc:
                    raise ConfigError(str(exc)) from None
                # The version is all that changes: digests read the held one (versions.active()).
                self._cfg = self._rec.cfg = resumed
        return self._cfg.digest_version

    def _release_digest_version(self) -> None:
        from detfp_capture._digest import versions

        versions.release(self)

    def _disable_at_start(self, exc: OSError) -> None:
        """The run directory cannot be written at all: capture nothing, warn once, train on."""
        self._inert = True
        self._release_digest_version()
        warnings.warn(
            f"detfp capture disabled on rank {self.rank}: cannot write the trace to {self.out_dir} "
            f"({type(exc).__name__}: {' '.join(str(exc).split())}); training continues without capture",
            RuntimeWarning,
            stacklevel=3,
        )

    def _boundaries(self) -> StepBoundaries:
        """The step boundaries: made with the sources whenever the session is not inert (every
        caller has returned on ``_inert`` first; an inert session never made them)."""
        assert self._steps is not None, "step boundaries of an inert session"
        return self._steps

    def _teardown(self) -> None:
        steps = self._boundaries()
        steps.leave_mode()
        steps.stop_kernels()
        if self._tracer is not None:
            self._tracer.uninstall()
        self._hooks.remove()
        steps.start.remove()
        for h in self._opt_handles:
            h.remove()
        self._opt_handles.clear()
        if self._ext is not None:
            self._ext.remove()
        self._ctx.patches.restore()


# The options, spelled once in CaptureOptions, make the Session's signature and the end of its docstring.
_P = inspect.Parameter
Session.__init__.__signature__ = session_signature(  # type: ignore[attr-defined]
    [_P("self", _P.POSITIONAL_OR_KEYWORD), _P("out_dir", _P.POSITIONAL_OR_KEYWORD, annotation="str | os.PathLike[str]")],
    [_P("extension", _P.KEYWORD_ONLY, default=None, annotation="Extension | None")],
)
Session.__doc__ = (Session.__doc__ or "").rstrip(" ") + options_doc()
