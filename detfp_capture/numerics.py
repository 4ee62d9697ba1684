"""The catalogue of numerics-relevant settings: every torch knob that changes what a step computes.

A manifest's ``determinism`` object is ``snapshot()``: the legacy keys (deterministic algorithms
and their warn-only mode, cuDNN, TF32, matmul precision, thread counts) and, under ``backends.``
and ``autocast.``, every ``torch.backends`` flag that selects a kernel or a precision and the
autocast state per device type. Each value is plain JSON (a bool, a string, an int, a list of
strings, or null where torch cannot say), read by a reader that never raises.

``BACKEND_NAMES`` classifies every public name of ``torch.backends.*`` (functions, flags, the
names a module object answers through ``__getattr__``): the catalogue key that records it, or
why it is not a setting (a query, a context manager, a debugging switch). A test enumerates
torch's backend names and fails for one this table does not classify, so a flag a new torch
adds is classified before it can go unrecorded.

The autocast state is what a forward runs under: ``Catalogue.autocast_raw`` is read at the first
root forward of each step (``RunManifest.forward_begins``), the rest at each step begin. torch is
imported inside the readers: the module is importable where torch is not.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["AUTOCAST_DEVICES", "BACKEND_NAMES", "NOT_A_SETTING", "SETTINGS", "Catalogue", "snapshot"]

#: Device types whose autocast state is recorded (others only when their backend is available).
AUTOCAST_DEVICES = ("cpu", "cuda")
_OTHER_AUTOCAST = ("xpu", "mps", "hpu")
#: Prefix of a ``BACKEND_NAMES`` value that is not recorded: the text after it says why.
NOT_A_SETTING = "not a setting: "


def _torch() -> Any:
    import torch

    return torch


def _fp32(backend: str, op: str) -> Callable[[Any], Callable[[], Any]]:
    return lambda t: functools.partial(t._C._get_fp32_precision_getter, backend, op)


def _item(name: str, i: int) -> Callable[[Any], Callable[[], Any]]:
    """Element ``i`` of what ``torch._C.<name>()`` returns (a pair of flags)."""

    def resolve(t: Any) -> Callable[[], Any]:
        get = getattr(t._C, name)
        return lambda: get()[i]

    return resolve


def _c(name: str) -> Callable[[Any], Callable[[], Any]]:
    """torch's C getter ``torch._C.<name>``."""
    return lambda t: getattr(t._C, name)


def _python_native_disabled() -> list[str]:
    """DSLs, operations and dispatch keys whose python_native overrides are turned off, sorted.

    Read from the filter that ``torch.backends.python_native`` changes (torch._native.registry):
    its public functions answer one name at a time, and the dispatch keys not at all."""
    registry = sys.modules.get("torch._native.registry")
    state = getattr(registry, "_filter_state", None)
    if state is None:
        return []  # never imported: nothing turned off
    groups = (("dsl", state._dsl_names), ("op", state._op_symbols), ("key", state._dispatch_keys))
    return sorted(f"{what}:{name}" for what, names in groups for name in names)


def _opt_einsum(attr: str) -> Callable[[Any], Callable[[], Any]]:
    # torch imports torch.backends.opt_einsum with torch; a flag's getter is a module function.
    def resolve(t: Any) -> Callable[[], Any]:
        mod = sys.modules["torch.backends.opt_einsum"]
        return lambda: getattr(mod, attr)

    return resolve


