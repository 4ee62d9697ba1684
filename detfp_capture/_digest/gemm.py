"""Exact int8 GEMM of byte rows by a level's int8 weights, on any device: torch's routes.

Both digest versions reduce each 1024-byte row with one integer matrix product (version 1: its
16 lanes directly; version 2: 24 partial sums it then combines, docs/digest.md), and every
product here is exact whatever the route: ``torch._int_mm`` (int8 x int8 -> int32, the fastest
integer kernel torch has on CUDA and on CPUs with VNNI), or a float32 GEMM on the same integers
(every product and partial sum is an integer of magnitude at most 2^24, exactly representable
whatever the summation order, TF32 and bf16 reduced-precision modes included, since the
operands have at most 8 significant bits). Which route a device takes is decided once per
process (on CPU by timing both: CPUs without VNNI run ``_int_mm`` through a generic kernel,
3-9x slower than the float path); the results are the same integers, so only speed decides.

``Weights`` caches one scheme's per-level weight matrices on each device; ``product`` runs the
GEMM by the chosen route. The native CPU kernels (``native``) are separate: each version's
module decides when they run instead.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

import torch

__all__ = ["ANY_M_DEVICES", "K", "Weights", "best_seconds", "product", "product_short", "use_int_mm"]

#: Bytes per row of every level.
K = 1024
#: Device types whose _int_mm takes any M; elsewhere rows are zero-padded to a multiple of 8, >= 32.
ANY_M_DEVICES = frozenset({"cpu"})
#: Batches of at least this many rows use column-major weights on CPU (measured: about 6% faster
#: from 256 rows on, slower below).
_COL_MAJOR_ROWS = 256
#: Rows per block of ``torch._int_mm`` on CPU: its kernel packs its operand, and on a whole 64 MiB
#: batch ran at 4-5 GB/s against 6-7 GB/s in blocks of 1024 rows (a Xeon with AMX, one thread).
_INT_MM_BLOCK_ROWS = 1024
#: Rows per block of the exact float32 GEMM on CPU: a block (1 MiB as float32) stays in cache and
#: is reused, where converting a whole batch at once wrote (and page-faulted) four times its bytes:
#: about 5x slower on a 32 MiB batch (AVX2-only EPYC, one thread).
_FLOAT_BLOCK_ROWS = 256
#: device type -> True when torch._int_mm works there (and, on CPU, beats the float32 GEMM),
#: False for the exact float32 GEMM. Decided by the first scheme that asks (the same kernels).
_INT_MM: dict[str, bool] = {}
_LOCK = threading.Lock()


class Weights:
    """One digest version's level weights (K x columns, int8) on every device, built once per
    (device, level, form) from ``make(level)``, a CPU int8 tensor."""

    def __init__(self, make: Callable[[int], torch.Tensor], columns: int) -> None:
        self.make = make
        self.columns = columns
        self._cpu: dict[int, torch.Tensor] = {}
        self._dev: dict[tuple[torch.device, int, bool, bool], torch.Tensor] = {}

    def get(self, device: torch.device, level: int, as_float: bool = False, col_major: bool = False) -> torch.Tensor:
        """The level's weights on ``device``: int8, or float32 for the exact float GEMM.
        ``col_major``: stored column-major on CPU too (faster for long batches there);
        CUDA's copy is always column-major (cuBLASLt's int8 GEMM is several times faster so)."""
        key = (device, level, as_float, col_major)
        w = self._dev.get(key)
        if w is None:
            with _LOCK:
                base = self._cpu.get(level)
                if base is None:
                    base = self._cpu[level] = self.make(level)
                w = base.to(torch.float32) if as_float else base
                with torch.inference_mode(False):
                    if device.type == "cpu":
                        w = w.t().contiguous().t() if col_major else w.clone()
                    else:
                        w = w.to(device).t().contiguous().t()
                self._dev[key] = w
        return w


def use_int_mm(device: torch.device, weights: Weights) -> bool:
    """Whether ``torch._int_mm`` is the route on ``device`` (works, and on CPU is faster than
    the exact float32 GEMM, timed once per process)."""
    ok = _INT_MM.get(device.type)
    if ok is None:
        try:
            a = torch.zeros(32, K, dtype=torch.int8, device=device)
            ok = torch._int_mm(a, weights.get(device, 0)).dtype == torch.int32
        except Exception:
            ok = False
        if ok and device.type == "cpu":
            wi, wf = weights.get(device, 0, False, True), weights.get(device, 0, True)
            best = best_seconds(
                device,
                {True: lambda x: torch._int_mm(x, wi), False: lambda x: (x.to(torch.float32) @ wf).to(torch.int32)},
            )
            ok = best[True] <= best[False]
        _INT_MM[device.type] = ok
    return ok


def best_seconds(device: torch.device, fns: dict) -> dict:
    """Best of three timings of each ``fn(x)``, taking turns, on fixed rows: 512 x 1024 bytes
    (not from torch's RNG, which the training job owns)."""
    x = (torch.arange(512 * K, dtype=torch.int32, device=device) % 251 - 125).to(torch.int8).view(512, K)
    best = dict.fromkeys(fns, math.inf)
    for _ in range(3):
        for key, fn in fns.items():
            t0 = time.perf_counter()
            fn(x)
            best[key] = min(best[key], time.perf_counter() - t0)
    return best


def product(x: torch.Tensor, level: int, weights: Weights, out: torch.Tensor | None = None) -> torch.Tensor:
    """(M, 1024) int8 @ the level's weights -> (M, columns) int32, exactly (into ``out`` if given)."""
    dev = x.device
    if use_int_mm(dev, weights):
        m = x.shape[0]
        if dev.type in ANY_M_DEVICES:
            w = weights.get(dev, level, False, m >= _COL_MAJOR_ROWS)
            if m <= _INT_MM_BLOCK_ROWS:
                return torch._int_mm(x, w) if out is None else torch._int_mm(x, w, out=out)
            y = out if out is not None and out.is_contiguous() else torch.empty(m, weights.columns, dtype=torch.int32)
            for i in range(0, m, _INT_MM_BLOCK_ROWS):
                torch._int_mm(x[i : i + _INT_MM_BLOCK_ROWS], w, out=y[i : i + _INT_MM_BLOCK_ROWS])
        else:
            w = weights.get(dev, level)
            # CUDA's kernel wants M > 16 and a multiple of 8: zero rows contribute zero outputs.
            mp = max(32, -(-m // 8) * 8)
            if mp != m:
                x = torch.cat([x, x.new_zeros(mp - m, K)])
                y = torch._int_mm(x, w)[:m]
            else:
                y = torch._int_mm(x, w) if out is None else torch._int_mm(x, w, out=out)
    elif dev.type != "cpu":
        y = (x.to(torch.float32) @ weights.get(dev, level, True)).to(torch.int32)
    else:
        return _float_mm(x, level, weights, out)
    if out is not None and y is not out:
        out.copy_(y)
        return out
    return y


def product_short(x: torch.Tensor, level: int, weights: Weights) -> torch.Tensor:
    """``product`` of (n, L) rows with L <= 1024, zero-padded to 1024 columns. Zero columns add
    nothing, so X_pad @ W == X @ W[:L]: on CPU that skips materializing the padding."""
    n, length = x.shape
    dev = x.device
    if dev.type in ANY_M_DEVICES and use_int_mm(dev, weights):
        if length == 0:
            return torch.zeros(n, weights.columns, dtype=torch.int32, device=dev)
        return torch._int_mm(x.contiguous(), weights.get(dev, level)[:length])
    if length != K:
        x = torch.nn.functional.pad(x, (0, K - length))
    return product(x, level, weights)


def _float_mm(x: torch.Tensor, level: int, weights: Weights, out: torch.Tensor | None) -> torch.Tensor:
    """The exact float32 route on CPU. One reused float32 block per thread (no 1 MiB allocation
    per call), every block's GEMM written into one float32 result and converted to int32 once at
    the end (one conversion call per call, not one per block)."""
    w = weights.get(x.device, level, True)
    m = x.shape[0]
    buf = _float_block()
    acc = torch.empty(m, weights.columns, dtype=torch.float32)
    mmul = torch.mm
    for i in range(0, m, _FLOAT_BLOCK_ROWS):
        j = i + _FLOAT_BLOCK_ROWS
        if j > m:
            j = m
        b = buf if j - i == _FLOAT_BLOCK_ROWS else buf[: j - i]
        b.copy_(x[i:j])
        mmul(b, w, out=acc[i:j])
    if out is None:
        return acc.to(torch.int32)
    out.copy_(acc)
    return out


_BLOCKS = threading.local()


def _float_block() -> torch.Tensor:
    """This thread's (``_FLOAT_BLOCK_ROWS``, 1024) float32 block of the exact float GEMM on CPU
    (per thread: a DDP comm hook's callback may digest on a backend thread)."""
    buf = getattr(_BLOCKS, "buf", None)
    if buf is None:
        with torch.inference_mode(False):  # written in and out of inference mode
            buf = _BLOCKS.buf = torch.empty(_FLOAT_BLOCK_ROWS, K, dtype=torch.float32)
    return buf
