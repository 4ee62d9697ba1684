"""`detfp-analyze env` (placeholder until its implementation lands)."""

from __future__ import annotations

from detfp_analyze._cli.common import fail


def command() -> None:
    """Not implemented yet."""
    fail("env is not implemented yet")