#: (manifest key under ``determinism``, resolver): a resolver takes the torch module and returns
#: the zero-argument getter of the setting, most of them torch's own C getters, resolved once per
#: session (``Catalogue``), so that reading the whole catalogue at every step begin costs tens of
#: microseconds and a change is seen at the step it takes effect. The first ten are the keys
#: manifests always held (their names kept, so that runs of earlier releases compare with new ones).
SETTINGS: tuple[tuple[str, Callable[[Any], Callable[[], Any]]], ...] = (
    ("deterministic_algorithms", _c("_get_deterministic_algorithms")),
    ("deterministic_warn_only", _c("_get_deterministic_algorithms_warn_only")),
    ("cudnn_deterministic", _c("_get_cudnn_deterministic")),
    ("cudnn_benchmark", _c("_get_cudnn_benchmark")),
    ("cuda_matmul_allow_tf32", _c("_get_cublas_allow_tf32")),
    ("cudnn_allow_tf32", _c("_get_cudnn_allow_tf32")),
    ("float32_matmul_precision", _c("_get_float32_matmul_precision")),
    ("fill_uninitialized_memory", _c("_get_deterministic_fill_uninitialized_memory")),
    ("num_threads", lambda t: t.get_num_threads),
    ("num_interop_threads", lambda t: t.get_num_interop_threads),
    ("backends.fp32_precision", _fp32("generic", "all")),
    ("backends.cpu.capability", _c("_get_cpu_capability")),
    ("backends.cuda.matmul.allow_fp16_reduced_precision_reduction", _item("_get_cublas_allow_fp16_reduced_precision_reduction", 0)),
    ("backends.cuda.matmul.allow_fp16_reduced_precision_reduction_split_k",
     _item("_get_cublas_allow_fp16_reduced_precision_reduction", 1)),
    ("backends.cuda.matmul.allow_bf16_reduced_precision_reduction", _item("_get_cublas_allow_bf16_reduced_precision_reduction", 0)),
    ("backends.cuda.matmul.allow_bf16_reduced_precision_reduction_split_k",
     _item("_get_cublas_allow_bf16_reduced_precision_reduction", 1)),
    ("backends.cuda.matmul.allow_fp16_accumulation", _c("_get_cublas_allow_fp16_accumulation")),
    ("backends.cuda.matmul.fp32_precision", _fp32("cuda", "matmul")),
    ("backends.cuda.preferred_linalg_library", _c("_get_linalg_preferred_backend")),
    ("backends.cuda.preferred_blas_library", _c("_get_blas_preferred_backend")),
    ("backends.cuda.preferred_rocm_fa_library", _c("_get_rocm_fa_preferred_backend")),
    ("backends.cuda.flash_sdp_enabled", _c("_get_flash_sdp_enabled")),
    ("backends.cuda.mem_efficient_sdp_enabled", _c("_get_mem_efficient_sdp_enabled")),
    ("backends.cuda.math_sdp_enabled", _c("_get_math_sdp_enabled")),
    ("backends.cuda.cudnn_sdp_enabled", _c("_get_cudnn_sdp_enabled")),
    ("backends.cuda.fa3_sdp_enabled", _c("_get_fa3_sdp_enabled")),
    ("backends.cuda.overrideable_sdp_enabled", _c("_get_overrideable_sdp_enabled")),
    ("backends.cuda.sdp_priority_order", _c("_get_sdp_priority_order")),
    ("backends.cuda.fp16_bf16_reduction_math_sdp_allowed", _c("_get_math_sdp_allow_fp16_bf16_reduction")),
    ("backends.cudnn.enabled", _c("_get_cudnn_enabled")),
    ("backends.cudnn.benchmark_limit", _c("_cuda_get_cudnn_benchmark_limit")),
    ("backends.cudnn.fp32_precision", _fp32("cuda", "all")),
    ("backends.cudnn.conv.fp32_precision", _fp32("cuda", "conv")),
    ("backends.cudnn.rnn.fp32_precision", _fp32("cuda", "rnn")),
    ("backends.cudnn.depthwise_kernel", _c("_get_cudnn_depthwise_kernel")),
    ("backends.miopen.immediate", _c("_get_miopen_immediate")),
    ("backends.mha.fastpath_enabled", lambda t: t.backends.mha.get_fastpath_enabled),
    ("backends.mkldnn.enabled", _c("_get_mkldnn_enabled")),
    ("backends.mkldnn.deterministic", _c("_get_mkldnn_deterministic")),
    ("backends.mkldnn.allow_tf32", _c("_get_onednn_allow_tf32")),
    ("backends.mkldnn.fp32_precision", _fp32("mkldnn", "all")),
    ("backends.mkldnn.matmul.fp32_precision", _fp32("mkldnn", "matmul")),
    ("backends.mkldnn.conv.fp32_precision", _fp32("mkldnn", "conv")),
    ("backends.mkldnn.rnn.fp32_precision", _fp32("mkldnn", "rnn")),
    ("backends.nnpack.enabled", _c("_get_nnpack_enabled")),
    ("backends.opt_einsum.enabled", _opt_einsum("enabled")),
    ("backends.opt_einsum.strategy", _opt_einsum("strategy")),
    ("backends.python_native.disabled", lambda t: _python_native_disabled),
    ("backends.quantized.engine", _c("_get_qengine")),
    ("backends.xnnpack.enabled", _c("_is_xnnpack_enabled")),
)  # fmt: skip

