"""The few places where the views' SQL (written for DuckDB) and Spark SQL disagree, as explicit rewrites.

The ``.sql`` files of ``detfp_analyze.sql`` are the one source of the views; their comparison
fragments are rendered from ``detfp_analyze.rule`` for Spark directly (``to_sql`` dialect
``spark``). What is left is DuckDB syntax in the files themselves, rewritten here one construct
at a time (``TRANSLATIONS``, each with its reason and a test in tests/unit/test_spark_dialect.py).
``translate`` applies them all and refuses a text that still holds a DuckDB-only construct, so
a new view that needs a new translation fails loudly instead of silently differing.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["TRANSLATIONS", "Translation", "translate"]


def _hex64(x: str) -> str:
    # An exact uint64 (decimal(20,0) in Spark) as 16 lowercase hex digits: conv works on the
    # decimal text and handles the full unsigned range.
    return f"lpad(lower(conv(CAST({x.strip()} AS STRING), 10, 16)), 16, '0')"


@dataclass(frozen=True)
class Translation:
    """One DuckDB construct and its Spark SQL equivalent."""

    #: What is rewritten and why it is equivalent.
    why: str
    #: The DuckDB construct (a regular expression).
    pattern: str
    #: Its Spark SQL replacement (a template or a function of the match).
    replacement: str | Callable[[re.Match[str]], str]


TRANSLATIONS: tuple[Translation, ...] = (
    Translation(
        "views are session-scoped temporary views in Spark",
        r"\bCREATE\s+VIEW\b",
        "CREATE OR REPLACE TEMPORARY VIEW",
    ),
    Translation("DuckDB's EXCLUDE is Spark's EXCEPT", r"\*\s+EXCLUDE\s*\(", "* EXCEPT ("),
    Translation(
        "printf's %x needs an integer; Spark holds uint64 digests as decimal(20,0)",
        r"printf\('%016x%016x',\s*([\w.]+),\s*([\w.]+)\)",
        lambda m: f"concat({_hex64(m.group(1))}, {_hex64(m.group(2))})",
    ),
    Translation(
        "Spark has no UNION BY NAME; both sides are the same per-run view template, so their "
        "columns are in the same order and a positional UNION ALL is the same union",
        r"\bUNION\s+ALL\s+BY\s+NAME\b",
        "UNION ALL",
    ),
    Translation("a CTE is not materialized on request in Spark (same rows)", r"\bAS\s+MATERIALIZED\s*\(", "AS ("),
    Translation(
        "an ordered string aggregate: sort the collected values, then join them",
        r"string_agg\((\w+),\s*(chr\(\d+\))\s+ORDER\s+BY\s+\1\)",
        r"array_join(array_sort(collect_list(\1)), \2)",
    ),
    Translation(
        "an ordered list aggregate: sort the collected values",
        r"\blist\((\w+)\s+ORDER\s+BY\s+\1\)",
        r"array_sort(collect_list(\1))",
    ),
    Translation(
        "Spark allows FILTER on aggregates, not on window functions: count the rows that pass",
        r"count\(\*\)\s+FILTER\s+\(WHERE\s+((?:[^()]|\([^()]*\))*?)\)\s+OVER\b",
        r"sum(CASE WHEN \1 THEN 1 ELSE 0 END) OVER",
    ),
    Translation("VARCHAR needs a length in Spark; STRING is the unbounded text type", r"\bAS\s+VARCHAR\b", "AS STRING"),
    Translation("Spark spells INTEGER as INT", r"\bAS\s+INTEGER\b", "AS INT"),
)

#: DuckDB-only constructs that must not survive translation.
_LEFTOVERS = re.compile(
    r"\bEXCLUDE\s*\(|\bBY\s+NAME\b|\bMATERIALIZED\b|\bstring_agg\(|\blist\(|printf\(|\bVARCHAR\b|"
    r"FILTER\s+\(WHERE[^)]*\)\s+OVER",
    re.IGNORECASE,
)


def translate(sql: str) -> str:
    """``sql`` (a view of the ``.sql`` files) in Spark SQL; ValueError when a DuckDB-only construct
    has no translation yet."""
    for t in TRANSLATIONS:
        sql = re.sub(t.pattern, t.replacement, sql, flags=re.IGNORECASE)
    left = _LEFTOVERS.search(sql)
    if left:
        raise ValueError(f"no Spark translation for {left.group(0)!r}; add one to detfp_analyze.spark.dialect")
    return sql
