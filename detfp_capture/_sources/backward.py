"""Backward records of module boundaries: gradient hooks bound to their forward call and step.

A module call's forward hooks put tensor hooks on its outputs (the gradient entering its
backward: ``module_input``, arg ``grad_out[i]``) and on its inputs (the gradients it produced:
``module_output``, arg ``grad_in[i]``). A tensor hook lives as long as its tensor, and some
tensors outlive the call that hooked them or are hooked by many calls: a Parameter returned as
an output (Megatron-Core's ``skip_bias_add`` returns the bias), a pipeline stage's receive buffer
reused every step, a leaf input, a cached tensor. So:

* every hook belongs to one step: it is removed at that step's end (``release``) and records
  nothing in another step;
* a tensor gets one hook per step, shared by every call that hooked it (``_Entry``); the hook
  serves each call (``_Side``) in that call's own backward: a call's *witness* is an autograd
  node its forward created (an output's node that is no input's), and the call is served by a
  backward that executes it. A call without a witness is served once, by the first backward
  that reaches the tensor;
* the records of one call in one backward form one record call: a second backward through the
  same graph (``retain_graph``, ``autograd.grad`` then ``backward``) is another call, so a key
  stays unique within its step;
* the gradients a call's inputs received are recorded together, in argument order, when the
  last one that backward computes has arrived (as ``register_multi_grad_hook(mode="all")``
  would; it is not used: it raises inside ``torch.autograd.grad`` for a leaf input, which
  pipeline stages do). Which inputs a backward computes is asked of the engine; where the engine
  cannot say (a leaf inside ``autograd.grad``), the call's gradients are recorded at the end of
  that backward instead;
* nothing raises into autograd: the engine's answers are asked inside ``try``, the records are
  made inside ``rec.guard``.

Autograd nodes are held in boxes emptied at step end: a hook holding a node directly is a
cycle through C++ (node -> hook -> node) that Python's collector cannot see.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from detfp_capture._sources.context import CaptureContext

__all__ = ["GradHooks", "witness"]

#: Record kinds of the two sides of a module's backward (see modules.py).
_OUT, _IN = "module_input", "module_output"


def witness(outputs: list[torch.Tensor], inputs: list[torch.Tensor]) -> Any:
    """An autograd node the call's forward created: the first output node that is no input's
    (an output passed through unchanged, or a Parameter, has none). None when there is none."""
    seen = {id(t.grad_fn) for t in inputs if t.grad_fn is not None}
    for t in outputs:
        n = t.grad_fn
        if n is not None and id(n) not in seen:
            return n
    return None


def _runs(node: Any) -> bool | None:
    """Whether the running backward executes ``node``; None when the engine cannot say (a leaf's
    accumulator inside ``torch.autograd.grad``, or not in a backward at all)."""
    try:
        return bool(torch._C._will_engine_execute_node(node))
    except Exception:
        return None


class _Side:
    """One side of one forward call's backward: the gradients of its outputs or of its inputs."""

    __slots__ = ("arg", "calls", "kind", "n", "name", "nodes", "path", "pending", "role", "served", "step", "witness")

    def __init__(self, kind: str, name: str, path: str, n: int, step: int) -> None:
        self.kind = kind
        self.name = name
        self.path = path
        self.n = n
        self.step = step
        self.role, self.arg = ("input", "grad_out[{}]") if kind == _OUT else ("output", "grad_in[{}]")
        #: [node]: an autograd node the call's forward created (see ``witness``), or None.
        self.witness: list | None = None
        #: Input side with several tensors: [their gradient-edge nodes] (for the expected count).
        self.nodes: list | None = None
        #: Graph task ids this side serves, and the record call made in each.
        self.served: set[int] = set()
        self.calls: dict[int, Any] = {}
        #: Graph task id -> (expected count or None, {index: gradient}) of an input side waiting.
        self.pending: dict[int, tuple[int | None, dict[int, torch.Tensor]]] = {}

    def serves(self, task: int) -> bool:
        """Whether this call's backward is the running one (``task``)."""
        if task in self.served:
            return True
        node = self.witness[0] if self.witness else None
        runs = _runs(node) if node is not None else None
        if runs is None:
            runs = not self.served  # no witness: the first backward that reaches it
        if runs:
            self.served.add(task)
        return runs

    def expected(self) -> int | None:
        """How many of the input side's tensors the running backward computes a gradient for;
        None when the engine cannot say for one of them."""
        count = 0
        for node in self.nodes or ():
            runs = _runs(node) if node is not None else False
            if runs is None:
                return None
            count += runs
        return count

    def release(self) -> None:
        self.witness = self.nodes = None
        self.pending.clear()
        self.calls.clear()


class _Entry:
    """A hooked tensor of this step and the calls it serves: [(side, index)]."""

    __slots__ = ("ref", "uses")

    def __init__(self, ref: Any, side: _Side, i: int) -> None:
        self.ref = ref
        self.uses = [(side, i)]


