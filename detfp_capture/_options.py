"""The capture's options, spelled once: ``CaptureOptions``, a frozen dataclass whose fields carry
each option's name, type, default and help. The three surfaces that take options are made from it:

* ``Session(out_dir, level, **options)``: its signature and the "Options" part of its docstring
  (``session_signature``, ``options_doc``);
* the launcher's command line (``python -m detfp_capture``): one flag per field that a command line
  can give (``add_arguments``; ``from_args`` turns the parsed flags back into options,
  ``to_argv`` into the flags of a process the launcher follows);
* ``_config.make_config``, which validates a ``CaptureOptions`` into the ``CaptureConfig`` the
  manifest stores (fields marked ``config``; the others are the Session's own: ``overwrite``,
  ``parallel``, ``group_names``).

A new option is one field here; ``tests/unit/test_options.py`` holds the three surfaces to it.
Standard library and the format's contract only: the launcher's parser imports no torch.
"""

# ruff: noqa: RUF009  # every default is made by _opt, a dataclasses.field with the option's metadata
from __future__ import annotations

import argparse
import dataclasses
import inspect
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from detfp_format.contract import CAPTURE_LEVELS, DIGEST_VERSION, DIGEST_VERSIONS

__all__ = ["CaptureOptions", "Flag", "add_arguments", "from_args", "option_fields", "options_doc", "session_signature",
           "to_argv"]  # fmt: skip


class Flag(Enum):
    """How the launcher's command line spells an option."""

    #: Free text handed on as is (a selector, a regex).
    TEXT = "text"
    #: An integer.
    INT = "int"
    #: A switch, on when given.
    SWITCH = "switch"
    #: ``all`` (or true/1/yes) for every record, a positive chunk size, or a regex (``rows``).
    TENSOR_CHUNKS = "tensor_chunks"
    #: ``all`` (or true/1/yes) for every record, or a regex (``moments``).
    TENSOR = "tensor"


def _opt(default: Any, help: str, *, flag: Flag | None, config: bool = True, **cli: Any) -> Any:
    """A field of ``CaptureOptions``: ``help`` for the Session's docstring and the launcher's
    --help (``cli_help`` where the command line spells it otherwise), ``flag`` how the launcher
    takes it (None: not on the command line), ``config`` whether ``CaptureConfig`` carries it."""
    return field(default=default, metadata={"help": help, "flag": flag, "config": config, **cli})


@dataclass(frozen=True)
class CaptureOptions:
    """Every option of a capture, as the user spells it (validated by ``_config.make_config``)."""

    level: str = _opt("metrics", '"metrics", "boundaries" or "ops"', flag=Flag.TEXT, choices=CAPTURE_LEVELS,
                      cli_help="capture depth (default: metrics)")  # fmt: skip
    steps: Any = _opt(None, 'steps to capture, e.g. "3-5,9" or "10-" (default all)', flag=Flag.TEXT)
    ranks: Any = _opt(None, 'ranks that capture, e.g. "0,4-7" (default all); other ranks write nothing', flag=Flag.TEXT)
    modules: Any = _opt(None, "regex of module paths whose boundaries and ops are recorded (default all)", flag=Flag.TEXT)
    rows: Any = _opt(False, "row digests: True (dim-0 rows of every record), an int chunk size, or a regex of record "
                     "names/modules", flag=Flag.TENSOR_CHUNKS,
                     cli_help="row digests: 'all', a chunk size, or a regex of record names/modules")  # fmt: skip
    moments: Any = _opt(False, "float64 sum/absmax/NaN/Inf counts: True or a regex of record names/modules",
                        flag=Flag.TENSOR, cli_help="moments: 'all' or a regex of record names/modules")  # fmt: skip
    dumps: Any = _opt(None, "regex of record names/modules whose tensors are also stored as raw bytes", flag=Flag.TEXT)
    kernels: Any = _opt(None, "steps whose device kernels (CPU: innermost profiler events) are recorded per op "
                        "(level ops), e.g. '2'", flag=Flag.TEXT)  # fmt: skip
    poison: bool = _opt(False, "fill tensors born from empty* with a per-run byte pattern (level ops)", flag=Flag.SWITCH)
    append: bool = _opt(False, "continue an existing run directory as a new segment (a resumed run)", flag=Flag.SWITCH)
    overwrite: bool = _opt(False, "replace what this rank wrote into the run directory before (refused when it holds "
                           "something that is not a detfp run; exclusive with append)", flag=Flag.SWITCH,
                           config=False)  # fmt: skip
    parallel: dict[str, Any] | None = _opt(None, 'this rank\'s parallel coordinates for the manifest, e.g. {"dp": 1, '
                                           '"tp": 0}', flag=None, config=False)  # fmt: skip
    group_names: dict[str, Any] | None = _opt(None, 'logical name -> ProcessGroup, used to name collectives ("tp", '
                                              '"dp")', flag=None, config=False)  # fmt: skip
    flush_records: int = _opt(65536, "resolve digests and write a window every this many records (bounds memory)",
                              flag=Flag.INT)  # fmt: skip
    flush_steps: int | None = _opt(None, "a step end also writes the window once it holds this many steps (default "
                                   "50; bounds what a killed job loses: 1 commits every step)", flag=Flag.INT)  # fmt: skip
    views: bool = _opt(False, "also digest view and metadata-only ops (default: counted, not digested)",
                       flag=Flag.SWITCH)  # fmt: skip
    # The launcher counts steps itself from --start-step, so its default is step 0; a Session left
    # without one takes the first step(n) the script opens.
    start_step: int | None = _opt(None, "first step of this launch for the manifest (default: the first step(n); the "
                                  "launcher: 0, or a resumed run's checkpoint step)", flag=Flag.INT,
                                  cli_default=0)  # fmt: skip
    digest_version: int | None = _opt(None, f"version of the tensor digests (docs/digest.md; default {DIGEST_VERSION}, "
                                      "or the environment's DETFP_DIGEST_VERSION): 1 only to compare with runs "
                                      "captured by a release whose digests were version 1", flag=Flag.INT,
                                      choices=tuple(sorted(DIGEST_VERSIONS)))  # fmt: skip


