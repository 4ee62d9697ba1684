"""Level ``ops`` inside compiled code: every kernel Inductor generated, recorded as it runs.

torch.compile's Inductor writes each compiled graph as a Python module (``wrapper_code``) whose
``call`` runs the graph's fused kernels, looking each one up as a module global at every call.
While a session is open, each such module (those loaded before it, from
``PyCodeCache.modules``, and each one loaded after, through ``codecache._reload_python_module``)
has its kernel globals replaced by a ``_Probe`` that calls the kernel with the same arguments and
records, around the call: the kernel's inputs before it runs (kind ``kernel``, name the kernel's,
module and phase of the code that runs it: the compiled region in forward, the module that made
its autograd node in backward), its outputs after. The generated code, the kernels and the
fusion decisions are untouched (capture on and off compile and run the same kernels, bit for
bit); the GEMMs, fallbacks and custom ops between the kernels are ATen calls the dispatch mode
records as ops. Closing the session puts the original globals back.

An argument the kernel reads is sometimes a buffer the wrapper allocated a moment before with
``empty_strided_<device>`` and nothing wrote yet: one updated in place (``in_out_ptr``: Inductor
reuses a fresh buffer), or one the kernel fills itself through an alias passed as an output
before reading it (``cat``). Its contents at the start are garbage that differs between
processes, not an input. So those allocators are wrapped too (``_Fresh``), as is
``extern_kernels`` (whose calls write their ``out=``), and such an argument is an input only
once something wrote it. The call's
non-tensor arguments (sizes) and the ATen ops the kernel fused are the call's ``args``.

Every probe runs its recording in ``rec.guard``: a failure there is a ``capture_error`` event and
one warning, and the kernel runs as without capture.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch._guards

from detfp_capture._recorder.args import flat_args
from detfp_capture._recorder.hazards import storage_key
from detfp_capture._sources.context import CaptureContext
from detfp_capture._sources.patches import Patches
from detfp_capture._sources.wrapper_code import ArgRole, KernelSig, cpp_kernels, triton_kernel

__all__ = ["CompiledKernels"]

#: Record kind of a generated kernel's call (detfp_format.contract.KINDS).
KIND = "kernel"
#: The wrapper's allocators of fresh buffers, by module global name.
_ALLOCATORS = ("empty_strided_cpu", "empty_strided_cuda", "empty_strided_xpu", "empty_strided_mtia")
_GUARDS_TLS = torch._guards._TLS
#: Whether CUDA is initialized in this process (only then can a stream be capturing a graph).
_CUDA_INIT = torch.cuda.is_initialized


def _aten_names() -> frozenset[str]:
    """ATen op names without namespace or overload (``native_layer_norm``)."""
    names = set()
    for n in torch._C._dispatch_get_all_op_names():
        ns, _, rest = n.partition("::")
        if ns == "aten":
            names.add(rest.split(".", 1)[0])
    return frozenset(names)


class _Fresh:
    """Storages the wrapper allocated and nothing has written yet (by data pointer, each with a
    weak reference to its storage: a storage object lives as long as a tensor over it)."""

    __slots__ = ("by_ptr",)

    def __init__(self) -> None:
        self.by_ptr: dict[int, Any] = {}

    def born(self, t: torch.Tensor) -> None:
        key = storage_key(t)
        if key is not None:
            self.by_ptr[key] = weakref.ref(t.untyped_storage())

    def wrote(self, t: torch.Tensor) -> None:
        if self.by_ptr:
            key = storage_key(t)
            if key is not None:
                self.by_ptr.pop(key, None)

    def holds(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s storage is fresh, never written."""
        if not self.by_ptr:
            return False
        key = storage_key(t)
        if key is None:
            return False
        ref = self.by_ptr.get(key)
        if ref is None:
            return False
        s = ref()
        if s is None or s.data_ptr() != key:
            del self.by_ptr[key]  # freed, and the address handed to another
            return False
        return True


class _Probe:
    """A C++ kernel's stand-in: called as the kernel (``kernel(*args)``)."""

    __slots__ = ("kernel", "owner", "sig")

    def __init__(self, owner: CompiledKernels, kernel: Any, sig: KernelSig) -> None:
        self.owner = owner
        self.kernel = kernel
        self.sig = sig

    def __call__(self, *args: Any) -> Any:
        return self.owner.run(self.sig, self.kernel, args, {})