class GradHooks:
    """The tensor hooks of module backwards for the running step (one per ``ModuleHooks``)."""

    def __init__(self, ctx: CaptureContext) -> None:
        self.rec = ctx.rec
        self.scope = ctx.scope
        #: id(tensor) -> its entry; hooks and sides of this step (all dropped by ``release``).
        self.entries: dict[int, _Entry] = {}
        self.handles: list[RemovableHandle] = []
        self.sides: list[_Side] = []

    # ------------------------------------------------------------------- registration
    def hook_outputs(self, name: str, path: str, tensors: list[torch.Tensor], inputs: list[torch.Tensor]) -> None:
        """Hooks on a call's outputs (``tensors``, all of them, in output order)."""
        want = [(i, t) for i, t in enumerate(tensors) if t.requires_grad]
        if want:
            side = self._side(_OUT, name, path, len(want))
            node = witness(tensors, inputs)
            side.witness = [node] if node is not None else None
            for i, t in want:
                self._use(t, side, i)

    def hook_inputs(self, name: str, path: str, tensors: list[torch.Tensor]) -> _Side | None:
        """Hooks on a call's inputs; the returned side gets its witness at the call's end (``bind``)."""
        want = [(i, t) for i, t in enumerate(tensors) if t.requires_grad]
        if not want:
            return None
        side = self._side(_IN, name, path, len(want))
        if len(want) > 1:
            side.nodes = [_edge_node(t) for _, t in want]
        for i, t in want:
            self._use(t, side, i)
        return side

    @staticmethod
    def bind(side: _Side | None, outputs: list[torch.Tensor], inputs: list[torch.Tensor]) -> None:
        """Give an input side the witness of its call, once the call returned."""
        if side is not None:
            node = witness(outputs, inputs)
            side.witness = [node] if node is not None else None

    def _side(self, kind: str, name: str, path: str, n: int) -> _Side:
        side = _Side(kind, name, path, n, self.rec.step)
        self.sides.append(side)
        return side

    def _use(self, t: torch.Tensor, side: _Side, i: int) -> None:
        e = self.entries.get(id(t))
        if e is not None and e.ref() is t:
            e.uses.append((side, i))
            return
        e = _Entry(weakref.ref(t), side, i)
        self.entries[id(t)] = e
        self.handles.append(t.register_hook(lambda grad, e=e: self._fire(e, grad)))

    def release(self) -> None:
        """The step ended: remove its hooks and drop what they held (nodes, gradients)."""
        for h in self.handles:
            h.remove()
        self.handles.clear()
        self.entries.clear()
        for side in self.sides:
            side.release()
        self.sides.clear()

    # ------------------------------------------------------------------- firing
    def _fire(self, entry: _Entry, grad: torch.Tensor) -> None:
        rec = self.rec
        if rec.busy or not rec.selected or rec.failed or entry.uses[0][0].step != rec.step:
            return
        self.scope.note_backward()
        with rec.guard("backward hook of {!r}", entry.uses[0][0].path):
            task = torch._C._current_graph_task_id()
            uses = entry.uses
            for side, i in uses:
                if len(uses) == 1 or side.serves(task):
                    self._take(side, task, i, grad)

    def _take(self, side: _Side, task: int, i: int, grad: torch.Tensor) -> None:
        if side.kind == _OUT or side.n == 1:
            self._record(side, task, [(i, grad)])
            return
        waiting = side.pending.get(task)
        if waiting is None:
            expected = side.expected()
            waiting = side.pending[task] = (expected, {})
            if expected is None:
                # The engine cannot say which gradients this backward computes: record what
                # arrived when it ends.
                torch.autograd.Variable._execution_engine.queue_callback(lambda: self._at_end(side, task))
        expected, got = waiting
        got[i] = grad
        if expected is not None and len(got) >= expected:
            del side.pending[task]
            self._record(side, task, sorted(got.items(), key=lambda kv: kv[0]))

    def _at_end(self, side: _Side, task: int) -> None:
        waiting = side.pending.pop(task, None)
        rec = self.rec
        if waiting is None or not waiting[1] or rec.failed or not rec.selected or side.step != rec.step:
            return
        with rec.guard("end of the backward of {!r}", side.path):
            self._record(side, task, sorted(waiting[1].items(), key=lambda kv: kv[0]))

    def _record(self, side: _Side, task: int, grads: list[tuple[int, torch.Tensor]]) -> None:
        recs = [(side.role, side.arg.format(i), g) for i, g in grads]
        call = side.calls.get(task)
        if call is None:
            side.calls[task] = self.rec.record_call(side.kind, side.name, side.path, "backward", recs)
        else:
            self.rec.append_records(call, recs)


def _edge_node(t: torch.Tensor) -> Any:
    """The autograd node a gradient for ``t`` flows into (its grad_fn, or a leaf's accumulator)."""
    if t.grad_fn is not None:
        return t.grad_fn
    try:
        return torch.autograd.graph.get_gradient_edge(t).node
    except Exception:
        return None
