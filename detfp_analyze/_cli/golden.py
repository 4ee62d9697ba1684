"""`detfp-analyze golden update GOLDEN NEW`: replace a golden trace, printing what changed.

Prints the bisect report of the old golden (A) against the new run (B) -- or that there was no
golden yet, or why the two cannot be compared bit for bit -- then replaces the golden with a copy
of the new run (``golden.update_golden``). ``--dry-run`` only prints. Exit 0 when done, 2 for bad
input (one line on stderr).
"""

from __future__ import annotations

from typing import Annotated

import typer

from detfp_analyze._cli.common import EXIT_OK, echo, handle_errors
from detfp_analyze._cli.depth import Depth, OldLevel, resolve_depth
from detfp_analyze.gate.golden import GoldenUpdate, update_golden
from detfp_analyze.render import jsontext
from detfp_analyze.render.report import render_text

__all__ = ["app"]

app = typer.Typer(
    name="golden",
    help="Keep golden traces for CI gates (compare with: detfp-analyze bisect GOLDEN NEW --expect FILE).",
    no_args_is_help=True,
    add_completion=False,
)


def render_update(u: GoldenUpdate) -> str:
    """Text of an update: what it did, then what changed (bisect's report)."""
    did = {
        "created": "created (there was no golden: nothing to compare)",
        "replaced": "replaced",
        "dry run": "not replaced (dry run)",
    }[u.action]
    lines = [f"golden {u.golden} <- {u.new}: {did}"]
    if u.incomparable is not None:
        lines.append(f"not comparable bit for bit: {u.incomparable}")
    elif u.change is not None and not u.change.diverged:
        lines.append("bitwise: the new run matches the golden (only the manifests may differ)")
    text = "\n".join(lines) + "\n"
    if u.change is not None:
        text += "\n" + render_text(u.change)
    return text


@app.command("update")
@handle_errors
def update(
    golden: Annotated[str, typer.Argument(metavar="GOLDEN", help="The golden run directory (replaced).")],
    new: Annotated[str, typer.Argument(metavar="NEW", help="The run that becomes the golden.")],
    depth: Depth = None,
    level: OldLevel = None,
    ignore_env: Annotated[
        list[str] | None,
        typer.Option("--ignore-env", metavar="KEY", help="Leave manifest keys out of the diff (glob, repeatable)."),
    ] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print what changed; replace nothing.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print {golden, new, action, incomparable, bisect}.")] = False,
    allow_missing_ranks: Annotated[
        bool, typer.Option("--allow-missing-ranks", help="Accept a new run that lacks some ranks.")
    ] = False,
) -> None:
    """Replace GOLDEN with a copy of NEW, printing what changed between them first."""
    chosen = resolve_depth(depth, level)
    u = update_golden(
        golden, new, level=chosen, ignore_env=ignore_env or (), allow_missing_ranks=allow_missing_ranks, dry_run=dry_run
    )
    if as_json:
        typer.echo(jsontext.dumps(u.to_json_dict()))
    else:
        echo(render_update(u))  # names from the traces: escaped
    raise typer.Exit(EXIT_OK)
