"""detfp_analyze: narrow the first bitwise divergence between two detfp runs.

Never imports torch (a subprocess test proves it). Pipeline, each stage a pure function:
open/validate a run (``reader``) -> diff manifests (``envdiff``) -> align records by
call-site key -> narrow step -> phase -> module -> op -> kernel -> verdicts and a
cross-rank diagnosis (``bisect``) -> report (text/JSON, in the CLI).
"""

from __future__ import annotations

__all__: list[str] = []
