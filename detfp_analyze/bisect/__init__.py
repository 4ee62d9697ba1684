"""The bisect pipeline: where two runs stopped being bitwise identical, rank by rank, and why.

``pipeline.bisect`` runs the stages in this order, each a module (or subpackage) with one job
handing the next a typed value (``records``: ``RecordKey``, ``Aligned``, ``Found``, ...):

1. ``scope``: what is compared (ranks, the common step window, resume boundaries: ``resume``);
2. ``search``: from the scope to each rank's first divergence, reading as little as possible:
   ``narrow`` (metrics and per-(rank, step) rollups pick candidate steps; ``blocks`` reads the
   stored rollups), then the exact ``walk`` over ``align`` with ``detfp_analyze.rule``
   (``callfacts`` and ``enrich`` answer what the walk asks about a call), as a ``records.Found``;
   ``reads`` says how the stages read, ``engine`` where the heavy stages run;
3. ``verdict``: origin, source, receiver, ... for each found record, the group-wide and
   cross-rank tests included;
4. ``evidence``, ``diffkind``, ``components`` and ``assemble``: what the report shows about the
   records it names and the result types built from them;
5. ``diagnose``: the cross-rank pattern; ``clues``, ``settings`` and ``cause``: the most likely
   cause weighed from all the evidence; ``advice``: next steps that fit it;
6. ``result`` (with the vocabularies of ``vocab``): the frozen result types and their JSON form.

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
