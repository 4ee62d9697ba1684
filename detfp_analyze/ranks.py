"""Rank and step lists as short text: ``0-3,8,10-11``, so a message about 4,096 ranks stays one line.

One formatter for every message, note and report line that names ranks (the reader's errors use
``", "`` between ranges and say ``none`` for an empty list; reports use ``","`` and print nothing).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable

__all__ = ["format_ranks", "rank_list", "without"]


def format_ranks(ranks: Iterable[int], *, sep: str = ",", empty: str = "") -> str:
    """Consecutive integers folded into ranges: ``format_ranks([0, 1, 2, 3, 8]) == "0-3,8"``.

    ``sep`` goes between ranges; ``empty`` is returned for no ranks. Duplicates are ignored.
    """
    vs = sorted(set(ranks))
    parts: list[str] = []
    i = 0
    while i < len(vs):
        j = i
        while j + 1 < len(vs) and vs[j + 1] == vs[j] + 1:
            j += 1
        parts.append(str(vs[i]) if i == j else f"{vs[i]}-{vs[j]}")
        i = j + 1
    return sep.join(parts) if parts else empty


def rank_list(ranks: Iterable[int]) -> str:
    """``'0-3, 5, 7-8'``, or ``'none'``: the style of the reader's messages and of ``summary``."""
    return format_ranks(ranks, sep=", ", empty="none")


def without(ranks: tuple[int, ...], rank: int) -> tuple[int, ...]:
    """Sorted ``ranks`` less ``rank``: a group's peers as one rank sees them, by a slice around it
    (a pass over every member, for every rank of a large group, would cost ranks x group size)."""
    i = bisect_left(ranks, rank)
    return ranks[:i] + ranks[i + 1 :] if i < len(ranks) and ranks[i] == rank else ranks
