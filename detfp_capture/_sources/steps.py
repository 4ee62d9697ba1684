"""Step boundaries and optimizer boundaries of a ``Session`` (a mixin ``Session`` inherits).

``StepRecording`` holds the part of the capture that runs at the edges of a training step:
``_begin_step`` (selection, the ``step_begin`` event, RNG states, the profiler and the
dispatch mode for the step), ``_end_step`` (the ``step_end`` event, parameters at step end,
and the flush policy), and the optimizer's pre/post-step hooks that record its params, grads
and state. It has no state of its own: every attribute it reads is set by
``Session.__init__``, and it calls back into ``Session`` for flushing, manifests and the
writer's failure; the public API stays on ``Session`` in session.py.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch

from detfp_capture import contract
from detfp_capture._recorder.records import flat_args

__all__ = ["StepRecording"]

#: A step end flushes at least this often (seconds), even when the window is not full.
_FLUSH_SECONDS = 20.0


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


class StepRecording:
    """Step begin/end and optimizer-boundary recording, mixed into ``Session``."""

    # ================================================================== steps
    def _begin_step(self, n: int) -> None:
        if self._inert or self._closed:
            return
        rec = self._rec
        if rec.in_step:
            self._end_step()
        if self._writer_error is not None:
            self._disable_for_writer()
        sel = not rec.failed and (self._cfg.steps is None or n in self._cfg.steps)
        rec.begin_step(n, sel)
        self._bwd_queued = False
        self._step_selected = sel
        self._seen_step = True
        if self._first_step is None:
            self._first_step = n
            self._manifest["start_step"] = n
            self._write_manifest_safely()
        self._check_settings()
        if self._regions_scans < 2:
            # Modules compiled in place (module.compile()) once training starts: record their
            # regions' boundaries (the first two steps: a compile right after step 0 counts).
            self._regions_scans += 1
            self._hooks.wrap_compiled()
        if not sel:
            if self._hazard is not None:
                self._hazard.unobserved()
            return
        rec.enter()
        try:
            rec.drain_foreign()
            rec.event("step_begin")
            rec.phase = "step"
            self._record_rng()
            rec.phase = "forward"
        except Exception as exc:
            rec.fail(exc, "step begin")
            return
        finally:
            rec.leave()
        if self._cfg.kernels is not None and n in self._cfg.kernels and self._depth >= 2:
            try:
                from detfp_capture._sources.kernels import KernelCapture

                self._kernels = KernelCapture(rec)
                self._kernels.start()
                self._kernel_range = self._kernels.range
            except Exception as exc:
                self._kernels = self._kernel_range = None
                rec.fail(exc, "starting the profiler")
        if self._mode is not None and not rec.failed:
            self._mode.__enter__()
            self._mode_entered = True
            rec.mode = self._mode

    def _check_settings(self) -> None:
        """The manifest's determinism settings and numerics environment are those in force when
        the first step begins (a script sets them after the launcher opened the session); a
        later change is a ``setting_changed`` event, which ``env`` and ``certify`` report."""
        from detfp_capture.manifest import determinism_settings, numerics_env

        try:
            now = determinism_settings()
        except Exception:
            return
        if self._settings is None:
            self._settings = now
            if self._manifest.get("determinism") != now or self._manifest.get("env") != numerics_env():
                self._manifest["determinism"] = now
                self._manifest["env"] = numerics_env()
                self._write_manifest_safely()
            return
        changed = sorted(k for k in now if now[k] != self._settings.get(k))
        if changed and not self._rec.failed:
            detail = ", ".join(f"{k}: {self._settings.get(k)!r} -> {now[k]!r}" for k in changed)
            self._rec.event("setting_changed", changed[0], "", len(changed), f"before step {self._rec.step}: {detail}")
        self._settings = now

    def _end_step(self) -> None:
        if self._inert:
            return
        rec = self._rec
        if not rec.in_step:
            return
        if self._mode_entered:
            self._mode_entered = False
            rec.mode = None
            with contextlib.suppress(Exception):
                self._mode.__exit__(None, None, None)
        if rec.selected and not rec.failed:
            rec.enter()
            try:
                if self._kernels is not None:
                    ks, self._kernels, self._kernel_range = self._kernels, None, None
                    ks.stop()
                # The dispatch mode is off from here on: what runs between steps writes unseen,
                # so digests still waiting for a batch are taken now, not at the next write.
                rec.run_deferred(staging=False)
                if self._collectives is not None:
                    self._collectives.wait_buckets()
                rec.drain_foreign()
                rec.phase = "step"
                rec.microbatch = contract.NO_MICROBATCH
                self._record_params()
                if self._collectives is not None:
                    self._collectives.step_end()
                rec.event("step_end", "", "", rec.records_in_step)
            except Exception as exc:
                rec.fail(exc, "step end")
            finally:
                rec.leave()
        if self._hazard is not None:
            self._hazard.step_end()
        rec.in_step = False
        rec.selected = False
        self._hooks.release_nodes()
        # A step end flushes when the window is full or old: one resolve and one shard per
        # window instead of per step keeps the cheap levels cheap; close() flushes the rest.
        now = time.monotonic()
        if rec.need_flush or rec.dumps or now - self._last_flush >= _FLUSH_SECONDS:
            self._last_flush = now
            self._flush_safely()
        if self._groups_changed:
            self._groups_changed = False
            self._write_manifest_safely()

    def _record_rng(self) -> None:
        rec = self._rec
        rec.record_call("rng_state", "cpu", "", "step", [("value", "state", torch.get_rng_state())], fresh=True)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            for i in range(torch.cuda.device_count()):
                rec.record_call(
                    "rng_state", f"cuda:{i}", "", "step", [("value", "state", torch.cuda.get_rng_state(i))], fresh=True
                )

    def _record_params(self) -> None:
        rec = self._rec
        # Right after a watched optimizer step the cached digests are the updated parameters, as
        # long as nothing wrote them since. Only level ops sees every write, through any alias
        # (before_write drops what a `.data` write makes stale); below it a `p.data.clamp_`
        # between optimizer.step() and the step end moves no version counter: digest afresh.
        fresh = not (self._opt_stepped and self._depth >= 2)
        self._opt_stepped = False
        seen: set[int] = set()
        specs = []
        for ref in self._models:
            m = ref()
            if m is None:
                continue
            for name, p in self._named_params(m):
                if id(p) in seen:
                    continue
                seen.add(id(p))
                specs.append((None, "param", name, "", "step", "value", "param", p))
        rec.record_many(specs, fresh=fresh)

    # ================================================================== optimizer
    def _opt_pre(self, opt: Any) -> None:
        rec = self._rec
        if rec.failed or not rec.selected or rec.busy:
            rec.phase = "optimizer" if rec.in_step else rec.phase
            return
        rec.enter()
        try:
            rec.drain_foreign()
            rec.phase = "optimizer"
            mb = rec.microbatch
            rec.microbatch = contract.NO_MICROBATCH
            names = self._param_names
            if any(id(p) not in names for g in opt.param_groups for p in g["params"]):
                # Parameters replaced since watch() (FSDP2's fully_shard swaps in DTensors):
                # name them again from the watched models.
                for ref in self._models:
                    m = ref()
                    if m is not None:
                        self._name_params(m)
            specs = []
            for gi, group in enumerate(opt.param_groups):
                hp = hyperparameters(group)
                for pi, p in enumerate(group["params"]):
                    name = self._pname(p, gi, pi)
                    # One call per parameter: its value before (here) and after the step, with
                    # the group's hyperparameters as the call's arguments.
                    occ = rec.occurrence("optimizer", "", "param", name)
                    call = (rec.step, rec.microbatch, "optimizer", "", "param", name, occ, hp, False)
                    specs.append((call, "param", name, "", "optimizer", "input", f"group[{gi}]", p))
                    if p.grad is not None:
                        self._grads_seen = True
                        specs.append((None, "grad", name, "", "optimizer", "input", f"group[{gi}]", p.grad))
            rec.record_many(specs, fresh=True)
            rec.microbatch = mb
        except Exception as exc:
            rec.fail(exc, "optimizer pre-step hook")
        finally:
            rec.leave()

    def _opt_post(self, opt: Any) -> None:
        rec = self._rec
        if rec.failed or not rec.selected or rec.busy:
            rec.phase = "forward" if rec.in_step else rec.phase
            return
        rec.enter()
        try:
            mb = rec.microbatch
            rec.microbatch = contract.NO_MICROBATCH
            specs = []
            for gi, group in enumerate(opt.param_groups):
                hp = hyperparameters(group)
                for pi, p in enumerate(group["params"]):
                    name = self._pname(p, gi, pi)
                    # The "after" side of the param call opened before the step (same occurrence).
                    key = (rec.microbatch, "optimizer", "", "param", name)
                    occ = max(0, rec.occ.get(key, 1) - 1)
                    call = (rec.step, rec.microbatch, "optimizer", "", "param", name, occ, hp, False)
                    specs.append((call, "param", name, "", "optimizer", "output", f"group[{gi}]", p))
                    state = opt.state.get(p, {})
                    for sname in sorted(state, key=str):
                        v = state[sname]
                        if isinstance(v, torch.Tensor):
                            specs.append(
                                (
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
        except Exception as exc:
            rec.fail(exc, "optimizer post-step hook")
        finally:
            rec.leave()
        if rec.need_flush:
            self._flush_safely()

    def _pname(self, p: torch.Tensor, gi: int, pi: int) -> str:
        return self._param_names.get(id(p)) or f"group[{gi}].params[{pi}]"
