"""Typed errors of the trace-format layer, and the root every detfp package's errors derive from.

``DetfpError`` is the one root (house rule 20): the format's ``FormatError``, the capture's
``CaptureError`` (``detfp_capture.errors``), the analysis's ``AnalysisError``
(``detfp_analyze.errors``, which also exports ``DetfpError`` itself) and the guards' errors all
derive from it, so one ``except DetfpError`` catches whatever the tool raises on purpose. It lives
here because this is the one layer every package imports.

The capture re-raises format errors as its own ``CaptureError`` subclasses where a ``Session`` opens
a run (``detfp_capture.errors.RunExistsError`` is both), so a job catching either family catches them.
"""

from __future__ import annotations

__all__ = ["DetfpError", "FormatError", "RunExistsError", "SchemaError", "SelectorError"]


class DetfpError(Exception):
    """Root of every error any detfp package raises on purpose (format, capture, analysis, guards)."""


class FormatError(DetfpError):
    """Base class of every error detfp_format raises on purpose."""


class RunExistsError(FormatError):
    """The run directory already holds a trace and appending was not asked for."""


class SchemaError(FormatError, ValueError):
    """Data handed to the writer does not fit the trace contract (unknown table or column, ...)."""


class SelectorError(FormatError, ValueError):
    """A step or rank selector (``3-5,9``, ``10-``, ``all``) cannot be parsed."""
