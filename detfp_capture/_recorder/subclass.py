"""Records of a tensor subclass: each inner tensor a record of its own, then the whole.

A tensor whose type defines ``__tensor_flatten__`` (an MX or NVFP4 quantized tensor, a DTensor,
torchao's training weight wrappers, a jagged nested tensor) is recorded as its parts, each under
``<arg>::<name>`` (``args[1]::scale``; nested subclasses recursively, with the names their own
``__tensor_flatten__`` gives: ``value::_local_tensor::qdata``) with its own dtype, shape and
digest, and with moments, row digests, dumps and hazard flags exactly like a plain tensor; then
the whole under ``<arg>``, with the outer dtype and shape and a digest combined at the flush
from its parts' digests and its non-tensor layout (``_digest.subclass.combined``: the value
``digest.start`` gives the whole). So the whole differs whenever a part or its layout does, and
a report names the part. Parts come before their whole: a rank's first divergent record is then
the part that differs (``scale``), not the whole. Capture only ever reads the parts: whatever a
subclass refuses (a byte view, ``.numpy()``, ``as_strided``) is never asked of it.

``flattens`` says which tensors take this path (one lookup per type); ``append_flattened`` is
``Recorder.append_records`` for a call holding such tensors; ``resolve_combined`` gives the
wholes their digests at the flush, once their parts are resolved.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from detfp_capture import digest
from detfp_capture._digest import versions
from detfp_capture._digest.awaited import collective_result
from detfp_capture._digest.core import Scheme
from detfp_capture._digest.resolve import Resolved
from detfp_capture._digest.subclass import combined, flatten
from detfp_capture._recorder.call import Call, TensorArg
from detfp_capture._recorder.slot import COMBINE, Slot, dtype_str, shape_tuple
from detfp_format import contract

__all__ = ["Combo", "append_flattened", "flattens", "has_subclass", "resolve_combined", "scalar_copy"]

_TENSOR = torch.Tensor
_PARAM = torch.nn.Parameter
_NO_HAZARDS: tuple[str, ...] = ()
#: Type -> whether its tensors are recorded part by part (learned once per type).
_FLATTENS: dict[type, bool] = {}


class Combo(NamedTuple):
    """What a subclass's whole digest is combined from (``Slot.source`` of a ``COMBINE`` slot)."""

    type_name: str
    dtype: str
    shape: tuple[int, ...]
    #: Non-tensor parts and flatten context as text (``subclass.Flat.meta``).
    meta: tuple[tuple[str, str], ...]
    #: (name, Slot of the part's record), in ``__tensor_flatten__`` order.
    parts: tuple[tuple[str, Slot], ...]
    #: The digest version its parts were started with (the session holds one for its lifetime).
    scheme: Scheme


def _learn(tp: type) -> bool:
    split = hasattr(tp, "__tensor_flatten__")
    if split:
        acs: type | None
        try:
            from torch.distributed._functional_collectives import AsyncCollectiveTensor as acs
        except Exception:  # a build without torch.distributed
            acs = None
        # An AsyncCollectiveTensor is a plain tensor whose buffer a collective may still be
        # writing, not a subclass with parts: when it may be read is the collective sources'
        # business (they digest it as one tensor), so it is never split here.
        if acs is not None and issubclass(tp, acs):
            split = False
    _FLATTENS[tp] = split
    return split


def flattens(t: Any) -> bool:
    """Whether ``t`` is recorded as its parts and its whole (see the module docstring)."""
    tp = t.__class__
    if tp is _TENSOR or tp is _PARAM:
        return False
    f = _FLATTENS.get(tp)
    return _learn(tp) if f is None else f


def has_subclass(tensors: Sequence[TensorArg]) -> bool:
    """Whether any tensor of a call is recorded part by part (two identity tests per plain tensor:
    every recorded call asks)."""
    for _, _, t in tensors:
        tp = t.__class__
        if tp is not _TENSOR and tp is not _PARAM:
            f = _FLATTENS.get(tp)
            if _learn(tp) if f is None else f:
                return True
    return False


