"""What the record sources share: the ``CaptureContext`` the Session hands each of them.

The sources (module hooks, the dispatch mode, the collective wrappers, DDP's comm hook, the step
and optimizer boundaries, the launcher's step counting) never hold the Session. Each receives
this context, whose members are the few things they share, by name:

* ``rec``: the ``Recorder``, through which every record, flush and failure goes;
* ``scope``: where a record made now belongs (``Scope``: the module stack, the phase, backward
  and recompute, regions whose ops are not recorded: compiled code, DDP's own work);
* ``hazards``: the false-root hazard tracker (None below level boundaries without poison);
* ``models``: the watched models and their parameter names (``WatchedModels``);
* ``pending_step``: launcher mode's step that begins at the next forward (``PendingStep``);
* ``patches``: class attributes replaced while the session is open (``patches.Patches``);
* ``cfg``/``caps``: the options and what the level turns on; ``place``: this process's rank and
  world size (``Place``: learned from the process group when it appears, see ``session.py``);
  ``group_names``: the user's names of process groups.

Sources that need each other (the steps need the module hooks and the collectives) get those
as named constructor arguments instead.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from detfp_capture._config import Capabilities, CaptureConfig
from detfp_capture._recorder.hazards import HazardTracker
from detfp_capture._recorder.recorder import Recorder
from detfp_capture._sources.patches import Patches

__all__ = ["NODE_KEY", "CaptureContext", "ModuleFrame", "PendingStep", "Place", "Scope", "WatchedModels"]

#: Key of the module path in an autograd node's ``metadata`` (set by the module hooks at level
#: ops, read to attribute a backward op or collective to the module whose forward made the node).
NODE_KEY = "detfp_module"


class ModuleFrame(NamedTuple):
    """A module whose forward is running (the scope's stack, innermost last)."""

    #: id() of the module.
    module_id: int
    #: Its path (FQN within the watched model).
    path: str
    #: ``forward`` (or the enclosing phase), or ``recompute`` inside a checkpoint re-forward.
    phase: str
    #: The tensors of its inputs (the autograd-node tagging walk stops at their nodes).
    inputs: list[torch.Tensor]
    #: Serial of the last tagging walk when its forward began (see ``modules.mark_graph``).
    walks: int
    #: The hooks on its inputs' gradients (``backward.GradHooks.hook_inputs``), given the call's
    #: witness when it returns; None when none were hooked.
    grads: Any = None


class Scope:
    """Where a record made now belongs, and where ops are not recorded at all.

    The module hooks push and pop ``stack``; the dispatch mode and the collective wrappers ask
    ``where``/``op_where``. A record made while autograd executes a node belongs to the backward
    (the module that made the node, from its tag) or, in a checkpoint re-forward, to the
    recompute; at the end of a backward in which capture recorded something (an autograd engine
    callback) the phase becomes ``step`` and records made on other threads join the stream.
    """

    def __init__(self, rec: Recorder, modules: Any) -> None:
        self.rec = rec
        self.stack: list[ModuleFrame] = []
        #: Inside DDP's own work (bucket rebuilds, buffer syncs, the comm hook's ops): level ops
        #: skips its ops.
        self.bookkeeping = 0
        #: An end-of-backward callback is queued for the running backward.
        self.backward_queued = False
        #: Run at the end of a backward, before the phase changes (DDP: wait for the buckets).
        self.on_backward_end: Callable[[], None] | None = None
        self._pattern = modules
        self._selected: dict[str, bool] = {}

    def module_selected(self, path: str) -> bool:
        """Whether ``modules=`` selects this module path (cached per path)."""
        pat = self._pattern
        if pat is None:
            return True
        hit = self._selected.get(path)
        if hit is None:
            hit = self._selected[path] = pat.search(path) is not None
        return hit

    def where(self) -> tuple[str, str]:
        """(module path, phase) of a record made now (a collective, a probe)."""
        stack = self.stack
        if stack and stack[-1].phase == "recompute":
            return stack[-1].path, "recompute"
        node = torch._C._current_autograd_node()
        if node is not None:
            self.note_backward()
            # Without module hooks (level metrics) a checkpoint re-forward is told by grad mode:
            # autograd runs nodes with it off (no create_graph), checkpoint turns it on to recompute.
            # (type: ignore below: torch's stubs declare Node.metadata a method; it is a dict property.)
            if torch.is_grad_enabled() or "CheckpointFunction" in node.name():
                return node.metadata.get(NODE_KEY, ""), "recompute"  # type: ignore[attr-defined]
            return node.metadata.get(NODE_KEY, ""), "backward"  # type: ignore[attr-defined]
        if stack:
            return stack[-1].path, stack[-1].phase
        return "", self.rec.phase

    def op_where(self) -> tuple[str, str]:
        """(module path, phase) of an op (or a compiled kernel) running now."""
        stack = self.stack
        if stack and stack[-1].phase == "recompute":
            return stack[-1].path, "recompute"
        node = torch._C._current_autograd_node()
        if node is not None:
            if not self.backward_queued:
                self.note_backward()
            return node.metadata.get(NODE_KEY, ""), "backward"  # type: ignore[attr-defined]
        if stack:
            return stack[-1].path, stack[-1].phase
        return "", self.rec.phase

    def note_backward(self) -> None:
        """Inside a backward: have the phase leave ``backward``-time context when it ends."""
        if self.backward_queued:
            return
        try:
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_ended)
            self.backward_queued = True
        except Exception:  # not in a backward after all
            pass

    def _backward_ended(self) -> None:
        """Engine callback at the end of a backward: DDP's reduced-gradient records join the
        stream (in parameter-name order), and records made after it (a loss all-reduce) get
        phase ``step``."""
        self.backward_queued = False
        rec = self.rec
        with rec.guard("end of backward", busy=False):  # an exception here would surface in backward()
            if self.on_backward_end is not None:
                self.on_backward_end()
            if rec.in_step and rec.phase == "forward":
                rec.phase = "step"
            if rec.live:
                with rec.guard("end of backward"):
                    rec.drain_foreign()


