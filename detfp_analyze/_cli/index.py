"""`detfp-analyze index RUN`: pre-warm the run index, so later commands open the run in bulk.

The index (``io.runindex``, docs/trace-format.md §5b) is the reader's cache of what opening a run
parses from its manifests and commit logs: ``open_run`` fills it when it parses them and, on every
later open, verifies it against those files and uses it only when it matches them exactly. This
command fills it ahead of the first open. ``--check`` only says whether a current index exists.
Exit 0 when written (or current), 2 with one line on stderr for a bad run or a missing index.
"""

from __future__ import annotations

from typing import Annotated

import typer

from detfp_analyze._cli.common import EXIT_BAD_INPUT, echo, fail, handle_errors
from detfp_analyze.io.reader import index_run


@handle_errors
def command(
    run: Annotated[str, typer.Argument(metavar="RUN", help="Run directory written by a detfp capture.")],
    check: Annotated[
        bool, typer.Option("--check", help="Only check that a current index exists (exit 2 if not); write nothing.")
    ] = False,
) -> None:
    """Pre-warm the run index, the cache of a run's manifests and commit logs that opening a run
    fills anyway (beside the run, or in the user cache directory when the run is read-only)."""
    got = index_run(run, check=check)
    if got is None:
        fail(f"{run}: no current run index (missing, stale or damaged); run detfp-analyze index {run}", EXIT_BAD_INPUT)
    if check:
        echo(f"{run}: the run index in {got.path} is current\n")
    else:
        echo(f"{run}: indexed {got.files} manifests and commit logs ({got.values} distinct manifest values, "
             f"{got.folds} step folds) in {got.path}\n")  # fmt: skip
