"""Module boundaries: forward, backward and recompute records, and module paths for ops.

Forward: a pre-hook records the inputs (kind ``module_input``; ``batch`` for a root module,
whose inputs are the data) and pushes the module on the scope's stack; a post-hook registered
with ``always_call=True`` (so an exception or checkpoint's early stop cannot unbalance the
stack) records the outputs (``module_output``) and pops it.

Backward uses plain tensor hooks, never ``register_full_backward_hook`` (which wraps outputs
in views and breaks code that inspects ``._base``): a hook on each output records the gradient
flowing into the module's backward (``module_input``, arg ``grad_out[i]``), and hooks on the
inputs record the gradients it produced (``module_output``, arg ``grad_in[i]``; for an input
also used elsewhere this is the accumulated gradient). ``backward.GradHooks`` owns them: bound
to their call and step, removed at step end, never raising inside autograd.

A module forward that runs while autograd is executing a node is a checkpoint recompute:
its records get phase ``recompute`` and the flush checks that the recomputed outputs equal the
original forward outputs (``recompute_mismatch`` events).

At level ``ops`` the post-hook also tags the autograd nodes created inside the module with
its path (``graph.mark_graph``), so ops that run in backward are attributed to their module.
Below level boundaries only the root module is hooked: its input is the batch.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from detfp_capture._sources import graph
from detfp_capture._sources.backward import GradHooks
from detfp_capture._sources.context import CaptureContext, ModuleFrame

__all__ = ["ModuleHooks", "class_name", "flatten_tensors"]

#: A module class -> the class name its records carry (``class_name``).
_CLASS_NAMES: dict[type, str] = {}


def class_name(module: torch.nn.Module) -> str:
    """The name of the class the program made ``module`` from. FSDP2's ``fully_shard`` (and the
    composable ``replicate``) swap a module's class for one they generate, ``FSDP<Name>`` (or
    ``DDP<Name>``) with bases (their marker class, the original): the records name the original,
    so a report says ``Llama``, the program's class, and a sharded run names its modules as an
    unsharded one does."""
    cls = type(module)
    name = _CLASS_NAMES.get(cls)
    if name is None:
        name = cls.__name__
        bases = cls.__bases__
        if (
            len(bases) == 2
            and bases[0].__module__.startswith("torch.distributed.")
            and name.endswith(bases[1].__name__)
            and name != bases[1].__name__
        ):
            name = bases[1].__name__
        _CLASS_NAMES[cls] = name
    return name


def _hook_callers() -> frozenset:
    """The code objects of ``Module._call_impl`` and of the closures inside it that call hooks."""
    code = torch.nn.Module._call_impl.__code__
    return frozenset([code, *(c for c in code.co_consts if isinstance(c, type(code)))])


_HOOK_CALLERS = _hook_callers()


def _caller_kwargs() -> dict:
    """The keyword arguments of the module call whose global pre-hook is running, or ``{}``
    when the hook was not called from ``Module._call_impl`` (another torch, a compiled call).
    The hooks run in a closure of ``_call_impl`` whose frame holds ``kwargs`` as a free variable."""
    frame = sys._getframe(2)  # 0: this function, 1: _global_pre, 2: the caller of the hook
    if frame.f_code not in _HOOK_CALLERS:
        return {}
    kwargs = frame.f_locals.get("kwargs")
    return kwargs if isinstance(kwargs, dict) else {}


def flatten_tensors(obj: Any, prefix: str, out: list[tuple[str, torch.Tensor]], depth: int = 0) -> None:
    """Collect (path, tensor) pairs from nested tuples/lists/dicts/dataclass-like outputs."""
    if isinstance(obj, torch.Tensor):
        out.append((prefix, obj))
    elif depth > 4:
        return
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            flatten_tensors(v, f"{prefix}[{i}]", out, depth + 1)
    elif isinstance(obj, (dict, Mapping)):  # dict first (fast); Mapping: UserDict, HF's BatchEncoding
        for k in obj:
            flatten_tensors(obj[k], f"{prefix}.{k}", out, depth + 1)
    elif hasattr(obj, "__dataclass_fields__"):
        for k in obj.__dataclass_fields__:
            flatten_tensors(getattr(obj, k, None), f"{prefix}.{k}", out, depth + 1)


def _call_tensors(args: tuple, kwargs: dict) -> list[tuple[str, torch.Tensor]]:
    out: list[tuple[str, torch.Tensor]] = []
    for i, a in enumerate(args):
        flatten_tensors(a, f"args[{i}]", out)
    for k in sorted(kwargs):
        flatten_tensors(kwargs[k], f"kwargs.{k}", out)
    return out


class ModuleHooks:
    """Hook functions shared by per-module (``watch``) and global (launcher, ``watch_all``)
    registration. ``on_root``: called with a module that runs forward as a root for the first
    time under the global hooks (the session names and watches it); ``on_forward``: called when
    a root module's forward begins (the manifest reads the autocast state it runs under)."""

    def __init__(
        self,
        ctx: CaptureContext,
        on_root: Callable[[torch.nn.Module], None],
        on_forward: Callable[[], None] = lambda: None,
    ) -> None:
        self.ctx = ctx
        self._on_forward = on_forward
        self.rec = ctx.rec
        self.scope = ctx.scope
        self.caps = ctx.caps
        self._on_root = on_root
        # id(module) -> (path, weakref); filled by watch() or, globally, from each root module.
        # A DDP wrapper is transparent: its path is None.
        self.paths: dict[int, tuple[str | None, Any]] = {}
        self.roots: set[int] = set()
        self.handles: list[RemovableHandle] = []
        self.global_mode = False
        self.grads = GradHooks(ctx)  # this step's gradient hooks
        # Modules compiled in place whose compiled call is wrapped: (module ref, original call).
        self.compiled_regions: list[tuple[Any, Callable]] = []

    def is_watched(self, module: object) -> bool:
        return id(module) in self.paths

    def release_nodes(self) -> None:
        """The step ended: remove its gradient hooks and their references to autograd nodes."""
        self.grads.release()

    # ------------------------------------------------------------------- registration
    def name_tree(self, root: torch.nn.Module) -> None:
        inner = getattr(root, "module", None)
        is_ddp = type(root).__name__ == "DistributedDataParallel" and isinstance(inner, torch.nn.Module)
        base: torch.nn.Module = inner if is_ddp and isinstance(inner, torch.nn.Module) else root
        if is_ddp:
            # The DDP wrapper itself is transparent: paths are those of the wrapped model.
            self.paths[id(root)] = (None, weakref.ref(root))
        for name, m in base.named_modules():
            if id(m) not in self.paths:
                self.paths[id(m)] = (name, weakref.ref(m))
        self.roots.add(id(base))

    def watch(self, model: torch.nn.Module) -> None:
        self.name_tree(model)
        for _mid, (path, ref) in list(self.paths.items()):
            m = ref()
            if m is None or path is None:
                continue
            if getattr(m, "_detfp_hooked", None) is self:
                continue
            if not self.caps.module_boundaries and id(m) not in self.roots:
                continue  # level metrics: only the data fed to the root (kind batch)
            self.handles.append(m.register_forward_pre_hook(self.pre, with_kwargs=True))
            self.handles.append(m.register_forward_hook(self.post, with_kwargs=True, always_call=True))
            m._detfp_hooked = self

    def install_global(self) -> None:
        from torch.nn.modules import module as nnmod

        self.global_mode = True
        self.handles.append(nnmod.register_module_forward_pre_hook(self._global_pre))
        self.handles.append(nnmod.register_module_forward_hook(self._global_post, with_kwargs=True, always_call=True))

    def remove(self) -> None:
        self.release_nodes()
        for ref, impl in self.compiled_regions:
            m = ref()
            if m is not None and getattr(m._compiled_call_impl, "__wrapped__", None) is impl:
                m._compiled_call_impl = impl
        self.compiled_regions.clear()
        for h in self.handles:
            h.remove()
        self.handles.clear()
        for _, ref in self.paths.values():
            m = ref()
            if m is not None and getattr(m, "_detfp_hooked", None) is self:
                del m._detfp_hooked

    # Names come from the root module of each forward. Global pre-hooks are called without the
    # keyword arguments (torch has no with_kwargs for them), yet Hugging Face models and
    # Trainer pass the whole batch that way (``model(**batch)``): they are read from the
    # frame of ``Module._call_impl`` that called the hook, which holds them as ``kwargs``.
    def _global_pre(self, module: torch.nn.Module, args: tuple) -> None:
        if torch.compiler.is_compiling():
            return  # traced into a compiled region: read no capture state (see ``pre``)
        if getattr(module, "_detfp_hooked", None) is self:
            return  # watched too (Session.watch_all next to watch): its own hooks record it
        if self.scope.stack:
            if not self.caps.module_boundaries:
                return  # level metrics: only roots (their input is the batch)
        else:
            # Named first: the step this forward begins records the state the model starts from.
            if id(module) not in self.paths:
                with self.rec.guard("naming modules", busy=False):
                    self.name_tree(module)
                self._on_root(module)
            pending = self.ctx.pending_step
            if pending.number is not None:
                pending.touch()  # the first forward of a step begins it (after the script seeded)
        self.pre(module, args, _caller_kwargs())

    def _global_post(self, module: torch.nn.Module, args: tuple, *rest: Any) -> None:
        # (kwargs, output) when the forward returned; (output,) alone when it raised: torch's
        # exception path calls the global always-call hooks without the kwargs even when they
        # were registered with_kwargs (torch 2.x ``Module._call_impl``). Checkpoint's early stop
        # of a recompute raises through every module still running, so a hook that accepted
        # only the first form would be skipped (a silenced TypeError) and leave the scope's
        # module stack unbalanced for the rest of the run.
        if torch.compiler.is_compiling() or getattr(module, "_detfp_hooked", None) is self:
            return
        kwargs, output = rest if len(rest) == 2 else ({}, rest[0])
        self.post(module, args, kwargs, output)

    # ------------------------------------------------------------------- forward
    def wrap_compiled(self) -> None:
        """Record the boundary of modules compiled in place (``module.compile()``).

        ``module.compile()`` compiles the module's whole call, its hooks included, so the
        hooks of this class never run there (they return while dynamo traces). The compiled
        call itself is run eagerly by ``Module.__call__`` through ``_compiled_call_impl``: a
        wrapper around it records the region's inputs and outputs (kind ``compiled``; the
        root's inputs are the batch) without touching what is compiled."""
        for mid, (path, ref) in list(self.paths.items()):
            m = ref()
            impl = getattr(m, "_compiled_call_impl", None) if m is not None and path is not None else None
            if impl is None or getattr(impl, "_detfp_region", None) is self:
                continue
            if not self.caps.module_boundaries and mid not in self.roots:
                continue  # level metrics: only the root, whose input is the batch

            def make(m: torch.nn.Module, impl: Callable) -> Callable:
                def call(*args: Any, **kwargs: Any) -> Any:
                    self.pre(m, args, kwargs, compiled=True)
                    try:
                        out = impl(*args, **kwargs)
                    except BaseException:
                        self.post(m, args, kwargs, None, compiled=True, failed=True)
                        raise
                    self.post(m, args, kwargs, out, compiled=True)
                    return out

                call._detfp_region = self  # type: ignore[attr-defined]
                call.__wrapped__ = impl  # type: ignore[attr-defined]
                return call

            m._compiled_call_impl = make(m, impl)
            self.compiled_regions.append((weakref.ref(m), impl))

    def pre(self, module: torch.nn.Module, args: tuple, kwargs: dict, compiled: bool | None = None) -> None:
        if torch.compiler.is_compiling():
            # First, before any capture state is read: dynamo traces this hook into the graph of
            # a compiled module, and would guard on every value read on the way (``rec.selected``
            # flips between steps: a recompile at each, until its limit leaves the module eager).
            return
        rec = self.rec
        if not self.scope.stack and rec.in_step and not rec.busy:
            with rec.guard("reading the autocast state", busy=False):
                self._on_forward()  # selected or not: a setting is the run's, not a step's
        if rec.busy or not rec.selected or rec.failed or self.scope.bookkeeping:
            return  # (bookkeeping: a framework's own pass, e.g. a pipeline stage inferring shapes)
        entry = self.paths.get(id(module))
        if entry is None or entry[0] is None:
            return
        path = entry[0]
        scope = self.scope
        stack = scope.stack
        with rec.guard("forward pre-hook of {!r}", path):
            in_autograd = torch._C._current_autograd_node() is not None
            if not stack and not in_autograd and rec.in_step and rec.phase == "step":
                rec.phase = "forward"  # a new forward after a backward (gradient accumulation)
            phase = "recompute" if in_autograd or (stack and stack[-1].phase == "recompute") else rec.phase
            root = not stack
            tensors = _call_tensors(args, kwargs)
            stack.append(ModuleFrame(id(module), path, phase, [t for _, t in tensors], graph.walks()))
            if compiled is None:
                compiled = type(module).__name__ == "OptimizedModule"
            boundaries = self.caps.module_boundaries
            if (boundaries or (root and phase == "forward")) and scope.module_selected(path):
                kind = "batch" if root and phase == "forward" else ("compiled" if compiled else "module_input")
                rec.record_call(
                    kind,
                    class_name(module),
                    path,
                    phase,
                    [("input", a, t) for a, t in tensors],
                    compiled=compiled,
                    hazards=self._hazards([t for _, t in tensors]),
                )
                if boundaries and phase != "recompute" and torch.is_grad_enabled():
                    side = self.grads.hook_inputs(class_name(module), path, [t for _, t in tensors])
                    if side is not None:
                        # (NamedTuple._replace costs ~2 us: a frame is rebuilt with its last field.)
                        stack[-1] = ModuleFrame(*stack[-1][:-1], side)
            if compiled:
                # Compiled code writes without the dispatch mode seeing it (an input mutated in
                # place): digests waiting for a batch, its input records' included, are taken now.
                rec.run_deferred(staging=False)
        if rec.need_flush:
            rec.flush_safely()

    def post(
        self,
        module: torch.nn.Module,
        args: tuple,
        kwargs: dict,
        output: Any,
        compiled: bool | None = None,
        failed: bool = False,
    ) -> None:
        rec = self.rec
        if torch.compiler.is_compiling():
            return  # traced into a compiled region (module.compile()): never touch the stack
        stack = self.scope.stack
        if not stack or stack[-1].module_id != id(module):
            return
        frame = stack.pop()
        path, phase = frame.path, frame.phase
        if compiled is None:
            compiled = type(module).__name__ == "OptimizedModule"
        if failed or rec.busy or not rec.selected or rec.failed:  # (not compiling: returned above)
            return
        with rec.guard("forward hook of {!r}", path):
            selected = self.caps.module_boundaries and self.scope.module_selected(path)
            tag = self.caps.ops and phase == "forward" and torch.is_grad_enabled()
            tensors: list[tuple[str, torch.Tensor]] = []
            if selected or tag:
                flatten_tensors(output, "out", tensors)  # once, for the records and the tagging walk
            if selected:
                rec.record_call(
                    "compiled" if compiled else "module_output",
                    class_name(module),
                    path,
                    phase,
                    [("output", a, t) for a, t in tensors],
                    compiled=compiled,
                    hazards=self._hazards([t for _, t in tensors]),
                )
                if phase != "recompute" and torch.is_grad_enabled():
                    outs = [t for _, t in tensors]
                    self.grads.hook_outputs(class_name(module), path, outs, frame.inputs)
                    self.grads.bind(frame.grads, outs, frame.inputs)
            if tag:
                graph.mark_graph([t for _, t in tensors], frame.inputs, path, frame.walks)
        if rec.need_flush:
            rec.flush_safely()

    def _hazards(self, tensors: list[torch.Tensor]) -> dict[int, tuple[str, ...]] | None:
        hz = self.ctx.hazards
        return hz.flag_all(tensors) if hz is not None and hz.active else None
