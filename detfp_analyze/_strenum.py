"""``StrEnum`` on every Python the package supports (3.10 lacks ``enum.StrEnum``).

The vocabularies (verdicts, patterns, causes, statuses, difference kinds, levels, record
states) are enums a type checker sees, and each member *is* its value: a ``str`` that compares,
hashes, joins, formats and serializes (JSON, polars literals, SQL text) exactly as the plain
string did, so reports stay byte-identical. ``repr`` differs: report code never uses it on a
vocabulary value.
"""

from __future__ import annotations

import enum
import sys

__all__ = ["StrEnum"]

if sys.version_info >= (3, 11):
    from enum import StrEnum
else:  # pragma: no cover - exercised on Python 3.10 only

    class StrEnum(str, enum.Enum):
        """The 3.11 ``enum.StrEnum`` behaviour the vocabularies rely on: str() and format() give the value."""

        def __str__(self) -> str:
            return str.__str__(self)

        def __format__(self, spec: str) -> str:
            return str.__format__(str.__str__(self), spec)
