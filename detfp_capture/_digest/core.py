"""Core of the detfp-tlh128 digest (docs/digest.md): weights, levels, finalizer, meta, moments.

Everything here is a pure function of its inputs: ``level_weights`` (the splitmix64 weight
stream), ``mm``/``tree``/``lanes_of`` (exact int8 x int8 -> int32 levels on the tensor's device,
``torch._int_mm`` or an exact float32 GEMM), ``finalize`` (vectorized 128-bit mixer on int64
tensors) and ``finalize_host`` (the same function in plain Python, used for small batches and as
a cross-check), ``meta_words``/``combine`` (host-side BLAKE2b of the metadata), and the
device-side moments and pointer check. ``detfp_capture.digest`` builds the public API on these.
"""

from __future__ import annotations

import hashlib
import math
import threading
from collections.abc import Sequence

import torch

from detfp_capture._digest import native
from detfp_capture.contract import DIGEST_ALGORITHM, DIGEST_VERSION

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
SCRATCH = 64 << 20
_COMPLEX = frozenset((torch.complex32, torch.complex64, torch.complex128))

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
_DEV_WEIGHTS: dict[tuple[torch.device, int, bool, bool], torch.Tensor] = {}
#: Batches of at least this many rows use column-major weights on CPU.
_COL_MAJOR_ROWS = 256
#: Device types whose _int_mm takes any M; elsewhere rows are zero-padded to a multiple of 8, >= 32.
ANY_M_DEVICES = frozenset({"cpu"})
#: Rows per block of the exact float32 GEMM on CPU: a block (1 MiB as float32) stays in cache and
#: is reused, where converting a whole batch at once wrote (and page-faulted) four times its bytes:
#: about 5x slower on a 32 MiB batch (AVX2-only EPYC, one thread).
_FLOAT_BLOCK_ROWS = 256
#: device type -> True when torch._int_mm works there (and, on CPU, beats the float32 GEMM),
#: False for the exact float32 GEMM.
_INT_MM: dict[str, bool] = {}
_STATE_LOCK = threading.Lock()


def weights(device: torch.device, level: int, as_float: bool, col_major: bool = False) -> torch.Tensor:
    """The level's weights on ``device`` (cached): int8, or float32 for the exact float GEMM.
    ``col_major``: stored column-major on CPU too (faster for long batches there, see ``mm``);
    CUDA's copy is always column-major."""
    key = (device, level, as_float, col_major)
    w = _DEV_WEIGHTS.get(key)
    if w is None:
        with _STATE_LOCK:
            base = _CPU_WEIGHTS.get(level)
            if base is None:
                base = torch.tensor(level_weights(level), dtype=torch.int8).view(K, LANES)
                _CPU_WEIGHTS[level] = base
            w = base.to(torch.float32) if as_float else base
            with torch.inference_mode(False):
                # cuBLASLt's int8 GEMM is several times faster with a column-major right operand.
                if device.type == "cpu":
                    w = w.t().contiguous().t() if col_major else w.clone()
                else:
                    w = w.to(device).t().contiguous().t()
            _DEV_WEIGHTS[key] = w
    return w


def use_int_mm(device: torch.device) -> bool:
    ok = _INT_MM.get(device.type)
    if ok is None:
        try:
            a = torch.zeros(32, K, dtype=torch.int8, device=device)
            ok = torch._int_mm(a, weights(device, 0, False)).dtype == torch.int32
        except Exception:
            ok = False
        if ok and device.type == "cpu":
            ok = _int_mm_is_faster(device)
        _INT_MM[device.type] = ok
    return ok


def _int_mm_is_faster(device: torch.device) -> bool:
    """Whether ``torch._int_mm`` beats the exact float32 GEMM here, timed once per process.

    Both give the same bits, so only speed decides. On CPUs without VNNI (an AVX2-only AMD EPYC)
    the int8 GEMM runs a generic kernel: 3-5x slower per digest than converting to float32 and
    using the float GEMM, while CPUs with VNNI run it several times faster than the float path.
    """
    wi, wf = weights(device, 0, False, True), weights(device, 0, True)
    best = _best_seconds(
        device, {True: lambda x: torch._int_mm(x, wi), False: lambda x: (x.to(torch.float32) @ wf).to(torch.int32)}
    )
    return best[True] <= best[False]


def _best_seconds(device: torch.device, fns: dict) -> dict:
    """Best of three timings of each ``fn(x)``, taking turns, on fixed rows: 512 x 1024 bytes
    (not from torch's RNG, which the training job owns)."""
    import time

    x = (torch.arange(512 * K, dtype=torch.int32, device=device) % 251 - 125).to(torch.int8).view(512, K)
    best = dict.fromkeys(fns, math.inf)
    for _ in range(3):
        for key, fn in fns.items():
            t0 = time.perf_counter()
            fn(x)
            best[key] = min(best[key], time.perf_counter() - t0)
    return best


