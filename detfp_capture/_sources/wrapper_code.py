"""What capture reads of the Python module torch.compile's Inductor generates (its output code).

Inductor turns a graph into one Python module: each fused kernel is a module global (on CPU a
C++ function bound with ``async_compile.cpp_pybinding(argtypes, source)``, on CUDA a Triton
``CachingAutotuner``) and ``call(args)`` runs them in order, with the GEMMs and fallbacks in
between as ordinary ATen calls (``extern_kernels.mm(..., out=buf)``, ``torch.ops.aten.x``) and its
buffers from ``empty_strided_<device>``. Nothing here changes that module; it only says, for each
kernel, which of its arguments it reads and which it writes, from the kernel's own parameter
names (Inductor's naming for both backends: ``in_ptrN`` read, ``out_ptrN`` written,
``in_out_ptrN`` read and written, anything else a scalar such as a size ``ksN`` or ``xnumel``),
and which ATen ops it fused, from its name (``cpp_fused_add_native_layer_norm_0``: Inductor names
a fused kernel after the original ATen ops of its nodes).

Pure functions of the module's text and the kernel objects: the same module, fresh from a compile
or loaded from Inductor's cache, gives the same answer.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import Enum
from typing import Any

__all__ = ["ArgRole", "KernelSig", "cpp_kernels", "fused_ops", "role_of", "triton_kernel"]


class ArgRole(Enum):
    """How a kernel uses one argument."""

    READ = "read"
    WRITE = "write"
    READ_WRITE = "read_write"
    SCALAR = "scalar"


@dataclass(frozen=True)
class KernelSig:
    """One generated kernel of a wrapper module."""

    #: The module global the wrapper calls (``cpp_fused_gelu_0``, ``triton_poi_fused_add_0``).
    name: str
    #: Its parameter names, in call order.
    params: tuple[str, ...]
    #: How it uses each parameter.
    roles: tuple[ArgRole, ...]
    #: The ATen ops it fused (from its name), in the order the name lists them.
    aten: tuple[str, ...]


def role_of(param: str, mutated: Iterable[str] = ()) -> ArgRole:
    """The role of a kernel parameter named ``param`` (``mutated``: names the kernel declares it writes)."""
    if param.startswith("in_out_ptr"):
        return ArgRole.READ_WRITE
    if param.startswith("out_ptr"):
        return ArgRole.WRITE
    if param.startswith("in_ptr"):
        return ArgRole.READ_WRITE if param in set(mutated) else ArgRole.READ
    return ArgRole.SCALAR


#: ``name = async_compile.cpp_pybinding([argtypes], r'''source''')`` in a wrapper module.
_CPP_DEF = re.compile(r"^(\w+) = async_compile\.cpp_pybinding\(\[[^\]]*\], r'''(.*?)'''\)", re.M | re.S)
#: The C signature of a pybinding kernel (``extern "C" ... kernel(const float* in_ptr0, ...)``).
_C_SIGNATURE = re.compile(r'extern "C"[^(]*\(([^)]*)\)')
#: A kernel name's descriptive part: the ops between ``fused_`` and the numeric suffix.
_FUSED = re.compile(r"^(?:cpp|triton_[a-z]+)_fused_(.+?)_\d+$")


def cpp_kernels(source: str, known: Callable[[str], bool]) -> dict[str, KernelSig]:
    """The C++ kernels defined in a wrapper module's ``source``, by global name (``known``:
    whether a name is an ATen op, for ``fused_ops``)."""
    out: dict[str, KernelSig] = {}
    for m in _CPP_DEF.finditer(source):
        name, body = m.group(1), m.group(2)
        sig = _C_SIGNATURE.search(body)
        if sig is None:
            continue
        params = tuple(p.split()[-1].lstrip("*&") for p in sig.group(1).split(",") if p.strip())
        out[name] = KernelSig(name, params, tuple(role_of(p) for p in params), fused_ops(name, known))
    return out


def triton_kernel(name: str, kernel: Any, known: Callable[[str], bool]) -> KernelSig | None:
    """The signature of a Triton kernel object of a wrapper module (a ``CachingAutotuner``:
    ``triton_meta['signature']`` names the arguments ``run`` takes, in order; constexprs are
    not passed); None when ``kernel`` is not one."""
    meta = getattr(kernel, "triton_meta", None)
    if not isinstance(meta, dict):
        return None
    signature = meta.get("signature")
    if not isinstance(signature, dict) or not callable(getattr(kernel, "run", None)):
        return None
    constants = meta.get("constants") or {}
    params = tuple(p for p in signature if p not in constants and signature[p] != "constexpr")
    inductor = getattr(kernel, "inductor_meta", None) or {}
    mutated = tuple(inductor.get("mutated_arg_names") or ())
    return KernelSig(name, params, tuple(role_of(p, mutated) for p in params), fused_ops(name, known))


def fused_ops(kernel: str, known: Callable[[str], bool]) -> tuple[str, ...]:
    """The ATen ops a kernel's name lists (``cpp_fused_add_native_layer_norm_sum_1`` ->
    ``('add', 'native_layer_norm', 'sum')``): its underscore-separated words cut into the
    longest known op names from the left; a word no op name starts is kept as it is. Empty
    for a name without a fused part."""
    m = _FUSED.match(kernel)
    if m is None:
        return ()
    # A leading underscore of an op (``_foreach_add``) leaves an empty word: it joins the next.
    words: list[str] = []
    lead = ""
    for w in m.group(1).split("_"):
        if not w:
            lead += "_"
            continue
        words.append(lead + w)
        lead = ""
    ops: list[str] = []
    i = 0
    while i < len(words):
        for j in range(len(words), i, -1):
            cand = "_".join(words[i:j])
            if j == i + 1 or known(cand):
                ops.append(cand)
                i = j
                break
    return tuple(ops)
