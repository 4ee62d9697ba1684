"""The state a capture starts from: parameters, buffers and optimizer state before a step.

A difference in the state a run starts from (another init seed, a checkpoint loaded with a key
missing, one rank loading another file) otherwise shows first inside the first forward, where
its module's inputs match and its output differs: it reads as a nondeterministic kernel. So the
watched models' parameters and buffers and the watched optimizers' state are recorded once, at
the begin of the first captured step (``StepBoundaries.begin``, after everything the script set
up: a load, DDP's broadcast of rank 0's parameters), and again at the begin of the first
captured step after a ``load_state_dict`` of a watched model or optimizer (its post-hooks).

Records: kind ``state``, phase ``step``, role ``value``, ``name`` the FQN (an optimizer state
``<param>.<state name>``), ``arg`` ``param``, ``buffer`` or ``optimizer_state``. Digesting every
parameter once per session costs what one step-end parameter record does; the load hooks only
set a flag.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any

import torch

from detfp_capture._recorder.call import RecordSpec
from detfp_capture._sources.context import CaptureContext

__all__ = ["StartState"]


class StartState:
    """What the next captured step starts from, recorded when it is due."""

    def __init__(self, ctx: CaptureContext) -> None:
        self.ctx = ctx
        #: The state is recorded at the next captured step's begin (the first, or after a load).
        self.due = True
        self._optimizers: list[weakref.ref] = []
        self._handles: list[Any] = []
        self._hooked: set[int] = set()

    def watch(self, model: torch.nn.Module) -> None:
        """Record ``model``'s state again after a ``load_state_dict`` of it (or of its DDP wrapper)."""
        base = self.ctx.models.base(model)
        if id(base) not in self._hooked:
            self._hooked.add(id(base))
            self._handles.append(base.register_load_state_dict_post_hook(self._loaded))

    def watch_optimizer(self, opt: torch.optim.Optimizer) -> None:
        """Record ``opt``'s state with the models' (and again after its ``load_state_dict``)."""
        if id(opt) not in self._hooked:
            self._hooked.add(id(opt))
            self._optimizers.append(weakref.ref(opt))
            # An optimizer class of its own without torch's hooks: recorded all the same, loads unseen.
            with contextlib.suppress(Exception):
                self._handles.append(opt.register_load_state_dict_post_hook(self._loaded))

    def _loaded(self, *_: Any) -> None:
        self.due = True  # a post-hook: returns None, so the load's result is unchanged

    def record(self) -> None:
        """The state now, as ``state`` records of the running step (call at its begin, when ``due``)."""
        self.due = False
        models = self.ctx.models
        seen: set[int] = set()
        specs = []

        def add(name: str, what: str, t: torch.Tensor) -> None:
            if id(t) not in seen:
                seen.add(id(t))
                specs.append(RecordSpec(None, "state", name, "", "step", "value", what, t))

        for m in models:
            for name, p in models.named_params(m):
                add(name, "param", p)
            for name, b in models.base(m).named_buffers():
                if isinstance(b, torch.Tensor):
                    add(name, "buffer", b)
        for ref in self._optimizers:
            opt = ref()
            if opt is None:
                continue
            for gi, group in enumerate(opt.param_groups):
                for pi, p in enumerate(group["params"]):
                    state = opt.state.get(p, {})
                    pname = models.pname(p, gi, pi)
                    for sname in sorted(state, key=str):
                        if isinstance(state[sname], torch.Tensor):
                            add(f"{pname}.{sname}", "optimizer_state", state[sname])
        if specs:
            self.ctx.rec.record_many(specs, fresh=True)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
