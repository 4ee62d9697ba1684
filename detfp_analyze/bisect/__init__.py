"""The bisect pipeline: where two runs stopped being bitwise identical, rank by rank, and why.

``pipeline.bisect`` runs the stages in this order (numbered once, ``pipeline.STAGES``; the docs
number theirs the same way), each a module (or subpackage) with one job handing the next a typed
value (``records``: ``RecordKey``, ``Aligned``, ``Found``, ...):

1. comparable: ``io.envdiff`` refuses a meaningless pair (``IncomparableError``) unless forced;
2. scope: what is compared (ranks, the common step window, resume boundaries: ``scope``,
   ``resume``);
3. search: from the scope to each rank's first divergence, reading as little as possible:
   ``narrow`` (metrics and per-(rank, step) rollups pick candidate steps; ``blocks`` reads the
   stored rollups), then the exact ``walk`` over ``align`` with ``detfp_analyze.rule``
   (``callfacts`` and ``enrich`` answer what the walk asks about a call), as a ``records.Found``;
   ``reads`` says how the stages read, ``engine`` where the heavy stages run;
4. verdicts: origin, source, receiver, ... for each found record, the group-wide and cross-rank
   tests included (``verdict``);
5. evidence: what the report shows about the records it names (``evidence``, ``diffkind``,
   ``components``) and the result types built from them (``assemble``);
6. diagnosis: the cross-rank pattern (``diagnose``); ``clues``, ``settings`` and ``cause``: the
   most likely cause weighed from all the evidence; ``advice``: next steps that fit it.

The stages end in a ``result.BisectResult`` (the frozen result types and their JSON form, with
the vocabularies of ``vocab``).

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
