"""The state ``repeat_check`` puts back between repeats: found once, snapshotted once, restored in place.

Pipeline: ``discover`` walks what the checked function can reach -- the function itself
(a module, a bound method's object, a ``functools.partial``, closure cells, the globals its
code names, helper functions it names, defaults), its arguments, nested containers and
dataclasses, plain objects' attributes -- and collects modules (parameters, buffers, their
gradients, train/eval flags), optimizers (per-parameter state and the hyperparameters of
every parameter group), stateful helpers with ``state_dict``/``load_state_dict`` (LR
schedulers, gradient scalers), ``torch.Generator`` objects and loose tensors (inputs, tensors
held by closures, an optimizer's bare parameters). ``Snapshot`` clones all of it once, plus
every global RNG (torch CPU, each CUDA device, Python ``random``, numpy's when loaded).

``Snapshot.restore`` writes the clones back *in place* (``copy_`` under ``no_grad``), so tensor
identities survive: the optimizer's state stays keyed by the same parameters, hooks and
views of parameters stay valid. A clone is assigned instead only where a tensor changed shape,
dtype or device (``.data`` reassigned). Whether ``.grad`` is None is restored exactly, since a
backward that accumulates into an existing gradient and one that creates it can differ in the
sign of zero. Loose tensors are written back only when their version counter moved (a large
read-only input costs one clone, never a copy per repeat); parameters, buffers, gradients and
optimizer state are always written back, because ``.data`` writes (weight clipping, EMA) move
no version counter. Python attributes, counters and caches outside these are not restored:
``repeat_check(state=[...])`` adds objects, ``warmup=1`` builds lazy caches before the repeats.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import random
import sys
import types
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from detfp_capture.errors import ConfigError

__all__ = ["Found", "Snapshot", "discover", "leafify"]

#: How deep the walk follows containers, attributes and helper functions from a root.
_MAX_DEPTH = 6
#: At most this many objects are visited: a walk that reaches a whole dataset must still end.
_MAX_OBJECTS = 20000
#: Packages whose objects are never walked into: library internals, and test-runner objects
#: (a pytest ``request`` leads to the session and every other test's fixture values).
_OPAQUE_MODULES = (
    "builtins",
    "torch",
    "numpy",
    "polars",
    "pandas",
    "typing",
    "collections",
    "abc",
    "logging",
    "threading",
    "unittest",
    "_pytest",
    "pytest",
    "pluggy",
    "detfp_capture",
    "detfp_analyze",
    "detfp_format",
    "detfp_guards",
)


@dataclass
class Found:
    """What the checked function can reach, in discovery order (arguments first)."""

    modules: list[torch.nn.Module] = field(default_factory=list)
    optimizers: list[torch.optim.Optimizer] = field(default_factory=list)
    #: Objects restored through state_dict/load_state_dict (LR schedulers, gradient scalers).
    stateful: list[Any] = field(default_factory=list)
    generators: list[torch.Generator] = field(default_factory=list)
    #: (label, tensor) of tensors that belong to no module: ``args[0]``, ``kwargs.x[1]``, ``fn.w``.
    tensors: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    #: Labels of the tensors that came from fn's own arguments (probed after each call).
    argument_labels: set[str] = field(default_factory=set)


def _opaque(obj: Any) -> bool:
    mod = type(obj).__module__ or ""
    return mod.split(".")[0] in _OPAQUE_MODULES


def _is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def _torch_stateful(obj: Any) -> bool:
    """torch's own helpers whose state changes numerics: LR schedulers and gradient scalers."""
    mod = type(obj).__module__ or ""
    return _is_stateful(obj) and mod.startswith(("torch.optim.lr_scheduler", "torch.amp", "torch.cuda.amp"))


