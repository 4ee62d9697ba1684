"""``stable_text``: the text of a non-tensor value that is the same in every process.

Two places turn Python values into text that must compare across runs: the non-tensor
arguments of a call (``args_digest`` and, when short, the ``args`` text of a record) and the
non-tensor parts of a tensor subclass's digest (a DTensor's device mesh and placements).
Equal values must give equal text in any process, so nothing may leak an address, an id or a
salted hash: an object without such a text is rendered as its type name.
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["stable_text"]

#: Deeper nesting than this is rendered as the type name (a bound on the work per value).
_MAX_DEPTH = 8
_SIMPLE = (torch.dtype, torch.device, torch.layout, torch.memory_format)


def stable_text(v: Any, *, objects: bool = False, _depth: int = 0) -> str:
    """Process-independent text of ``v``.

    Numbers, strings, None, bools, lists (``[a,b]``), tuples (``(a,b)``), dicts (``{k:v}`` in
    key order), dtypes, devices and enum members (``ReduceOp.SUM``) always; a tensor as ``T``.
    ``objects``: other objects by their ``repr`` when it holds no address (placements such as
    ``Shard(dim=0)``) and a device mesh by its device type, ranks and dimension names;
    otherwise (and by default) by their type name.
    """
    if v is None or isinstance(v, (bool, int, str)):
        return repr(v)
    if isinstance(v, float):
        return repr(v) if not math.isnan(v) else "nan"
    if _depth > _MAX_DEPTH:
        return type(v).__name__
    if isinstance(v, (list, tuple)):
        inner = ",".join(stable_text(x, objects=objects, _depth=_depth + 1) for x in v)
        return f"[{inner}]" if isinstance(v, list) else f"({inner})"
    if isinstance(v, dict):
        items = sorted(v.items(), key=lambda kv: str(kv[0]))
        return "{" + ",".join(f"{k}:{stable_text(x, objects=objects, _depth=_depth + 1)}" for k, x in items) + "}"
    if isinstance(v, torch.Tensor):
        return "T"
    if isinstance(v, _SIMPLE):
        return str(v)
    if isinstance(v, complex):
        return repr(v)
    name = getattr(v, "name", None)  # enums such as ReduceOp.SUM: the member, not just the type
    if isinstance(name, str):
        return f"{type(v).__name__}.{name}"
    if not objects:
        return type(v).__name__
    mesh = getattr(v, "mesh", None)
    if isinstance(mesh, torch.Tensor) and hasattr(v, "device_type"):  # a DeviceMesh
        dims = stable_text(getattr(v, "mesh_dim_names", None), objects=True, _depth=_depth + 1)
        return f"DeviceMesh({v.device_type},{mesh.tolist()},{dims})"
    try:
        text = repr(v)
    except Exception:
        return type(v).__name__
    return type(v).__name__ if " at 0x" in text or " object at " in text else text
