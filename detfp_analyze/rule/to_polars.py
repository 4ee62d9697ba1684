"""Render a rule expression (``rule.expr``) as a polars expression.

``names`` maps a ``Col`` to the frame's column name: the default suffixes a side
(``Col("status", "a")`` -> ``status_a``); ``names_for`` builds the mapping for frames whose run
A columns carry no suffix and run B's ``_b`` (a polars full join with ``suffix="_b"``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import polars as pl

from detfp_analyze.rule.expr import All, Any, Case, Col, Eq, Expr, IsNull, IsTrue, Lit, NonEmpty, Not, Same

if TYPE_CHECKING:  # polars exports the when/then builder types only from this module
    from polars.expr.whenthen import ChainedThen, Then

__all__ = ["Names", "names_for", "suffixed", "to_polars"]

#: Col -> the column name in the frame.
Names = Callable[[Col], str]


def suffixed(col: Col) -> str:
    """``status_a`` / ``status_b`` for a side, the bare name for a pair column."""
    return col.name if col.side is None else f"{col.name}_{col.side}"


def names_for(a: str = "", b: str = "_b") -> Names:
    """Names for a frame whose run A columns end with ``a`` and run B's with ``b``."""
    return lambda col: col.name + {"a": a, "b": b, None: ""}[col.side]


def to_polars(e: Expr, names: Names = suffixed) -> pl.Expr:
    """The polars expression of ``e``."""

    def r(x: Expr) -> pl.Expr:
        return to_polars(x, names)

    if isinstance(e, Col):
        return pl.col(names(e))
    if isinstance(e, Lit):
        return pl.lit(e.value)
    if isinstance(e, Eq):
        return r(e.left) == r(e.right)
    if isinstance(e, Same):
        return r(e.left).eq_missing(r(e.right))
    if isinstance(e, IsNull):
        return r(e.x).is_null()
    if isinstance(e, IsTrue):
        return r(e.x).fill_null(False)
    if isinstance(e, NonEmpty):
        return r(e.x).list.len().fill_null(0) > 0
    if isinstance(e, Not):
        return ~r(e.x)
    if isinstance(e, All):
        out = r(e.parts[0])
        for p in e.parts[1:]:
            out = out & r(p)
        return out
    if isinstance(e, Any):
        out = r(e.parts[0])
        for p in e.parts[1:]:
            out = out | r(p)
        return out
    if isinstance(e, Case):
        # The first when/then is a Then, every later one a ChainedThen; both end in otherwise().
        chain: Then | ChainedThen = pl.when(r(e.whens[0][0])).then(r(e.whens[0][1]))
        for cond, value in e.whens[1:]:
            chain = chain.when(r(cond)).then(r(value))
        return chain.otherwise(r(e.default))
    raise TypeError(f"not a rule expression: {e!r}")
