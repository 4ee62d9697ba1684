"""Non-tensor arguments of a call: kept flat until the flush, then ``args_digest`` and its text.

An op's non-tensor arguments (sizes, scalars, dtypes, reductions) wait for the flush in one
flat tuple of plain values (``flat_args``); the flush digests each distinct one once
(``ArgsColumn``): a 16-hex BLAKE2b of their process-independent text (``stable_text``), the
``args_digest`` column, and the text itself, once per segment, in the ``args`` table, when it
is at most ``ARGS_TEXT_MAX`` characters. The same arguments recur every step, so the digest is
memoized across flushes under a key that is equal only when the text is.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

from detfp_capture._digest.stable import stable_text
from detfp_capture._recorder.call import ARGS, STEP, TensorArg

__all__ = [
    "ARGS_TEXT_MAX", "ARG_NAMES", "OUT_NAMES", "ArgsColumn", "args_digest_text", "args_key", "args_text", "flat_args",
    "gather", "markers",
]  # fmt: skip

#: ``args[i]`` and ``out[i]`` for the first argument positions (one string each, instead of
#: formatting one per record on the per-op path).
ARG_NAMES = tuple(f"args[{i}]" for i in range(64))
OUT_NAMES = tuple(f"out[{i}]" for i in range(64))


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


def markers() -> tuple[str, str, str]:
    """The flat tuple's markers (the flat start, a list's open and close), compared by identity:
    for the native record path's ``flat_args`` (``_hostpath.c``), which must use these objects."""
    return _FLAT, _OPEN, _CLOSE


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


_ARGS_MEMO: dict[tuple, tuple[str | None, str | None]] = {}
_ARGS_MEMO_LIMIT = 1 << 16
#: Classes whose equal values always have the same ``_arg_repr`` (not bool, which equals 1,
#: nor float, where -0.0 == 0.0).
_EXACT = frozenset((int, str, type(None)))


def args_key(src: Any) -> tuple | None:
    """A dictionary key for a ``flat_args`` tuple that is equal only when ``args_text`` is:
    floats as ("f", exact hex text), other non-exact values with their class (tuples, so never
    equal to a string argument); None when a value cannot be a key (or ``src`` is not flat)."""
    if not src or src[0] is not _FLAT:
        return None
    if _EXACT.issuperset(map(type, src)):
        return src  # (most calls: ints, strings and None only; the key below would equal it)
    try:
        key = tuple(
            v if v.__class__ in _EXACT else (("f", v.hex()) if v.__class__ is float else (v.__class__, v)) for v in src
        )
        hash(key)
    except (TypeError, AttributeError):
        return None
    return key


def gather(
    args: tuple, kwargs: dict, dest_pos: frozenset = frozenset(), dest_kw: frozenset = frozenset()
) -> tuple[list[TensorArg], tuple | None]:
    """An op's input records (role ``dest`` for write-only arguments) and its non-tensor
    arguments (kept for args_digest; no tensor references). The record path's ``gather``:
    this, or its C twin (``hostpath_c/ops.c``)."""
    tensors: list[TensorArg] = []
    other: list[Any] = []
    for i, a in enumerate(args):
        role = "dest" if i in dest_pos else "input"
        if isinstance(a, torch.Tensor):
            tensors.append((role, ARG_NAMES[i] if i < 64 else f"args[{i}]", a))
        elif isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor | None):
            for j, x in enumerate(a):
                if isinstance(x, torch.Tensor):
                    tensors.append((role, f"args[{i}][{j}]", x))
        else:
            other.append(a)
    kw: list[tuple[str, Any]] = []
    for k, v in kwargs.items():
        role = "dest" if k in dest_kw else "input"
        if isinstance(v, torch.Tensor):
            tensors.append((role, f"kwargs.{k}", v))
        elif isinstance(v, (list, tuple)) and v and isinstance(v[0], torch.Tensor):
            for j, x in enumerate(v):
                if isinstance(x, torch.Tensor):
                    tensors.append((role, f"kwargs.{k}[{j}]", x))
        else:
            kw.append((k, v))
    return tensors, flat_args(other, kw)


class ArgsColumn:
    """The ``args_digest`` column of each flush window, and the ``args`` table rows it adds:
    each argument text once per segment, in the window it first appears in. ``key``: the record
    path's ``args_key`` (``seam.RecordPath``)."""

    def __init__(self, key: Callable[[tuple], tuple | None] = args_key) -> None:
        #: Argument digests whose text this segment has written.
        self.written: set[str] = set()
        self._key = key

    def build(self, calls: Sequence[tuple], seqs: Sequence[int]) -> tuple[list[str | None], dict[str, list] | None]:
        """(``args_digest`` per call, the new ``args`` table rows or None). ``calls``: the
        window's distinct call tuples (``call.Call``), whose ``ARGS`` field is a ``flat_args``
        tuple or None; ``seqs``: the seq of each call's first record."""
        ads: list[str | None] = []
        memo = _ARGS_MEMO
        texts: dict[str, tuple[str, int, int]] = {}
        for c, seq in zip(calls, seqs, strict=True):
            src = c[ARGS]
            if src is None:
                ads.append(None)
                continue
            # The same op arguments recur every step: their digest is memoized across flushes
            # under an exact key (see args_key), the text and BLAKE2b computed once.
            key = self._key(src)
            got = memo.get(key) if key is not None else None
            if got is None:
                got = args_digest_text(src) or (None, None)
                if key is not None:
                    if len(memo) >= _ARGS_MEMO_LIMIT:
                        memo.clear()
                    memo[key] = got
            digest, text = got
            if text is not None and digest is not None and digest not in texts:
                texts[digest] = (text, c[STEP], seq)
            ads.append(digest)
        seen = self.written
        new = sorted((v[1], v[2], d, v[0]) for d, v in texts.items() if d not in seen)
        if not new:
            return ads, None
        seen.update(d for _, _, d, _ in new)
        rows: dict[str, list] = {
            "step": [r[0] for r in new],
            "seq": [r[1] for r in new],
            "args_digest": [r[2] for r in new],
            "text": [r[3] for r in new],
        }
        return ads, rows