def _code_names(code: types.CodeType) -> set[str]:
    """Global names a function's code (and the code of lambdas and comprehensions inside it) reads."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names


def discover(fn: Any, args: tuple, kwargs: dict, extra: Iterable[Any] = ()) -> Found:
    """Walk ``fn``, its arguments and ``extra`` (bounded depth) and collect the state to restore."""
    found = Found()
    seen: set[int] = set()
    tensor_ids: set[int] = set()

    def add_tensor(label: str, t: torch.Tensor, from_args: bool) -> None:
        if id(t) in tensor_ids:
            return
        tensor_ids.add(id(t))
        found.tensors.append((label, t))
        if from_args:
            found.argument_labels.add(label)

    def visit(obj: Any, label: str, depth: int, from_args: bool = False, explicit: bool = False) -> None:
        if obj is None or isinstance(obj, (str, bytes, int, float, complex, bool, type, types.ModuleType)):
            return
        if isinstance(obj, torch.Tensor):
            add_tensor(label, obj, from_args)
            return
        if id(obj) in seen or depth > _MAX_DEPTH or len(seen) > _MAX_OBJECTS:
            return
        seen.add(id(obj))
        if isinstance(obj, torch.nn.Module):
            found.modules.append(obj)
            return
        if isinstance(obj, torch.optim.Optimizer):
            found.optimizers.append(obj)
            for g, group in enumerate(obj.param_groups):
                for i, p in enumerate(group["params"]):
                    add_tensor(f"{label}.param_groups[{g}][{i}]", p, False)
            return
        if isinstance(obj, torch.Generator):
            found.generators.append(obj)
            return
        if isinstance(obj, (list, tuple, set, frozenset)):
            for i, v in enumerate(obj):
                visit(v, f"{label}[{i}]", depth + 1, from_args)
            return
        if isinstance(obj, dict):
            for k, v in obj.items():
                visit(v, f"{label}.{k}", depth + 1, from_args)
            return
        if isinstance(obj, functools.partial):
            visit(obj.func, label, depth + 1)
            visit(obj.args, f"{label}.args", depth + 1, from_args)
            visit(obj.keywords, f"{label}.kwargs", depth + 1, from_args)
            return
        if isinstance(obj, types.MethodType):
            visit(obj.__self__, f"{label}.self", depth + 1)
            visit(obj.__func__, label, depth + 1)
            return
        if isinstance(obj, types.FunctionType):
            code = obj.__code__
            for name, cell in zip(code.co_freevars, obj.__closure__ or (), strict=False):
                try:
                    contents = cell.cell_contents
                except ValueError:  # an empty cell (a name assigned later)
                    continue
                visit(contents, f"{label}.{name}", depth + 1)
            visit(obj.__defaults__, f"{label}.defaults", depth + 1)
            visit(obj.__kwdefaults__, f"{label}.kwdefaults", depth + 1)
            glb = obj.__globals__
            for name in sorted(_code_names(code)):
                if name in glb:
                    visit(glb[name], name, depth + 1)
            return
        if _torch_stateful(obj) or (explicit and _is_stateful(obj)):
            found.stateful.append(obj)
            visit(getattr(obj, "optimizer", None), f"{label}.optimizer", depth + 1)  # an LR scheduler's
            return
        if dataclasses.is_dataclass(obj):
            for f in dataclasses.fields(obj):
                visit(getattr(obj, f.name, None), f"{label}.{f.name}", depth + 1, from_args)
            return
        if _opaque(obj):
            return
        attrs = getattr(obj, "__dict__", None)
        if isinstance(attrs, dict):
            for k, v in list(attrs.items()):
                visit(v, f"{label}.{k}", depth + 1, from_args)

    for i, a in enumerate(args):
        visit(a, f"args[{i}]", 0, True)
    for k in sorted(kwargs):
        visit(kwargs[k], f"kwargs.{k}", 0, True)
    visit(fn, "fn", 0)
    for i, obj in enumerate(extra):
        visit(obj, f"state[{i}]", 0, explicit=True)
    owned = {id(t) for m in found.modules for t in (*m.parameters(), *m.buffers())}
    found.tensors = [(label, t) for label, t in found.tensors if id(t) not in owned]
    return found


def leafify(obj: Any) -> Any:
    """``obj`` with every non-leaf tensor that requires grad replaced by a detached leaf that does.

    A repeat must not backpropagate into a graph built before the check (the first repeat would
    free it, the second would fail, and gradients would land on parameters the check never saw).
    Rebuilds lists, tuples (named ones too) and dicts; everything else is passed as it is.
    """
    if isinstance(obj, torch.Tensor):
        if obj.requires_grad and obj.grad_fn is not None:
            return obj.detach().requires_grad_(True)
        return obj
    if isinstance(obj, list):
        return [leafify(v) for v in obj]
    if isinstance(obj, tuple):
        items = [leafify(v) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if isinstance(obj, dict):
        out = {k: leafify(v) for k, v in obj.items()}
        return out if type(obj) is dict else type(obj)(out)
    return obj


# ----------------------------------------------------------------------------- snapshot
def _clone(v: Any) -> Any:
    return v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device and a.layout == b.layout


def _put(dst: Any, src: Any) -> Any:
    """Write ``src`` (a snapshot value) back: into ``dst`` when it is a tensor of the same layout."""
    if isinstance(src, torch.Tensor) and isinstance(dst, torch.Tensor) and _same_layout(dst, src):
        dst.copy_(src)
        return dst
    return _clone(src)


class _TensorState:
    """One tensor's value and gradient at snapshot time."""

    __slots__ = ("always", "grad", "has_grad", "tensor", "value", "version")

    def __init__(self, t: torch.Tensor, always: bool) -> None:
        self.tensor = t
        self.always = always
        self.value = t.detach().clone()
        self.has_grad = t.is_leaf and t.requires_grad
        self.grad = None if not self.has_grad or t.grad is None else t.grad.detach().clone()
        self.version = t._version

    def restore(self) -> None:
        t = self.tensor
        if self.always or t._version != self.version:
            if _same_layout(t, self.value):
                t.copy_(self.value)
            elif t.is_leaf:
                t.data = self.value.clone()
            self.version = t._version
        if self.has_grad:
            if self.grad is None:
                t.grad = None
            elif t.grad is not None and _same_layout(t.grad, self.grad):
                t.grad.copy_(self.grad)
            else:
                t.grad = self.grad.clone()


