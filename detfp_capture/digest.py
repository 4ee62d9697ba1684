"""The detfp tensor digest, "detfp-tlh128" (tree linear hash, 128 bits); spec in docs/digest.md.

Pipeline for one tensor (all on the tensor's own device, no host sync until ``resolve``):

1. the logical contents, row-major, viewed as signed bytes (int8);
2. levels: zero-pad to a multiple of 1024 bytes, multiply the (M, 1024) byte matrix by a fixed
   per-level int8 matrix (1024 x 16) with exact int32 accumulation (``torch._int_mm``, or an exact
   float32 GEMM where that kernel is missing), take the int32 output's bytes as the next level's
   input, until one row of 16 lanes is left;
3. finalize the 16 lanes with a 128-bit meta word (algorithm, version, dtype, byte length, numel,
   shape) through a multiply-xorshift mixer, vectorized over a whole batch.

Capture calls ``start`` on every tensor of every op, so small tensors (<= 1024 bytes, one level)
are copied into a per-device arena by a single copy and hashed together by one GEMM at
``resolve``; ``resolve`` finalizes everything batched and makes one device-to-host copy per device.
Integer arithmetic makes the result identical on every device.
"""

from __future__ import annotations

import hashlib
import math
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

from detfp_capture.contract import DIGEST_ALGORITHM, DIGEST_VERSION
from detfp_capture.errors import CaptureError

__all__ = ["DigestError", "Fingerprint", "Moments", "Pending", "fingerprint", "resolve", "start"]

#: Bytes per level-0 row and lanes per output row (docs/digest.md, "Levels").
K = 1024
LANES = 16
#: splitmix64 seed of the level weights: the ASCII bytes "detfptlh" read big-endian.
WEIGHT_SEED = 0x6465746670746C68
_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
#: Scratch bound for large tensors: chunks of at most this many bytes (or nbytes / 8 if larger).
_SCRATCH = 64 << 20
#: Rows per small-tensor arena (4 MiB of int8).
_ARENA_ROWS = 4096
#: 1-byte dtypes whose kernels are sparse on some devices: moved as raw bytes.
_BYTE_DTYPES = frozenset(
    getattr(torch, n)
    for n in (
        "float8_e4m3fn",
        "float8_e4m3fnuz",
        "float8_e5m2",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
        "float4_e2m1fn_x2",
    )
    if hasattr(torch, n)
)
_COMPLEX = frozenset((torch.complex32, torch.complex64, torch.complex128))


class DigestError(CaptureError):
    """A digest was asked for with a bad argument, or an errored fingerprint's value was read."""


@dataclass(frozen=True)
class Moments:
    """Cheap magnitude statistics, computed on device in float64 (informative, not bitwise identity)."""

    #: float64 sum of the values (real part for complex; 0/1 for bool).
    sum: float
    #: float64 max |value| (modulus for complex); NaN when any value is NaN; 0.0 for empty tensors.
    absmax: float
    #: Number of NaN elements (0 for integer/bool dtypes).
    nan: int
    #: Number of +-Inf elements (0 for integer/bool dtypes).
    inf: int


_NO_COMPONENTS: Mapping[str, Fingerprint] = MappingProxyType({})


