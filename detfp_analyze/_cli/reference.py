"""The command-line reference (docs/cli.md), generated from the commands' own ``--help``.

``render()`` returns the Markdown: a short preamble, then each command's help text exactly as
``detfp-analyze COMMAND --help`` prints it, at a fixed width of 100 columns so the file does not
depend on the terminal that generated it. A test fails when docs/cli.md differs from ``render()``;
regenerate it with ``python -m detfp_analyze._cli.reference --write docs/cli.md``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from typer.core import TyperGroup
from typer.main import get_command

__all__ = ["render"]

_WIDTH = 100
_PREAMBLE = """# `detfp-analyze` command reference

Generated from `--help` by `python -m detfp_analyze._cli.reference --write docs/cli.md`; a test
fails when this file is stale. Exit codes everywhere: **0** identical / no problem / written,
**1** diverged / problems found (`bisect`, `env`, `certify`; for `bisect` also status `rng_only`:
only an RNG state differs and no value does, which `--expect` can accept with `status =
"rng_only"`, and status `ended_early`: a run ended before the other and what both hold matched,
which `--allow-incomplete` or `status = "ended_early"` accepts), **2** bad input, an unusable trace or a missing optional dependency, with one line
on stderr naming the object, the problem and the fix.
What the reports mean: `docs/report.md`; the SQL views: `docs/sql.md`; single-run checks:
`docs/certify.md`; how to investigate: `docs/guide.md` and `docs/symptoms.md`.
"""


def _help(cmd, name: str, parent=None) -> str:
    ctx = cmd.make_context(
        name, ["--help"], parent=parent, resilient_parsing=True, terminal_width=_WIDTH, max_content_width=_WIDTH
    )
    return cmd.get_help(ctx)


def render() -> str:
    """The whole reference as Markdown (ends with a newline)."""
    from detfp_analyze.cli import app

    group = get_command(app)
    if not isinstance(group, TyperGroup):  # a Typer app with several commands is a group
        raise TypeError(f"the detfp-analyze app is a single command ({type(group).__name__}), not a group")
    parts = [_PREAMBLE, "```text", "$ detfp-analyze --help", _help(group, "detfp-analyze"), "```"]
    root = group.make_context(
        "detfp-analyze", [], resilient_parsing=True, terminal_width=_WIDTH, max_content_width=_WIDTH
    )
    for name in group.list_commands(root):
        cmd = group.get_command(root, name)
        parts += [
            "",
            f"## `detfp-analyze {name}`",
            "",
            "```text",
            f"$ detfp-analyze {name} --help",
            _help(cmd, name, root),
            "```",
        ]
    return "\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    text = render()
    if args[:1] == ["--write"] and len(args) == 2:
        Path(args[1]).write_text(text, encoding="utf-8")
    elif not args:
        sys.stdout.write(text)
    else:
        print("usage: python -m detfp_analyze._cli.reference [--write docs/cli.md]", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