#: True when the native kernel (``native.py``) is this process's level GEMM on CPU.
_NATIVE: dict[str, bool] = {}
_CPU = torch.device("cpu")


def use_native(device: torch.device) -> bool:
    """Whether the level GEMM runs in the native kernel: on CPU, when it is built and, timed once
    per process, faster than torch's route (the int8 GEMM where VNNI makes that fast, else the
    exact float32 GEMM). All three give the same bits, so only speed decides."""
    return device.type == "cpu" and _native_on_cpu()


def _native_on_cpu() -> bool:
    """``use_native`` on CPU: the decision read from ``_NATIVE`` (the hot path), made on first use."""
    ok = _NATIVE.get("cpu")
    if ok is None:
        ok = native.AVAILABLE
        if ok and not native.FORCED:
            pw = _native_pairs(0)
            best = _best_seconds(_CPU, {True: lambda x: native.mm(x, pw), False: lambda x: _torch_mm(x, 0, None)})
            ok = best[True] <= best[False]
        _NATIVE["cpu"] = ok
    return ok


def _native_pairs(level: int) -> torch.Tensor:
    pw = native.PAIRS.get(level)
    return pw if pw is not None else native.pair_weights(weights(_CPU, level, False), level)


def route(device: torch.device) -> str:
    """The level GEMM this process runs on ``device``, in words (benchmarks print it)."""
    if use_native(device):
        return f"native kernel ({native.KERNEL})"
    return "int8 GEMM (torch._int_mm)" if use_int_mm(device) else "exact float32 GEMM"


