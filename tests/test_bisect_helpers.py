"""Builders of tiny paired runs for the bisect tests (no tests in this module).

A rank's step is a fixed little stream (``template``): RNG state and batch at step start,
a forward ``aten::mm`` in module ``l1`` followed by a view and a relu in ``l2``, a backward
``all_reduce@dp`` and a parameter at step end. Every record gets a label; run B is run A
with edits keyed by label: ``change`` (new digest), ``after`` (every later record of the
rank-step differs too, except batch and RNG, as a real divergence propagates), ``extra``
(an inserted call), ``set`` (other column values). Runs are written through the real
writer (``tests.shards.write_run``) and opened with the real reader.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from detfp_analyze.io.reader import open_run
from tests.shards import hexdigest, write_run

__all__ = ["Edit", "build_pair", "records_for", "template"]

Edit = Mapping[str, Any]


def template(step: int) -> list[dict[str, Any]]:
    """One rank-step of records (label -> row), in execution order."""
    rows = [
        dict(label="rng", kind="rng_state", phase="step", name="cpu", role="value", arg=""),
        dict(label="batch", kind="batch", phase="forward", name="batch", role="value", arg=""),
        dict(label="mm.in0", module="l1", name="aten::mm.default", role="input", arg="args[0]"),
        dict(label="mm.in1", module="l1", name="aten::mm.default", role="input", arg="args[1]"),
        dict(label="mm.out", module="l1", name="aten::mm.default", role="output", arg="out[0]"),
        dict(label="view.in", module="l1", name="aten::view.default", role="input", arg="args[0]"),
        dict(label="view.out", module="l1", name="aten::view.default", role="output", arg="out[0]"),
        dict(label="relu.in", module="l2", name="aten::relu.default", role="input", arg="args[0]"),
        dict(label="relu.out", module="l2", name="aten::relu.default", role="output", arg="out[0]"),
        dict(label="mm2.in0", module="l2", name="aten::mm.default", role="input", arg="args[0]"),
        dict(label="mm2.out", module="l2", name="aten::mm.default", role="output", arg="out[0]"),
        dict(label="ar.in", kind="collective", phase="backward", name="all_reduce@dp", role="input", arg="args[0]"),
        dict(label="ar.out", kind="collective", phase="backward", name="all_reduce@dp", role="output", arg="out[0]"),
        dict(label="param", kind="param", phase="step", name="l1.weight", role="value", arg=""),
    ]
    for r in rows:
        r["step"] = step
    return rows


_STABLE = ("rng", "batch")


def records_for(rank: int, steps: range, edits: Mapping[tuple[int, int], Edit] | None = None) -> list[dict[str, Any]]:
    """The rank's records over ``steps`` with ``edits[(rank, step)]`` applied."""
    out: list[dict[str, Any]] = []
    for step in steps:
        rows = template(step)
        edit = (edits or {}).get((rank, step), {})
        changed = False
        for row in rows:
            label = row["label"]
            for extra in edit.get("extra_before", {}).get(label, ()):
                out.append({**extra, "step": step})
            row["digest"] = hexdigest((rank, step, label))
            if label in edit.get("change", ()) or (changed and label not in _STABLE):
                row["digest"] = hexdigest((rank, step, label, "B"))
            if label == edit.get("after"):
                changed = True
                row["digest"] = hexdigest((rank, step, label, "B"))
            row.update(edit.get("set", {}).get(label, {}))
            if label in edit.get("drop", ()):
                continue
            out.append(row)
    for r in out:
        r.pop("label", None)
    return out


def build_pair(
    tmp: Path,
    *,
    world: int = 2,
    steps: range = range(3),
    edits_b: Mapping[tuple[int, int], Edit] | None = None,
    edits_a: Mapping[tuple[int, int], Edit] | None = None,
    metrics_b: Callable[[int, int], float] | None = None,
    groups: Mapping[str, list[int]] | None = None,
    parallel: Callable[[int], dict] | None = None,
    extra_tables_a: Callable[[int], dict] | None = None,
    extra_tables_b: Callable[[int], dict] | None = None,
    manifest_b: Mapping[str, Any] | None = None,
    steps_b: range | None = None,
    open_runs: bool = True,
) -> tuple[Any, Any]:
    """Write runs ``tmp/a`` and ``tmp/b`` and open them (labels are those paths)."""
    groups = dict(groups or {"dp": list(range(world))})
    edits_b = dict(edits_b or {})
    # A difference on a rank reaches every rank through the all-reduce: mark its output on
    # every rank of the step as changed, unless the caller already said what happens there.
    paths = []
    for side, edits, srange, extra, mover in (
        ("a", edits_a or {}, steps, extra_tables_a, None),
        ("b", edits_b, steps_b or steps, extra_tables_b, manifest_b),
    ):
        ranks = {}
        for rank in range(world):
            tables: dict[str, list] = {"records": records_for(rank, srange, edits)}
            tables["metrics"] = [
                dict(step=s, name="loss", value=(metrics_b(rank, s) if (side == "b" and metrics_b) else 1.0 + s))
                for s in srange
            ]
            if extra is not None:
                for k, v in extra(rank).items():
                    tables[k] = copy.deepcopy(v)
            ranks[rank] = tables
        overrides: dict[int, dict] = {}
        for rank in range(world):
            o: dict[str, Any] = {"groups": groups}
            if parallel is not None:
                o["parallel"] = parallel(rank)
            if mover:
                o.update(mover)
            overrides[rank] = o
        p = write_run(
            tmp / side,
            ranks,
            world_size=world,
            start_step=srange.start if srange.start else None,
            manifest_overrides=overrides,
        )
        paths.append(p)
    if not open_runs:
        return paths[0], paths[1]
    return open_run(str(paths[0])), open_run(str(paths[1]))
