"""The ``--engine``, ``--master`` and ``--conf`` options of ``bisect`` and ``sql``, shared.

``--engine local`` (default) is polars and DuckDB on this machine; ``--engine spark`` runs the
heavy stages on Apache Spark (``detfp_analyze.spark``; docs/spark.md). The Spark session starts
only after the runs were opened, validated and found comparable, so bad input fails in a second
with the same one-line errors, and its JVM writes start-up noise and stack traces to a log
file, never to the terminal or the report.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer

__all__ = [
    "ConfOption",
    "EngineOption",
    "MasterOption",
    "bisect_engine",
    "check",
    "parse_conf",
    "spark_query",
    "spark_session",
]

EngineOption = Annotated[
    str,
    typer.Option(
        "--engine",
        metavar="ENGINE",
        help="Where the heavy stages run: local (polars/DuckDB) or spark (Apache Spark; docs/spark.md).",
    ),
]
MasterOption = Annotated[
    str | None,
    typer.Option("--master", metavar="URL", help="With --engine spark: the Spark master (default local[*])."),
]
ConfOption = Annotated[
    list[str] | None,
    typer.Option("--conf", metavar="KEY=VALUE", help="With --engine spark: a Spark setting (repeatable)."),
]
ENGINES = ("local", "spark")


def parse_conf(items: list[str] | None) -> list[tuple[str, str]]:
    """``["k=v", ...]`` -> [(k, v), ...]; ValueError naming the item without ``=``."""
    out = []
    for item in items or ():
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(item)
        out.append((key.strip(), value))
    return out


def check(engine: str, master: str | None, conf: list[str] | None) -> str | None:
    """The one-line complaint about these options, or None when they are usable."""
    if engine not in ENGINES:
        return f"--engine {engine!r}: not an engine; use local or spark"
    if engine == "local" and (master or conf):
        return "--master and --conf configure Spark; add --engine spark"
    try:
        parse_conf(conf)
    except ValueError as exc:
        return f"--conf {exc.args[0]!r}: not KEY=VALUE; use e.g. --conf spark.executor.memory=8g"
    return None


def spark_session(master: str | None, conf: list[str] | None) -> Any:
    """The Spark session for a command, started with the JVM's stderr in a log file."""
    from detfp_analyze.spark.runtime import quiet_jvm, session

    with quiet_jvm():
        return session(master, parse_conf(conf))


def bisect_engine(master: str | None, conf: list[str] | None) -> Any:
    """``bisect``'s ``engine`` argument for ``--engine spark``: the heavy stages on a quiet session,
    started when bisect binds its runs (after they were found comparable: an incomparable pair
    fails in a second, without a JVM)."""

    def bind(run_a: Any, run_b: Any) -> Any:
        from detfp_analyze.spark import engine

        return engine(spark_session(master, conf))(run_a, run_b)

    return bind


def spark_query(
    runs: list[str],
    sql: str,
    allow_missing_ranks: bool,
    allow_incomplete: bool,
    allow_file_access: bool,
    master: str | None,
    conf: list[str] | None,
) -> Any:
    """``sql --engine spark``: the query over the views on Spark, as an Arrow table (runs opened
    and validated first: bad input fails before a JVM starts)."""
    from detfp_analyze.io.reader import open_run
    from detfp_analyze.spark.views import connect, query

    opened = [open_run(r, allow_missing_ranks=allow_missing_ranks, allow_incomplete=allow_incomplete) for r in runs]
    spark = spark_session(master, conf)
    connect(spark, *opened)
    return query(spark, sql, allow_file_access=allow_file_access)
