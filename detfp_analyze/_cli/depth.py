"""``--depth``: how deep the commands that bisect (``bisect``, ``plot``, ``export``, ``golden
update``) narrow a divergence: step, phase, module, op or kernel (``bisect.result.LEVELS``).

The flag was ``--level`` until issue 44, the word the capture uses for something else (what was
recorded: ``python -m detfp_capture --level ops``); a user reading ``--level op`` next to
``--level ops`` could not tell the two apart. ``--level`` still works for these commands, says in
one line on stderr that it is deprecated, and is refused when it contradicts ``--depth``.
"""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from detfp_analyze._cli.common import fail, one_line
from detfp_analyze.bisect.result import LEVELS

__all__ = ["DEPRECATED_LEVEL", "Depth", "OldLevel", "resolve_depth"]

#: The depth when neither flag is given.
DEFAULT_DEPTH = "op"
#: The one line a use of the old flag prints on stderr.
DEPRECATED_LEVEL = (
    "--level is deprecated for the narrowing depth (capture's --level names what was recorded); use --depth {value}"
)

Depth = Annotated[
    str | None,
    typer.Option(
        "--depth",
        metavar="DEPTH",
        help=f"Narrowing depth: {'|'.join(LEVELS)} (default: {DEFAULT_DEPTH}).",
        show_default=False,
    ),
]
OldLevel = Annotated[
    str | None,
    typer.Option("--level", metavar="DEPTH", help="Deprecated: the old name of --depth.", show_default=False),
]


def resolve_depth(depth: str | None, level: str | None) -> str:
    """The depth asked for: ``--depth``, else the deprecated ``--level`` (with its one-line note on
    stderr), else ``op``. A value outside LEVELS, or two flags that disagree, exit 2 with one line
    (the error alone: a bad ``--level`` value says the new flag's name in that line)."""
    if depth is not None and level is not None and depth != level:
        fail(f"--depth {depth!r} and --level {level!r} disagree; pass --depth alone (--level is its deprecated name)")
    chosen = depth if depth is not None else level if level is not None else DEFAULT_DEPTH
    if chosen not in LEVELS:
        old = " (--level is deprecated: use --depth)" if depth is None else ""
        flag = "--level" if depth is None else "--depth"
        fail(f"{flag} {chosen!r}: not a depth; use one of {'|'.join(LEVELS)}{old}")
    if level is not None:
        print(f"detfp-analyze: {one_line(DEPRECATED_LEVEL.format(value=level))}", file=sys.stderr)
    return chosen
