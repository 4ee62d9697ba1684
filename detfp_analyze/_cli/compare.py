"""Options and the bisect run shared by the commands that compare two runs and then render
(``plot``, ``export``): the same selection as ``bisect`` (``--ranks``, ``--steps``, ``--depth``,
``--force``, ``--allow-missing-ranks``), parsed and checked in one place."""

from __future__ import annotations

from typing import Annotated

import typer

from detfp_analyze._cli.depth import Depth, OldLevel, resolve_depth
from detfp_analyze._cli.selection import parse_ranks, parse_steps, rank_values
from detfp_analyze.bisect import bisect
from detfp_analyze.bisect.result import BisectResult
from detfp_analyze.io.reader import Run, open_run

__all__ = ["Depth", "Force", "MissingRanks", "OldLevel", "Ranks", "RunA", "RunB", "Steps", "compare"]

RunA = Annotated[str, typer.Argument(metavar="A", help="Run directory A (the reference).")]
RunB = Annotated[str, typer.Argument(metavar="B", help="Run directory B.")]
Ranks = Annotated[
    str | None, typer.Option("--ranks", metavar="RANKS", help="Ranks to compare, e.g. 0,4-7 (default: all).")
]
Steps = Annotated[str | None, typer.Option("--steps", metavar="STEPS", help="Inclusive step range, e.g. 3-5 or 4.")]
Force = Annotated[bool, typer.Option("--force", help="Compare even if world size, layout or digest version differ.")]
MissingRanks = Annotated[
    bool, typer.Option("--allow-missing-ranks", help="Compare the ranks present even if some are missing.")
]


def compare(
    run_a: str,
    run_b: str,
    ranks: str | None,
    steps: str | None,
    depth: str | None,
    level: str | None,
    force: bool,
    allow_missing_ranks: bool,
) -> tuple[Run, Run, BisectResult]:
    """Open both runs and bisect them as ``detfp-analyze bisect`` would (bad options: exit 2)."""
    rank_sel = parse_ranks(ranks)
    step_range = parse_steps(steps)
    chosen = resolve_depth(depth, level)
    a = open_run(run_a, allow_missing_ranks=allow_missing_ranks)
    b = open_run(run_b, allow_missing_ranks=allow_missing_ranks)
    rank_list = rank_values(rank_sel, max(a.world_size, b.world_size))
    result = bisect(a, b, ranks=rank_list, steps=step_range, level=chosen, force=force)
    return a, b, result
