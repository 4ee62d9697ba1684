"""An ``AsyncCollectiveTensor`` is the tensor its functional collective writes: ``collective_result``.

torch's functional collectives (``torch.distributed._functional_collectives``: what DTensor's
redistributions, tensor and sequence parallelism and torchtitan use) return an
``AsyncCollectiveTensor``: a wrapper around the buffer the collective writes (``elem``), which
waits for the collective at its first non-view use. Capture treats it as what it stands for,
that buffer once written: a plain tensor, never a subclass with components, so its digest,
moments, rows and dumps are those of the plain tensor with the same values.

This module is the one place that knows the wrapper. It only unwraps: it never reads the values
(a non-view op on the wrapper would run the program's wait early), and whether the collective
has completed is the recorder's business (``_recorder.inflight``). torch marks the wrapper for
its own code the same way, by the method ``_get_acs_underlying_tensor``.
"""

from __future__ import annotations

import torch

__all__ = ["PLAIN", "collective_result", "unwaited"]

_PLAIN = torch.Tensor
#: Tensor types that wrap nothing (a quick test before looking inside a tensor).
PLAIN = (torch.Tensor, torch.nn.Parameter)


def collective_result(t: torch.Tensor) -> torch.Tensor:
    """The buffer an ``AsyncCollectiveTensor`` stands for; any other tensor as it is."""
    tp = type(t)
    if tp is _PLAIN:
        return t
    get = getattr(tp, "_get_acs_underlying_tensor", None)
    return t if get is None else get(t)


def unwaited(t: torch.Tensor) -> list[torch.Tensor]:
    """The ``AsyncCollectiveTensor``s in ``t`` (itself, or a wrapper subclass's components: a
    DTensor holding one) that have not run their wait: a wait of another wrapper of the same
    buffer (a view) is not known here, so they may be complete already."""
    tp = type(t)
    if tp in PLAIN:
        return []
    if getattr(tp, "_get_acs_underlying_tensor", None) is not None:
        return [] if getattr(t, "completed", True) else [t]
    flatten = getattr(t, "__tensor_flatten__", None)
    if flatten is None:
        return []
    try:
        names, _ = flatten()
    except Exception:
        return []
    out: list[torch.Tensor] = []
    for name in names:
        inner = getattr(t, name, None)
        if isinstance(inner, torch.Tensor):
            out += unwaited(inner)
    return out
