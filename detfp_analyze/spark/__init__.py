"""detfp on Apache Spark: bisect's heavy stages and the SQL views, for traces past one node.

``engine(spark)`` makes ``bisect(a, b, engine=...)`` run its heavy stages as a fixed number of
Spark jobs (``stages``): the first metric split per rank, the stored rollups' blocks or the
records' rollups joined into candidate steps, the group-wide collective input test, and one read
of every rank-step the walk needs; the walk, verdicts, diagnosis and report are the local
engine's code on the driver (the report is byte-identical). ``connect(spark, a, b=None)`` registers the documented views (``a_records``,
``pairs``, ``first_divergence``, ``step_summary``, ``metric_pairs``, ...) as temporary views,
from the same ``.sql`` files as DuckDB's, with the explicit translations of ``dialect``.
``session(master, conf)`` builds a quiet session (see docs/spark.md).

Needs the ``spark`` extra (``pip install 'detfp[spark]'``) and Java 17+. ``import detfp_analyze``
never imports pyspark; this package imports it on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["connect", "engine", "query", "session"]

_LAZY = {
    "connect": "detfp_analyze.spark.views",
    "query": "detfp_analyze.spark.views",
    "engine": "detfp_analyze.spark.stages",
    "session": "detfp_analyze.spark.runtime",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'detfp_analyze.spark' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(__all__)
