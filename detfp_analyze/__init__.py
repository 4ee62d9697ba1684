"""detfp_analyze: narrow the first bitwise divergence between two detfp runs.

Never imports torch (a subprocess test proves it). Grouped by role (docs/architecture.md):
``io`` opens and validates runs and diffs their manifests; ``bisect`` is the pipeline
(scope -> search: ``narrow``, ``walk`` over ``align`` -> ``verdict`` -> ``evidence``,
``diffkind``, ``assemble`` -> ``diagnose`` -> ``BisectResult``), every comparison taken from the
one rule in ``rule``; ``sql`` exposes the same traces through documented DuckDB views;
``single`` checks and summarizes one run (``certify``, ``summarize``); ``render`` turns a result
into text, JSON, HTML, pictures and timelines; ``gate`` is the CI gate over golden traces; ``testing``
writes synthetic run pairs. Printing happens only in the CLI (``cli``, ``_cli``).

Public names load lazily (PEP 562) so ``import detfp_analyze`` stays cheap for the CLI.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = [
    "REPORT_VERSION",
    "BisectResult",
    "CertifyResult",
    "DetfpError",
    "Diagnosis",
    "Divergence",
    "EnvDiff",
    "Problem",
    "RankResult",
    "Run",
    "RunSummary",
    "bisect",
    "certify",
    "connect",
    "divergence_heatmap",
    "env_diff",
    "open_run",
    "render_text",
    "summarize",
]

_LAZY = {
    "REPORT_VERSION": "detfp_analyze.bisect.result",
    "BisectResult": "detfp_analyze.bisect.result",
    "Diagnosis": "detfp_analyze.bisect.result",
    "Divergence": "detfp_analyze.bisect.result",
    "RankResult": "detfp_analyze.bisect.result",
    "CertifyResult": "detfp_analyze.single.certify",
    "Problem": "detfp_analyze.single.certify",
    "certify": "detfp_analyze.single.certify",
    "connect": "detfp_analyze.sql",
    "divergence_heatmap": "detfp_analyze.render.heatmap",
    "EnvDiff": "detfp_analyze.io.envdiff",
    "env_diff": "detfp_analyze.io.envdiff",
    "DetfpError": "detfp_analyze.errors",
    "Run": "detfp_analyze.io.run",
    "open_run": "detfp_analyze.io.reader",
    "render_text": "detfp_analyze.render.report",
    "RunSummary": "detfp_analyze.single.summary",
    "summarize": "detfp_analyze.single.summary",
}

# ``bisect`` is the function, imported now rather than lazily: the subpackage of the same name is
# bound as this package's attribute when it is first imported, so a lazy function would lose to
# the module once anything ran ``import detfp_analyze.bisect`` (the CLI does). Imported first, the
# subpackage is already loaded and the name stays the function. It costs ~10 ms (no polars yet).
from detfp_analyze.bisect import bisect  # noqa: E402

if TYPE_CHECKING:  # pragma: no cover
    from detfp_analyze.bisect.result import REPORT_VERSION, BisectResult, Diagnosis, Divergence, RankResult
    from detfp_analyze.errors import DetfpError
    from detfp_analyze.io.envdiff import EnvDiff, env_diff
    from detfp_analyze.io.reader import open_run
    from detfp_analyze.io.run import Run
    from detfp_analyze.render.heatmap import divergence_heatmap
    from detfp_analyze.render.report import render_text
    from detfp_analyze.single.certify import CertifyResult, Problem, certify
    from detfp_analyze.single.summary import RunSummary, summarize
    from detfp_analyze.sql import connect


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'detfp_analyze' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    # Only the public names: not the helpers this module imports (importlib, Any, ...).
    return sorted(__all__)
