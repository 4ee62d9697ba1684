"""The digest's level functions through the optional native kernel (``_lanes.c``), on CPU.

The kernel computes, for each version, the same integers as torch's routes: version 1's level
GEMM (``mm``: where torch has no fast int8 GEMM, AVX2 without VNNI, about 2.3 GB/s against 1 GB/s
for the float route) and version 2's multilinear level (``mm2``: near memory bandwidth, the
reason version 2 exists). It is built by ``pip install`` where a C compiler and Python's headers
are (``setup.py``, optional); without it ``AVAILABLE`` is False and the digest takes torch's
routes, which give the same bits.

``DETFP_NATIVE=0`` in the environment leaves the kernel unused and ``DETFP_NATIVE=1`` uses it for
version 1 without timing it against torch's routes (to rule it out, or to compare the routes).
The kernel picks the best instruction set the CPU runs (AVX-512 F+BW, AVX2, or plain C) at
import; ``DETFP_NATIVE_ISA=avx2`` (or ``portable``) lowers that choice for the whole process, read
once here: how an AVX-512 machine measures the AVX2 path (``benchmarks/digest.py``), and what a
test uses to hold the paths to each other. Version 1 has no AVX-512 path: it runs AVX2 there.

Everything here checks what it hands the kernel (CPU, dtype, shape, strides): the kernel reads
and writes raw addresses.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
from collections.abc import Iterator

import torch

try:
    from detfp_capture._digest import _lanes  # the C extension (its types: _lanes.pyi)
except ImportError:  # not built (no compiler or headers at install): torch's routes only
    # Typed as the module (the stub) for its uses, each behind AVAILABLE, which is False here.
    _lanes = None  # type: ignore[assignment]

__all__ = [
    "AVAILABLE", "FORCED", "ISA", "ISAS", "KERNEL", "PAIRS", "kernel_name", "mlh", "mm", "mm2", "pair_weights", "root2", "root2_mlh",
    "running",
]  # fmt: skip

_MODE = os.environ.get("DETFP_NATIVE", "")
#: Whether the kernel is built and not switched off by ``DETFP_NATIVE=0``.
AVAILABLE = _lanes is not None and _MODE != "0"
#: ``DETFP_NATIVE=1``: version 1 uses it wherever built, without timing it against torch's routes.
FORCED = AVAILABLE and _MODE == "1"
#: The instruction sets this CPU runs, worst first (empty when the kernel is not built).
ISAS: tuple[str, ...] = _lanes.isas() if _lanes is not None else ()


def _select_isa() -> str | None:
    """The instruction set this process runs: the CPU's best, or ``DETFP_NATIVE_ISA`` when that
    names one the CPU has (an unknown or unavailable name keeps the best: capture never fails
    over a speed knob; ``benchmarks/digest.py`` prints what ran)."""
    if _lanes is None:
        return None
    want = os.environ.get("DETFP_NATIVE_ISA", "").strip().lower()
    if want in ISAS:
        _lanes.select(ISAS.index(want))
    return _lanes.kernel()


#: The instruction set the kernels run in this process ("avx512", "avx2", "portable"), or None.
ISA = _select_isa()
#: Version 1's kernel ("avx2" or "portable"; it has no AVX-512 path), or None.
KERNEL = None if ISA is None else ("avx2" if ISA == "avx512" else ISA)

_K = 1024
_LANES = 16
_PAIR_SHAPE = (_K // 2, _LANES, 2)
#: level -> its pair_weights (read by ``tlh1`` without a call, then built once by ``pair_weights``).
PAIRS: dict[int, torch.Tensor] = {}
_LOCK = threading.Lock()
#: Bytes of one level's packed version-2 keys (``tlh2.pack_keys``).
KEYS2_BYTES = _lanes.keys_bytes() if _lanes is not None else 0


@contextlib.contextmanager
def running(isa: str) -> Iterator[None]:
    """Run instruction set ``isa`` (one of ``ISAS``) inside the block, then the process's again:
    how ``benchmarks/digest.py`` times every path of this CPU in one run. Not for capture."""
    if isa not in ISAS:
        raise ValueError(f"instruction set {isa!r} is not one of {ISAS}")
    _lanes.select(ISAS.index(isa))
    try:
        yield
    finally:
        _lanes.select(ISAS.index(ISA))


def kernel_name(version: int) -> str | None:
    """The instruction set ``version``'s kernel runs here (None when not built)."""
    return KERNEL if version == 1 else ISA


