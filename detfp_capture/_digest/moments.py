"""Moments and the pointer check of digested tensors, on the tensor's device (docs/digest.md).

Not part of identity: ``moments_of`` (float64 sum, absmax, NaN and Inf counts of a strided
tensor, chunked so scratch stays near ``SCRATCH``) and ``moments_rows`` (the same for small
tensors held zero-padded in the rows of a digest arena, vectorized over rows) say how large a
difference is; ``pointer_like`` / ``pointer_rows`` / ``looks_like_pointer`` flag int64 tables of
device pointers, which differ between any two processes. The same for every digest version.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from detfp_capture._digest.core import SCRATCH

__all__ = ["looks_like_pointer", "moments_of", "moments_rows", "pointer_like", "pointer_rows"]

_COMPLEX = frozenset((torch.complex32, torch.complex64, torch.complex128))

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
