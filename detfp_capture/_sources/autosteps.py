"""Launcher mode's step counting (``python -m detfp_capture``; installed by ``_launch.mode``):
steps are the optimizer steps of the first optimizer that steps, counted by global optimizer
step hooks. A record source like the others, below the launcher's package; torch is imported
when the hooks are installed (the launcher's parser imports no torch).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from detfp_capture._sources.context import CaptureContext
    from detfp_capture._sources.steps import StepBoundaries

__all__ = ["AutoSteps"]


class AutoSteps:
    """Launcher mode's step counting: steps are the optimizer steps of the first optimizer that
    steps. Step ``start_step`` begins at the first forward of a root module (or the first
    collective or optimizer step) after launch, not at launch: the script has seeded its RNGs
    and set its determinism flags by then. Each step of that optimizer ends one step; the next
    begins at the next such forward (``ctx.pending_step``), so there is no trailing step after
    the last ``optimizer.step()`` unless forwards (an evaluation) follow it: ``trailing``."""

    def __init__(self, ctx: CaptureContext, steps: StepBoundaries) -> None:
        self.ctx = ctx
        self.steps = steps
        self.primary: Any = None  # weak reference to the optimizer whose steps are the steps
        self.stepped = False  # the running step has seen an optimizer step of it
        self.handles: list[Any] = []

    def install(self) -> None:
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        self.handles.append(register_optimizer_step_pre_hook(self._pre))
        self.handles.append(register_optimizer_step_post_hook(lambda opt, a, k: self._post(opt)))
        pending = self.ctx.pending_step
        pending.begin = self._begin
        pending.number = self.ctx.cfg.start_step or 0

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    @property
    def trailing(self) -> bool:
        """The running step has seen no optimizer step (forwards after the last one)."""
        return self.primary is not None and not self.stepped

    def close_trailing(self) -> None:
        """At close inside a step: forwards after the last optimizer step (an evaluation) form a
        step no optimizer step ended; say so (``partial_step``): a run that ends there while the
        other goes on ended early (``clues.endings``); two that both end so are compared there too."""
        rec = self.ctx.rec
        if self.trailing and rec.selected:
            rec.event(
                "partial_step",
                "",
                "",
                None,
                f"step {rec.step} ended at close without an optimizer step (an evaluation or a "
                "trailing forward); its records are compared as far as both runs hold them",
            )

    def _begin(self, n: int) -> None:
        if not self.ctx.rec.closed:
            self.stepped = False
            self.steps.begin(n)

    def _pre(self, opt: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if self.primary is None:
            self.primary = weakref.ref(opt)
        pending = self.ctx.pending_step
        if pending.number is not None:
            pending.touch()
        if self.ctx.caps.optimizer:
            return self.steps.optimizer_pre(opt, args, kwargs)  # a closure comes back wrapped
        return None

    def _post(self, opt: Any) -> None:
        if self.ctx.caps.optimizer:
            self.steps.optimizer_post(opt)
        rec = self.ctx.rec
        if rec.closed or self.primary is None or self.primary() is not opt:
            return
        n = rec.step + 1
        self.stepped = True
        self.steps.end()
        self.ctx.pending_step.number = n  # begins at the next forward: no trailing step after the last one