def option_fields() -> tuple[dataclasses.Field, ...]:
    return dataclasses.fields(CaptureOptions)


def session_signature(head: list[inspect.Parameter], tail: list[inspect.Parameter]) -> inspect.Signature:
    """The Session's signature: ``head`` (self, out_dir), ``level`` positional, every other option
    keyword-only with its default, then ``tail`` (keyword-only parameters that are no option)."""
    kinds = {"level": inspect.Parameter.POSITIONAL_OR_KEYWORD}
    params = [
        inspect.Parameter(f.name, kinds.get(f.name, inspect.Parameter.KEYWORD_ONLY), default=f.default,
                          annotation=str(f.type))
        for f in option_fields()
    ]  # fmt: skip
    return inspect.Signature([*head, *params, *tail])


def options_doc(indent: str = "        ") -> str:
    """One ``name: help`` line per option, for the Session's docstring."""
    return "".join(f"{indent}{f.name}: {f.metadata['help']}.\n" for f in option_fields())


def _flag(f: dataclasses.Field) -> str:
    return "--" + f.name.replace("_", "-")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The launcher's flags, one per option a command line can give."""
    for f in option_fields():
        kind: Flag | None = f.metadata["flag"]
        if kind is None:
            continue
        meta = f.metadata
        helptext = meta.get("cli_help", meta["help"])
        if kind is Flag.SWITCH:
            parser.add_argument(_flag(f), action="store_true", help=helptext)
            continue
        default = meta.get("cli_default", None if kind in (Flag.TENSOR, Flag.TENSOR_CHUNKS) else f.default)
        parser.add_argument(_flag(f), type=int if kind is Flag.INT else str, default=default,
                            choices=meta.get("choices"), help=helptext)  # fmt: skip


def _tensor_text(value: str | None, chunks: bool) -> Any:
    if value is None:
        return False
    if value.lower() in ("all", "true", "1", "yes"):
        return True
    if value.isdigit():  # a chunk size for rows; any number means every record for moments
        return int(value) if chunks else True
    return value


def from_args(ns: argparse.Namespace) -> dict[str, Any]:
    """The Session's options from the launcher's parsed flags."""
    out: dict[str, Any] = {}
    for f in option_fields():
        kind = f.metadata["flag"]
        if kind is None:
            continue
        value = getattr(ns, f.name)
        if kind in (Flag.TENSOR, Flag.TENSOR_CHUNKS):
            value = _tensor_text(value, kind is Flag.TENSOR_CHUNKS)
        out[f.name] = value
    return out


def to_argv(ns: argparse.Namespace) -> list[str]:
    """The flags that give a process the same options as ``ns`` (a process the launcher follows)."""
    out: list[str] = []
    for f in option_fields():
        kind = f.metadata["flag"]
        value = None if kind is None else getattr(ns, f.name)
        if kind is Flag.SWITCH:
            out += [_flag(f)] if value else []
        elif value is not None:
            out += [_flag(f), str(value)]
    return out
