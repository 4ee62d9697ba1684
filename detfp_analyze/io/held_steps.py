"""What opened runs hold: the steps two runs both hold completely, and the ranks holding rows.

``restrict_pair`` limits two runs to the steps both hold completely (bisect and SQL with
``--allow-incomplete``) and says in notes what was left out; ``held_ranks`` says which ranks
hold any record or metric a scan would return.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from types import MappingProxyType

from detfp_analyze.io.completeness import merge_ranges
from detfp_analyze.io.run import Run

__all__ = ["held_ranks", "restrict_pair"]


def restrict_pair(run_a: Run, run_b: Run) -> tuple[Run, Run, tuple[str, ...]]:
    """Runs A and B limited to the steps both hold completely, and notes on what was left out.

    Every rank's excluded step ranges become the union of both runs' (a step complete on one
    side only cannot be compared), so both runs see exactly the same (rank, step) pairs.
    """
    notes: list[str] = []
    if run_a.completeness is None or run_b.completeness is None:
        return run_a, run_b, ()
    ranks = sorted(set(run_a.excluded) | set(run_b.excluded))
    union = {r: merge_ranges([*run_a.excluded.get(r, ()), *run_b.excluded.get(r, ())]) for r in ranks}
    for tag, run, comp in (("A", run_a, run_a.completeness), ("B", run_b, run_b.completeness)):
        for g in comp.gaps:
            steps = g.steps()
            notes.append(
                f"{tag} ({run.label}) incomplete: rank {g.rank} segment {g.segment}: {g.detail}"
                + (f"; {steps} not compared" if steps else "")
            )
        if comp.legacy_ranks:
            notes.append(
                f"{tag} ({run.label}) was written before commit logs (legacy): its completeness was not verified"
            )
    a = dataclasses.replace(run_a, excluded=MappingProxyType(union)) if union else run_a
    b = dataclasses.replace(run_b, excluded=MappingProxyType(union)) if union else run_b
    return a, b, tuple(notes)


def held_ranks(run: Run, ranks: Sequence[int]) -> set[int]:
    """Ranks of ``ranks`` holding at least one record or metric ``run.scan`` would return.

    From the footers' row counts when nothing is excluded; otherwise one scan of the rank and
    step columns (excluded steps are a row filter the footers cannot answer).
    """
    wanted = set(ranks)
    tables = ("records", "metrics")
    if not any(r in wanted for r in run.excluded):
        return {s.rank for t in tables for s in run.shards.get(t, ()) if s.rank in wanted and s.num_rows}
    held: set[int] = set()
    for t in tables:
        got = run.scan(t, ranks=sorted(wanted)).select("rank").unique().collect()
        held.update(int(r) for r in got["rank"].to_list())
    return held
