"""detfp_guards: bitwise-reproducibility guards for tests and CI, on top of capture and analysis.

``repeat_check(fn, *args)`` calls a function several times from the same state, captures each
call with ``detfp_capture`` and compares the calls with ``detfp_analyze.bisect``;
``assert_bitwise_reproducible`` raises ``NotReproducibleError`` with bisect's report; the pytest
plugin (entry point ``detfp``, ``detfp_guards.pytest_plugin``) offers both as the fixture
``detfp_repeat`` and the marker ``@pytest.mark.detfp_repeat``.

This package sits above both sides and uses only their public APIs (``detfp_capture.Session``,
``detfp_analyze.bisect``, ...); neither side imports it (a test walks every module's imports).
Golden-trace gates over stored runs are the analysis' own (``detfp_analyze.gate``; CLI
``detfp-analyze bisect --expect``): they need no torch.

Public names load lazily (PEP 562): pytest imports the plugin in every session of a project that
has detfp installed, including analysis-only installs without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = ["NotReproducibleError", "RepeatResult", "assert_bitwise_reproducible", "repeat_check"]

if TYPE_CHECKING:  # pragma: no cover
    from detfp_guards.repeat import NotReproducibleError, RepeatResult, assert_bitwise_reproducible, repeat_check


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'detfp_guards' has no attribute {name!r}")
    value = getattr(importlib.import_module("detfp_guards.repeat"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