def pair_weights(w: torch.Tensor, level: int) -> torch.Tensor:
    """Version 1: the level's (1024, 16) int8 weights as the kernel reads them: int16 pairs,
    ``[p][l][j] = W[2p + j][l]`` (cached per level)."""
    pw = PAIRS.get(level)
    if pw is None:
        with _LOCK, torch.inference_mode(False):
            pw = w.to(torch.int16).view(_K // 2, 2, _LANES).transpose(1, 2).contiguous()
            PAIRS[level] = pw
    return pw


def _rows(x: torch.Tensor, what: str) -> tuple[torch.Tensor, int, int, int]:
    """``x`` checked as (M, L <= 1024) int8 rows on CPU, made readable by the kernel (unit
    column stride, rows at least L bytes apart): (x, rows, cols, row stride)."""
    if _lanes is None:
        raise RuntimeError("detfp's native digest kernel is not built")
    if not x.is_cpu or x.dtype is not torch.int8 or x.dim() != 2:
        raise ValueError(f"native {what}: want a 2-D int8 CPU tensor, got {x.dtype} {tuple(x.shape)} on {x.device}")
    rows, cols = x.shape
    if cols > _K:
        raise ValueError(f"native {what}: rows of {cols} bytes, at most {_K}")
    st = x.stride()
    if (cols > 1 and st[1] != 1) or (rows > 1 and st[0] < cols):
        x = x.contiguous()
        st = x.stride()
    return x, rows, cols, st[0]


def _out(out: torch.Tensor | None, rows: int, dtype: torch.dtype, width: int) -> torch.Tensor:
    """``out`` if the kernel can write it directly, else a fresh (rows, width) tensor."""
    if out is not None and out.is_cpu and out.dtype is dtype and out.shape == (rows, width) and out.is_contiguous():
        return out
    return torch.empty((rows, width), dtype=dtype)


def _hand_back(y: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is not None and y is not out:
        out.copy_(y)  # an ``out`` the kernel cannot write directly (strided, another dtype)
        return out
    return y


def mm(x: torch.Tensor, pw: torch.Tensor, out: torch.Tensor | None = None, portable: bool = False) -> torch.Tensor:
    """Version 1: (M, L) int8 with L <= 1024 @ the first L rows of a level's weights -> (M, 16)
    int32, exactly, written into ``out`` if given. ``pw``: that level's ``pair_weights``.
    ``portable``: the plain-C loop even where AVX2 runs (tests hold the two to each other). Per
    call about 4 us of checks around the kernel (called hundreds of times per step at level ops)."""
    x, rows, cols, stride = _rows(x, "mm")
    if not pw.is_cpu or pw.dtype is not torch.int16 or pw.shape != _PAIR_SHAPE or not pw.is_contiguous():
        raise ValueError("native mm: pw must be a level's pair_weights")
    y = _out(out, rows, torch.int32, _LANES)
    if rows and not cols:
        y.zero_()  # no bytes: no terms (and an empty tensor has no address to hand over)
    elif rows:
        _lanes.lanes(x.data_ptr(), rows, cols, stride, pw.data_ptr(), y.data_ptr(), portable)
    return _hand_back(y, out)


def mm2(x: torch.Tensor, keys: torch.Tensor, out: torch.Tensor | None = None, isa: str | None = None) -> torch.Tensor:
    """Version 2: (M, L) int8 rows with L <= 1024, zero-padded -> (M, 4) int32 (each row's two
    uint64 sums, little-endian), exactly, written into ``out`` if given. ``keys``: a level's
    ``tlh2.pack_keys``. ``isa``: one of ``ISAS`` instead of the process's (tests)."""
    x, rows, cols, stride = _rows(x, "mm2")
    if not keys.is_cpu or keys.dtype is not torch.uint8 or keys.numel() != KEYS2_BYTES or not keys.is_contiguous():
        raise ValueError("native mm2: keys must be a level's tlh2.pack_keys")
    if isa is not None and isa not in ISAS:
        raise ValueError(f"native mm2: instruction set {isa!r} is not one of {ISAS}")
    y = _out(out, rows, torch.int32, 4)
    if rows and not cols:
        y.zero_()  # no words: both sums are zero
    elif rows:
        which = -1 if isa is None else ISAS.index(isa)
        _lanes.tlh2(x.data_ptr(), rows, cols, stride, keys.data_ptr(), y.data_ptr(), which)
    return _hand_back(y, out)


def _check_tree_args(name: str, b: torch.Tensor, keys: torch.Tensor) -> None:
    """The arguments of a whole-tree call: a contiguous 1-D int8 CPU tensor and every level's keys."""
    if _lanes is None:
        raise RuntimeError("detfp's native digest kernel is not built")
    if not b.is_cpu or b.dtype is not torch.int8 or b.dim() != 1 or not b.is_contiguous():
        raise ValueError(f"native {name}: want a contiguous 1-D int8 CPU tensor, got {b.dtype} {tuple(b.shape)}")
    if not keys.is_cpu or keys.dtype is not torch.uint8 or keys.numel() % KEYS2_BYTES or not keys.is_contiguous():
        raise ValueError(f"native {name}: keys must be tlh2.pack_all_keys")


def root2(b: torch.Tensor, keys: torch.Tensor, isa: str | None = None) -> torch.Tensor:
    """Version 2: the root of the whole tree of a contiguous 1-D int8 tensor ``b`` (its bytes), in
    one call (no level written to memory) -> (1, 4) int32, the root's two uint64 sums. ``keys``:
    ``tlh2.pack_all_keys`` (every level's packed keys, one after the other)."""
    _check_tree_args("root2", b, keys)
    if isa is not None and isa not in ISAS:
        raise ValueError(f"native root2: instruction set {isa!r} is not one of {ISAS}")
    y = torch.empty((1, 4), dtype=torch.int32)
    which = -1 if isa is None else ISAS.index(isa)
    n = b.numel()
    _lanes.tlh2_root(b.data_ptr() if n else 0, n, keys.data_ptr(), keys.numel() // KEYS2_BYTES, y.data_ptr(), which)
    return y


def mlh(
    x: torch.Tensor,
    sizes: tuple[int, ...],
    strides: tuple[int, ...],
    run: int,
    base: int,
    keys: torch.Tensor,
    seed_a: int,
    seed_b: int,
    isa: str | None = None,
) -> tuple[int, int]:
    """The mergeable fingerprint's part (ma, mb) of a contiguous CPU tensor ``x`` whose bytes are
    runs of ``run`` bytes at the global byte offsets ``base + sum_d i_d * strides[d]`` over the
    row-major index of ``sizes`` (``merge.Box.runs``). ``keys``: ``tlh2.pack_keys(0)``."""
    if _lanes is None:
        raise RuntimeError("detfp's native digest kernel is not built")
    if not x.is_cpu or not x.is_contiguous():
        raise ValueError("native mlh: want a contiguous CPU tensor")
    if x.numel() * x.element_size() != run * math.prod(sizes):
        raise ValueError(f"native mlh: {x.numel() * x.element_size()} bytes are not {math.prod(sizes)} runs of {run}")
    if not keys.is_cpu or keys.dtype is not torch.uint8 or keys.numel() != KEYS2_BYTES or not keys.is_contiguous():
        raise ValueError("native mlh: keys must be tlh2.pack_keys(0)")
    if isa is not None and isa not in ISAS:
        raise ValueError(f"native mlh: instruction set {isa!r} is not one of {ISAS}")
    which = -1 if isa is None else ISAS.index(isa)
    addr = x.data_ptr() if x.numel() else 0
    return _lanes.mlh(addr, run, tuple(sizes), tuple(strides), base, keys.data_ptr(), seed_a, seed_b, which)


def root2_mlh(b: torch.Tensor, keys: torch.Tensor, seed_a: int, seed_b: int) -> tuple[torch.Tensor, tuple[int, int]]:
    """``root2`` and, from the same pass's level 0, the mergeable fingerprint's sums (ma, mb) of
    the same bytes as a whole tensor (``merge``; one 64-bit multiply per 1 KiB row more)."""
    _check_tree_args("root2_mlh", b, keys)
    y = torch.empty((1, 4), dtype=torch.int32)
    n = b.numel()
    ab = _lanes.tlh2_root_mlh(
        b.data_ptr() if n else 0, n, keys.data_ptr(), keys.numel() // KEYS2_BYTES, y.data_ptr(), seed_a, seed_b
    )
    return y, ab
