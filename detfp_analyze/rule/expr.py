"""A tiny engine-neutral expression language: the comparison rule is written once in it.

Each node is a frozen dataclass; ``to_polars`` and ``to_sql`` render the same tree for their
engine, so polars (bisect, pictures, timeline) and SQL (DuckDB views, a Spark job) evaluate one
definition. Columns are named abstractly (``Col("status", "a")``: the status of run A's
record); each rendering maps names to its own columns (``status_a``, ``a.status``, ...).

Null semantics are the same in both engines and are kept explicit: comparisons with a null are
null, ``All``/``Any``/``Not`` follow three-valued (Kleene) logic, a null condition of a ``Case``
is not taken, ``IsTrue`` turns null into false and ``Same`` is null-safe equality. No node
has an engine-specific meaning, which is what lets a new engine add a renderer and nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["All", "Any", "Case", "Col", "Eq", "Expr", "IsNull", "IsTrue", "Lit", "NonEmpty", "Not", "Same", "one_of"]


@dataclass(frozen=True)
class Col:
    """A column: ``name`` of run ``side`` ("a" or "b"), or of the pair (``side`` None: a key column
    equal on both sides, such as ``role`` or ``state``)."""

    name: str
    side: str | None = None


@dataclass(frozen=True)
class Lit:
    """A literal: a string, an int, a bool or None (null)."""

    value: str | int | bool | None


@dataclass(frozen=True)
class Eq:
    """``left = right``: null when either side is null."""

    left: Expr
    right: Expr


@dataclass(frozen=True)
class Same:
    """Null-safe equality (``IS NOT DISTINCT FROM``): two nulls are the same, never null."""

    left: Expr
    right: Expr


@dataclass(frozen=True)
class IsNull:
    """``x IS NULL``: never null."""

    x: Expr


@dataclass(frozen=True)
class IsTrue:
    """``x IS TRUE``: false when ``x`` is null or false, never null."""

    x: Expr


@dataclass(frozen=True)
class NonEmpty:
    """A list column holds at least one element (false when null)."""

    x: Expr


@dataclass(frozen=True)
class Not:
    """Logical negation (null stays null)."""

    x: Expr


@dataclass(frozen=True)
class All:
    """Conjunction of ``parts`` (three-valued)."""

    parts: tuple[Expr, ...]

    def __init__(self, *parts: Expr):
        object.__setattr__(self, "parts", tuple(parts))


@dataclass(frozen=True)
class Any:
    """Disjunction of ``parts`` (three-valued)."""

    parts: tuple[Expr, ...]

    def __init__(self, *parts: Expr):
        object.__setattr__(self, "parts", tuple(parts))


@dataclass(frozen=True)
class Case:
    """The value of the first ``(condition, value)`` whose condition is true, else ``default``."""

    whens: tuple[tuple[Expr, Expr], ...]
    default: Expr


Expr = Col | Lit | Eq | Same | IsNull | IsTrue | NonEmpty | Not | All | Any | Case


def one_of(x: Expr, values: tuple[str, ...]) -> Expr:
    """``x`` equals one of ``values`` (an ``Any`` of equalities: null-in-list semantics differ
    between engines, a chain of ``=`` does not)."""
    return Any(*(Eq(x, Lit(v)) for v in values))
