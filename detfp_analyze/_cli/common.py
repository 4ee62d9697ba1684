"""Shared CLI plumbing: exit codes and the translation of typed errors into one line."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import typer

from detfp_analyze.errors import DetfpError

__all__ = ["EXIT_BAD_INPUT", "EXIT_DIVERGED", "EXIT_OK", "fail", "handle_errors"]

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
