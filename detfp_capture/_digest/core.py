"""The tree every digest version shares (docs/digest.md): bytes, levels, metadata, mixing.

A digest reads a tensor's logical bytes (``bytes_view``, ``chunks``), cuts them into 1024-byte
rows, reduces each row with its version's level function (``Scheme.mm``: ``lanes`` int32 per
row), and repeats on the concatenated outputs until one row is left (``tree``, ``lanes_of``,
``rows_lanes``); then the version's finalizer mixes that row with the metadata words
(``meta_words``: BLAKE2b of algorithm, version, dtype, length, numel, shape). ``Scheme`` says what
a version provides; ``tlh1`` and ``tlh2`` are the two versions, ``versions`` picks one. The
splitmix64 mixer (``mix_int``, ``mix_t``, ``mix_np``) serves both versions' key schedules and
finalizers. Everything here is a pure function of its inputs.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator, Sequence

import torch

__all__ = [
    "GAMMA",
    "MASK64",
    "SCRATCH",
    "K",
    "Scheme",
    "bytes_view",
    "chunks",
    "combine",
    "lanes_of",
    "meta_words",
    "mix_int",
    "mix_np",
    "mix_t",
    "rows_lanes",
    "s64",
    "splitmix64",
    "tree",
]

#: Bytes per row of every level.
K = 1024
#: Scratch bound for large tensors: chunks of at most this many bytes (or nbytes / 8 if larger).
SCRATCH = 64 << 20
MASK64 = (1 << 64) - 1
GAMMA = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB


class Scheme:
    """One digest version: its level function and finalizer, and the shapes the batch code
    (arena, ``batched``, ``levels``, ``staging``, ``resolve``) needs. Subclasses: ``tlh1.Tlh1``,
    ``tlh2.Tlh2``; ``versions`` holds one instance of each."""

    #: ``contract.DIGEST_VERSIONS`` key and value.
    version: int
    algorithm: str = "detfp-tlh128"
    #: int32 lanes per level-output row (version 1: 16; version 2: 4, two uint64).
    lanes: int
    #: Whether the native kernel is this process's level function on CPU (None: not decided
    #: yet; each version decides on first use, tests set it to hold the routes to each other).
    native_cpu: bool | None = None

    def use_native(self, device: torch.device) -> bool:
        """Whether the level function runs in the native kernel on ``device`` (CPU only)."""
        return device.type == "cpu" and self._native_on_cpu()

    def _native_on_cpu(self) -> bool:
        raise NotImplementedError

    def mm(self, x: torch.Tensor, level: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """(M, 1024) int8 rows -> (M, ``lanes``) int32 level outputs (into ``out`` if given)."""
        raise NotImplementedError

    def mm_short(self, x: torch.Tensor, level: int) -> torch.Tensor:
        """``mm`` of (n, L) rows with L <= 1024, as if zero-padded to 1024 bytes."""
        raise NotImplementedError

    @property
    def fanin(self) -> int:
        """Level-output rows per 1024-byte row of the next level: ``K // (4 * lanes)``."""
        return K // (4 * self.lanes)

    def finalize(self, lanes: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
        """lanes (B, ``lanes``) int32 of root rows, meta (B, 2) int64 -> (B, 2) int64 (hi, lo).
        On CPU through numpy's uint64 arithmetic when importable (``finalize_np``: one numpy call
        per step of the mixer instead of two to four torch ops, each costlier to dispatch than the
        work on a few thousand digests); elsewhere, or without a numpy bridge, with torch ops
        (``finalize_t``). The same bits (tested)."""
        if lanes.device.type == "cpu" and meta.device.type == "cpu" and numpy_or_none() is not None:
            try:
                return self.finalize_np(lanes, meta)
            except (RuntimeError, TypeError):  # a torch build without a working numpy bridge
                numpy_failed()
        return self.finalize_t(lanes, meta)

    def finalize_t(self, lanes: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
        """``finalize`` with torch int64 ops (wrapping products, logical shifts): any device."""
        raise NotImplementedError

    def finalize_np(self, lanes: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
        """``finalize`` on CPU tensors through numpy's uint64 arithmetic."""
        raise NotImplementedError

    def finalize_host(self, lanes: Sequence[int], meta: tuple[int, int]) -> tuple[int, int]:
        """``finalize`` of one digest in plain Python (unsigned results); bit-identical by test."""
        raise NotImplementedError

    def route(self, device: torch.device) -> str:
        """The level function's route on ``device``, in words (benchmarks print it)."""
        raise NotImplementedError

    def root(self, b: torch.Tensor) -> torch.Tensor | None:
        """The root lanes (1, ``lanes``) of a contiguous 1-D int8 tensor in one step, where the
        version has such a route here (the same integers as level by level); else None."""
        return None

    def __repr__(self) -> str:
        return f"<digest {self.algorithm} version {self.version}>"


# ---------------------------------------------------------------------------------------------
# splitmix64: key schedules and finalizers.


def splitmix64(state: int) -> tuple[int, int]:
    """One splitmix64 step: returns (new state, output)."""
    state = (state + GAMMA) & MASK64
    return state, mix_int(state)


def mix_int(z: int) -> int:
    """splitmix64's finalizer (a bijection of 64-bit words) on a Python int."""
    z = ((z ^ (z >> 30)) * _MIX1) & MASK64
    z = ((z ^ (z >> 27)) * _MIX2) & MASK64
    return z ^ (z >> 31)


def s64(v: int) -> int:
    """The signed 64-bit integer with the bits of ``v`` (mod 2^64)."""
    v &= MASK64
    return v - (1 << 64) if v >= 1 << 63 else v


_MIX1_S = s64(_MIX1)
_MIX2_S = s64(_MIX2)


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> is arithmetic)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def mix_t(z: torch.Tensor) -> torch.Tensor:
    """``mix_int`` elementwise on int64 tensors (wrapping products, logical shifts)."""
    z = (z ^ _shr(z, 30)) * _MIX1_S
    z = (z ^ _shr(z, 27)) * _MIX2_S
    return z ^ _shr(z, 31)


def mix_np(z, np):
    """``mix_int`` elementwise on a numpy uint64 array (``np``: the numpy module)."""
    u64 = np.uint64
    z = z ^ (z >> u64(30))
    z *= u64(_MIX1)
    z ^= z >> u64(27)
    z *= u64(_MIX2)
    z ^= z >> u64(31)
    return z


_NUMPY: list = []


def numpy_or_none():
    """numpy, if importable (an optional speed-up of the CPU finalizers), else None."""
    if not _NUMPY:
        try:
            import numpy

            numpy.zeros(1, dtype=numpy.uint64)
        except Exception:
            numpy = None
        _NUMPY.append(numpy)
    return _NUMPY[0]


def numpy_failed() -> None:
    """A torch build without a working numpy bridge: the finalizers use torch ops from now on."""
    _NUMPY[:] = [None]


# ---------------------------------------------------------------------------------------------
# Metadata words and subclass combination (host side).

_META_CACHE: dict[tuple[int, torch.dtype, tuple[int, ...]], tuple[int, int]] = {}


def meta_words(sch: Scheme, dtype: torch.dtype, shape: Sequence[int]) -> tuple[int, int]:
    """The two signed 64-bit meta words of (dtype, shape) under ``sch`` (docs/digest.md, "Meta")."""
    key = (sch.version, dtype, tuple(shape))
    m = _META_CACHE.get(key)
    if m is None:
        numel = math.prod(key[2])
        nbytes = numel * dtype.itemsize
        text = "\x1f".join(
            (sch.algorithm, str(sch.version), str(dtype), str(nbytes), str(numel), ",".join(map(str, key[2])))
        )
        d = hashlib.blake2b(text.encode(), digest_size=16).digest()
        m = (s64(int.from_bytes(d[:8], "little")), s64(int.from_bytes(d[8:], "little")))
        if len(_META_CACHE) < 65536:
            _META_CACHE[key] = m
    return m


def combine(
    sch: Scheme, type_name: str, dtype: str, shape: Sequence[int], components: Sequence[tuple[str, str]]
) -> str:
    """Digest of a flattened subclass from its components' (name, digest) pairs (host side)."""
    parts = [sch.algorithm, str(sch.version), "subclass", type_name, dtype, ",".join(map(str, shape))]
    parts += [f"{name}={digest}" for name, digest in components]
    return hashlib.blake2b("\x1f".join(parts).encode(), digest_size=16).hexdigest()


# ---------------------------------------------------------------------------------------------
# The tree.


def tree(x: torch.Tensor, level: int, sch: Scheme) -> torch.Tensor:
    """Run levels ``level``.. on a batch of byte rows (n, L) int8 -> (n, ``sch.lanes``) int32."""
    n, length = x.shape
    lanes = sch.lanes
    while True:
        m = max(1, -(-length // K))
        if m == 1:
            return sch.mm_short(x, level)
        if length != m * K:
            x = torch.nn.functional.pad(x, (0, m * K - length))
        y = sch.mm(x.reshape(n * m, K), level)
        x = y.view(n, m * lanes).view(torch.int8)
        length = m * lanes * 4
        level += 1


def bytes_view(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's logical contents as a 1-D int8 view (no copy)."""
    return t.reshape(-1).view(torch.int8)


def chunks(t: torch.Tensor, limit: int) -> Iterator[torch.Tensor]:
    """Contiguous 1-D int8 pieces of ``t``'s logical bytes, in order; every piece but the last
    is a whole number of 1024-byte rows. A non-contiguous tensor is copied piecewise along
    dim 0 so the scratch stays near ``limit`` bytes."""
    nbytes = t.numel() * t.element_size()
    if t.is_contiguous() or nbytes == 0:
        yield bytes_view(t.contiguous())
        return
    rowbytes = nbytes // t.shape[0]
    q = K // math.gcd(rowbytes, K)  # dim-0 rows per whole number of 1024-byte rows
    if q * rowbytes > 4 * limit:
        yield bytes_view(t.contiguous())
        return
    step = max(q, (limit // rowbytes) // q * q)
    for i in range(0, t.shape[0], step):
        yield bytes_view(t[i : i + step].contiguous())


def lanes_of(t: torch.Tensor, sch: Scheme) -> torch.Tensor:
    """Final (1, ``sch.lanes``) int32 lanes of a strided tensor (the definition, chunked)."""
    nbytes = t.numel() * t.element_size()
    if t.is_contiguous():
        root = sch.root(bytes_view(t))
        if root is not None:
            return root
    limit = max(SCRATCH, nbytes // 8)
    parts = []
    for b in chunks(t, limit):
        full = b.numel() // K
        if full:
            parts.append(sch.mm(b[: full * K].view(full, K), 0))
        tail = b.numel() - full * K
        if tail or not parts:
            parts.append(sch.mm_short(b[full * K :].view(1, tail), 0))
    lanes = parts[0] if len(parts) == 1 else torch.cat(parts)
    if lanes.shape[0] == 1:
        return lanes
    return tree(lanes.view(1, -1).view(torch.int8), 1, sch)


def rows_lanes(t: torch.Tensor, n: int, rowbytes: int, sch: Scheme) -> torch.Tensor:
    """(n, ``sch.lanes``) lanes of the n consecutive byte rows of length ``rowbytes`` of contiguous ``t``."""
    if n == 0:
        return torch.zeros(0, sch.lanes, dtype=torch.int32, device=t.device)
    b = bytes_view(t)[: n * rowbytes].view(n, rowbytes)
    padded = max(1, -(-rowbytes // K)) * K
    group = max(1, max(SCRATCH, n * rowbytes // 8) // padded)
    if group >= n:
        return tree(b, 0, sch)
    return torch.cat([tree(b[i : i + group], 0, sch) for i in range(0, n, group)])
