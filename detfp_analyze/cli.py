"""The ``detfp-analyze`` command line: a thin shell over the library.

Each command lives in ``detfp_analyze._cli.<name>``; this module only assembles them.
Exit codes: 0 identical / no problems, 1 diverged / problems, 2 bad input.
"""

from __future__ import annotations

import typer

from detfp_analyze._cli import bisect as _bisect
from detfp_analyze._cli import certify as _certify
from detfp_analyze._cli import env as _env
from detfp_analyze._cli import export as _export
from detfp_analyze._cli import golden as _golden
from detfp_analyze._cli import index as _index
from detfp_analyze._cli import plot as _plot
from detfp_analyze._cli import sql as _sql
from detfp_analyze._cli import summary as _summary
from detfp_analyze._cli.common import Command, OneLineGroup

__all__ = ["app", "main"]

app = typer.Typer(
    name="detfp-analyze",
    help="Find where two detfp runs stopped being bitwise identical.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    # Plain help (no boxes, no per-flag type column such as "--json <bool>"), at most 100 columns:
    # readable in a terminal, in a CI log, and in docs/cli.md, which is generated from it.
    rich_markup_mode=None,
    context_settings={"max_content_width": 100},
    cls=OneLineGroup,  # usage errors as one line, exit 2
)
_COMMANDS = (
    ("summary", _summary.command, "What a run holds: ranks, steps, levels, counts."),
    ("certify", _certify.command, "Check one run's invariants before comparing it."),
    ("env", _env.command, "What differs between two runs' manifests."),
    ("bisect", _bisect.command, "Where two runs stopped being bitwise identical, and why."),
    ("sql", _sql.command, "One SQL query over one or two runs' views."),
    ("plot", _plot.command, "Pictures of where two runs diverge (PNG or SVG files)."),
    ("export", _export.command, "Where two runs diverge as a Perfetto timeline."),
    ("index", _index.command, "Index a run's manifests and commit logs, so it opens in bulk."),
)
for _name, _fn, _short in _COMMANDS:
    app.command(_name, cls=Command, short_help=_short)(_fn)
app.add_typer(_golden.app, name="golden", help="Re-record a golden trace, printing what changed.")


def main() -> None:
    """Console-script entry point."""
    app()
