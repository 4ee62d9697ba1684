"""Typed errors of the capture layer (all subclasses of CaptureError)."""

from __future__ import annotations

__all__ = ["CaptureError", "ConfigError", "LaunchRefusedError", "RunExistsError", "SchemaError"]


class CaptureError(Exception):
    """Base class of every error detfp_capture raises on purpose."""


class RunExistsError(CaptureError):
    """The run directory already holds a trace and appending was not asked for."""


class ConfigError(CaptureError, ValueError):
    """A capture option is malformed (bad step/rank selector, unknown level, ...)."""


class SchemaError(CaptureError, ValueError):
    """Data handed to the writer does not fit the trace contract (unknown table or column, ...)."""


class LaunchRefusedError(CaptureError):
    """The launcher cannot capture the processes the script starts (``torch.multiprocessing``)."""
