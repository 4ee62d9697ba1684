"""`detfp-analyze certify` (placeholder until its implementation lands)."""

from __future__ import annotations

from detfp_analyze._cli.common import fail


def command() -> None:
    """Not implemented yet."""
    fail("certify is not implemented yet")
