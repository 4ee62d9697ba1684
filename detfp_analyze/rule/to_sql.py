"""Render a rule expression (``rule.expr``) as SQL text.

``names`` maps a ``Col`` to SQL (``a.status``, ``status_a``, or an expression such as
``coalesce(a.role, b.role)``). ``dialect`` picks the few spellings that differ: ``duckdb``
(the views of ``detfp_analyze.sql``) and ``spark`` (Spark SQL: ``<=>`` for null-safe equality,
``size`` of an array). Every other construct is standard SQL.
"""

from __future__ import annotations

from collections.abc import Callable

from detfp_analyze.rule.expr import All, Any, Case, Col, Eq, Expr, IsNull, IsTrue, Lit, NonEmpty, Not, Same

__all__ = ["DIALECTS", "SqlNames", "qualified", "suffixed", "to_sql"]

DIALECTS = ("duckdb", "spark")
#: Col -> SQL text naming that column.
SqlNames = Callable[[Col], str]


def qualified(col: Col) -> str:
    """``a.status`` / ``b.status`` for a side (a join of aliases a and b), ``coalesce(a.x, b.x)`` for a pair column."""
    return f"coalesce(a.{col.name}, b.{col.name})" if col.side is None else f"{col.side}.{col.name}"


def suffixed(col: Col) -> str:
    """``status_a`` / ``status_b`` for a side, the bare name for a pair column."""
    return col.name if col.side is None else f"{col.name}_{col.side}"


def _literal(v: str | int | bool | None) -> str:
    if v is None:
        return "NULL"
    if isinstance(v, bool):
        return "TRUE" if v else "FALSE"
    if isinstance(v, int):
        return str(v)
    return "'" + v.replace("'", "''") + "'"


def to_sql(e: Expr, names: SqlNames = qualified, dialect: str = "duckdb") -> str:
    """The SQL text of ``e`` (fully parenthesized, so it embeds anywhere)."""
    if dialect not in DIALECTS:
        raise ValueError(f"dialect {dialect!r} is not one of {', '.join(DIALECTS)}")

    def r(x: Expr) -> str:
        return to_sql(x, names, dialect)

    if isinstance(e, Col):
        return names(e)
    if isinstance(e, Lit):
        return _literal(e.value)
    if isinstance(e, Eq):
        return f"({r(e.left)} = {r(e.right)})"
    if isinstance(e, Same):
        op = "<=>" if dialect == "spark" else "IS NOT DISTINCT FROM"
        return f"({r(e.left)} {op} {r(e.right)})"
    if isinstance(e, IsNull):
        return f"({r(e.x)} IS NULL)"
    if isinstance(e, IsTrue):
        return f"({r(e.x)} IS TRUE)" if dialect == "duckdb" else f"coalesce({r(e.x)}, FALSE)"
    if isinstance(e, NonEmpty):
        size = "size" if dialect == "spark" else "len"
        return f"coalesce({size}({r(e.x)}) > 0, FALSE)"
    if isinstance(e, Not):
        return f"(NOT {r(e.x)})"
    if isinstance(e, All):
        return "(" + " AND ".join(r(p) for p in e.parts) + ")"
    if isinstance(e, Any):
        return "(" + " OR ".join(r(p) for p in e.parts) + ")"
    if isinstance(e, Case):
        whens = " ".join(f"WHEN {r(c)} THEN {r(v)}" for c, v in e.whens)
        return f"(CASE {whens} ELSE {r(e.default)} END)"
    raise TypeError(f"not a rule expression: {e!r}")
