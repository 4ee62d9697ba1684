"""`detfp-analyze certify RUN [--json]`: a single run's invariants (docs/certify.md).

Exit 0 when every check passes, 1 when problems were found, 2 (one line on stderr) when the
directory is not a usable run. Text and JSON are byte-stable (problems sorted, no timestamps).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from detfp_analyze._cli.common import EXIT_DIVERGED, EXIT_OK, echo, handle_errors
from detfp_analyze.single.certify import CertifyResult, certify

__all__ = ["command", "format_certify"]


def format_certify(res: CertifyResult) -> str:
    """Human text: a status line, then one line per problem."""
    if res.ok:
        return f"{res.label}: ok ({res.ranks} rank(s), {res.steps} step(s) checked)\n"
    lines = [f"{res.label}: {len(res.problems)} problem(s) ({res.ranks} rank(s), {res.steps} step(s) checked)"]
    for p in res.problems:
        where = " ".join(
            part
            for part in (
                "all ranks" if p.rank is None else f"rank {p.rank}",
                "" if p.step is None else f"step {p.step}",
                "" if p.module is None else f"module {p.module}",
            )
            if part
        )
        lines.append(f"  {p.kind}: {where}: {p.detail}")
    return "\n".join(lines) + "\n"


@handle_errors
def command(
    run: Annotated[Path, typer.Argument(metavar="RUN", help="Run directory written by a detfp capture.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print {status, problems} as JSON.")] = False,
) -> None:
    """Check one run before comparing it: ranks, steps, sequence, hazards, pending collectives, determinism."""
    res = certify(run)
    if as_json:
        typer.echo(json.dumps(res.to_json_dict(), indent=2))
    else:
        echo(format_certify(res))
    raise typer.Exit(EXIT_OK if res.ok else EXIT_DIVERGED)