def mm(x: torch.Tensor, level: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """(M, 1024) int8 @ W_level -> (M, 16) int32, exactly (written into ``out`` if given)."""
    if x.is_cpu and _native_on_cpu():
        return native.mm(x, _native_pairs(level), out)
    return _torch_mm(x, level, out)


def _torch_mm(x: torch.Tensor, level: int, out: torch.Tensor | None) -> torch.Tensor:
    """``mm`` through torch: its int8 GEMM where ``use_int_mm``, else the exact float32 GEMM."""
    dev = x.device
    if use_int_mm(dev):
        m = x.shape[0]
        if dev.type in ANY_M_DEVICES:
            # Column-major weights: measured on CPU, about 6% faster from 256 rows on, slower below.
            w = weights(dev, level, False, m >= _COL_MAJOR_ROWS)
            return torch._int_mm(x, w) if out is None else torch._int_mm(x, w, out=out)
        w = weights(dev, level, False)
        # CUDA's kernel wants M > 16 and a multiple of 8: zero rows contribute zero outputs.
        mp = max(32, -(-m // 8) * 8)
        if mp != m:
            x = torch.cat([x, x.new_zeros(mp - m, K)])
            y = torch._int_mm(x, w)[:m]
        else:
            y = torch._int_mm(x, w) if out is None else torch._int_mm(x, w, out=out)
    else:
        # Exact: every product and partial sum is an integer of magnitude < 1024*128*127 < 2**24,
        # and the operands have <= 8 significant bits, so TF32/bf16 matmul modes are exact too.
        if dev.type != "cpu":
            y = (x.to(torch.float32) @ weights(dev, level, True)).to(torch.int32)
        else:
            return _float_mm(x, level, out)
    if out is not None and y is not out:
        out.copy_(y)
        return out
    return y


def _float_mm(x: torch.Tensor, level: int, out: torch.Tensor | None) -> torch.Tensor:
    """The exact float32 route of ``mm`` on CPU (see ``mm``). One reused float32 block per thread
    (no 1 MiB allocation per call), every block's GEMM written into one float32 result and
    converted to int32 once at the end (one conversion call per call, not one per block)."""
    w = weights(x.device, level, True)
    m = x.shape[0]
    buf = _float_block()
    acc = torch.empty(m, LANES, dtype=torch.float32)
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


def mm_short(x: torch.Tensor, level: int) -> torch.Tensor:
    """(n, L) int8 with L <= 1024, zero-padded to 1024 columns, @ W_level -> (n, 16) int32.

    Zero padding columns contribute nothing, so X_pad @ W == X @ W[:L]: on CPU that skips
    materializing the padding (a 16-byte row would otherwise cost a 1024-byte GEMM row).
    """
    if x.is_cpu and _native_on_cpu():
        return native.mm(x, _native_pairs(level))
    n, length = x.shape
    dev = x.device
    if dev.type in ANY_M_DEVICES and use_int_mm(dev):
        if length == 0:
            return torch.zeros(n, LANES, dtype=torch.int32, device=dev)
        return torch._int_mm(x.contiguous(), weights(dev, level, False)[:length])
    if length != K:
        x = torch.nn.functional.pad(x, (0, K - length))
    return mm(x, level)


def tree(x: torch.Tensor, level: int) -> torch.Tensor:
    """Run levels ``level``.. on a batch of byte rows (n, L) int8 -> (n, 16) int32 lanes."""
    n, length = x.shape
    while True:
        m = max(1, -(-length // K))
        if m == 1:
            return mm_short(x, level)
        if length != m * K:
            x = torch.nn.functional.pad(x, (0, m * K - length))
        y = mm(x.reshape(n * m, K), level)
        x = y.view(n, m * LANES).view(torch.int8)
        length = m * LANES * 4
        level += 1


def bytes_view(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's logical contents as a 1-D int8 view (no copy)."""
    return t.reshape(-1).view(torch.int8)


def chunks(t: torch.Tensor, limit: int):
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


def lanes_of(t: torch.Tensor) -> torch.Tensor:
    """Final (1, 16) int32 lanes of a strided tensor (the reference definition, chunked)."""
    nbytes = t.numel() * t.element_size()
    limit = max(SCRATCH, nbytes // 8)
    parts = []
    for b in chunks(t, limit):
        full = b.numel() // K
        if full:
            parts.append(mm(b[: full * K].view(full, K), 0))
        tail = b.numel() - full * K
        if tail or not parts:
            parts.append(mm_short(b[full * K :].view(1, tail), 0))
    lanes = parts[0] if len(parts) == 1 else torch.cat(parts)
    if lanes.shape[0] == 1:
        return lanes
    return tree(lanes.view(1, -1).view(torch.int8), 1)


def rows_lanes(t: torch.Tensor, n: int, rowbytes: int) -> torch.Tensor:
    """(n, 16) lanes of the n consecutive byte rows of length ``rowbytes`` of contiguous ``t``."""
    if n == 0:
        return torch.zeros(0, LANES, dtype=torch.int32, device=t.device)
    b = bytes_view(t)[: n * rowbytes].view(n, rowbytes)
    padded = max(1, -(-rowbytes // K)) * K
    group = max(1, max(SCRATCH, n * rowbytes // 8) // padded)
    if group >= n:
        return tree(b, 0)
    return torch.cat([tree(b[i : i + group], 0) for i in range(0, n, group)])


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


def finalize(lanes: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
    """lanes (B, 16) int32, meta (B, 2) int64 -> (B, 2) int64 digests (hi, lo)."""
    if lanes.device.type == "cpu" and meta.device.type == "cpu" and _np() is not None:
        try:
            return _finalize_np(lanes, meta)
        except (RuntimeError, TypeError):  # a torch build without a working numpy bridge
            _NUMPY[:] = [None]
    u = lanes.to(torch.int64) & 0xFFFFFFFF
    words = u[:, 0::2] | (u[:, 1::2] << 32)  # (B, 8): lane 2i low, lane 2i+1 high
    s = meta
    for i in range(LANES // 2):
        s = _mix(s ^ words[:, i : i + 1])
    a, b = s[:, 0], s[:, 1]
    hi = _mix(a + b)
    lo = _mix(b ^ hi)
    return torch.stack([hi, lo], dim=1)


_NUMPY: list = []


def _np():
    """numpy, if importable (an optional speed-up of the CPU finalizer), else None."""
    if not _NUMPY:
        try:
            import numpy

            numpy.zeros(1, dtype=numpy.uint64)
        except Exception:
            numpy = None
        _NUMPY.append(numpy)
    return _NUMPY[0]


def _finalize_np(lanes: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
    """``finalize`` on CPU through numpy's uint64 arithmetic (logical shifts, wrapping
    products): one numpy call per step of the mixer instead of two to four torch ops, each of
    which costs more in dispatch than the work on a few thousand digests. Same bits (tested)."""
    np = _np()
    u64 = np.uint64
    m1, m2 = u64(_MIX1), u64(_MIX2)
    s30, s27, s31, s32 = u64(30), u64(27), u64(31), u64(32)

    def mix(z):
        z = z ^ (z >> s30)
        z *= m1
        z ^= z >> s27
        z *= m2
        z ^= z >> s31
        return z

    u = lanes.detach().contiguous().numpy().view(np.uint32).astype(np.uint64)
    words = u[:, 0::2] | (u[:, 1::2] << s32)
    s = meta.detach().contiguous().numpy().view(np.uint64)
    with np.errstate(over="ignore"):  # the products wrap modulo 2**64 by design
        for i in range(LANES // 2):
            s = mix(s ^ words[:, i : i + 1])
        a, b = s[:, 0], s[:, 1]
        hi = mix(a + b)
        lo = mix(b ^ hi)
    return torch.from_numpy(np.stack([hi, lo], axis=1).view(np.int64))


def _mix_int(z: int) -> int:
    z = ((z ^ (z >> 30)) * _MIX1) & _MASK64
    z = ((z ^ (z >> 27)) * _MIX2) & _MASK64
    return z ^ (z >> 31)


def finalize_host(lanes: Sequence[int], meta: tuple[int, int]) -> tuple[int, int]:
    """``finalize`` for one digest in plain Python (unsigned results); bit-identical by test."""
    u = [v & 0xFFFFFFFF for v in lanes]
    a, b = meta[0] & _MASK64, meta[1] & _MASK64
    for i in range(LANES // 2):
        w = u[2 * i] | (u[2 * i + 1] << 32)
        a = _mix_int(a ^ w)
        b = _mix_int(b ^ w)
    hi = _mix_int((a + b) & _MASK64)
    return hi, _mix_int(b ^ hi)


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

_FP4 = getattr(torch, "float4_e2m1fn_x2", None)
_E8M0 = getattr(torch, "float8_e8m0fnu", None)
_FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def moments_of(t: torch.Tensor) -> torch.Tensor:
    """(4,) float64 [sum, absmax, nan, inf] of a strided tensor, chunked to bound scratch."""
    dev = t.device
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    acc = torch.zeros(4, dtype=torch.float64, device=dev)
    if t.numel() == 0:
        return acc
    per = max(1, SCRATCH // 32)  # elements: a float64 copy plus temporaries stay near SCRATCH
    if t.is_contiguous() or t.dim() == 1:
        flat = t.reshape(-1)
        pieces = [flat[i : i + per] for i in range(0, flat.numel(), per)]
    else:
        step = max(1, per // max(1, t.numel() // t.shape[0]))
        pieces = [t[i : i + step].reshape(-1) for i in range(0, t.shape[0], step)]
    parts = []
    for p in pieces:
        if p.dtype == _FP4:
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


def moments_rows(rows: torch.Tensor, dtype: torch.dtype, numels: Sequence[int]) -> torch.Tensor:
    """(k, 4) float64 moments of k small tensors of ``dtype`` held zero-padded in int8 rows (k, 1024).

    Zero padding adds zeros, which change no moment, except for float8_e8m0fnu (byte 0 is
    2**-127): its padding is masked. Same definitions as ``moments_of``."""
    if dtype == _FP4:
        lut = torch.tensor(_FP4_VALUES, dtype=torch.float64, device=rows.device)
        u = rows.view(torch.uint8).to(torch.int64)
        re = torch.cat([lut[u & 15], lut[u >> 4]], dim=1)
        mag = re.abs()
    elif dtype in _COMPLEX:
        r = torch.view_as_real(rows.view(dtype)).to(torch.float64)
        re = r[..., 0]
        mag = r.square().sum(-1).sqrt()
    else:
        re = rows.view(dtype).to(torch.float64)
        mag = re.abs()
    if dtype == _E8M0:
        n = torch.tensor(numels, dtype=torch.int64, device=rows.device)
        pad = torch.arange(re.shape[1], device=rows.device) >= n[:, None]
        re = re.masked_fill(pad, 0.0)
        mag = mag.masked_fill(pad, 0.0)
    return torch.stack(
        [re.sum(1), mag.amax(1), torch.isnan(mag).sum(1).to(torch.float64), torch.isinf(mag).sum(1).to(torch.float64)],
        dim=1,
    )


def pointer_rows(rows: torch.Tensor, numels: Sequence[int]) -> torch.Tensor:
    """(k,) bool ``pointer_like`` of k small int64 tensors held zero-padded in int8 rows (k, 1024)."""
    x = rows.view(torch.int64)
    n = torch.tensor(numels, dtype=torch.int64, device=rows.device)
    ok = looks_like_pointer(x)
    ok |= torch.arange(x.shape[1], device=rows.device) >= n[:, None]  # padding does not count
    return ok.all(1) & (n > 0)


#: Bits that must be clear in a pointer-like value: the top 16 and the low 4.
_POINTER_MASK = -(1 << 48) | 15


def looks_like_pointer(x: torch.Tensor) -> torch.Tensor:
    """Elementwise, for int64 ``x``: the value is in [2**32, 2**48) and a multiple of 16."""
    return ((x & _POINTER_MASK) == 0) & (x >= (1 << 32))


def pointer_like(t: torch.Tensor) -> torch.Tensor:
    """0-dim bool: int64, numel >= 1, every value in [2**32, 2**48) and a multiple of 16."""
    if t.dtype != torch.int64 or t.numel() == 0:
        return torch.zeros((), dtype=torch.bool, device=t.device)
    return looks_like_pointer(t).all()
