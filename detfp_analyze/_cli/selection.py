"""``--ranks`` and ``--steps`` of the CLI, in the one selector grammar (``detfp_format.selectors``).

The capture's ``steps=``/``ranks=`` options take the same text, so ``--steps 10-`` (step 10 and
every later one) and ``--ranks all`` mean here what they mean there. A bad selector is exit 2 with
one line naming the flag and an example.
"""

from __future__ import annotations

from detfp_analyze._cli.common import fail
from detfp_format.errors import SelectorError
from detfp_format.selectors import Selector, parse_selector

__all__ = ["OPEN_END", "parse_ranks", "parse_steps", "rank_values"]

#: The last step of an open-ended ``--steps 10-``: the analysis clips every window to the steps
#: both runs hold, so "no upper bound" is any bound past them.
OPEN_END = 2**62


def parse_ranks(text: str | None) -> Selector | None:
    """``--ranks``: a selector (None: every rank); ``rank_values`` lists it once the world size is known."""
    try:
        return parse_selector(text, "--ranks")
    except SelectorError as exc:
        fail(str(exc))
    raise AssertionError  # fail() exits


def rank_values(selector: Selector | None, world_size: int) -> list[int] | None:
    """The ranks a ``--ranks`` selector names below ``world_size`` (None: all)."""
    if selector is None:
        return None
    ranks = selector.values(world_size)
    if not ranks:
        fail(f"--ranks {selector.text!r}: selects no rank of a world of {world_size}")
    return ranks


def parse_steps(text: str | None) -> tuple[int, int] | None:
    """``--steps``: one inclusive window (``3-5``, ``4``, ``10-``; None or ``all``: every step)."""
    try:
        selector = parse_selector(text, "--steps")
    except SelectorError as exc:
        fail(str(exc))
        raise AssertionError from None  # fail() exits
    if selector is None:
        return None
    span = selector.span()
    if span is None:
        fail(f"--steps {selector.text!r}: a step window is one contiguous range; use e.g. --steps 3-5 or --steps 10-")
        raise AssertionError  # fail() exits
    lo, hi = span
    return lo, OPEN_END if hi is None else hi
