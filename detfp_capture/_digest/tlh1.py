"""Version 1 of the digest, ``detfp-tlh128`` v1 (docs/digest.md, "Version 1"): kept to compare
runs captured with it (old goldens, the sample traces).

Level function: each 1024-byte row (signed bytes) times a fixed per-level 1024 x 16 int8 weight
matrix, exact int32 (16 lanes); weights from a splitmix64 stream (``level_weights``). Routes:
torch's exact GEMMs (``gemm``) or the native kernel (``native.mm``, AVX2 ``vpmaddwd``), which a
process times once against torch's route on CPU and takes when faster (``DETFP_NATIVE=1``: taken
without timing; ``=0``: never). Finalizer: the 16 lanes absorbed as 8 words into two mixers
seeded with the metadata words, vectorized on int64 tensors (numpy's uint64 on CPU, when
importable) and in plain Python for a few digests (``finalize_host``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from detfp_capture._digest import gemm, native
from detfp_capture._digest.core import MASK64, Scheme, mix_int, mix_np, mix_t, numpy_or_none, splitmix64

__all__ = ["LANES", "SCHEME", "WEIGHT_SEED", "Tlh1", "level_weights"]

#: Lanes per output row (int32).
LANES = 16
#: splitmix64 seed of the level weights: the ASCII bytes "detfptlh" read big-endian.
WEIGHT_SEED = 0x6465746670746C68
_CPU = torch.device("cpu")


def level_weights(level: int) -> list[int]:
    """The 1024 x 16 weights of ``level``, row-major, as Python ints (docs/digest.md, "Weights")."""
    state = (WEIGHT_SEED + level) & MASK64
    out = []
    for _ in range(gemm.K * LANES):
        state, z = splitmix64(state)
        v = z % 254
        out.append(v - 127 if v < 127 else v - 126)
    return out


class Tlh1(Scheme):
    """Version 1 (see the module docstring)."""

    version = 1
    lanes = LANES

    def __init__(self) -> None:
        self.weights = gemm.Weights(
            lambda level: torch.tensor(level_weights(level), dtype=torch.int8).view(gemm.K, LANES), LANES
        )

    # -- level function

    def _native_on_cpu(self) -> bool:
        """When the kernel is built and, timed once per process, faster than torch's route (the
        int8 GEMM where VNNI makes that fast, else the exact float32 GEMM)."""
        ok = self.native_cpu
        if ok is None:
            ok = native.AVAILABLE
            if ok and not native.FORCED:
                pw = self.pairs(0)
                best = gemm.best_seconds(
                    _CPU, {True: lambda x: native.mm(x, pw), False: lambda x: gemm.product(x, 0, self.weights)}
                )
                ok = best[True] <= best[False]
            self.native_cpu = ok
        return ok

    def pairs(self, level: int) -> torch.Tensor:
        """The level's weights as the native kernel reads them (``native.pair_weights``)."""
        pw = native.PAIRS.get(level)
        return pw if pw is not None else native.pair_weights(self.weights.get(_CPU, level), level)

    def mm(self, x: torch.Tensor, level: int, out: torch.Tensor | None = None) -> torch.Tensor:
        if x.is_cpu and self._native_on_cpu():
            return native.mm(x, self.pairs(level), out)
        return gemm.product(x, level, self.weights, out)

    def mm_short(self, x: torch.Tensor, level: int) -> torch.Tensor:
        if x.is_cpu and self._native_on_cpu():
            return native.mm(x, self.pairs(level))
        return gemm.product_short(x, level, self.weights)

    def route(self, device: torch.device) -> str:
        if self.use_native(device):
            return f"native kernel ({native.kernel_name(1)})"
        return "int8 GEMM (torch._int_mm)" if gemm.use_int_mm(device, self.weights) else "exact float32 GEMM"

    # -- finalizer

    def finalize_np(self, lanes: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
        return _finalize_np(lanes, meta)

    def finalize_t(self, lanes: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
        u = lanes.to(torch.int64) & 0xFFFFFFFF
        words = u[:, 0::2] | (u[:, 1::2] << 32)  # (B, 8): lane 2i low, lane 2i+1 high
        s = meta
        for i in range(LANES // 2):
            s = mix_t(s ^ words[:, i : i + 1])
        a, b = s[:, 0], s[:, 1]
        hi = mix_t(a + b)
        lo = mix_t(b ^ hi)
        return torch.stack([hi, lo], dim=1)

    def finalize_host(self, lanes: Sequence[int], meta: tuple[int, int]) -> tuple[int, int]:
        u = [v & 0xFFFFFFFF for v in lanes]
        a, b = meta[0] & MASK64, meta[1] & MASK64
        for i in range(LANES // 2):
            w = u[2 * i] | (u[2 * i + 1] << 32)
            a = mix_int(a ^ w)
            b = mix_int(b ^ w)
        hi = mix_int((a + b) & MASK64)
        return hi, mix_int(b ^ hi)


def _finalize_np(lanes: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
    """``finalize`` on CPU through numpy's uint64 arithmetic (logical shifts, wrapping
    products): one numpy call per step of the mixer instead of two to four torch ops, each of
    which costs more in dispatch than the work on a few thousand digests. Same bits (tested)."""
    np = numpy_or_none()
    u = lanes.detach().contiguous().numpy().view(np.uint32).astype(np.uint64)
    words = u[:, 0::2] | (u[:, 1::2] << np.uint64(32))
    s = meta.detach().contiguous().numpy().view(np.uint64)
    with np.errstate(over="ignore"):  # the products wrap modulo 2**64 by design
        for i in range(LANES // 2):
            s = mix_np(s ^ words[:, i : i + 1], np)
        a, b = s[:, 0], s[:, 1]
        hi = mix_np(a + b, np)
        lo = mix_np(b ^ hi, np)
    return torch.from_numpy(np.stack([hi, lo], axis=1).view(np.int64))


#: The one instance (``versions`` registers it).
SCHEME = Tlh1()
