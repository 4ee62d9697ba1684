"""Version 2 of the digest, ``detfp-tlh128`` v2 (docs/digest.md, "Version 2"): a tree of
multilinear hashes designed for memory bandwidth.

Level function: a 1024-byte row is 256 words (4 bytes each, read as the *balanced* value
sum_j 256^j * signed byte j); its output is two 64-bit sums a = sum_i A[i] * w_i and
b = sum_i B[i] * w_i mod 2^64 with the level's unsigned 32-bit keys A, B (``level_keys``,
splitmix64): 16 bytes, four int32 lanes. Two routes compute the same integers:

- the native kernel (``native.mm2``: one 32 x 32 -> 64-bit multiply per word and half, AVX-512,
  AVX2 or plain C), used on CPU wherever it is built (it is faster than any torch route by far);
- torch (every device, no host sync): with the keys' bytes as balanced digits too
  (k = 0x80808080 + sum_a 256^a t_a), a * ... is a sum of byte products grouped by the power of
  256 they carry, so one exact int8 GEMM (``gemm``: ``torch._int_mm`` or the float32 GEMM)
  against a fixed 1024 x 24 matrix (``gemm_weights``) gives 24 partial sums of at most 2^24,
  which a float64 product (exact below 2^53) and two int64 operations combine (``_combine``).

Finalizer: x = mix(a ^ m0), y = mix(b ^ m1 ^ x), hi = mix(x + y), lo = mix(y ^ hi) with the
metadata words (m0, m1): a bijection of (a, b) for fixed metadata, so the digest collides
exactly when the root sums do (the collision bound is docs/digest.md's).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from detfp_capture._digest import gemm, native
from detfp_capture._digest.core import MASK64, Scheme, mix_int, mix_np, mix_t, numpy_or_none, splitmix64

__all__ = ["BIAS", "KEY_SEED", "LANES", "SCHEME", "Tlh2", "gemm_weights", "level_keys", "pack_all_keys", "pack_keys"]

#: Lanes per output row (int32): the two uint64 sums, little-endian.
LANES = 4
#: Words per row.
WORDS = gemm.K // 4
#: splitmix64 seed of the level keys: the ASCII bytes "detfptl2" read big-endian.
KEY_SEED = 0x6465746670746C32
#: A word's unsigned value XOR this, minus this, is its balanced value (each byte's sign kept).
BIAS = 0x80808080
#: Columns of the GEMM route: half A's 7 powers of 256, half B's 7, 4 byte sums, 6 zero.
COLUMNS = 24
_CPU = torch.device("cpu")
_LOCK = threading.RLock()  # pack_all_keys calls pack_keys under it


def level_keys(level: int) -> tuple[list[int], list[int]]:
    """The level's keys (A, B): 256 unsigned 32-bit integers each (docs/digest.md, "Keys")."""
    state = (KEY_SEED + level) & MASK64
    a, b = [], []
    for _ in range(WORDS):
        state, z = splitmix64(state)
        a.append(z & 0xFFFFFFFF)
        b.append(z >> 32)
    return a, b


def gemm_weights(level: int) -> torch.Tensor:
    """(1024, 24) int8: column s (s = 0..6) of half A holds, at byte 4i + j, digit s - j of A[i]
    (t = key byte - 128; zero where s - j is not a digit 0..3); columns 7..13 the same for B;
    column 14 + j a 1 at every byte j of a word (the byte sums the bias term needs)."""
    w = torch.zeros(gemm.K, COLUMNS, dtype=torch.int8)
    for half, keys in enumerate(level_keys(level)):
        k = torch.tensor(keys, dtype=torch.int64)
        digits = torch.stack([((k >> (8 * d)) & 255) - 128 for d in range(4)], dim=1).to(torch.int8)  # (256, 4)
        for j in range(4):  # byte j of each word
            for d in range(4):  # digit d of its key: power 256^(d + j)
                w[j::4, 7 * half + d + j] = digits[:, d]
    for j in range(4):
        w[j::4, 14 + j] = 1
    return w


def _combination() -> torch.Tensor:
    """(24, 5) float64: the GEMM's partial sums to [a_lo, a_hi, b_lo, b_hi, byte sums], each a
    sum of at most four terms below 2^48, so exact in float64 (a = a_lo + 2^32 a_hi + BIAS *
    byte sums, mod 2^64)."""
    c = torch.zeros(COLUMNS, 5, dtype=torch.float64)
    for half in range(2):
        for s in range(7):
            c[7 * half + s, 2 * half + (s >= 4)] = float(256 ** (s % 4 if s < 4 else s - 4))
    for j in range(4):
        c[14 + j, 4] = float(256**j)
    return c


_COMBINE: dict[torch.device, torch.Tensor] = {}


def _combine(g: torch.Tensor) -> torch.Tensor:
    """(M, 24) int32 partial sums -> (M, 4) int32: the two uint64 sums of each row."""
    dev = g.device
    c = _COMBINE.get(dev)
    if c is None:
        with torch.inference_mode(False):
            c = _COMBINE[dev] = _combination().to(dev)
    q = (g.to(torch.float64) @ c).to(torch.int64)  # exact: every value is an integer below 2^53
    out = torch.add(q[:, 0:4:2], q[:, 1:4:2], alpha=1 << 32)  # int64 arithmetic wraps mod 2^64
    out.add_(q[:, 4:5], alpha=BIAS)
    return out.view(torch.int32)


_KEYS: dict[int, torch.Tensor] = {}


