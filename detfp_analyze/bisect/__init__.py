"""The bisect pipeline: where two runs stopped being bitwise identical, rank by rank, and why.

Stages, each a module with one job (``pipeline.bisect`` runs them in this order):

1. ``scope``: what is compared (ranks, the common step window, resume boundaries: ``resume``);
2. ``narrow``: per (rank, step) rollups over narrow columns: candidate steps, and the first
   step whose metrics differ bitwise;
3. ``align`` -> ``walk``: each candidate step read in the rank's own order and matched record by
   record with ``detfp_analyze.rule``; the walk keeps each rank's first divergence (and the
   next clean one past a likely false root) as a ``walk.Found``;
4. ``verdict``: origin, source, receiver, ... for each found record, the group-wide and
   cross-rank tests included;
5. ``diagnose``: the cross-rank pattern;
6. ``evidence`` and ``diffkind``: what the report shows about the records it names (kind and
   size of the difference, kernels, the discriminator view);
7. ``result``: the frozen result types and their JSON form (``VERDICTS``, ``PATTERNS``).

``from detfp_analyze.bisect import bisect`` is the entry point (also ``detfp_analyze.bisect``);
``ReadPaths`` (``reads``) turns off the shortcuts its search takes past the records.
"""

from __future__ import annotations

from typing import Any

__all__ = ["BisectResult", "Progress", "ReadPaths", "bisect"]


def __getattr__(name: str) -> Any:
    # Lazy: importing one stage (``detfp_analyze.bisect.result``) must not import the whole pipeline.
    if name in __all__:
        from detfp_analyze.bisect import pipeline

        return getattr(pipeline, name)
    raise AttributeError(f"module 'detfp_analyze.bisect' has no attribute {name!r}")
