"""detfp_capture: per-rank, ordered tensor fingerprint streams from a PyTorch training job.

Public names are loaded lazily (PEP 562): ``import detfp_capture`` does not import torch until a
name needs it. The trace format it writes is ``detfp_format``'s; the reproducibility guards built
on capture and analysis (``repeat_check``, the pytest plugin) are ``detfp_guards``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = [
    "CaptureError",
    "DigestError",
    "Fingerprint",
    "Moments",
    "Session",
    "fingerprint",
]

_LAZY = {
    "Session": "detfp_capture.session",
    "Fingerprint": "detfp_capture.digest",
    "fingerprint": "detfp_capture.digest",
    "Moments": "detfp_capture.digest",
    "DigestError": "detfp_capture.digest",
    "CaptureError": "detfp_capture.errors",
}

if TYPE_CHECKING:  # pragma: no cover
    from detfp_capture.digest import DigestError, Fingerprint, Moments, fingerprint
    from detfp_capture.errors import CaptureError
    from detfp_capture.session import Session


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'detfp_capture' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