_RECORDED = frozenset(k for k, _ in SETTINGS)


def _not(why: str) -> str:
    return NOT_A_SETTING + why


_QUERY = _not("a query of what is available or built")
_CM = _not("a context manager or setter of flags recorded under their own names")
_TYPE = _not("a type or constant of the module")
_DEBUG = _not("a debugging or logging switch")
_CACHE = _not("a cache or workspace size: no effect on which kernel computes what")

#: Every public name of ``torch.backends.*`` (``module.name``; the module object's own flags and
#: the names its attributes answer through ``__getattr__``): the ``SETTINGS`` key recording it,
#: or why it is not a setting. A name missing here fails ``tests/unit/test_numerics.py``.
BACKEND_NAMES: dict[str, str] = {
    "fp32_precision": "backends.fp32_precision",
    **{n: _CM for n in ("flags", "set_flags")},
    "disable_global_flags": _not("forbids assigning flags outside flags() blocks; the flags are recorded"),
    "flags_frozen": _QUERY,
    **{n: _TYPE for n in ("ContextProp", "PropModule", "GenericModule")},
    "cpu.get_cpu_capability": "backends.cpu.capability",
    "cuda.matmul.allow_tf32": "cuda_matmul_allow_tf32",
    **{f"cuda.matmul.{n}": f"backends.cuda.matmul.{n}" for n in (
        "allow_fp16_reduced_precision_reduction", "allow_fp16_reduced_precision_reduction_split_k",
        "allow_bf16_reduced_precision_reduction", "allow_bf16_reduced_precision_reduction_split_k",
        "allow_fp16_accumulation", "fp32_precision")},
    "cuda.preferred_linalg_library": "backends.cuda.preferred_linalg_library",
    "cuda.preferred_blas_library": "backends.cuda.preferred_blas_library",
    "cuda.preferred_rocm_fa_library": "backends.cuda.preferred_rocm_fa_library",
    **{f"cuda.{n}": f"backends.cuda.{n}" for n in (
        "flash_sdp_enabled", "mem_efficient_sdp_enabled", "math_sdp_enabled", "cudnn_sdp_enabled",
        "fp16_bf16_reduction_math_sdp_allowed")},
    **{f"cuda.{n}": _CM for n in (
        "enable_flash_sdp", "enable_mem_efficient_sdp", "enable_math_sdp", "enable_cudnn_sdp",
        "allow_fp16_bf16_reduction_math_sdp", "sdp_kernel")},
    **{f"cuda.{n}": _QUERY for n in (
        "is_built", "is_flash_attention_available", "is_ck_sdpa_available", "can_use_flash_attention",
        "can_use_efficient_attention", "can_use_cudnn_attention")},
    **{f"cuda.{n}": _TYPE for n in (
        "SDPAParams", "cuBLASModule", "cuFFTPlanCache", "cuFFTPlanCacheAttrContextProp", "cuFFTPlanCacheManager")},
    **{f"cuda.{n}": _CACHE for n in (
        "cufft_plan_cache", "cufft_plan_cache.size", "cufft_plan_cache.max_size", "cublas_workspace_size",
        "cublaslt_workspace_size", "blas_workspace_size")},
    "cuda.matmul": _not("the namespace of the cuda.matmul.* flags"),
    "cudnn.enabled": "backends.cudnn.enabled",
    "cudnn.deterministic": "cudnn_deterministic",
    "cudnn.benchmark": "cudnn_benchmark",
    "cudnn.benchmark_limit": "backends.cudnn.benchmark_limit",
    "cudnn.allow_tf32": "cudnn_allow_tf32",
    "cudnn.fp32_precision": "backends.cudnn.fp32_precision",
    "cudnn.conv.fp32_precision": "backends.cudnn.conv.fp32_precision",
    "cudnn.rnn.fp32_precision": "backends.cudnn.rnn.fp32_precision",
    "cudnn.depthwise_kernel": "backends.cudnn.depthwise_kernel",
    "cudnn.conv": _not("the namespace of cudnn.conv.fp32_precision"),
    "cudnn.rnn": _not("the namespace of cudnn.rnn.fp32_precision"),
    **{f"cudnn.{n}": _QUERY for n in ("is_available", "is_acceptable", "version")},
    **{f"cudnn.{n}": _CM for n in ("flags", "set_flags")},
    **{f"cudnn.{n}": _TYPE for n in ("CudnnModule", "CUDNN_TENSOR_DTYPES", "Optional")},
    **{f"cusparselt.{n}": _QUERY for n in ("is_available", "version", "get_max_alg_id")},
    "cusparselt.Optional": _TYPE,
    "kleidiai.is_available": _QUERY,
    "mha.get_fastpath_enabled": "backends.mha.fastpath_enabled",
    "mha.set_fastpath_enabled": _CM,
    "miopen.immediate": "backends.miopen.immediate",
    **{f"miopen.{n}": _CM for n in ("flags", "set_flags")},
    "miopen.MiopenModule": _TYPE,
    "mkl.is_available": _QUERY,
    **{f"mkl.{n}": _DEBUG for n in ("verbose", "VERBOSE_ON", "VERBOSE_OFF")},
    **{f"mkldnn.{n}": f"backends.mkldnn.{n}" for n in ("enabled", "deterministic", "allow_tf32", "fp32_precision")},
    **{f"mkldnn.{op}.fp32_precision": f"backends.mkldnn.{op}.fp32_precision" for op in ("matmul", "conv", "rnn")},
    **{f"mkldnn.{op}": _not(f"the namespace of mkldnn.{op}.fp32_precision") for op in ("matmul", "conv", "rnn")},
    **{f"mkldnn.{n}": _QUERY for n in ("is_available", "is_acl_available")},
    **{f"mkldnn.{n}": _CM for n in ("flags", "set_flags")},
    **{f"mkldnn.{n}": _DEBUG for n in ("verbose", "VERBOSE_ON", "VERBOSE_OFF", "VERBOSE_ON_CREATION")},
    **{f"mkldnn.{n}": _TYPE for n in ("MkldnnModule", "TYPE_CHECKING")},
    **{f"mps.{n}": _QUERY for n in (
        "is_available", "is_built", "is_macos13_or_newer", "is_macos_or_newer", "get_name", "get_core_count")},
    **{f"mps.{n}": _TYPE for n in ("Optional", "TYPE_CHECKING")},
    "nnpack.is_available": _QUERY,
    "nnpack.flags": "backends.nnpack.enabled",
    "nnpack.set_flags": _CM,
    "openmp.is_available": _QUERY,
    "opt_einsum.enabled": "backends.opt_einsum.enabled",
    "opt_einsum.strategy": "backends.opt_einsum.strategy",
    "opt_einsum.is_available": _QUERY,
    "opt_einsum.get_opt_einsum": _QUERY,
    **{f"opt_einsum.{n}": _CM for n in ("flags", "set_flags")},
    "opt_einsum.OptEinsumModule": _TYPE,
    **{f"python_native.{n}": "backends.python_native.disabled" for n in (
        "disable_operations", "enable_operations", "operations_disabled", "is_operation_disabled", "is_dsl_disabled",
        "triton", "cutedsl", "triton.enabled", "cutedsl.enabled")},
    **{f"python_native.{n}": _not("dispatch keys have no getter in torch; the DSLs and operations turned off are "
                                  "recorded") for n in ("disable_dispatch_keys", "enable_dispatch_keys")},
    **{f"python_native.{n}": _QUERY for n in ("all_dsls", "available_dsls", "get_dsl_operations")},
    **{f"python_native.{d}.{n}": _QUERY for d in ("triton", "cutedsl") for n in ("available", "name", "version")},
    **{f"python_native.{n}": _TYPE for n in ("DSLController", "PythonNativeModule")},
    "quantized.engine": "backends.quantized.engine",
    "quantized.supported_engines": _QUERY,
    "quantized.QuantizedEngine": _TYPE,
    "xnnpack.XNNPACKEngine": _TYPE,
    "xnnpack.enabled": "backends.xnnpack.enabled",
    "xeon.run_cpu": _not("a launcher script (numactl, thread pinning): its thread counts are recorded"),
}  # fmt: skip


