"""Step boundaries and optimizer boundaries: what runs at the edges of a training step.

``StepBoundaries.begin`` selects the step (``steps=``), writes the ``step_begin`` event, the state
the capture starts from when it is due (``startstate``: the first captured step, and the first
after a checkpoint load) and the RNG states, starts the profiler for a step whose kernels are recorded and enters the dispatch
mode (level ops); ``end`` leaves the mode, takes every digest still waiting, lets DDP's reduced
gradients join the stream, records the parameters of the watched models and the ``step_end``
event, and applies the flush policy (a full window, or one holding ``flush_steps`` steps: counts,
never a clock). The optimizer's pre/post-step hooks (``optimizer_pre``/``optimizer_post``) record
its params, grads and state.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from detfp_capture._recorder.args import flat_args
from detfp_capture._recorder.call import RecordSpec, make_call
from detfp_capture._recorder.manifest import RunManifest
from detfp_capture._sources.context import CaptureContext
from detfp_capture._sources.modules import ModuleHooks
from detfp_capture._sources.pipelining import StageInference
from detfp_capture._sources.startstate import StartState
from detfp_format import contract

if TYPE_CHECKING:  # imported by the Session only at the levels that use them
    from detfp_capture._sources.collectives import CollectiveTracer
    from detfp_capture._sources.ddp import DDPReduction
    from detfp_capture._sources.dispatch import CaptureMode

__all__ = ["StepBoundaries", "hyperparameters"]


def hyperparameters(group: dict) -> tuple | None:
    """A param group's hyperparameters (lr as the scheduler left it, betas, eps, weight_decay,
    momentum, foreach/fused/capturable flags, ...) as the arguments of its optimizer calls.
    A one-element CPU tensor (a tensor lr) counts by value; other tensors only by presence
    (reading a device tensor here would synchronize)."""
    items = []
    for k in sorted(group):
        if k == "params":
            continue
        v = group[k]
        if isinstance(v, torch.Tensor):
            v = v.item() if v.numel() == 1 and v.device.type == "cpu" else v
        items.append((k, v))
    return flat_args([], items)


class StepBoundaries:
    """Step begin/end and the optimizer's boundaries. ``tracer``/``ddp`` (level boundaries and
    up) and ``mode`` (level ops) are None below their level."""

    def __init__(
        self,
        ctx: CaptureContext,
        *,
        hooks: ModuleHooks,
        manifest: RunManifest,
        tracer: CollectiveTracer | None,
        ddp: DDPReduction | None,
        mode: CaptureMode | None,
        stage_inference: StageInference,
        learn_place: Callable[[], None],
    ) -> None:
        self.ctx = ctx
        self.rec = ctx.rec
        self.hooks = hooks
        self.manifest = manifest
        self.tracer = tracer
        self.ddp = ddp
        self.mode = mode
        self.stage_inference = stage_inference
        #: Reads the process group once it appears (``Session._learn_place``): the rank and world
        #: size, and a launcher's part of the run directory waiting for its rank opened.
        self.learn_place = learn_place
        #: The state the capture starts from (parameters, buffers, optimizer state), when due.
        self.start = StartState(ctx)
        self.mode_entered = False
        self.kernels: Any = None  # kernels.KernelCapture of the running step
        #: The last step begun was selected (a metric right after its block is filed under it).
        self.selected = False
        #: A step has begun (for the outside-a-step warning).
        self.seen = False
        self._regions_scans = 0  # step begins that looked for modules compiled in place
        self._grads_seen = False  # the optimizer read gradients this step (CollectiveTracer.step_end)
        self._opt_stepped = False  # a watched optimizer stepped since the last step-end params

    # ================================================================== steps
    def begin(self, n: int) -> None:
        rec = self.rec
        if not rec.closed:
            self.learn_place()
        if rec.closed:
            return
        if rec.in_step:
            self.end()
        rec.check_writer()
        self.stage_inference.maybe_install()  # before the step's schedule infers any shape
        cfg = self.ctx.cfg
        sel = not rec.failed and (cfg.steps is None or n in cfg.steps)
        rec.begin_step(n, sel)
        self.ctx.scope.backward_queued = False
        self.selected = sel
        self.seen = True
        self.manifest.step_begins(n)
        if self._regions_scans < 2:
            # Modules compiled in place (module.compile()) once training starts: record their
            # regions' boundaries (the first two steps: a compile right after step 0 counts).
            self._regions_scans += 1
            self.hooks.wrap_compiled()
        if not sel:
            if self.ctx.hazards is not None:
                self.ctx.hazards.unobserved()
            return
        guard = rec.guard("step begin")
        with guard:
            rec.drain_foreign()
            rec.event("step_begin")
            rec.phase = "step"
            if self.start.due:
                self.start.record()
            self._record_rng()
            rec.phase = "forward"
        if guard.failed:
            return
        mode = self.mode
        if cfg.kernels is not None and n in cfg.kernels and mode is not None:
            from detfp_capture._sources.kernels import KernelCapture

            starting = rec.guard("starting the profiler", busy=False)
            with starting:
                self.kernels = KernelCapture(rec)
                self.kernels.start()
                mode.kernel_range = self.kernels.range
            if starting.failed:
                self.kernels = mode.kernel_range = None
        if mode is not None and not rec.failed:
            mode.__enter__()
            self.mode_entered = True
            rec.mode = mode

    def raised(self, n: int, exc: BaseException) -> None:
        """Step ``n`` ends by an exception: say so (a ``partial_step`` event), so its missing rest
        reads as where the run ended, not as control flow that differed."""
        rec = self.rec
        if not rec.in_step or not rec.selected:
            return
        with rec.guard("step {} raised", n):
            what = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
            rec.event("partial_step", "", "", None, f"step {n} raised {what}; its records stop there")

    def end(self) -> None:
        rec = self.rec
        if not rec.in_step:
            return
        self.leave_mode()
        if rec.selected and not rec.failed:
            with rec.guard("step end"):
                if self.kernels is not None:
                    ks, self.kernels = self.kernels, None
                    if self.mode is not None:
                        self.mode.kernel_range = None
                    ks.stop()
                # Collectives the program has not waited for yet: capture completes those that
                # records wait for now, after the step's work (``inflight``).
                rec.inflight.finish(rec.step)
                # The dispatch mode is off from here on: what runs between steps writes unseen,
                # so digests still waiting for a batch are taken now, not at the next write.
                rec.run_deferred(staging=False)
                if self.ddp is not None:
                    self.ddp.wait_buckets()
                rec.drain_foreign()
                rec.phase = "step"
                rec.microbatch = contract.NO_MICROBATCH
                self._record_params()
                if self.tracer is not None:
                    self.tracer.step_end(self._grads_seen)
                    self._grads_seen = False
                rec.event("step_end", "", "", rec.records_in_step)
        if not rec.selected:
            rec.inflight.finish(rec.step)  # nothing of the step waits for anything
        if self.ctx.hazards is not None:
            self.ctx.hazards.step_end()
        rec.in_step = False
        rec.selected = False
        self.hooks.release_nodes()
        # A step end flushes when the window is full or holds flush_steps steps: one resolve and
        # one shard per window instead of per step keeps the cheap levels cheap; close() flushes
        # the rest. Counts, never a clock: where a window ends is a function of the job, so two
        # runs of one job write the same windows (the rollups' rows, the seq of events a flush
        # adds) however fast the machine ran each (docs/capture.md, "Flush windows").
        rec.window_steps += 1
        if rec.need_flush or rec.dumps or rec.window_steps >= self.ctx.cfg.flush_steps:
            rec.flush_safely()
        if self.tracer is not None and self.tracer.groups_changed:
            self.tracer.groups_changed = False
            self.manifest.write_safely()

    def leave_mode(self) -> None:
        mode = self.mode
        if self.mode_entered and mode is not None:  # entered only when there is one (enter_mode)
            self.mode_entered = False
            self.rec.mode = None
            with contextlib.suppress(Exception):
                mode.__exit__(None, None, None)

    def stop_kernels(self) -> None:
        """Capture failed or the session closes: stop the profiler, keep nothing of it."""
        if self.kernels is not None:
            with contextlib.suppress(Exception):
                self.kernels.stop(discard=True)
            self.kernels = None
            if self.mode is not None:
                self.mode.kernel_range = None

    def _record_rng(self) -> None:
        rec = self.rec
        rec.record_call("rng_state", "cpu", "", "step", [("value", "state", torch.get_rng_state())], fresh=True)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            for i in range(torch.cuda.device_count()):
                rec.record_call(
                    "rng_state", f"cuda:{i}", "", "step", [("value", "state", torch.cuda.get_rng_state(i))], fresh=True
                )

    def _record_params(self) -> None:
        # Right after a watched optimizer step the cached digests are the updated parameters, as
        # long as nothing wrote them since. Only level ops sees every write, through any alias
        # (before_write drops what a `.data` write makes stale); below it a `p.data.clamp_`
        # between optimizer.step() and the step end moves no version counter: digest afresh.
        fresh = not (self._opt_stepped and self.ctx.caps.sees_writes)
        self._opt_stepped = False
        seen: set[int] = set()
        specs = []
        models = self.ctx.models
        for m in models:
            for name, p in models.named_params(m):
                if id(p) in seen:
                    continue
                seen.add(id(p))
                specs.append(RecordSpec(None, "param", name, "", "step", "value", "param", p))
        self.rec.record_many(specs, fresh=fresh)

    # ================================================================== optimizer
    def optimizer_pre(self, opt: Any, args: tuple = (), kwargs: dict | None = None) -> tuple[tuple, dict] | None:
        """The optimizer's pre-step hook: its parameters (and gradients) before the update.

        ``args``/``kwargs`` are those of ``step()`` (``args[0]`` is the optimizer). With a closure
        (``step(closure)``: Lightning's automatic optimization, L-BFGS) the forward and backward
        run inside the step, so the gradients the update reads do not exist yet: the closure is
        replaced by ``_closure_run`` (returned as the hook's new arguments), which gives what the
        closure runs the phases of a forward and a backward and records the gradients after each
        call of it."""
        rec = self.rec
        if rec.failed or not rec.selected or rec.busy:
            rec.phase = "optimizer" if rec.in_step else rec.phase
            return None
        closure, where = _closure_of(args, kwargs or {})
        models = self.ctx.models
        wrapped = None
        with rec.guard("optimizer pre-step hook"):
            rec.drain_foreign()
            rec.phase = "optimizer"
            mb = rec.microbatch
            rec.microbatch = contract.NO_MICROBATCH
            names = models.param_names
            if any(id(p) not in names for g in opt.param_groups for p in g["params"]):
                # Parameters replaced since watch() (FSDP2's fully_shard swaps in DTensors):
                # name them again from the watched models.
                for m in models:
                    models.name_params(m)
            specs = []
            for gi, group in enumerate(opt.param_groups):
                hp = hyperparameters(group)
                for pi, p in enumerate(group["params"]):
                    name = models.pname(p, gi, pi)
                    # One call per parameter: its value before (here) and after the step, with
                    # the group's hyperparameters as the call's arguments.
                    occ = rec.occurrence("optimizer", "", "param", name)
                    call = make_call(rec.step, rec.microbatch, "optimizer", "", "param", name, occ, hp)
                    specs.append(RecordSpec(call, "param", name, "", "optimizer", "input", f"group[{gi}]", p))
                    if closure is None and p.grad is not None:
                        specs.append(self._grad_spec(name, gi, p.grad))
            rec.record_many(specs, fresh=True)
            rec.microbatch = mb
            if closure is not None:
                wrapped = _with_closure(args, kwargs or {}, where, self._closure_run(opt, closure))
        return wrapped

    def _grad_spec(self, name: str, gi: int, grad: torch.Tensor) -> RecordSpec:
        self._grads_seen = True
        return RecordSpec(None, "grad", name, "", "optimizer", "input", f"group[{gi}]", grad)

    def _closure_run(self, opt: Any, closure: Callable[..., Any]) -> Callable[..., Any]:
        """``closure`` as the optimizer calls it (once per step, or several times: L-BFGS).

        What it runs is a forward (a root module's input is the batch) and a backward, whatever
        encloses it; when it returns, the optimizer is running again, and the gradients it left
        are the ones the update reads: recorded then (kind ``grad``, one call per closure call).
        The closure's result and exceptions pass through unchanged."""
        rec = self.rec

        def closure_run(*a: Any, **k: Any) -> Any:
            if rec.in_step and rec.phase == "optimizer":
                rec.phase = "forward"
            try:
                out = closure(*a, **k)
            finally:
                if rec.in_step:
                    rec.phase = "optimizer"
            self._record_grads(opt)
            return out

        closure_run.__wrapped__ = closure  # type: ignore[attr-defined]
        return closure_run

    def _record_grads(self, opt: Any) -> None:
        rec = self.rec
        if rec.failed or not rec.selected or rec.busy:
            return
        models = self.ctx.models
        with rec.guard("optimizer closure"):
            rec.drain_foreign()
            mb = rec.microbatch
            rec.microbatch = contract.NO_MICROBATCH
            specs = [
                self._grad_spec(models.pname(p, gi, pi), gi, p.grad)
                for gi, group in enumerate(opt.param_groups)
                for pi, p in enumerate(group["params"])
                if p.grad is not None
            ]
            rec.record_many(specs, fresh=True)
            rec.microbatch = mb

    def optimizer_post(self, opt: Any) -> None:
        rec = self.rec
        if rec.failed or not rec.selected or rec.busy:
            rec.phase = "forward" if rec.in_step else rec.phase
            return
        models = self.ctx.models
        with rec.guard("optimizer post-step hook"):
            mb = rec.microbatch
            rec.microbatch = contract.NO_MICROBATCH
            specs = []
            for gi, group in enumerate(opt.param_groups):
                hp = hyperparameters(group)
                for pi, p in enumerate(group["params"]):
                    name = models.pname(p, gi, pi)
                    # The "after" side of the param call opened before the step (same occurrence).
                    key = (rec.microbatch, "optimizer", "", "param", name)
                    occ = max(0, rec.occ.get(key, 1) - 1)
                    call = make_call(rec.step, rec.microbatch, "optimizer", "", "param", name, occ, hp)
                    specs.append(RecordSpec(call, "param", name, "", "optimizer", "output", f"group[{gi}]", p))
                    state = opt.state.get(p, {})
                    for sname in sorted(state, key=str):
                        v = state[sname]
                        if isinstance(v, torch.Tensor):
                            specs.append(
                                RecordSpec(
                                    None,
                                    "optimizer_state",
                                    f"{name}.{sname}",
                                    "",
                                    "optimizer",
                                    "output",
                                    f"group[{gi}].state[{sname}]",
                                    v,
                                )
                            )
            rec.record_many(specs, fresh=True)
            rec.microbatch = mb
            rec.phase = "forward"
            self._opt_stepped = True  # step-end parameter records may reuse these digests
        if rec.need_flush:
            rec.flush_safely()


def _closure_of(args: tuple, kwargs: dict) -> tuple[Callable[..., Any] | None, int | str]:
    """The closure passed to ``step()`` and where: the index in ``args`` (after the optimizer
    itself, ``args[0]``) or the keyword ``closure``."""
    c = kwargs.get("closure")
    if c is not None:
        return c, "closure"
    if len(args) > 1 and callable(args[1]):
        return args[1], 1
    return None, 0


def _with_closure(args: tuple, kwargs: dict, where: int | str, closure: Callable[..., Any]) -> tuple[tuple, dict]:
    """``step()``'s arguments with the closure replaced (a pre-step hook's return value)."""
    if where == "closure":
        return args, {**kwargs, "closure": closure}
    return (*args[:1], closure, *args[2:]), kwargs