@dataclass(frozen=True, eq=False)
class Fingerprint:
    """dtype, shape, numel and the 128-bit content digest of one tensor.

    Equality compares dtype, shape, numel, digest and components (rows and moments are derived
    views of the same contents and are not part of identity). A fingerprint with ``error`` set
    is never equal to anything, itself included.
    """

    #: torch dtype as str(), e.g. "torch.bfloat16".
    dtype: str
    #: Logical shape.
    shape: tuple[int, ...]
    #: Number of elements.
    numel: int
    #: 32 lowercase hex characters (hi 64 bits then lo 64 bits); "" when error is set.
    digest: str
    #: Ordered row (dim 0) or chunk digests when asked for, else None.
    rows: tuple[str, ...] | None = None
    #: Inner tensor name -> Fingerprint for flattened tensor subclasses; empty otherwise.
    components: Mapping[str, Fingerprint] = field(default_factory=lambda: _NO_COMPONENTS)
    #: Magnitude moments when asked for (None for subclasses: see components).
    moments: Moments | None = None
    #: Why the tensor could not be digested; None when the digest is valid.
    error: str | None = None
    #: For int64 tensors started with pointer_check=True: every value looks like a device pointer.
    pointer_like: bool = False

    @property
    def hi(self) -> int:
        """High 64 bits of the digest as an unsigned int."""
        return int(self._valid_digest()[:16], 16)

    @property
    def lo(self) -> int:
        """Low 64 bits of the digest as an unsigned int."""
        return int(self._valid_digest()[16:], 16)

    def _valid_digest(self) -> str:
        if self.error is not None:
            raise DigestError(f"fingerprint of a {self.dtype} tensor has no digest: {self.error}")
        return self.digest

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Fingerprint):
            return NotImplemented
        if self.error is not None or other.error is not None:
            return False
        return (
            self.digest == other.digest
            and self.dtype == other.dtype
            and self.shape == other.shape
            and self.numel == other.numel
            and dict(self.components) == dict(other.components)
        )

    def __hash__(self) -> int:
        if self.error is not None:
            return id(self)
        return hash((self.dtype, self.shape, self.digest))


# ---------------------------------------------------------------------------------------------
# Level weights: splitmix64 stream seeded per level, mapped to nonzero int8 in [-127, 127].


def _splitmix64(state: int) -> tuple[int, int]:
    """One splitmix64 step: returns (new state, output)."""
    state = (state + _GAMMA) & _MASK64
    z = state
    z = ((z ^ (z >> 30)) * _MIX1) & _MASK64
    z = ((z ^ (z >> 27)) * _MIX2) & _MASK64
    return state, z ^ (z >> 31)


def level_weights(level: int) -> list[int]:
    """The 1024 x 16 weights of ``level``, row-major, as Python ints (docs/digest.md, "Weights")."""
    state = (WEIGHT_SEED + level) & _MASK64
    out = []
    for _ in range(K * LANES):
        state, z = _splitmix64(state)
        v = z % 254
        out.append(v - 127 if v < 127 else v - 126)
    return out


_CPU_WEIGHTS: dict[int, torch.Tensor] = {}
_DEV_WEIGHTS: dict[tuple[torch.device, int, bool], torch.Tensor] = {}
#: device type -> True when torch._int_mm works there, False for the float32 fallback.
_INT_MM: dict[str, bool] = {}
_STATE_LOCK = threading.Lock()


def _weights(device: torch.device, level: int, as_float: bool) -> torch.Tensor:
    key = (device, level, as_float)
    w = _DEV_WEIGHTS.get(key)
    if w is None:
        with _STATE_LOCK:
            base = _CPU_WEIGHTS.get(level)
            if base is None:
                base = torch.tensor(level_weights(level), dtype=torch.int8).view(K, LANES)
                _CPU_WEIGHTS[level] = base
            w = base.to(torch.float32) if as_float else base
            with torch.inference_mode(False):
                w = w.to(device).clone() if device.type != "cpu" else w.clone()
            _DEV_WEIGHTS[key] = w
    return w


def _use_int_mm(device: torch.device) -> bool:
    ok = _INT_MM.get(device.type)
    if ok is None:
        try:
            a = torch.zeros(32, K, dtype=torch.int8, device=device)
            ok = torch._int_mm(a, _weights(device, 0, False)).dtype == torch.int32
        except Exception:
            ok = False
        _INT_MM[device.type] = ok
    return ok