def _safe(read: Callable[[], Any]) -> Any:
    # Every fact is optional: a failing reader (no CUDA, an older torch) must not stop the run.
    try:
        value = read()
    except Exception:
        return None
    return _plain(value)


def _plain(value: Any) -> Any:
    """A setting's value as plain JSON."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [v if isinstance(v, (bool, int, str)) else str(v) for v in value]
    name = getattr(value, "name", None)  # an enum of torch's (_LinalgBackend.Default): its name
    return name if isinstance(name, str) else str(value)


def _autocast_devices(t: Any) -> tuple[str, ...]:
    out = list(AUTOCAST_DEVICES)
    for dev in _OTHER_AUTOCAST:
        mod = getattr(t, dev, None)
        if mod is not None and _safe(getattr(mod, "is_available", lambda: False)):
            out.append(dev)
    return tuple(out)


class Catalogue:
    """The catalogue's getters resolved against this process's torch, once (a session holds one):
    a getter this build lacks (cuDNN's on a CPU build) reads as null without being looked up again."""

    def __init__(self) -> None:
        t = _torch()
        self._t = t
        #: Device types whose autocast state is read.
        self.devices = _autocast_devices(t)
        self._getters: list[Callable[[], Any] | None] = []
        for _, resolve in SETTINGS:
            try:
                get: Callable[[], Any] | None = resolve(t)
                get()  # type: ignore[misc]
            except Exception:
                get = None
            self._getters.append(get)

    def raw(self) -> list[Any]:
        """The settings now, as torch returns them, in ``SETTINGS`` order (None where a getter
        fails): what a step begin compares with the previous step's before converting anything."""
        out: list[Any] = []
        for get in self._getters:
            try:
                out.append(None if get is None else get())
            except Exception:
                out.append(None)
        return out

    def snapshot(self, values: list[Any] | None = None) -> dict[str, Any]:
        """Every setting (``SETTINGS``, from ``values`` when given: ``raw()``'s), then ``autocast()``,
        as plain JSON values (torch's enums by name, the quantized engine by name)."""
        got = self.raw() if values is None else values
        out = {key: _plain(v) for (key, _), v in zip(SETTINGS, got, strict=True)}
        engine = out.get("backends.quantized.engine")
        if isinstance(engine, int):
            out["backends.quantized.engine"] = _safe(lambda: _torch().backends.quantized.engine)
        out.update(self.autocast())
        return out

    def autocast_raw(self) -> tuple[Any, ...]:
        """The autocast state now, as torch returns it: (enabled, dtype) per device type, then
        whether its cast cache is on (what a root forward compares with the step before)."""
        t = self._t
        try:
            out: list[Any] = []
            for dev in self.devices:
                on = t.is_autocast_enabled(dev)
                out += (on, t.get_autocast_dtype(dev) if on else None)
            return (*out, t.is_autocast_cache_enabled())
        except Exception:
            return ()

    def autocast(self, values: tuple[Any, ...] | None = None) -> dict[str, Any]:
        """The autocast state (``values``: ``autocast_raw()``'s) as manifest keys:
        ``autocast.<device>.enabled`` and ``.dtype`` (null when disabled: the dtype of a region not
        entered changes nothing) per device type, and ``autocast.cache_enabled``."""
        got = self.autocast_raw() if values is None else values
        out: dict[str, Any] = {}
        for i, dev in enumerate(self.devices):
            on, dtype = (got[2 * i], got[2 * i + 1]) if got else (None, None)
            out[f"autocast.{dev}.enabled"] = on
            out[f"autocast.{dev}.dtype"] = None if dtype is None else str(dtype)
        out["autocast.cache_enabled"] = got[-1] if got else None
        return out


def snapshot() -> dict[str, Any]:
    """Every setting of the catalogue now (``Catalogue().snapshot()``)."""
    return Catalogue().snapshot()


assert all(v in _RECORDED or v.startswith(NOT_A_SETTING) for v in BACKEND_NAMES.values()), "unknown catalogue key"