class Snapshot:
    """Clones of everything ``found`` holds, plus the global RNGs; ``restore`` writes them back."""

    def __init__(self, found: Found) -> None:
        self.found = found
        states: list[_TensorState] = []
        seen: set[int] = set()
        for m in found.modules:
            for t in (*m.parameters(), *m.buffers()):
                if isinstance(t, torch.nn.parameter.UninitializedParameter | torch.nn.parameter.UninitializedBuffer):
                    raise ConfigError(
                        f"{type(m).__name__} has uninitialized (lazy) parameters; call it once before "
                        "repeat_check so that every repeat starts from the same materialized weights"
                    )
                if id(t) not in seen:
                    seen.add(id(t))
                    states.append(_TensorState(t, always=True))
        for _, t in found.tensors:
            if id(t) not in seen:
                seen.add(id(t))
                # Non-leaf tensors (held by a closure, say) cannot be written without breaking their graph.
                if t.is_leaf or not t.requires_grad:
                    states.append(_TensorState(t, always=False))
        self.tensors = states
        self.training = [(m, m.training) for root in found.modules for m in root.modules()]
        self.optimizers = [(o, _opt_state(o)) for o in found.optimizers]
        self.stateful = [(obj, copy.deepcopy(obj.state_dict())) for obj in found.stateful]
        self.generators = [(g, g.get_state()) for g in found.generators]
        self.rng = _rng_state()

    def restore(self) -> None:
        """Put every snapshot value back (in place where the tensor kept its layout)."""
        with torch.no_grad():
            for st in self.tensors:
                st.restore()
            for opt, (state, groups) in self.optimizers:
                _restore_opt(opt, state, groups)
        for obj, sd in self.stateful:
            obj.load_state_dict(copy.deepcopy(sd))
        for m, training in self.training:
            m.training = training
        for g, s in self.generators:
            g.set_state(s)
        _set_rng_state(self.rng)


def _opt_state(opt: torch.optim.Optimizer) -> tuple[dict, list]:
    state = {p: {k: _clone(v) for k, v in s.items()} for p, s in opt.state.items()}
    groups = [{k: _clone(v) for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return state, groups


def _restore_opt(opt: torch.optim.Optimizer, state: dict, groups: list) -> None:
    cur = opt.state
    for p in [p for p in cur if p not in state]:
        del cur[p]
    for p, saved in state.items():
        if p not in cur:
            cur[p] = {k: _clone(v) for k, v in saved.items()}
            continue
        d = cur[p]
        for k in [k for k in d if k not in saved]:
            del d[k]
        for k, v in saved.items():
            d[k] = _put(d.get(k), v)
    for g, saved in zip(opt.param_groups, groups, strict=False):
        for k in [k for k in g if k != "params" and k not in saved]:
            del g[k]
        for k, v in saved.items():
            g[k] = _put(g.get(k), v)


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        # Taken even when CUDA is not initialized yet: fn may start it, and its first repeat
        # would then draw from a generator the later repeats could not rewind.
        state["cuda"] = torch.cuda.get_rng_state_all()
    np = sys.modules.get("numpy")
    if np is not None:
        state["numpy"] = np.random.get_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        sys.modules["numpy"].random.set_state(state["numpy"])