def _mm(x: torch.Tensor, level: int) -> torch.Tensor:
    """(M, 1024) int8 @ W_level -> (M, 16) int32, exactly."""
    dev = x.device
    if _use_int_mm(dev):
        w = _weights(dev, level, False)
        m = x.shape[0]
        if dev.type == "cpu":
            return torch._int_mm(x, w)
        # CUDA's kernel wants M > 16 and a multiple of 8: zero rows contribute zero outputs.
        mp = max(32, -(-m // 8) * 8)
        if mp != m:
            x = torch.cat([x, x.new_zeros(mp - m, K)])
            return torch._int_mm(x, w)[:m]
        return torch._int_mm(x, w)
    # Exact: every product and partial sum is an integer of magnitude < 1024*128*127 < 2**24.
    return (x.to(torch.float32) @ _weights(dev, level, True)).to(torch.int32)


def _tree(x: torch.Tensor, level: int) -> torch.Tensor:
    """Run levels ``level``.. on a batch of byte rows (n, L) int8 -> (n, 16) int32 lanes."""
    n, length = x.shape
    while True:
        m = max(1, -(-length // K))
        if length != m * K:
            x = torch.nn.functional.pad(x, (0, m * K - length))
        y = _mm(x.reshape(n * m, K), level)
        if m == 1:
            return y
        x = y.view(n, m * LANES).view(torch.int8)
        length = m * LANES * 4
        level += 1


def _bytes_view(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's logical contents as a 1-D int8 view (no copy)."""
    return t.reshape(-1).view(torch.int8)


def _chunks(t: torch.Tensor, limit: int):
    """Contiguous 1-D int8 pieces of ``t``'s logical bytes, in order; every piece but the last
    is a whole number of 1024-byte rows. A non-contiguous tensor is copied piecewise along
    dim 0 so the scratch stays near ``limit`` bytes."""
    nbytes = t.numel() * t.element_size()
    if t.is_contiguous():
        yield _bytes_view(t)
        return
    rowbytes = nbytes // t.shape[0]
    q = K // math.gcd(rowbytes, K)  # dim-0 rows per whole number of 1024-byte rows
    if q * rowbytes > 4 * limit or t.dim() == 1:
        yield _bytes_view(t.contiguous())
        return
    step = max(q, (limit // rowbytes) // q * q)
    for i in range(0, t.shape[0], step):
        yield _bytes_view(t[i : i + step].contiguous())


def _lanes_of(t: torch.Tensor) -> torch.Tensor:
    """Final (1, 16) int32 lanes of a strided tensor (the reference definition, chunked)."""
    nbytes = t.numel() * t.element_size()
    limit = max(_SCRATCH, nbytes // 8)
    parts = []
    for b in _chunks(t, limit):
        full = b.numel() // K
        if full:
            parts.append(_mm(b[: full * K].view(full, K), 0))
        tail = b.numel() - full * K
        if tail or not parts:
            pad = b.new_zeros(1, K)
            if tail:
                pad[0, :tail].copy_(b[full * K :])
            parts.append(_mm(pad, 0))
    lanes = parts[0] if len(parts) == 1 else torch.cat(parts)
    if lanes.shape[0] == 1:
        return lanes
    return _tree(lanes.view(1, -1).view(torch.int8), 1)


def _rows_lanes(t: torch.Tensor, n: int, rowbytes: int) -> torch.Tensor:
    """(n, 16) lanes of the n consecutive byte rows of length ``rowbytes`` of contiguous ``t``."""
    if n == 0:
        return torch.zeros(0, LANES, dtype=torch.int32, device=t.device)
    b = _bytes_view(t)[: n * rowbytes].view(n, rowbytes)
    padded = max(1, -(-rowbytes // K)) * K
    group = max(1, max(_SCRATCH, n * rowbytes // 8) // padded)
    if group >= n:
        return _tree(b, 0)
    return torch.cat([_tree(b[i : i + group], 0) for i in range(0, n, group)])


# ---------------------------------------------------------------------------------------------
# Finalization: 16 int32 lanes + meta -> 128 bits, vectorized with int64 tensor ops.


def _s64(v: int) -> int:
    v &= _MASK64
    return v - (1 << 64) if v >= 1 << 63 else v


_MIX1_S = _s64(_MIX1)
_MIX2_S = _s64(_MIX2)


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> is arithmetic)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    z = (z ^ _shr(z, 30)) * _MIX1_S
    z = (z ^ _shr(z, 27)) * _MIX2_S
    return z ^ _shr(z, 31)


def _finalize(lanes: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
    """lanes (B, 16) int32, meta (B, 2) int64 -> (B, 2) int64 digests (hi, lo)."""
    u = lanes.to(torch.int64) & 0xFFFFFFFF
    words = u[:, 0::2] | (u[:, 1::2] << 32)  # (B, 8): lane 2i low, lane 2i+1 high
    s = meta
    for i in range(LANES // 2):
        s = _mix(s ^ words[:, i : i + 1])
    a, b = s[:, 0], s[:, 1]
    hi = _mix(a + b)
    lo = _mix(b ^ hi)
    return torch.stack([hi, lo], dim=1)


_META_CACHE: dict[tuple[torch.dtype, tuple[int, ...]], tuple[int, int]] = {}


def meta_words(dtype: torch.dtype, shape: Sequence[int]) -> tuple[int, int]:
    """The two signed 64-bit meta words of (dtype, shape) (docs/digest.md, "Meta")."""
    key = (dtype, tuple(shape))
    m = _META_CACHE.get(key)
    if m is None:
        numel = math.prod(key[1])
        nbytes = numel * dtype.itemsize
        text = "\x1f".join(
            (DIGEST_ALGORITHM, str(DIGEST_VERSION), str(dtype), str(nbytes), str(numel), ",".join(map(str, key[1])))
        )
        d = hashlib.blake2b(text.encode(), digest_size=16).digest()
        m = (_s64(int.from_bytes(d[:8], "little")), _s64(int.from_bytes(d[8:], "little")))
        if len(_META_CACHE) < 65536:
            _META_CACHE[key] = m
    return m


def combine(type_name: str, dtype: str, shape: Sequence[int], components: Sequence[tuple[str, str]]) -> str:
    """Digest of a flattened subclass from its components' (name, digest) pairs (host side)."""
    parts = [DIGEST_ALGORITHM, str(DIGEST_VERSION), "subclass", type_name, dtype, ",".join(map(str, shape))]
    parts += [f"{name}={digest}" for name, digest in components]
    return hashlib.blake2b("\x1f".join(parts).encode(), digest_size=16).hexdigest()


# ---------------------------------------------------------------------------------------------
# Moments and the pointer check (device side).

_FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def _moments_of(t: torch.Tensor) -> torch.Tensor:
    """(4,) float64 [sum, absmax, nan, inf] of a strided tensor, chunked to bound scratch."""
    dev = t.device
    acc = torch.zeros(4, dtype=torch.float64, device=dev)
    if t.numel() == 0:
        return acc
    per = max(1, _SCRATCH // 32)  # elements: a float64 copy plus temporaries stay near _SCRATCH
    if t.is_contiguous() or t.dim() == 1:
        flat = t.reshape(-1)
        pieces = [flat[i : i + per] for i in range(0, flat.numel(), per)]
    else:
        step = max(1, per // max(1, t.numel() // t.shape[0]))
        pieces = [t[i : i + step].reshape(-1) for i in range(0, t.shape[0], step)]
    parts = []
    for p in pieces:
        if p.dtype == getattr(torch, "float4_e2m1fn_x2", None):
            lut = torch.tensor(_FP4_VALUES, dtype=torch.float64, device=dev)
            u = p.view(torch.uint8).to(torch.int64)
            re = torch.cat([lut[u & 15], lut[u >> 4]])
            mag = re.abs()
        elif p.dtype in _COMPLEX:
            r = torch.view_as_real(p).to(torch.float64)
            re = r[:, 0]
            mag = r.square().sum(1).sqrt()
        else:
            re = p.to(torch.float64)
            mag = re.abs()
        if p.dtype.is_floating_point or p.dtype in _COMPLEX:
            nan = torch.isnan(mag).sum()
            inf = torch.isinf(mag).sum()
            amax = mag.max()  # max propagates NaN
        else:
            nan = inf = torch.zeros((), dtype=torch.int64, device=dev)
            amax = mag.max()
        parts.append(torch.stack([re.sum(), amax, nan.to(torch.float64), inf.to(torch.float64)]))
    if len(parts) == 1:
        return parts[0]
    s = torch.stack(parts)
    return torch.stack([s[:, 0].sum(), s[:, 1].max(), s[:, 2].sum(), s[:, 3].sum()])


def _pointer_like(t: torch.Tensor) -> torch.Tensor:
    """0-dim bool: int64, numel >= 1, every value in [2**32, 2**48) and a multiple of 16."""
    if t.dtype != torch.int64 or t.numel() == 0:
        return torch.zeros((), dtype=torch.bool, device=t.device)
    ok = (t >= (1 << 32)) & (t < (1 << 48)) & ((t & 15) == 0)
    return ok.all()


# ---------------------------------------------------------------------------------------------
# Small-tensor arena: one copy per tensor at start, one GEMM per arena at resolve.


class _Arena:
    """A (rows, 1024) int8 zero buffer; each small tensor's bytes go into one row."""

    def __init__(self, device: torch.device) -> None:
        # A normal (non-inference) tensor, so in-place copies work in and out of inference mode.
        with torch.inference_mode(False):
            self.buf = torch.zeros(_ARENA_ROWS, K, dtype=torch.int8, device=device)
        self.flat = self.buf.view(-1)
        self.used = 0
        self.lanes: torch.Tensor | None = None

    def seal(self) -> torch.Tensor:
        if self.lanes is None:
            self.lanes = _mm(self.buf[: max(1, self.used)], 0)
        return self.lanes


_ARENAS: dict[torch.device, _Arena] = {}
_ARENA_LOCK = threading.Lock()


class Pending:
    """Device-side state of one started digest; turn a batch into Fingerprints with ``resolve``.

    Holds device tensors only (lanes, row lanes, moments, pointer flag) or an error; creating
    one never synchronizes with the device.
    """

    # Class-level defaults keep ``start`` cheap: an instance sets only what it has.
    lanes: torch.Tensor | None = None  # (1, 16) int32 final-level lanes
    arena: _Arena | None = None  # small tensors: their arena and row instead of lanes
    row: int = 0
    rows_lanes: torch.Tensor | None = None  # (R, 16) int32 lanes of row/chunk digests
    rows_meta: tuple[tuple[int, tuple[int, ...]], ...] = ()  # (count, shape) segments of rows_lanes
    moments: torch.Tensor | None = None  # (4,) float64
    pointer: torch.Tensor | None = None  # 0-dim bool
    components: dict[str, Pending] | None = None  # flattened subclasses
    type_name: str = ""
    error: str | None = None

    def __init__(self, dtype: torch.dtype | None, shape: tuple[int, ...], numel: int, device: Any = None) -> None:
        self.dtype = dtype
        self.shape = shape
        self.numel = numel
        self.device = device

    def __repr__(self) -> str:
        state = f"error={self.error!r}" if self.error else "pending"
        return f"Pending({self.dtype}, {tuple(self.shape)}, {state})"


def _error(t: Any, msg: str) -> Pending:
    dtype = getattr(t, "dtype", None)
    try:
        shape = tuple(int(s) for s in t.shape)
        numel = math.prod(shape)
    except Exception:
        shape, numel = (), 0
    p = Pending(dtype if isinstance(dtype, torch.dtype) else None, shape, numel)
    p.error = msg
    return p


def _check_rows(rows: Any) -> None:
    if rows is True or rows is False:
        return
    if isinstance(rows, int) and rows >= 1:
        return
    raise DigestError(f"rows={rows!r} is not valid: pass True (rows along dim 0), False, or a chunk size >= 1")


def start(t: torch.Tensor, *, rows: bool | int = False, moments: bool = False, pointer_check: bool = False) -> Pending:
    """Start digesting ``t`` on its device; never synchronizes, never raises for a bad tensor.

    ``rows=True``: also digest each ``t[i]``; ``rows=N``: each N-element chunk of the flattened
    tensor. ``moments``: float64 sum/absmax and NaN/Inf counts. ``pointer_check``: for int64
    tensors, flag tables of device pointers (Fingerprint.pointer_like).
    """
    if rows is not False:
        _check_rows(rows)
    prev = torch.is_grad_enabled()
    torch._C._set_grad_enabled(False)
    try:
        return _start(t, rows, moments, pointer_check)
    except Exception as e:  # a tensor we cannot digest must never break training
        return _error(t, f"{type(e).__name__}: {e}".splitlines()[0][:300])
    finally:
        torch._C._set_grad_enabled(prev)


def _start(t: Any, rows: bool | int, moments: bool, pointer_check: bool) -> Pending:
    tp = type(t)
    if tp is not torch.Tensor and tp is not torch.nn.Parameter:
        if not isinstance(t, torch.Tensor):
            return _error(t, f"not a tensor: {tp.__name__}")
        if hasattr(tp, "__tensor_flatten__"):
            return _start_subclass(t, rows, moments)
        with torch._C.DisableTorchFunctionSubclass():
            return _start_plain(t, rows, moments, pointer_check)
    return _start_plain(t, rows, moments, pointer_check)


def _start_subclass(t: torch.Tensor, rows: bool | int, moments: bool) -> Pending:
    tp = type(t)
    p = Pending(t.dtype, tuple(t.shape), t.numel(), t.device)
    p.type_name = f"{tp.__module__}.{tp.__qualname__}"
    names, _ctx = t.__tensor_flatten__()
    p.components = {name: _start(getattr(t, name), rows, moments, False) for name in names}
    return p


def _start_plain(t: torch.Tensor, rows: bool | int, moments: bool, pointer_check: bool) -> Pending:
    if t.layout is not torch.strided or t.is_nested:
        return _error(t, f"layout {t.layout} is not digestible (only strided tensors are)")
    dev = t.device
    if dev.type == "meta":
        return _error(t, "meta tensor has no data")
    dtype = t.dtype
    shape = t.shape
    numel = t.numel()
    nbytes = numel * dtype.itemsize
    p = Pending(dtype, shape, numel, dev)
    x = t.view(torch.int8) if dtype in _BYTE_DTYPES else t
    if nbytes <= K and rows is False:
        # Small: one copy into a shared zeroed row; resolve hashes the whole arena at once.
        with _ARENA_LOCK:
            a = _ARENAS.get(dev)
            if a is None or a.lanes is not None or a.used == _ARENA_ROWS:
                a = _ARENAS[dev] = _Arena(dev)
            off = a.used * K
            if nbytes:
                a.flat[off : off + nbytes].view(x.dtype).view(shape).copy_(x)
            p.arena = a
            p.row = a.used
            a.used += 1
    else:
        p.lanes = _lanes_of(x)
        if rows is not False:
            _start_rows(p, x, rows)
    if moments:
        p.moments = _moments_of(t)
    if pointer_check and dtype is torch.int64:
        p.pointer = _pointer_like(t)
    return p


def _start_rows(p: Pending, x: torch.Tensor, rows: bool | int) -> None:
    item = x.element_size()
    if rows is True:
        if x.dim() == 0:
            return  # rows stay None: a 0-dim tensor has no dim 0
        n = x.shape[0]
        p.rows_meta = ((n, tuple(x.shape[1:])),)
        rowbytes = (x.numel() // n) * item if n else 0
        if x.is_contiguous() or n == 0:
            p.rows_lanes = _rows_lanes(x, n, rowbytes)
        else:  # bounded scratch: contiguous copies of groups of dim-0 rows
            group = max(1, max(_SCRATCH, n * rowbytes // 8) // max(1, rowbytes))
            p.rows_lanes = torch.cat(
                [_rows_lanes(x[i : i + group].contiguous(), min(group, n - i), rowbytes) for i in range(0, n, group)]
            )
        return
    flat = x.reshape(-1)
    nfull, rem = divmod(flat.numel(), rows)
    parts = []
    segs = []
    if nfull:
        parts.append(_rows_lanes(flat, nfull, rows * item))
        segs.append((nfull, (rows,)))
    if rem:
        parts.append(_lanes_of(flat[nfull * rows :]))
        segs.append((1, (rem,)))
    p.rows_meta = tuple(segs)
    p.rows_lanes = torch.cat(parts) if len(parts) > 1 else (parts[0] if parts else None)
    if not parts:
        p.rows_lanes = torch.zeros(0, LANES, dtype=torch.int32, device=x.device)


# ---------------------------------------------------------------------------------------------
# resolve: batched finalization, one device-to-host copy per device.


class _Batch:
    def __init__(self) -> None:
        self.direct: list[torch.Tensor] = []
        self.direct_meta: list[tuple[int, int]] = []
        self.ndirect = 0
        self.arenas: dict[_Arena, tuple[list[int], list[tuple[int, int]]]] = {}
        self.slots: dict[int, tuple[Any, int]] = {}  # id(pending) -> (group, index)
        self.row_slots: dict[int, int] = {}  # id(pending) -> first direct index of its rows
        self.moments: list[torch.Tensor] = []
        self.mom_slots: dict[int, int] = {}
        self.pointers: list[torch.Tensor] = []
        self.ptr_slots: dict[int, int] = {}

    def add(self, p: Pending) -> None:
        key = id(p)
        if key in self.slots:
            return
        meta = meta_words(p.dtype, p.shape)
        if p.arena is not None:
            rows, metas = self.arenas.setdefault(p.arena, ([], []))
            self.slots[key] = (p.arena, len(rows))
            rows.append(p.row)
            metas.append(meta)
        else:
            self.slots[key] = (None, self.ndirect)
            self._direct(p.lanes, [meta])
        if p.rows_lanes is not None:
            self.row_slots[key] = self.ndirect
            metas = []
            for count, shape in p.rows_meta:
                metas += [meta_words(p.dtype, shape)] * count
            self._direct(p.rows_lanes, metas)
        if p.moments is not None:
            self.mom_slots[key] = len(self.moments)
            self.moments.append(p.moments)
        if p.pointer is not None:
            self.ptr_slots[key] = len(self.pointers)
            self.pointers.append(p.pointer)

    def _direct(self, lanes: torch.Tensor, metas: list[tuple[int, int]]) -> None:
        self.direct.append(lanes)
        self.direct_meta += metas
        self.ndirect += len(metas)

    def run(self, device: torch.device) -> tuple[list[int], dict[_Arena, int], list[float], list[int]]:
        """Finalize on device, fetch once; returns (digest words, arena offsets, moments, pointers)."""
        parts = list(self.direct)
        metas = list(self.direct_meta)
        offsets: dict[_Arena, int] = {}
        at = self.ndirect
        for arena, (rows, ameta) in self.arenas.items():
            lanes = arena.seal()
            offsets[arena] = at
            if rows == list(range(len(rows))):
                parts.append(lanes[: len(rows)])
            else:
                parts.append(lanes[torch.tensor(rows, dtype=torch.int64, device=device)])
            metas += ameta
            at += len(rows)
        lanes_all = parts[0] if len(parts) == 1 else torch.cat(parts)
        meta = torch.tensor(metas, dtype=torch.int64).to(device)
        pack = [_finalize(lanes_all, meta).reshape(-1)]
        if self.moments:
            pack.append(torch.stack(self.moments).view(torch.int64).reshape(-1))
        if self.pointers:
            pack.append(torch.stack(self.pointers).to(torch.int64))
        host = (pack[0] if len(pack) == 1 else torch.cat(pack)).cpu()  # the one device->host copy
        nd = 2 * at
        nm = 4 * len(self.moments)
        words = host[:nd].tolist()
        moms = host[nd : nd + nm].view(torch.float64).tolist() if nm else []
        ptrs = host[nd + nm :].tolist() if self.pointers else []
        return words, offsets, moms, ptrs


def _leaves(p: Pending, out: list[Pending]) -> None:
    if p.error is not None:
        return
    if p.components is not None:
        for c in p.components.values():
            _leaves(c, out)
    else:
        out.append(p)


def _hex(hi: int, lo: int) -> str:
    return f"{hi & _MASK64:016x}{lo & _MASK64:016x}"


def resolve(pendings: Sequence[Pending]) -> list[Fingerprint]:
    """Fingerprints of started digests, in order: one batched finalize and one fetch per device."""
    leaves: list[Pending] = []
    for p in pendings:
        _leaves(p, leaves)
    batches: dict[Any, _Batch] = {}
    for p in leaves:
        b = batches.get(p.device)
        if b is None:
            b = batches[p.device] = _Batch()
        b.add(p)
    results: dict[Any, Any] = {}
    failed: dict[Any, str] = {}
    prev = torch.is_grad_enabled()
    torch._C._set_grad_enabled(False)
    try:
        for dev, b in batches.items():
            try:
                results[dev] = b.run(dev)
            except Exception as e:  # e.g. a device error surfacing late: mark that device's digests
                failed[dev] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
    finally:
        torch._C._set_grad_enabled(prev)
    return [_build(p, batches, results, failed) for p in pendings]


def _build(p: Pending, batches: dict, results: dict, failed: dict) -> Fingerprint:
    dtype = str(p.dtype) if p.dtype is not None else ""
    shape = tuple(int(s) for s in p.shape)
    if p.error is not None:
        return Fingerprint(dtype, shape, p.numel, "", error=p.error)
    if p.components is not None:
        comps = {n: _build(c, batches, results, failed) for n, c in p.components.items()}
        view = MappingProxyType(comps)
        for n, f in comps.items():
            if f.error is not None:
                return Fingerprint(dtype, shape, p.numel, "", components=view, error=f"component {n!r}: {f.error}")
        digest = combine(p.type_name, dtype, shape, [(n, f.digest) for n, f in comps.items()])
        return Fingerprint(dtype, shape, p.numel, digest, components=view)
    if p.device in failed:
        return Fingerprint(dtype, shape, p.numel, "", error=failed[p.device])
    b = batches[p.device]
    words, offsets, moms, ptrs = results[p.device]
    key = id(p)
    group, i = b.slots[key]
    if group is not None:
        i += offsets[group]
    digest = _hex(words[2 * i], words[2 * i + 1])
    rows = None
    if key in b.row_slots:
        r0 = b.row_slots[key]
        n = sum(c for c, _ in p.rows_meta)
        rows = tuple(_hex(words[2 * j], words[2 * j + 1]) for j in range(r0, r0 + n))
    m = None
    if key in b.mom_slots:
        j = 4 * b.mom_slots[key]
        m = Moments(moms[j], moms[j + 1], int(moms[j + 2]), int(moms[j + 3]))
    ptr = bool(ptrs[b.ptr_slots[key]]) if key in b.ptr_slots else False
    return Fingerprint(dtype, shape, p.numel, digest, rows, _NO_COMPONENTS, m, None, ptr)


def fingerprint(
    t: torch.Tensor, rows: bool | int = False, moments: bool = False, *, pointer_check: bool = False
) -> Fingerprint:
    """Fingerprint of ``t`` now (one device synchronization); see ``start`` for the options."""
    if not isinstance(t, torch.Tensor):
        raise DigestError(f"fingerprint() needs a torch.Tensor, got {type(t).__name__}")
    return resolve([start(t, rows=rows, moments=moments, pointer_check=pointer_check)])[0]