class _TritonProbe:
    """A Triton kernel's stand-in: ``run(*args, stream=...)`` recorded, everything else the kernel's."""

    def __init__(self, owner: CompiledKernels, kernel: Any, sig: KernelSig) -> None:
        self.owner = owner
        self.kernel = kernel
        self.sig = sig

    def run(self, *args: Any, **kwargs: Any) -> Any:
        return self.owner.run(self.sig, self.kernel.run, args, kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.kernel, name)


class _Externs:
    """The wrapper's ``extern_kernels`` (GEMMs and the like, called with ``out=`` a buffer): each
    call as it was; its ``out=`` is no longer a fresh buffer afterwards."""

    def __init__(self, externs: Any, fresh: _Fresh) -> None:
        self._externs = externs
        self._fresh = fresh
        self._wrapped: dict[str, Any] = {}

    def __getattr__(self, name: str) -> Any:
        w = self._wrapped.get(name)
        if w is None:
            fn = getattr(self._externs, name)
            if not callable(fn):
                return fn
            fresh = self._fresh

            def w(*a: Any, **k: Any) -> Any:
                r = fn(*a, **k)
                out = k.get("out")
                if fresh.by_ptr and isinstance(out, torch.Tensor):
                    fresh.wrote(out)
                return r

            self._wrapped[name] = w
        return w


