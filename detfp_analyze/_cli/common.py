"""Shared CLI plumbing: exit codes, the translation of errors into one line, safe text output.

Exit 1 means "diverged" (or "problems found") to a CI gate, so nothing else may ever end a
command with 1: typed errors, a trace file that cannot be decoded and detfp's own bugs all
exit 2 with one line on stderr (``DETFP_DEBUG=1`` shows the traceback of the last kind).
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import typer
from typer.core import TyperCommand, TyperGroup

from detfp_analyze import _gcpause
from detfp_analyze.errors import DetfpError, OutputError

try:  # typer >= 0.20 vendors click
    from typer._click.exceptions import NoArgsIsHelpError, UsageError
except ImportError:  # pragma: no cover - older typer on click
    from click.exceptions import UsageError  # type: ignore[assignment]  # the class typer vendors later

    NoArgsIsHelpError = ()  # type: ignore[assignment,misc]

#: The --allow-incomplete option's help, shared by the commands that take it.
ALLOW_INCOMPLETE_HELP = (
    "Use a run that holds less than its commit logs promise (killed capture, missing shards): "
    "only the steps held completely are used, the rest is listed in notes."
)

__all__ = [
    "ALLOW_INCOMPLETE_HELP",
    "EXIT_BAD_INPUT",
    "EXIT_DIVERGED",
    "EXIT_OK",
    "Command",
    "OneLineGroup",
    "echo",
    "fail",
    "handle_errors",
    "one_line",
    "write_output",
]

#: Runs identical / single run has no problems.
EXIT_OK = 0
#: Runs diverged / single run has problems.
EXIT_DIVERGED = 1
#: Bad input or unusable trace.
EXIT_BAD_INPUT = 2

F = TypeVar("F", bound=Callable[..., Any])


# C0 and C1 control characters (but newline and tab) and lone surrogates: escaped in what we print,
# so names taken from a trace can neither break a line nor drive a terminal.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff]")


def _escape(m: re.Match) -> str:
    code = ord(m.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def one_line(message: str) -> str:
    """``message`` as one printable line: whitespace runs collapsed, control characters escaped."""
    return _CONTROL.sub(_escape, " ".join(message.split()))


def echo(text: str) -> None:
    """Print report text on stdout (no extra newline), control characters escaped."""
    typer.echo(_CONTROL.sub(_escape, text), nl=False)


def fail(message: str, code: int = EXIT_BAD_INPUT) -> NoReturn:
    """Print ``detfp-analyze: <message>`` on stderr and exit with ``code``."""
    print(f"detfp-analyze: {one_line(message)}", file=sys.stderr)
    raise typer.Exit(code)


def write_output(
    path: Path, data: str | bytes | Callable[[Path], None], option: str, *, parents: bool = False
) -> None:
    """Write the output file ``path`` that ``option`` named: ``data`` (text as UTF-8, bytes), or
    ``data(path)`` for a writer of its own (Parquet); ``parents``: make its directory first. An
    OSError is an ``OutputError`` naming the output (the trace was read fine: "cannot read a file
    of the trace" would send the user to the wrong place)."""
    try:
        if parents:
            path.parent.mkdir(parents=True, exist_ok=True)
        if callable(data):
            data(path)
        elif isinstance(data, bytes):
            path.write_bytes(data)
        else:
            path.write_text(data, encoding="utf-8")
    except OSError as exc:
        reason = exc.strerror or " ".join(str(exc).split())[:120] or type(exc).__name__
        raise OutputError(
            f"{option} {path}: cannot write it ({type(exc).__name__}: {reason}); pick a path in a directory "
            "that exists and that you can write to"
        ) from None


def _unexpected(exc: Exception) -> str:
    """One line for an exception no library function turned into a typed error."""
    reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
    if isinstance(exc, OSError):
        return f"cannot read a file of the trace ({reason}); check the path and its permissions"
    module = type(exc).__module__.split(".")[0]
    if module in ("polars", "pyarrow", "duckdb") or isinstance(exc, (UnicodeDecodeError, OverflowError)):
        # Footers and commit logs were valid, the data inside a shard is not.
        return (
            f"a shard could not be decoded ({reason}); it is damaged: run detfp-analyze certify on each run, "
            "then delete the shard or re-run the capture"
        )
    return f"internal error ({reason}); this is a bug in detfp, please report it (DETFP_DEBUG=1 shows the traceback)"


def _show_warning(
    message: Warning | str, category: type[Warning], filename: str, lineno: int, file: Any = None, line: Any = None
) -> None:
    """``warnings.showwarning`` for the commands: the standard one line, on stderr, with control
    characters escaped (``one_line``): a library's warning can quote a name from the trace (a
    font without a glyph for a character of a module's name), and stderr is a terminal too."""
    text = f"{filename}:{lineno}: {category.__name__}: {one_line(str(message))}\n"
    with contextlib.suppress(OSError):  # stderr gone (a closed pipe): a warning is not worth a failure
        (file if file is not None else sys.stderr).write(text)


def handle_errors(fn: F) -> F:
    """Turn any DetfpError raised by ``fn`` into one line on stderr and exit code 2; any other
    exception too (never a traceback, never exit 1: see the module docstring)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            # The whole command, report included: its bulk of objects forms no cycle (_gcpause);
            # a library's warning (matplotlib's, pyarrow's) is printed with its text escaped.
            with _gcpause.paused(), warnings.catch_warnings():
                warnings.showwarning = _show_warning
                return fn(*args, **kwargs)
        except DetfpError as exc:
            # One line only: a multi-line message would break log scrapers and CI annotations.
            fail(str(exc))
        except (typer.Exit, typer.Abort, KeyboardInterrupt):
            raise
        except Exception as exc:
            if os.environ.get("DETFP_DEBUG"):
                raise
            fail(_unexpected(exc))
        return None

    return wrapper  # type: ignore[return-value]


class OneLineGroup(TyperGroup):
    """The command group, with usage errors (a mistyped option, a missing argument, a bad value)
    printed as one line and exit 2, like every other error, instead of a boxed block."""

    def main(self, args: Sequence[str] | None = None, prog_name: str | None = None, complete_var: str | None = None,
             standalone_mode: bool = True, windows_expand_args: bool = True, **extra: Any) -> Any:  # fmt: skip
        if not windows_expand_args:  # passed on only when asked: the default is click's own
            extra["windows_expand_args"] = False
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except UsageError as exc:
            if isinstance(exc, NoArgsIsHelpError) and exc.ctx is not None:
                typer.echo(exc.ctx.get_help())  # bare `detfp-analyze`: the help, as before
                sys.exit(EXIT_BAD_INPUT)
            path = exc.ctx.command_path if exc.ctx is not None else "detfp-analyze"
            print(f"detfp-analyze: {one_line(exc.format_message()).rstrip('.')}; see: {path} --help", file=sys.stderr)
            sys.exit(EXIT_BAD_INPUT)
        except typer.Abort:
            sys.exit(130)
        sys.exit(rv if isinstance(rv, int) else EXIT_OK)


class Command(TyperCommand):
    """Click-style help for every command: arguments listed by name (``A``), as the usage line
    names them, without Typer's type suffix (``A <str>``) or braces (``{A}``)."""

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        pieces = [re.sub(r"^\{(.*)\}", r"\1", piece) for piece in super().collect_usage_pieces(ctx)]
        # A variadic argument ends in "..." whether or not it has a metavar (Typer < 0.29 leaves
        # the metavar bare), so the usage line is the same on every supported Typer.
        bare = {p.metavar for p in self.get_params(ctx) if p.param_type_name == "argument" and p.nargs != 1}
        return [f"{piece}..." if piece in bare else piece for piece in pieces]

    def format_options(self, ctx: Any, formatter: Any) -> None:
        args, opts = [], []
        for param in self.get_params(ctx):
            if param.param_type_name == "argument":
                args.append((param.metavar or (param.name or "").upper(), getattr(param, "help", None) or ""))
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
