"""`detfp-analyze sql` (placeholder until its implementation lands)."""

from __future__ import annotations

from detfp_analyze._cli.common import fail


def command() -> None:
    """Not implemented yet."""
    fail("sql is not implemented yet")