def pack_keys(level: int) -> torch.Tensor:
    """The level's keys as the native kernel reads them (``_lanes.c``, "version 2"): uint8,
    A, A shifted by one word, B, B shifted, each 272 uint32; then the bias prefix sums
    CA[n] = BIAS * (A[0] + ... + A[n-1]) mod 2^64 and CB, 264 uint64 each (cached per level)."""
    keys = _KEYS.get(level)
    if keys is None:
        a, b = level_keys(level)
        words: list[int] = []
        for k in (a, b):
            words += k + [0] * 16
            words += k[1:] + [0] * 17
        sums: list[int] = []
        for k in (a, b):
            acc, pre = 0, [0]
            for v in k:
                acc += v
                pre.append(BIAS * acc & MASK64)
            sums += pre + [0] * 7
        with _LOCK, torch.inference_mode(False):
            packed = torch.tensor(words, dtype=torch.int64).to(torch.int32).view(torch.uint8)
            prefix = torch.tensor([v - (1 << 64) if v >> 63 else v for v in sums], dtype=torch.int64)
            keys = _KEYS[level] = torch.cat([packed, prefix.view(torch.uint8)])
    return keys


#: Levels whose keys ``pack_all_keys`` holds: enough for 64^7 rows (2^52 bytes).
TREE_LEVELS = 8
_ALL_KEYS: list[torch.Tensor] = []


def pack_all_keys() -> torch.Tensor:
    """Every level's ``pack_keys``, one after the other: what ``native.root2`` reads (cached)."""
    if not _ALL_KEYS:
        with _LOCK, torch.inference_mode(False):
            if not _ALL_KEYS:
                _ALL_KEYS.append(torch.cat([pack_keys(level) for level in range(TREE_LEVELS)]))
    return _ALL_KEYS[0]


class Tlh2(Scheme):
    """Version 2 (see the module docstring)."""

    version = 2
    lanes = LANES

    def __init__(self) -> None:
        self.weights = gemm.Weights(gemm_weights, COLUMNS)

    def _native_on_cpu(self) -> bool:
        """Wherever the kernel is built and not switched off: faster than any torch route."""
        ok = self.native_cpu
        if ok is None:
            ok = self.native_cpu = native.AVAILABLE and native.KEYS2_BYTES > 0
        return ok

    def mm(self, x: torch.Tensor, level: int, out: torch.Tensor | None = None) -> torch.Tensor:
        if x.is_cpu and self._native_on_cpu():
            return native.mm2(x, pack_keys(level), out)
        y = _combine(gemm.product(x, level, self.weights))
        if out is not None:
            out.copy_(y)
            return out
        return y

    def mm_short(self, x: torch.Tensor, level: int) -> torch.Tensor:
        if x.is_cpu and self._native_on_cpu():
            return native.mm2(x, pack_keys(level))
        return _combine(gemm.product_short(x, level, self.weights))

    def root(self, b: torch.Tensor) -> torch.Tensor | None:
        """The whole tree of a contiguous 1-D int8 tensor in one native call (CPU, kernel
        built): its (1, 4) root lanes; None where the levels run one by one instead."""
        if b.is_cpu and self._native_on_cpu():
            return native.root2(b, pack_all_keys())
        return None

    def route(self, device: torch.device) -> str:
        if self.use_native(device):
            return f"native kernel ({native.kernel_name(2)})"
        gemm_route = "int8 GEMM (torch._int_mm)" if gemm.use_int_mm(device, self.weights) else "exact float32 GEMM"
        return f"torch: {gemm_route}"

    # -- finalizer

    def finalize_np(self, lanes: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
        return _finalize_np(lanes, meta)

    def finalize_t(self, lanes: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
        ab = lanes.contiguous().view(torch.int64)  # (B, 2): a, b
        x = mix_t(ab[:, 0] ^ meta[:, 0])
        y = mix_t(ab[:, 1] ^ meta[:, 1] ^ x)
        hi = mix_t(x + y)
        lo = mix_t(y ^ hi)
        return torch.stack([hi, lo], dim=1)

    def finalize_host(self, lanes: Sequence[int], meta: tuple[int, int]) -> tuple[int, int]:
        a = (lanes[0] & 0xFFFFFFFF) | (lanes[1] & 0xFFFFFFFF) << 32
        b = (lanes[2] & 0xFFFFFFFF) | (lanes[3] & 0xFFFFFFFF) << 32
        x = mix_int(a ^ (meta[0] & MASK64))
        y = mix_int(b ^ (meta[1] & MASK64) ^ x)
        hi = mix_int((x + y) & MASK64)
        return hi, mix_int(y ^ hi)


def _finalize_np(lanes: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
    """``finalize`` on CPU through numpy's uint64 arithmetic (a handful of numpy calls instead of
    about 40 torch ops, each costlier to dispatch than the work on a few thousand digests)."""
    np = numpy_or_none()
    ab = lanes.detach().contiguous().numpy().view(np.uint64)
    m = meta.detach().contiguous().numpy().view(np.uint64)
    with np.errstate(over="ignore"):  # the products wrap modulo 2**64 by design
        x = mix_np(ab[:, 0] ^ m[:, 0], np)
        y = mix_np(ab[:, 1] ^ m[:, 1] ^ x, np)
        hi = mix_np(x + y, np)
        lo = mix_np(y ^ hi, np)
    return torch.from_numpy(np.stack([hi, lo], axis=1).view(np.int64))


#: The one instance (``versions`` registers it).
SCHEME = Tlh2()
