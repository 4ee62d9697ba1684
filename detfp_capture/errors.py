"""Typed errors of the capture layer (all subclasses of CaptureError, itself a ``DetfpError``:
the root of every detfp package's errors, ``detfp_format.errors``).

``RunExistsError`` is also the trace-format layer's error of that name (``detfp_format.errors``):
the format raises that one and the ``Session`` re-raises it as this one, so ``except CaptureError``
and ``except detfp_format.errors.FormatError`` both catch it. The format's ``SchemaError`` (data
that does not fit the contract) comes only from using its writer directly.
"""

from __future__ import annotations

from detfp_format import errors as _format

__all__ = ["CaptureError", "ConfigError", "LaunchRefusedError", "RunExistsError"]


class CaptureError(_format.DetfpError):
    """Base class of every error detfp_capture raises on purpose."""


class RunExistsError(CaptureError, _format.RunExistsError):
    """The run directory already holds a trace and appending was not asked for."""


class ConfigError(CaptureError, ValueError):
    """A capture option is malformed (bad step/rank selector, unknown level, ...)."""


class LaunchRefusedError(CaptureError):
    """The launcher cannot capture the processes the script starts (``torch.multiprocessing``)."""
