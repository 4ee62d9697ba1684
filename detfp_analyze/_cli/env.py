"""`detfp-analyze env A B`: the manifest diff of two runs alone.

One line per differing fact (``key [rank R]: a -> b``), then the determinism settings each run
changed during the run (``setting_changed`` events; a manifest holds those of the first step),
or ``--json`` for ``{a, b, env_diff: [{key, a, b, rank, blocking}], changes_a, changes_b}``.
Exit 0 when the manifests and the changes agree, 1 when they differ, 2 for bad input.
"""

from __future__ import annotations

from typing import Annotated

import typer

from detfp_analyze._cli.common import ALLOW_INCOMPLETE_HELP, EXIT_DIVERGED, EXIT_OK, echo, handle_errors
from detfp_analyze.io.envdiff import drop_keys, env_diff, setting_changes
from detfp_analyze.io.reader import open_run
from detfp_analyze.render import jsontext
from detfp_analyze.render.report import render_env

__all__ = ["command"]


@handle_errors
def command(
    run_a: Annotated[str, typer.Argument(metavar="A", help="Run directory A.")],
    run_b: Annotated[str, typer.Argument(metavar="B", help="Run directory B.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the differences as a JSON list.")] = False,
    allow_missing_ranks: Annotated[
        bool, typer.Option("--allow-missing-ranks", help="Diff the ranks present even if some are missing.")
    ] = False,
    allow_incomplete: Annotated[bool, typer.Option("--allow-incomplete", help=ALLOW_INCOMPLETE_HELP)] = False,
    ignore_env: Annotated[
        list[str] | None,
        typer.Option("--ignore-env", metavar="KEY", help="Leave manifest keys out of the diff (glob, repeatable)."),
    ] = None,
) -> None:
    """Print what differs between the two runs' manifests (versions, determinism, env, layout, hardware)."""
    a = open_run(run_a, allow_missing_ranks=allow_missing_ranks, allow_incomplete=allow_incomplete)
    b = open_run(run_b, allow_missing_ranks=allow_missing_ranks, allow_incomplete=allow_incomplete)
    diffs, _ = drop_keys(env_diff(a, b), ignore_env or ())
    changes = (setting_changes(a), setting_changes(b))
    if as_json:
        payload = {
            "a": a.label,
            "b": b.label,
            "env_diff": [d.to_json_dict() for d in diffs],
            "changes_a": [c.to_json_dict() for c in changes[0]],
            "changes_b": [c.to_json_dict() for c in changes[1]],
        }
        typer.echo(jsontext.dumps(payload))
    else:
        echo(render_env(diffs, a.label, b.label, changes))
    raise typer.Exit(EXIT_DIVERGED if diffs or changes[0] != changes[1] else EXIT_OK)