class CompiledKernels:
    """The kernel records of every Inductor module while the session is open (level ops)."""

    def __init__(self, ctx: CaptureContext) -> None:
        self.ctx = ctx
        self.rec = ctx.rec
        self.scope = ctx.scope
        self.fresh = _Fresh()
        #: Modules instrumented (weak references by id): each one once.
        self.done: dict[int, Any] = {}
        self._known: frozenset[str] | None = None

    # ------------------------------------------------------------------ installation
    def install(self, patches: Patches) -> None:
        """Instrument the modules loaded so far and, through the loader, each one loaded later;
        every global replaced goes through ``patches``, which puts it back at close."""
        try:
            from torch._inductor import codecache
        except Exception:  # no Inductor in this torch: nothing is ever compiled by it
            return
        with self.rec.guard("instrumenting compiled code", busy=False):
            for mod in list(codecache.PyCodeCache.modules):
                self.instrument(mod, patches)

        def wrap(orig: Any) -> Any:
            def load(*a: Any, **k: Any) -> Any:
                mod = orig(*a, **k)
                if not self.rec.closed:
                    with self.rec.guard("instrumenting compiled code", busy=False):
                        self.instrument(mod, patches)
                return mod

            load.__wrapped__ = orig  # type: ignore[attr-defined]
            return load

        patches.wrap(codecache, "_reload_python_module", wrap)

    def known(self, name: str) -> bool:
        """Whether ``name`` is an ATen op's name (``fused_ops``)."""
        if self._known is None:
            self._known = _aten_names()
        return name in self._known

    def instrument(self, mod: Any, patches: Patches) -> None:
        """Replace the kernel globals and allocators of one wrapper module (once)."""
        ns = getattr(mod, "__dict__", None)
        if ns is None or not callable(ns.get("call")):
            return
        done = self.done.get(id(mod))
        if done is not None and done() is mod:
            return
        self.done[id(mod)] = weakref.ref(mod)
        path = ns.get("__file__")
        cpp = cpp_kernels(Path(path).read_text(), self.known) if isinstance(path, str) else {}
        for name, value in list(ns.items()):
            make: Callable[[Any], Any] | None = None
            sig = cpp.get(name)
            if sig is not None and callable(value) and not isinstance(value, _Probe):
                make = functools.partial(_Probe, self, sig=sig)
            elif name.startswith("triton_") and not isinstance(value, _TritonProbe):
                tsig = triton_kernel(name, value, self.known)
                if tsig is not None:
                    make = functools.partial(_TritonProbe, self, sig=tsig)
            elif name in _ALLOCATORS and callable(value) and not hasattr(value, "_detfp_fresh"):
                make = self._allocator
            elif name == "extern_kernels" and not isinstance(value, _Externs):
                make = functools.partial(_Externs, fresh=self.fresh)
            if make is not None:
                patches.wrap(mod, name, make)

    def _allocator(self, orig: Any) -> Any:
        fresh = self.fresh
        rec = self.rec

        def alloc(*a: Any) -> Any:
            t = orig(*a)
            if rec.selected and not rec.failed:
                fresh.born(t)
            return t

        alloc._detfp_fresh = True  # type: ignore[attr-defined]
        return alloc

    # ------------------------------------------------------------------ recording
    def run(self, sig: KernelSig, call: Any, args: tuple, kwargs: dict) -> Any:
        """Call the kernel (``call(*args, **kwargs)``), recorded when capture is live."""
        rec = self.rec
        if rec.busy or not rec.selected or rec.failed or getattr(_GUARDS_TLS, "compile_context", None) is not None:
            return call(*args, **kwargs)
        if _CUDA_INIT() and torch.cuda.is_current_stream_capturing():
            # Recorded into a CUDA graph (cudagraph trees): its digests would have no value now
            # and the replays run without Python (``_digest/graphs.py`` is the way; not wired yet).
            return call(*args, **kwargs)
        pre = None
        with rec.guard("kernel {} of compiled code", sig.name):
            pre = self._pre(sig, args)
        out = call(*args, **kwargs)
        if pre is not None:
            with rec.guard("kernel {} of compiled code", sig.name):
                self._post(sig, args, pre)
        if rec.need_flush:
            rec.flush_safely()
        return out

    def _pre(self, sig: KernelSig, args: tuple) -> tuple | None:
        """Record the kernel's inputs; returns (call, written tensors, phase) for ``_post``, or
        (None, written, None) when ``modules=`` leaves it out (its writes still count)."""
        rec = self.rec
        scope = self.scope
        where = scope.op_where()
        written: list[tuple[str, torch.Tensor]] = []
        ins: list[tuple[str, str, torch.Tensor]] = []
        scalars: list[tuple[str, Any]] = []
        fresh = self.fresh
        for param, role, a in zip(sig.params, sig.roles, args, strict=False):
            if not isinstance(a, torch.Tensor):
                if role is ArgRole.SCALAR and isinstance(a, (int, float, bool)):
                    scalars.append((param, a))
                continue
            if role is ArgRole.WRITE:
                written.append((param, a))
                continue
            # A buffer still fresh when the kernel starts holds no input: one reused in place is
            # written before it is read, and a read argument over a fresh buffer is filled by
            # the kernel itself through an alias passed as an output (Inductor's ``cat``).
            if not fresh.holds(a):
                ins.append(("input", param, a))
            if role is ArgRole.READ_WRITE:
                written.append((param, a))
        ptrs = _storages([t for _, t in written])
        if where is None or (rec.cfg.modules is not None and not scope.module_selected(where[0])):
            rec.before_write(ptrs)
            return None, written, None
        module, phase = where
        hz = self.ctx.hazards
        flags = hz.flag_all([t for _, _, t in ins]) if hz is not None and hz.active else None
        if sig.aten:
            scalars.append(("aten", list(sig.aten)))
        call = rec.record_call(
            KIND,
            sig.name,
            module,
            phase,
            ins,
            args_src=flat_args([], scalars),
            hazards=flags,
            defer=phase != "backward",
        )
        # Digests waiting for a batch over what the kernel writes are taken now, cached ones dropped.
        rec.before_write(ptrs)
        return call, written, phase

    def _post(self, sig: KernelSig, args: tuple, pre: tuple) -> None:
        call, written, phase = pre
        rec = self.rec
        hz = self.ctx.hazards
        for _, t in written:
            self.fresh.wrote(t)
            if hz is not None:
                hz.wrote(t)
        if call is None or not written:
            return
        outs = [("output", p, t) for p, t in written]
        # (No version counter moves: the kernel wrote through raw pointers. The digests cached
        # over these storages went in _pre; these are the values now, at the current versions.)
        rec.append_records(call, outs, fresh=True, defer=phase != "backward")


def _storages(tensors: list[torch.Tensor]) -> list[int] | None:
    """Data pointers of the tensors' storages; None when one has no plain storage (anything may be written)."""
    ptrs = []
    for t in tensors:
        k = storage_key(t)
        if k is None:
            return None
        ptrs.append(k)
    return ptrs