def append_flattened(
    rec: Any,
    call: Call,
    tensors: list[TensorArg],
    hazards: dict[int, tuple[str, ...]] | None,
    opts: dict[str, Any],
) -> None:
    """``rec.append_records(call, tensors, hazards=hazards, **opts)`` for a call holding subclass
    tensors: plain tensors as they are, each subclass as its parts then its whole. A whole's
    hazard flags (the union of its parts', ``HazardTracker.flags``) go on its parts too."""
    for i, (role, arg, t) in enumerate(tensors):
        hz = hazards.get(i) if hazards else None
        if flattens(t):
            _append_whole(rec, call, role, arg, t, hz, opts)
        else:
            rec.append_records(call, [(role, arg, t)], hazards={0: hz} if hz else None, **opts)


def _append_whole(
    rec: Any, call: Call, role: str, arg: str, t: torch.Tensor, hz: tuple[str, ...] | None, opts: dict[str, Any]
) -> Slot | None:
    """The records of subclass ``t``'s parts, then its own; returns the whole's Slot (None: not
    digested, because the call digests nothing or a part went undigested)."""
    digest_it = opts.get("digest_it", True)
    try:
        flat = flatten(t, meta=digest_it)
    except Exception:
        flat = None
    whole: Slot | None = None
    if flat is None:
        # A subclass that cannot be flattened: one record, whose digest is the error saying why.
        if digest_it:
            whole = Slot(digest.start(t))
    else:
        parts = []
        for name, v in flat.tensors:
            part_arg = f"{arg}{contract.COMPONENT_SEP}{name}"
            if flattens(v):
                s = _append_whole(rec, call, role, part_arg, v, hz, opts)
            else:
                rec.append_records(call, [(role, part_arg, v)], hazards={0: hz} if hz else None, **opts)
                s = rec.last_slot()
            parts.append((name, s))
        done = [(name, s) for name, s in parts if s is not None]
        if digest_it and len(done) == len(parts):
            whole = Slot(COMBINE)
            shape = shape_tuple(t.shape)
            whole.source = Combo(flat.type_name, dtype_str(t.dtype), shape, flat.meta, tuple(done), versions.active())
    rec.records.add(
        call, rec.next_seq(), role, arg, dtype_str(t.dtype), shape_tuple(t.shape), t.numel(), whole, hz or _NO_HAZARDS
    )
    rec.records_in_step += 1
    return whole


def resolve_combined(slots: list[Slot]) -> None:
    """Give every ``COMBINE`` slot of ``slots`` (in record order, so a nested whole comes before
    the whole holding it) its digest from its parts' resolved slots."""
    for s in slots:
        c: Combo = s.source
        parts: list[tuple[str, str, str | None]] = []
        for name, p in c.parts:
            if p.hi is not None:
                parts.append((name, f"{p.hi:016x}{p.lo:016x}", None))
            else:
                why = p.extra.error if p.extra is not None and p.extra.error else "no digest"
                parts.append((name, "", why))
        hexd, error = combined(c.scheme, c.type_name, c.dtype, c.shape, parts, c.meta)
        if error is None:
            s.hi, s.lo = int(hexd[:16], 16), int(hexd[16:], 16)
        else:
            s.extra = Resolved(None, None, error, None, None, False)
        s.pending = s.source = None


def scalar_copy(value: torch.Tensor) -> torch.Tensor:
    """A 1-D copy of a one-element tensor's value, read once its producer completed. A tensor
    subclass refuses to be read as a number (a DTensor's ``.tolist()``): its first inner tensor
    holds the value (a DTensor's: this rank's local value, no communication)."""
    t = collective_result(value).detach()
    while flattens(t) and (parts := flatten(t, meta=False).tensors):
        t = collective_result(parts[0][1])
    return t.reshape(1).clone()
