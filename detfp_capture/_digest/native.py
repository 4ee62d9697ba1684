"""The digest's level GEMM through the optional native kernel (``_lanes.c``), on CPU.

The kernel computes the same integers as ``torch._int_mm`` and the exact float32 GEMM of
``core.mm``; it only runs faster where torch has no fast int8 GEMM (AVX2 without VNNI: about 2.3
GB/s of digested bytes against 1 GB/s for the float route). It is built by ``pip install`` where
a C compiler and Python's headers are (``setup.py``, optional); without it ``AVAILABLE`` is False
and ``core.mm`` takes torch's routes. Which route a process takes is decided once, by timing (``core.use_native``);
``DETFP_NATIVE=0`` in the environment leaves the kernel unused and ``DETFP_NATIVE=1`` uses it
wherever it is built, without timing it (to rule it out, or to compare the routes).

Everything here checks what it hands the kernel (CPU, dtype, shape, strides): the kernel reads and
writes raw addresses.
"""

from __future__ import annotations

import os
import threading

import torch

try:
    from detfp_capture._digest import _lanes
except ImportError:  # not built (no compiler or headers at install): torch's routes only
    _lanes = None

__all__ = ["AVAILABLE", "FORCED", "KERNEL", "PAIRS", "mm", "pair_weights"]

_MODE = os.environ.get("DETFP_NATIVE", "")
#: Whether the kernel is built and not switched off by ``DETFP_NATIVE=0``.
AVAILABLE = _lanes is not None and _MODE != "0"
#: ``DETFP_NATIVE=1``: used wherever built, without timing it against torch's routes.
FORCED = AVAILABLE and _MODE == "1"
#: The kernel this CPU runs ("avx2", "portable"), or None.
KERNEL = _lanes.kernel() if _lanes is not None else None

_K = 1024
_LANES = 16
_PAIR_SHAPE = (_K // 2, _LANES, 2)
#: level -> its pair_weights (read by ``core`` without a call, then built once by ``pair_weights``).
PAIRS: dict[int, torch.Tensor] = {}
_LOCK = threading.Lock()


def pair_weights(w: torch.Tensor, level: int) -> torch.Tensor:
    """The level's (1024, 16) int8 weights as the kernel reads them: int16 pairs,
    ``[p][l][j] = W[2p + j][l]`` (cached per level)."""
    pw = PAIRS.get(level)
    if pw is None:
        with _LOCK, torch.inference_mode(False):
            pw = w.to(torch.int16).view(_K // 2, 2, _LANES).transpose(1, 2).contiguous()
            PAIRS[level] = pw
    return pw


def mm(x: torch.Tensor, pw: torch.Tensor, out: torch.Tensor | None = None, portable: bool = False) -> torch.Tensor:
    """(M, L) int8 with L <= 1024 @ the first L rows of a level's weights -> (M, 16) int32,
    exactly, written into ``out`` if given. ``pw``: that level's ``pair_weights``. ``portable``:
    the plain-C loop even where AVX2 runs (tests hold the two to each other). Per call about 4 us
    of checks around the kernel (``core.mm`` calls it hundreds of times per step at level ops)."""
    if _lanes is None:
        raise RuntimeError("detfp's native digest kernel is not built")
    if not x.is_cpu or x.dtype is not torch.int8 or x.dim() != 2:
        raise ValueError(f"native mm: want a 2-D int8 CPU tensor, got {x.dtype} {tuple(x.shape)} on {x.device}")
    if not pw.is_cpu or pw.dtype is not torch.int16 or pw.shape != _PAIR_SHAPE or not pw.is_contiguous():
        raise ValueError("native mm: pw must be a level's pair_weights")
    rows, cols = x.shape
    if cols > _K:
        raise ValueError(f"native mm: rows of {cols} bytes, at most {_K}")
    st = x.stride()
    if (cols > 1 and st[1] != 1) or (rows > 1 and st[0] < cols):
        x = x.contiguous()
        st = x.stride()
    y = out
    if y is None or not (y.is_cpu and y.dtype is torch.int32 and y.shape == (rows, _LANES) and y.is_contiguous()):
        y = torch.empty((rows, _LANES), dtype=torch.int32)
    if rows and not cols:
        y.zero_()  # no bytes: no terms (and an empty tensor has no address to hand over)
    elif rows:
        _lanes.lanes(x.data_ptr(), rows, cols, st[0], pw.data_ptr(), y.data_ptr(), portable)
    if out is not None and y is not out:
        out.copy_(y)  # an ``out`` the kernel cannot write directly (strided, another dtype)
        return out
    return y
