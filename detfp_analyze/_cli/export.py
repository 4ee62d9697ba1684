"""`detfp-analyze export A B --perfetto FILE`: the bisect as a Perfetto / chrome://tracing timeline.

One track per rank (grouped by parallel coordinate), each rank's records of the selected steps
as nested slices in its own execution order, differing calls marked, an instant event at each
rank's first divergence (``perfetto.trace``). The bisect itself runs over the whole common
window and every rank, so verdicts do not depend on the selection; ``--steps`` and ``--ranks``
only choose what goes into the trace. A size guard refuses more than ``--max-records`` records
with a one-line hint. Exit 0 when written, 2 for bad input or a refused size.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from detfp_analyze._cli.common import EXIT_OK, echo, fail, handle_errors, write_output
from detfp_analyze._cli.compare import Depth, Force, MissingRanks, OldLevel, RunA, RunB, compare
from detfp_analyze._cli.selection import OPEN_END, parse_ranks, parse_steps, rank_values
from detfp_analyze.ranks import format_ranks
from detfp_analyze.render.perfetto import count_records, dumps_trace, trace

__all__ = ["command"]


@handle_errors
def command(
    run_a: RunA,
    run_b: RunB,
    perfetto: Annotated[
        Path,
        typer.Option("--perfetto", metavar="FILE", help="Write the trace-event JSON here (ui.perfetto.dev opens it)."),
    ],
    steps: Annotated[
        str | None,
        typer.Option(
            "--steps", metavar="STEPS", help="Steps in the trace, e.g. 3 or 3-5 (default: the compared window)."
        ),
    ] = None,
    ranks: Annotated[
        str | None,
        typer.Option("--ranks", metavar="RANKS", help="Ranks in the trace, e.g. 0,4-7 (default: all compared)."),
    ] = None,
    max_records: Annotated[
        int, typer.Option("--max-records", metavar="N", help="Refuse a trace of more records than this.")
    ] = 500_000,
    depth: Depth = None,
    level: OldLevel = None,
    force: Force = False,
    allow_missing_ranks: MissingRanks = False,
) -> None:
    """Export where A and B diverge as a timeline: a track per rank, records as nested slices."""
    rank_sel = parse_ranks(ranks)
    sel_steps = parse_steps(steps)
    a, b, result = compare(run_a, run_b, None, None, depth, level, force, allow_missing_ranks)
    sel_ranks = rank_values(rank_sel, max(a.world_size, b.world_size))
    compared = set(result.window.ranks)
    if sel_ranks is not None and not set(sel_ranks) <= compared:
        fail(
            f"--ranks {ranks}: rank(s) {format_ranks(sorted(set(sel_ranks) - compared))} were not compared "
            f"(compared: {format_ranks(sorted(compared)) or 'none'})"
        )
    window = sel_steps or result.window.steps
    if sel_steps is not None and sel_steps[1] == OPEN_END:
        # An open-ended --steps (10-) ends where the compared steps end.
        last = result.window.steps[1] if result.window.steps is not None else sel_steps[0]
        window = (sel_steps[0], max(last, sel_steps[0]))
    if window is None:
        fail(f"{result.label_a} and {result.label_b} share no step: nothing to export")
    chosen = sorted(compared) if sel_ranks is None else sel_ranks
    n = count_records(a, chosen, window)
    if n > max_records:
        step = min((r.first.step for r in result.ranks if r.first is not None), default=window[0])
        focus = result.diagnosis.origin_ranks or tuple(chosen[:4])
        fail(
            f"the trace would hold {n} records (steps {window[0]}-{window[1]}, {len(chosen)} ranks), more than "
            f"--max-records {max_records}; select fewer, e.g. --steps {step} --ranks {format_ranks(focus[:8])}, "
            "or raise --max-records"
        )
    obj = trace(a, b, result, steps=window, ranks=chosen)
    write_output(perfetto, dumps_trace(obj), "--perfetto", parents=True)
    echo(
        f"wrote {perfetto}: {len(obj['traceEvents'])} events, {len(chosen)} rank(s), steps {window[0]}-{window[1]}; "
        "open it at https://ui.perfetto.dev (it runs in your browser) or chrome://tracing\n"
    )
    raise typer.Exit(EXIT_OK)
