"""What kind of difference a divergent record shows, and how big it is.

Kinds, decided in this order: ``structure`` (record on one side only or out of order),
``error`` (a digest failed on a side: no evidence of values), ``arguments`` (the call's
non-tensor arguments differ; by value, ``lr 0.1 -> 0.2``, where the runs recorded their
texts), ``dtype`` and ``shape`` (the tensor's dtype or shape differs: another computation, not
another rounding of the same one), ``layout`` (a tensor subclass whose parts are all equal
differs as a whole), ``permutation`` (row digests equal as multisets but in a different order),
``values`` (everything else).

Magnitude comes from what was captured: moments give |Δsum| and Δabsmax; dumps (raw bytes
of both sides) give the exact number of differing elements, the first differing flat
index, the largest distance in units in the last place (ULP) and whether every difference
is ±1 ULP, the signature of float atomics accumulating in a different order. With dumps
the match or mismatch is "confirmed" byte for byte, otherwise it rests on the fingerprint.
Dumps are decoded with the standard ``array`` module and polars; no numpy, no torch.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Mapping, Sequence
from typing import Any

import polars as pl

from detfp_analyze import rule
from detfp_analyze.bisect.result import ValueDiff
from detfp_analyze.bisect.vocab import DiffKind

__all__ = ["args_changes", "classify", "compare_dumps"]

# dtype -> (array typecode of the raw bits, is floating, exponent+mantissa bits mask width)
_BITS = {
    "torch.float64": ("Q", True, 64),
    "torch.float32": ("I", True, 32),
    "torch.float16": ("H", True, 16),
    "torch.bfloat16": ("H", True, 16),
    # 8-bit floats (the parts of MX and NVFP4 tensors) are sign-magnitude like the wider ones; an
    # e8m0 scale is an unsigned biased exponent (no sign, no mantissa): ordered as an integer, so
    # its "ULP" distance counts factors of two.
    "torch.float8_e4m3fn": ("B", True, 8),
    "torch.float8_e5m2": ("B", True, 8),
    "torch.float8_e4m3fnuz": ("B", True, 8),
    "torch.float8_e5m2fnuz": ("B", True, 8),
    "torch.float8_e8m0fnu": ("B", False, 8),
    "torch.int64": ("q", False, 64),
    "torch.int32": ("i", False, 32),
    "torch.int16": ("h", False, 16),
    "torch.int8": ("b", False, 8),
    "torch.uint8": ("B", False, 8),
    "torch.bool": ("B", False, 8),
}


def _decode(data: bytes, code: str) -> pl.Series:
    arr = array(code)
    usable = len(data) - len(data) % arr.itemsize
    arr.frombytes(data[:usable])
    if sys.byteorder == "big":  # dumps are little-endian by contract
        arr.byteswap()
    return pl.Series(arr.tolist())


def compare_dumps(data_a: bytes, data_b: bytes, dtype: str | None) -> dict[str, Any]:
    """Byte-level comparison of two dumps of the same record.

    Returns {equal, numel, n_differing, first_index, max_ulp, all_one_ulp}; ULP fields are
    None for dtypes that are not decoded (then elements are bytes).
    """
    equal = data_a == data_b
    spec = _BITS.get(dtype or "")
    if spec is not None and len(data_a) != len(data_b):
        spec = None  # different lengths: compare bytes, no element decoding
    if spec is None:
        code, floating, width = "B", False, 8
    else:
        code, floating, width = spec
    a, b = _decode(data_a, code), _decode(data_b, code)
    n = min(len(a), len(b))
    a, b = a[:n], b[:n]
    differs = a != b
    dist: pl.Series | None = None
    if spec is not None and width < 64:
        # Map IEEE bits to a monotonic integer line: a ULP distance is then a plain difference.
        def ordered(s: pl.Series) -> pl.Series:
            x = s.cast(pl.Int64)
            if not floating:
                return x
            sign = 1 << (width - 1)
            return pl.select(pl.when(x >= sign).then(sign - x).otherwise(x)).to_series()

        dist = (ordered(a) - ordered(b)).abs()
    idx = differs.arg_true()
    n_diff = len(idx) + abs(len(data_a) - len(data_b)) // (array(code).itemsize or 1)
    out: dict[str, Any] = {
        "equal": equal,
        "numel": n,
        "n_differing": int(n_diff),
        "first_index": int(idx[0]) if len(idx) else None,
        "max_ulp": None,
        "all_one_ulp": None,
    }
    if spec is not None and len(idx):
        if dist is not None:
            d = dist.gather(idx).to_list()
        else:  # 64-bit: Python ints on the differing elements only (no overflow)
            d = [
                abs(_ordered64(x, floating) - _ordered64(y, floating))
                for x, y in zip(a.gather(idx), b.gather(idx), strict=True)
            ]
        out["max_ulp"] = int(max(d))
        out["all_one_ulp"] = bool(floating and max(d) <= 1)
    return out


def _ordered64(x: int, floating: bool) -> int:
    if not floating:
        return x
    sign = 1 << 63
    return sign - x if x >= sign else x


def _parse_args(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    if not text:
        return out
    for part in text.split("; "):
        k, sep, v = part.partition("=")
        out[k] = v if sep else ""
    return out


def args_changes(text_a: str | None, text_b: str | None) -> tuple[str, ...]:
    """``("weight_decay 0.01 -> 0.02", ...)``: the arguments whose values differ between two
    argument texts (``name=value; ...``), in name order; empty when either text is unknown."""
    if text_a is None or text_b is None:
        return ()
    pa, pb = _parse_args(text_a), _parse_args(text_b)
    out = []
    for k in sorted(set(pa) | set(pb), key=lambda k: (not k.isdigit(), int(k) if k.isdigit() else 0, k)):
        va, vb = pa.get(k, "(absent)"), pb.get(k, "(absent)")
        if va != vb:
            name = f"args[{k}]" if k.isdigit() else k
            out.append(f"{name} {va} -> {vb}")
    return tuple(out)


def _short_dtype(dtype: str | None) -> str:
    return (dtype or "?").removeprefix("torch.")


def _shape_text(shape: tuple[int, ...] | None) -> str:
    return "[" + "x".join(str(n) for n in shape) + "]" if shape is not None else "?"


def _f(x: Any) -> float | None:
    return None if x is None else float(x)


def _permutation(rows_a: Sequence[str] | None, rows_b: Sequence[str] | None) -> tuple[bool, int | None]:
    if rows_a is None or rows_b is None:
        return False, None
    ra, rb = list(rows_a), list(rows_b)
    differing = sum(1 for x, y in zip(ra, rb, strict=False) if x != y) + abs(len(ra) - len(rb))
    return (differing > 0 and sorted(ra) == sorted(rb)), differing


def classify(
    state: str,
    a: Mapping[str, Any] | None,
    b: Mapping[str, Any] | None,
    dumps: tuple[bytes, bytes] | None = None,
    args_text: tuple[str | None, str | None] | None = None,
    *,
    tensors_same: bool = False,
    args_same: bool = True,
    dtypes: tuple[str | None, str | None] = (None, None),
    shapes: tuple[tuple[int, ...] | None, tuple[int, ...] | None] = (None, None),
    layout: bool = False,
) -> ValueDiff:
    """Kind and magnitude of one divergent record.

    ``state``: its ``rule.STATES`` value; ``a``/``b``: the record's columns on each side (status,
    digest_hi/lo, args_digest, dtype, rows, m_sum, m_absmax), None for the missing side;
    ``dumps``: raw bytes of both sides; ``args_text``: the call's argument texts on both sides
    (the ``args`` table), when recorded; ``tensors_same`` / ``args_same``: the aligned pair's
    ``rule.TENSORS_EQUAL`` / ``rule.ARGS_EQUAL``; ``dtypes`` / ``shapes``: the record's dtype and
    shape on each side; ``layout``: the record is a tensor subclass's whole whose parts all match.
    """
    if state in rule.STRUCTURAL or a is None or b is None:
        where: dict[str, str] = {  # a RecordState is its value: a plain state string looks it up
            rule.ONLY_A: "run A only",
            rule.ONLY_B: "run B only",
            rule.SHIFTED: "both runs, but its call sequence has a different number of calls",
        }
        side = where.get(state, "both runs, in a different order")
        return ValueDiff(DiffKind.STRUCTURE, detail=f"record present in {side}")
    meta: dict[str, Any] = {"dtype_a": dtypes[0], "dtype_b": dtypes[1], "shape_a": shapes[0], "shape_b": shapes[1]}
    sums = (_f(a.get("m_sum")), _f(b.get("m_sum")))
    maxs = (_f(a.get("m_absmax")), _f(b.get("m_absmax")))
    moments: dict[str, Any] = {}
    if None not in sums:
        moments.update(sum_a=sums[0], sum_b=sums[1], abs_dsum=abs(sums[0] - sums[1]))  # type: ignore[operator]
    if None not in maxs:
        moments.update(absmax_a=maxs[0], absmax_b=maxs[1], d_absmax=maxs[1] - maxs[0])  # type: ignore[operator]
    if "error" in (a.get("status"), b.get("status")):
        why = a.get("error") or b.get("error") or "digest failed"
        return ValueDiff(DiffKind.ERROR, detail=f"digest error ({why}): no evidence either way", **moments, **meta)
    dump_fields: dict[str, Any] = {}
    confirmed = "fingerprint"
    if dumps is not None:
        cmp = compare_dumps(dumps[0], dumps[1], a.get("dtype"))
        confirmed = "bytes"
        dump_fields = {k: cmp[k] for k in ("numel", "n_differing", "first_index", "max_ulp", "all_one_ulp")}
    if not args_same:
        # The call site passed different non-tensor values: that is the difference to name,
        # whatever the tensors then did.
        changes = args_changes(*(args_text or (None, None)))
        what = "; ".join(changes) if changes else "values not recorded (digests only)"
        tail = "same tensors" if tensors_same else "the tensors differ as a consequence"
        return ValueDiff(
            DiffKind.ARGUMENTS,
            confirmed,
            args_a=a.get("args_digest"),
            args_b=b.get("args_digest"),
            args_changes=changes,
            detail=f"arguments differ: {what} ({tail})",
            **moments,
            **dump_fields,
            **meta,
        )
    if None not in dtypes and dtypes[0] != dtypes[1]:
        da, db = (_short_dtype(x) for x in dtypes)
        return ValueDiff(
            DiffKind.DTYPE, confirmed, detail=f"the dtype differs ({da} -> {db}): an autocast dtype or a cast changed",
            **moments, **meta,
        )  # fmt: skip
    if None not in shapes and shapes[0] != shapes[1]:
        sa, sb = (_shape_text(x) for x in shapes)
        return ValueDiff(
            DiffKind.SHAPE, confirmed, detail=f"the shape differs ({sa} -> {sb}): a size in the configuration or a "
            "reshape changed", **moments, **meta,
        )  # fmt: skip
    if layout:
        return ValueDiff(
            DiffKind.LAYOUT, confirmed, detail="every part of the tensor is equal and the whole differs: its layout "
            "(a DTensor's placements or mesh, a subclass's non-tensor attributes) changed", **meta,
        )  # fmt: skip
    perm, rows_differing = _permutation(a.get("rows"), b.get("rows"))
    if perm:
        return ValueDiff(
            DiffKind.PERMUTATION,
            confirmed,
            rows_differing=rows_differing,
            detail=f"same rows in a different order ({rows_differing} rows moved)",
            **moments,
            **dump_fields,
            **meta,
        )
    parts = []
    if "abs_dsum" in moments:
        parts.append(f"|Δsum|={moments['abs_dsum']:.6g}")
    if "d_absmax" in moments:
        parts.append(f"Δabsmax={moments['d_absmax']:.6g}")
    if dump_fields:
        parts.append(f"{dump_fields['n_differing']}/{dump_fields['numel']} elements differ")
        if dump_fields["first_index"] is not None:
            parts.append(f"first at {dump_fields['first_index']}")
        if dump_fields["max_ulp"] is not None:
            parts.append(f"max {dump_fields['max_ulp']} ULP")
        if dump_fields["all_one_ulp"]:
            parts.append("all ±1 ULP (float atomics signature)")
        if dump_fields["n_differing"] == 0:
            parts.append("dumps are byte-identical: the fingerprints disagree with the bytes")
    if rows_differing is not None:
        parts.append(f"{rows_differing} rows differ")
    if not parts:
        parts.append("magnitude unknown (capture moments or dumps to see it)")
    return ValueDiff(
        DiffKind.VALUES,
        confirmed,
        rows_differing=rows_differing,
        detail=", ".join(parts),
        **moments,
        **dump_fields,
        **meta,
    )
