"""Typed errors of the trace-format layer (all subclasses of FormatError).

The capture re-raises them as its own ``CaptureError`` subclasses where a ``Session`` opens a run
(``detfp_capture.errors.RunExistsError`` is both), so a job catching either family catches them.
"""

from __future__ import annotations

__all__ = ["FormatError", "RunExistsError", "SchemaError", "SelectorError"]


class FormatError(Exception):
    """Base class of every error detfp_format raises on purpose."""


class RunExistsError(FormatError):
    """The run directory already holds a trace and appending was not asked for."""


class SchemaError(FormatError, ValueError):
    """Data handed to the writer does not fit the trace contract (unknown table or column, ...)."""


class SelectorError(FormatError, ValueError):
    """A step or rank selector (``3-5,9``, ``10-``, ``all``) cannot be parsed."""
