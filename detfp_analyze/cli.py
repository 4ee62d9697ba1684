"""The ``detfp-analyze`` command line: a thin shell over the library.

Each command lives in ``detfp_analyze._cli.<name>``; this module only assembles them.
Exit codes: 0 identical / no problems, 1 diverged / problems, 2 bad input.
"""

from __future__ import annotations

import typer

from detfp_analyze._cli import bisect as _bisect
from detfp_analyze._cli import certify as _certify
from detfp_analyze._cli import env as _env
from detfp_analyze._cli import golden as _golden
from detfp_analyze._cli import sql as _sql
from detfp_analyze._cli import summary as _summary
from detfp_analyze._cli.common import OneLineGroup

__all__ = ["app", "main"]

app = typer.Typer(
    name="detfp-analyze",
    help="Find where two detfp runs stopped being bitwise identical.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    cls=OneLineGroup,  # usage errors as one line, exit 2
)
app.command("summary")(_summary.command)
app.command("bisect")(_bisect.command)
app.command("certify")(_certify.command)
app.command("env")(_env.command)
app.command("sql")(_sql.command)
app.add_typer(_golden.app, name="golden")


def main() -> None:
    """Console-script entry point."""
    app()
