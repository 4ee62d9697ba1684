"""Optional heavy dependencies behind one helper that names the install command."""

from __future__ import annotations

import importlib
from types import ModuleType

from detfp_analyze.errors import OptionalDependencyError

__all__ = ["require"]

_EXTRA = {"matplotlib": "plot", "matplotlib.pyplot": "plot", "nbformat": "notebooks", "nbclient": "notebooks", "pyspark": "spark"}


def require(module: str) -> ModuleType:
    """Import ``module`` or raise OptionalDependencyError with the exact install command."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        extra = _EXTRA.get(module, "dev")
        raise OptionalDependencyError(
            f"{module} is not installed; install it with: pip install 'detfp[{extra}]'"
        ) from exc