class PendingStep:
    """Launcher mode: the step that begins at the next forward, collective or optimizer step
    (``number``; None when none is pending, and always outside launcher mode)."""

    __slots__ = ("begin", "number")

    def __init__(self) -> None:
        self.number: int | None = None
        self.begin: Callable[[int], None] | None = None

    def touch(self) -> None:
        """Begin the pending step now."""
        n, self.number = self.number, None
        if n is not None and self.begin is not None:
            self.begin(n)


class Place:
    """This process's rank and world size as the session knows them now: from ``RANK``/
    ``WORLD_SIZE`` or the process group when the session opened, corrected when the process
    group appears (``Session._learn_place``)."""

    __slots__ = ("rank", "world_size")

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size


class WatchedModels:
    """The watched models (weak references) and the FQN of every parameter seen in them."""

    def __init__(self) -> None:
        self._refs: list[weakref.ref] = []
        #: id(parameter) -> FQN (the first name it was seen under).
        self.param_names: dict[int, str] = {}

    def __iter__(self) -> Iterator[torch.nn.Module]:
        for ref in self._refs:
            m = ref()
            if m is not None:
                yield m

    def __contains__(self, module: object) -> bool:
        return any(ref() is module for ref in self._refs)

    def add(self, model: torch.nn.Module) -> None:
        self.name_params(model)
        self._refs.append(weakref.ref(model))

    @staticmethod
    def base(model: torch.nn.Module) -> torch.nn.Module:
        """The model its own code names (a DDP wrapper is transparent)."""
        inner = getattr(model, "module", None)
        return inner if isinstance(inner, torch.nn.Module) and type(model).__name__ == "DistributedDataParallel" else model

    @classmethod
    def named_params(cls, model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        """(FQN, parameter) of a watched model, as its own code names them (a DDP wrapper is
        transparent); a wrapper that swaps parameters in (FSDP2's DTensors) is named as it is now."""
        return cls.base(model).named_parameters(remove_duplicate=True)

    def name_params(self, model: torch.nn.Module) -> None:
        for name, p in self.named_params(model):
            self.param_names.setdefault(id(p), name)

    def pname(self, p: torch.Tensor, gi: int, pi: int) -> str:
        """A parameter's FQN, else its place in the optimizer's param groups."""
        return self.param_names.get(id(p)) or f"group[{gi}].params[{pi}]"


@dataclass(frozen=True, eq=False)
class CaptureContext:
    """What every record source receives (see the module docstring)."""

    #: The validated options.
    cfg: CaptureConfig
    #: What the level turns on.
    caps: Capabilities
    #: This process's rank and the world size (kept current: ``rank``/``world_size`` read it).
    place: Place
    #: The record stream.
    rec: Recorder
    #: Where a record made now belongs.
    scope: Scope
    #: The false-root hazard tracker; None below level boundaries (without ``poison``).
    hazards: HazardTracker | None
    #: The watched models and their parameter names.
    models: WatchedModels
    #: Launcher mode: the step that begins at the next forward, collective or optimizer step.
    pending_step: PendingStep
    #: Class attributes patched while the session is open.
    patches: Patches
    #: The user's names of process groups (``group_names=``): name -> ProcessGroup.
    group_names: Mapping[str, Any]

    @property
    def rank(self) -> int:
        return self.place.rank

    @property
    def world_size(self) -> int:
        return self.place.world_size
