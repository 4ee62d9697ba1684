"""A tensor subclass's parts: what its digest is made of, for ``digest.start`` and the capture.

A tensor whose type defines ``__tensor_flatten__`` (MX and NVFP4 quantized tensors, DTensor,
torchao's training weight wrappers, ...) refuses a flat byte view; it is fingerprinted through
its parts (docs/digest.md, "Tensor subclasses"). ``flatten`` names its inner tensors in the order
``__tensor_flatten__`` gives them, and turns its non-tensor parts (DTensor's device mesh) plus the
flatten context (placements, global shape) into process-independent text; ``combined`` is the
whole's digest from its parts' digests. ``pending.start`` builds a ``Fingerprint`` with
components from them; the capture writes every part as a record of its own and the whole's
record from the parts' digests (``_recorder/subclass.py``): the same value both ways.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from detfp_capture._digest import core
from detfp_capture._digest.core import Scheme
from detfp_capture._digest.stable import stable_text

__all__ = ["Flat", "combined", "flatten"]


class Flat(NamedTuple):
    """One level of a subclass tensor, flattened."""

    #: ``module.qualname`` of its type (part of its digest).
    type_name: str
    #: (name, inner tensor) in ``__tensor_flatten__`` order; an inner tensor may be a subclass.
    tensors: tuple[tuple[str, torch.Tensor], ...]
    #: (name, text) of its non-tensor parts and, when there are any, of the flatten context.
    meta: tuple[tuple[str, str], ...]


def flatten(t: torch.Tensor, meta: bool = True) -> Flat:
    """The parts of ``t`` (whose type defines ``__tensor_flatten__``); raises what it raises.
    ``meta=False``: leave the text of the non-tensor parts out (nothing will be digested)."""
    tp = type(t)
    names, ctx = t.__tensor_flatten__()  # type: ignore[attr-defined]  # the subclass protocol: not on Tensor
    tensors: list[tuple[str, torch.Tensor]] = []
    texts: list[tuple[str, str]] = []
    for name in names:
        v = getattr(t, name)
        if isinstance(v, torch.Tensor):
            tensors.append((name, v))
        elif meta:
            texts.append((name, stable_text(v, objects=True)))
    if texts:
        # A subclass with non-tensor components (DTensor: its local shard and device mesh) is
        # its tensors plus how they are laid out: the mesh and the flatten context (placements,
        # global shape) join the digest. Subclasses whose components are all tensors digest
        # without their context (their digest never held it), so no earlier digest changes.
        texts.append(("ctx", stable_text(ctx, objects=True)))
    return Flat(f"{tp.__module__}.{tp.__qualname__}", tuple(tensors), tuple(texts))


def combined(
    sch: Scheme,
    type_name: str,
    dtype: str,
    shape: Sequence[int],
    parts: Sequence[tuple[str, str, str | None]],
    meta: Sequence[tuple[str, str]],
) -> tuple[str, str | None]:
    """(digest, None) of a whole from its ``parts`` (name, digest, error) under the digest version
    ``sch`` (its parts'), or ("", why) when a part has no digest: a whole is never equal to
    anything when one of its parts failed."""
    for name, _, error in parts:
        if error is not None:
            return "", f"component {name!r}: {error}"
    return core.combine(sch, type_name, dtype, shape, [*((n, d) for n, d, _ in parts), *meta]), None
