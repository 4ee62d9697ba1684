"""Where each rank sits in the parallel layout: the order and groups pictures and timelines use.

``rank_layout(run)`` reads the manifests' ``parallel`` object (``{"tp": 1, "tp_size": 8, "dp":
3, ...}``) and returns one row per rank: its coordinates, its position when ranks are ordered
outermost coordinate first (pipeline stage, then data-parallel replica, context, expert and
tensor parallel ranks, then any other coordinate by name), and a group label for the outermost
coordinate that splits the ranks into a readable number of groups (``pp 3``). Ranks without
coordinates keep their rank order in one unnamed group. Pure over the manifests; no data is read.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

import polars as pl

from detfp_analyze.io.reader import Run, as_run

__all__ = ["COORDINATE_ORDER", "coordinates", "rank_layout"]

#: Known coordinates, outermost first; others follow in name order.
COORDINATE_ORDER = ("pp", "dp", "cp", "ep", "tp")
#: A coordinate splits the ranks into groups worth labelling only up to this many groups.
_MAX_GROUPS = 64


def coordinates(parallel: Mapping[str, Any]) -> dict[str, int]:
    """The integer coordinates of one manifest's ``parallel`` object (``*_size`` keys dropped)."""
    return {
        k: int(v)
        for k, v in parallel.items()
        if not k.endswith("_size") and isinstance(v, int) and not isinstance(v, bool)
    }


def _order(keys: Iterable[str]) -> list[str]:
    known = [k for k in COORDINATE_ORDER if k in keys]
    return known + sorted(set(keys) - set(known))


def rank_layout(run: Run | str | os.PathLike[str], ranks: Iterable[int] | None = None) -> pl.DataFrame:
    """One row per rank: ``rank``, ``position`` (0.. in layout order), ``group`` (label of its
    group, "" when no coordinate groups the ranks), ``label`` (``rank 5 (pp 0, dp 1, tp 1)``), then
    one Int64 column per coordinate that varies across ranks, outermost first. Sorted by position.

    ``ranks``: the ranks to lay out (default: every rank of the run).
    """
    r = as_run(run)
    wanted = sorted(r.ranks if ranks is None else {int(x) for x in ranks})
    coords = {k: coordinates(r.manifest(k).get("parallel") or {}) if k in r.manifests else {} for k in wanted}
    keys = _order({k for c in coords.values() for k in c})
    varying = [k for k in keys if len({coords[x].get(k) for x in wanted}) > 1]
    rows = sorted(wanted, key=lambda x: (*(coords[x].get(k, -1) for k in varying), x))
    group_key = next((k for k in varying if len({coords[x].get(k) for x in wanted}) <= _MAX_GROUPS), None)

    def label(x: int) -> str:
        parts = ", ".join(f"{k} {coords[x][k]}" for k in varying if k in coords[x])
        return f"rank {x}" + (f" ({parts})" if parts else "")

    data: dict[str, list[Any]] = {
        "rank": rows,
        "position": list(range(len(rows))),
        "group": [f"{group_key} {coords[x].get(group_key, '?')}" if group_key else "" for x in rows],
        "label": [label(x) for x in rows],
    }
    for k in varying:
        data[k] = [coords[x].get(k) for x in rows]
    schema = {"rank": pl.Int32, "position": pl.Int64, "group": pl.String, "label": pl.String}
    return pl.DataFrame(data, schema={**schema, **{k: pl.Int64 for k in varying}})
