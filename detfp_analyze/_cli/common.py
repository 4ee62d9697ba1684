"""Shared CLI plumbing: exit codes and the translation of typed errors into one line."""

from __future__ import annotations

import functools
import re
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import typer
from typer.core import TyperCommand

from detfp_analyze.errors import DetfpError

__all__ = ["EXIT_BAD_INPUT", "EXIT_DIVERGED", "EXIT_OK", "Command", "fail", "handle_errors"]

#: Runs identical / single run has no problems.
EXIT_OK = 0
#: Runs diverged / single run has problems.
EXIT_DIVERGED = 1
#: Bad input or unusable trace.
EXIT_BAD_INPUT = 2

F = TypeVar("F", bound=Callable[..., Any])


def fail(message: str, code: int = EXIT_BAD_INPUT) -> None:
    """Print ``detfp-analyze: <message>`` on stderr and exit with ``code``."""
    print(f"detfp-analyze: {message}", file=sys.stderr)
    raise typer.Exit(code)


def handle_errors(fn: F) -> F:
    """Turn any DetfpError raised by ``fn`` into one line on stderr and exit code 2."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except DetfpError as exc:
            # One line only: a multi-line message would break log scrapers and CI annotations.
            fail(" ".join(str(exc).split()))
        return None

    return wrapper  # type: ignore[return-value]


class Command(TyperCommand):
    """Click-style help for every command: arguments listed by name (``A``), as the usage line
    names them, without Typer's type suffix (``A <str>``) or braces (``{A}``)."""

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        return [re.sub(r"^\{(.*)\}", r"\1", piece) for piece in super().collect_usage_pieces(ctx)]

    def format_options(self, ctx: Any, formatter: Any) -> None:
        args, opts = [], []
        for param in self.get_params(ctx):
            if param.param_type_name == "argument":
                args.append((param.metavar or param.name.upper(), getattr(param, "help", None) or ""))
            else:
                record = param.get_help_record(ctx)
                if record is not None:
                    opts.append(record)
        if args:
            with formatter.section("Arguments"):
                formatter.write_dl(args)
        if opts:
            with formatter.section("Options"):
                formatter.write_dl(opts)
