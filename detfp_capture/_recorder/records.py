"""The records buffer of one flush window, kept as columns, and the records table built from it.

Why columns: a record kept as a tuple is one more container object that lives until the flush,
and Python's cyclic collector pays for every such object (roughly 1.5 us each, amortized over
its full collections) on top of building it. Parallel lists of ints, strings and shared call
tuples add almost nothing the collector has to look at. The remaining per-digest objects
(``Slot``, ``digest.Pending``) are one per distinct tensor value, not one per record.

A record is (call, seq, role, arg, dtype text, shape tuple, numel, Slot or None, hazards);
``call`` = (step, microbatch, phase, module, kind, name, occurrence, args source, compiled)
is shared by the records of one call.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from detfp_capture._digest.stable import stable_text

__all__ = ["ARGS_TEXT_MAX", "RecordBuffer", "args_digest_text", "args_text", "flat_args", "record_columns"]


class RecordBuffer:
    """Buffered records as parallel lists (append to all of them, or use ``add``)."""

    __slots__ = ("arg", "call", "dtype", "hazards", "numel", "role", "seq", "shape", "slot")

    def __init__(self) -> None:
        self.call: list[tuple] = []
        self.seq: list[int] = []
        self.role: list[str] = []
        self.arg: list[str] = []
        self.dtype: list[str] = []
        self.shape: list[tuple[int, ...]] = []
        self.numel: list[int] = []
        self.slot: list[Any] = []
        self.hazards: list[tuple[str, ...]] = []

    def __len__(self) -> int:
        return len(self.seq)

    def add(
        self,
        call: tuple,
        seq: int,
        role: str,
        arg: str,
        dtype: str,
        shape: tuple[int, ...],
        numel: int,
        slot: Any,
        hazards: tuple[str, ...],
    ) -> None:
        self.call.append(call)
        self.seq.append(seq)
        self.role.append(role)
        self.arg.append(arg)
        self.dtype.append(dtype)
        self.shape.append(shape)
        self.numel.append(numel)
        self.slot.append(slot)
        self.hazards.append(hazards)


# Op arguments wait for the flush in one flat tuple of plain values (``flat_args``): a call
# tuple holding nested containers is a container the cyclic collector keeps tracking, and
# promotes, until a pass has untracked each level; a flat one is untracked at its first pass.
_FLAT = "\x00detfp-args"
_OPEN = "\x00detfp-["
_CLOSE = "\x00detfp-]"


def flat_args(args: list, kwargs: list[tuple[str, Any]]) -> tuple | None:
    """(marker, number of positional args, args..., then name, value pairs), lists inlined
    between open/close markers; None when there are no arguments. ``args_text`` reads it."""
    if not args and not kwargs:
        return None
    out: list[Any] = [_FLAT, len(args)]
    for a in args:
        _inline(a, out)
    for k, v in kwargs:
        out.append(k)
        _inline(v, out)
    return tuple(out)


def _inline(v: Any, out: list) -> None:
    if type(v) is list:
        out.append(_OPEN)
        for x in v:
            _inline(x, out)
        out.append(_CLOSE)
    else:
        out.append(v)


def _take(flat: tuple, i: int) -> tuple[Any, int]:
    """The value starting at ``flat[i]`` (a list rebuilt from its markers) and the next index."""
    v = flat[i]
    if v is not _OPEN:
        return v, i + 1
    items = []
    i += 1
    while flat[i] is not _CLOSE:
        x, i = _take(flat, i)
        items.append(x)
    return items, i + 1


def _unflatten(flat: tuple) -> tuple[list, list[tuple[str, Any]]]:
    args: list[Any] = []
    i = 2
    for _ in range(flat[1]):
        v, i = _take(flat, i)
        args.append(v)
    kwargs = []
    while i < len(flat):
        k = flat[i]
        v, i = _take(flat, i + 1)
        kwargs.append((k, v))
    return args, kwargs


#: Longest argument text kept by value (the ``args`` table); longer ones keep only their digest.
ARGS_TEXT_MAX = 1024


def args_text(src: Any) -> str | None:
    """16-hex digest of a call's non-tensor arguments, None when none.

    ``src`` = (args, kwargs), kwargs a dict or (name, value) pairs, or a ``flat_args`` tuple."""
    got = args_digest_text(src)
    return None if got is None else got[0]


def args_digest_text(src: Any) -> tuple[str, str | None] | None:
    """(16-hex digest, text) of a call's non-tensor arguments, None when none. The text is
    ``name=value`` pairs joined by ``"; "`` (positional arguments named by index), None when
    longer than ARGS_TEXT_MAX; the digest covers every argument whatever the length."""
    args, kwargs = _unflatten(src) if src and src[0] is _FLAT else src
    parts = []
    for i, a in enumerate(args):
        if not isinstance(a, torch.Tensor):
            parts.append(f"{i}={stable_text(a)}")
    items = kwargs.items() if isinstance(kwargs, dict) else kwargs
    for k, v in sorted(items, key=lambda kv: kv[0]):
        if not isinstance(v, torch.Tensor):
            parts.append(f"{k}={stable_text(v)}")
    if not parts:
        return None
    digest = hashlib.blake2b("\x1f".join(parts).encode(), digest_size=8).hexdigest()
    text = "; ".join(parts)
    return digest, (text if len(text) <= ARGS_TEXT_MAX else None)


_ARGS_MEMO: dict[tuple, str | None] = {}
_ARGS_MEMO_LIMIT = 1 << 16
#: The low half of a 128-bit digest.
_MASK64 = (1 << 64) - 1
#: Classes whose equal values always have the same ``_arg_repr`` (not bool, which equals 1,
#: nor float, where -0.0 == 0.0).
_EXACT = frozenset((int, str, type(None)))


def _args_key(src: Any) -> tuple | None:
    """A dictionary key for a ``flat_args`` tuple that is equal only when ``args_text`` is:
    floats as ("f", exact hex text), other non-exact values with their class (tuples, so never
    equal to a string argument); None when a value cannot be a key (or ``src`` is not flat)."""
    if not src or src[0] is not _FLAT:
        return None
    try:
        key = tuple(
            v if v.__class__ in _EXACT else (("f", v.hex()) if v.__class__ is float else (v.__class__, v)) for v in src
        )
        hash(key)
    except (TypeError, AttributeError):
        return None
    return key


def record_columns(
    buf: RecordBuffer,
) -> tuple[dict[str, list], list[Any], list[bool], list[str | None], dict[str, tuple[str, int, int]]]:
    """Columns of the records table from a buffer whose slots are resolved.

    Returns (columns, fingerprint per record, ok per record, digest hex per record, argument
    texts: args digest -> (text, step, seq) of its first record in the window); the caller
    adds the ``hazards`` column (it may extend the hazards from the fingerprints). One
    comprehension per column: this runs once per flush over every record.
    """
    calls = buf.call
    fps = [None if s is None else s.fp for s in buf.slot]
    cols: dict[str, list] = {
        "step": [c[0] for c in calls],
        "seq": buf.seq,
        "microbatch": [c[1] for c in calls],
        "phase": [c[2] for c in calls],
        "module": [c[3] for c in calls],
        "kind": [c[4] for c in calls],
        "name": [c[5] for c in calls],
        "occurrence": [c[6] for c in calls],
        "role": buf.role,
        "arg": buf.arg,
        "dtype": buf.dtype,
        "shape": buf.shape,  # tuples: pyarrow converts them like lists
        "numel": buf.numel,
        "compiled": [bool(c[8]) for c in calls],
    }
    adcache: dict[int, str | None] = {}
    ads = []
    memo = _ARGS_MEMO
    texts = {}
    for i, c in enumerate(calls):
        src = c[7]
        if src is None:
            ads.append(None)
            continue
        k = id(c)
        if k not in adcache:
            # The same op arguments recur every step: their digest is memoized across flushes
            # under an exact key (see _args_key), the text and BLAKE2b computed once.
            key = _args_key(src)
            got = memo.get(key) if key is not None else None
            if got is None:
                got = args_digest_text(src) or (None, None)
                if key is not None:
                    if len(memo) >= _ARGS_MEMO_LIMIT:
                        memo.clear()
                    memo[key] = got
            adcache[k] = got[0]
            if got[1] is not None and got[0] not in texts:
                texts[got[0]] = (got[1], c[0], buf.seq[i])
        ads.append(adcache[k])
    cols["args_digest"] = ads
    # fps: _resolve.resolve_raw tuples (digest, error, rows, moments, pointer_like) or None.
    ok = [fp is not None and fp[1] is None for fp in fps]
    digests = [fp[0] if o else None for fp, o in zip(fps, ok, strict=True)]
    cols["status"] = ["ok" if o else ("skipped" if fp is None else "error") for fp, o in zip(fps, ok, strict=True)]
    # One parse of the 32 hex digits per digest, split by shifts (half the cost of parsing the
    # halves: this runs over every record of a flush).
    words = [None if d is None else int(d, 16) for d in digests]
    cols["digest_hi"] = [None if w is None else w >> 64 for w in words]
    cols["digest_lo"] = [None if w is None else w & _MASK64 for w in words]
    cols["error"] = [None if fp is None or o else fp[1] for fp, o in zip(fps, ok, strict=True)]
    cols["rows"] = [list(fp[2]) if o and fp[2] is not None else None for fp, o in zip(fps, ok, strict=True)]
    if any(o and fp[3] is not None for fp, o in zip(fps, ok, strict=True)):
        ms = [fp[3] if o else None for fp, o in zip(fps, ok, strict=True)]
        cols["m_sum"] = [None if m is None else m.sum for m in ms]
        cols["m_absmax"] = [None if m is None else m.absmax for m in ms]
        cols["m_nan"] = [None if m is None else m.nan for m in ms]
        cols["m_inf"] = [None if m is None else m.inf for m in ms]
    return cols, fps, ok, digests, texts
