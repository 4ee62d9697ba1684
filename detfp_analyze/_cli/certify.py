"""`detfp-analyze certify RUN [--json]`: a single run's invariants (docs/certify.md).

Exit 0 when every check passes, 1 when problems were found, 2 (one line on stderr) when the
directory is not a usable run. Text and JSON are byte-stable (problems sorted, no timestamps).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from detfp_analyze._cli.common import EXIT_DIVERGED, EXIT_OK, echo, handle_errors
from detfp_analyze.io.uri import is_remote
from detfp_analyze.single.certify import CertifyResult, Problem, certify
from detfp_format import strictjson

__all__ = ["command", "format_certify"]


def _line(p: Problem, prefix: str = "") -> str:
    where = " ".join(
        part
        for part in (
            "all ranks" if p.rank is None else f"rank {p.rank}",
            "" if p.step is None else f"step {p.step}",
            "" if p.module is None else f"module {p.module}",
        )
        if part
    )
    return f"  {prefix}{p.kind}: {where}: {p.detail}"


def format_certify(res: CertifyResult) -> str:
    """Human text: a status line, one line per problem, then one per note."""
    checked = f"({res.ranks} rank(s), {res.steps} step(s) checked)"
    head = f"{res.label}: ok {checked}" if res.ok else f"{res.label}: {len(res.problems)} problem(s) {checked}"
    lines = [head, *(_line(p) for p in res.problems), *(_line(p, "note: ") for p in res.notes)]
    return "\n".join(lines) + "\n"


@handle_errors
def command(
    run: Annotated[str, typer.Argument(metavar="RUN", help="Run directory written by a detfp capture.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print {status, problems, notes} as JSON.")] = False,
) -> None:
    """Check one run before comparing it: ranks, steps, sequence, hazards, pending collectives, determinism."""
    res = certify(run if is_remote(run) else Path(run))  # a local path shown as before: Path-normalised
    if as_json:
        typer.echo(strictjson.dumps(res.to_json_dict(), indent=2))
    else:
        echo(format_certify(res))
    raise typer.Exit(EXIT_OK if res.ok else EXIT_DIVERGED)
