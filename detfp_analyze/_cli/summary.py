"""`detfp-analyze summary RUN`: what a run holds (ranks, steps, levels, counts, environment).

Plain text by default (byte-stable: sorted, no timestamps), ``--json`` for machines.
Exit 0 on a readable run, 2 with one line on stderr for a bad run directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from detfp_analyze._cli.common import echo, handle_errors
from detfp_analyze.io.reader import open_run
from detfp_analyze.io.uri import is_remote
from detfp_analyze.single.summary import format_summary, summarize, summary_dict
from detfp_format import strictjson


@handle_errors
def command(
    run: Annotated[str, typer.Argument(metavar="RUN", help="Run directory written by a detfp capture.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary as JSON.")] = False,
    allow_missing_ranks: Annotated[
        bool, typer.Option("--allow-missing-ranks", help="Summarize the ranks present even if some are missing.")
    ] = False,
) -> None:
    """Print what a run holds: ranks, segments, steps, capture levels, row counts, hazards, environment."""
    # Incomplete runs are summarized, not refused: the summary says what each rank holds completely.
    local = not is_remote(run)  # a local path shown as before: Path-normalised
    summary = summarize(
        open_run(Path(run) if local else run, allow_missing_ranks=allow_missing_ranks, allow_incomplete=True)
    )
    if as_json:
        typer.echo(strictjson.dumps(summary_dict(summary), indent=2, sort_keys=False))
    else:
        echo(format_summary(summary))
