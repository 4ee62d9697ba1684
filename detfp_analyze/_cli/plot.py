"""`detfp-analyze plot A B --out DIR [--format png|svg]`: the pictures of one bisect, as files.

Writes ``ranks_steps``, ``ranks_modules``, ``metrics`` and ``discriminator`` (``gallery``),
one line per file written or left out (with the reason). Byte-stable files for the same inputs.
Exit 0 when the pictures were written, 2 for bad input or without matplotlib (the line names
the install command). Whether the runs diverged is ``bisect``'s answer, not this command's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from detfp_analyze._cli.common import EXIT_OK, echo, fail, handle_errors, write_output
from detfp_analyze._cli.compare import Depth, Force, MissingRanks, OldLevel, Ranks, RunA, RunB, Steps, compare
from detfp_analyze._deps import require
from detfp_analyze.render.draw import figure_bytes
from detfp_analyze.render.gallery import bisect_pictures

__all__ = ["command", "write_pictures"]


def write_pictures(pics, out: Path, fmt: str) -> list[str]:
    """Write each picture as ``out/<name>.<fmt>``; return the lines to print."""
    lines = []
    for p in pics.figures:
        path = out / f"{p.name}.{fmt}"
        write_output(path, figure_bytes(p.figure, fmt), "--out", parents=True)
        lines.append(f"wrote {path}: {p.caption}")
    lines.extend(f"skipped {name}: {why}" for name, why in pics.skipped)
    return lines


@handle_errors
def command(
    run_a: RunA,
    run_b: RunB,
    out: Annotated[Path, typer.Option("--out", metavar="DIR", help="Directory to write the pictures into.")],
    fmt: Annotated[str, typer.Option("--format", metavar="FORMAT", help="Image format: png|svg.")] = "png",
    max_rows: Annotated[
        int, typer.Option("--max-rows", metavar="N", help="Heatmap rows at most; more ranks are binned.")
    ] = 256,
    ranks: Ranks = None,
    steps: Steps = None,
    depth: Depth = None,
    level: OldLevel = None,
    force: Force = False,
    allow_missing_ranks: MissingRanks = False,
) -> None:
    """Draw where A and B diverge: ranks x steps, ranks x modules, metric curves, discriminator."""
    if fmt not in ("png", "svg"):
        fail(f"--format {fmt!r}: use png or svg")
    if max_rows < 8:
        fail(f"--max-rows {max_rows}: use at least 8")
    require("matplotlib")  # before the bisect: say how to install it without making the user wait
    a, b, result = compare(run_a, run_b, ranks, steps, depth, level, force, allow_missing_ranks)
    pics = bisect_pictures(result, a, b, max_rows=max_rows)
    for line in write_pictures(pics, out, fmt):
        echo(line + "\n")  # captions name ops and modules of the trace: escaped
    raise typer.Exit(EXIT_OK)
