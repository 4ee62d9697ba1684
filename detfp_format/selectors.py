"""The one grammar for step and rank selectors, shared by the capture options and the CLI.

``"3-5,9"`` is steps 3, 4, 5 and 9; ``"10-"`` is step 10 and every later one; ``"all"``, ``"*"``
or an empty string select everything (``None``). The capture's ``steps=``/``ranks=``/``kernels=``
options, the launcher's flags and ``detfp-analyze``'s ``--steps``/``--ranks`` all parse with
``parse_selector``, so a selector that works in one place works in every other.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from detfp_format.errors import SelectorError

__all__ = ["Selector", "parse_selector"]

_PART = re.compile(r"(\d+)(?:\s*-\s*(\d*))?")


@dataclass(frozen=True)
class Selector:
    """A set of non-negative integers written as ``"3-5,9"`` or ``"10-"`` (open-ended)."""

    #: The text the user gave (kept for the manifest).
    text: str
    #: Closed ranges (lo, hi); hi is None for an open-ended range.
    ranges: tuple[tuple[int, int | None], ...]

    def __contains__(self, n: object) -> bool:
        if not isinstance(n, int):
            return False
        return any(lo <= n and (hi is None or n <= hi) for lo, hi in self.ranges)

    def values(self, end: int) -> list[int]:
        """The selected integers, sorted; an open-ended range stops before ``end`` (a closed one is
        listed whole, so a caller can say which of its numbers do not exist)."""
        out: set[int] = set()
        for lo, hi in self.ranges:
            out.update(range(lo, end if hi is None else hi + 1))
        return sorted(out)

    def span(self) -> tuple[int, int | None] | None:
        """The one contiguous inclusive range selected (hi None when open-ended), or None when the
        selection has gaps (``"3,5"``): a step window must be contiguous."""
        ordered = sorted(self.ranges)
        lo, hi = ordered[0]
        for a, b in ordered[1:]:
            if hi is not None and a > hi + 1:
                return None
            hi = None if hi is None or b is None else max(hi, b)
        return lo, hi


def parse_selector(value: Any, option: str) -> Selector | None:
    """Parse a step or rank selector; None (or "all") selects everything.

    ``value`` is a string, an int, or a collection of ints; ``option`` names it in the
    SelectorError raised for anything else: a keyword (``steps='x': cannot parse 'x'; ...``) or a
    command-line flag (``--steps 'x': cannot parse 'x'; ...``).
    """
    if value is None:
        return None
    said = f"{option} {value!r}" if option.startswith("-") else f"{option}={value!r}"
    if isinstance(value, bool):
        raise SelectorError(f"{said}: expected a selector such as '3-5,9' or None for all")
    if isinstance(value, int):
        value = str(value)
    elif isinstance(value, (list, tuple, range, set, frozenset)):
        value = ",".join(str(int(v)) for v in sorted(_ints(value, option)))
    if not isinstance(value, str):
        raise SelectorError(f"{said}: expected a selector string such as '3-5,9'")
    text = value.strip()
    if text.lower() in ("", "all", "*"):
        return None
    ranges: list[tuple[int, int | None]] = []
    for part in text.split(","):
        part = part.strip()
        m = _PART.fullmatch(part)
        if not m:
            raise SelectorError(
                f"{said}: cannot parse {part!r}; use comma-separated numbers and ranges like '3-5,9' or '10-'"
            )
        lo = int(m.group(1))
        if m.group(2) is None:
            hi: int | None = lo
        elif m.group(2) == "":
            hi = None
        else:
            hi = int(m.group(2))
            if hi < lo:
                raise SelectorError(f"{said}: range {part!r} is empty; write the lower bound first")
        ranges.append((lo, hi))
    return Selector(text, tuple(ranges))


def _ints(values: Iterable[Any], option: str) -> list[int]:
    out = []
    for v in values:
        try:
            n = operator.index(v)  # ints and integer scalars (numpy), never floats or bools' text
        except TypeError:
            raise SelectorError(f"{option}: {v!r} is not an integer; expected non-negative integers") from None
        if n < 0:
            raise SelectorError(f"{option}: {n} is negative; expected non-negative integers")
        out.append(n)
    return out
