"""`detfp-analyze sql A [B] "QUERY"`: run one SQL query over the documented views (docs/sql.md).

Output as an aligned text table (default), CSV, JSON (an array of objects; uint64 digests
stay exact integers) or Parquet (needs --output). Byte-stable for a given result: no
timestamps, no terminal-width dependent truncation. Exit 0 on success, 2 with one line on
stderr for a bad run directory or a failing query (DuckDB's reason). The query can read only
the runs' shards unless --allow-file-access is given (see ``detfp_analyze.sql``).
"""

from __future__ import annotations

import csv
import io
import math
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from detfp_analyze._cli import engine as _engine
from detfp_analyze._cli.common import ALLOW_INCOMPLETE_HELP, echo, fail, handle_errors, write_output
from detfp_format import strictjson

if TYPE_CHECKING:  # pyarrow is imported by the command itself: other commands start without it
    import pyarrow as pa

__all__ = ["command", "format_table"]


class Format(str, Enum):
    """Output formats."""

    table = "table"
    csv = "csv"
    json = "json"
    parquet = "parquet"


def _cell(v: Any) -> Any:
    """A JSON-able value: bytes as hex, non-finite floats as their ``strictjson.NONFINITE`` strings,
    nested values recursively."""
    if isinstance(v, bytes):
        return v.hex()
    if isinstance(v, float) and not math.isfinite(v):
        return strictjson.finite(v)
    if isinstance(v, list):
        return [_cell(x) for x in v]
    if isinstance(v, dict):
        return {k: _cell(x) for k, x in v.items()}
    return v


def _text(v: Any) -> str:
    if v is None:
        return "NULL"
    if isinstance(v, float):
        return repr(v)  # shortest exact round-trip form: never hides a 1-ULP difference
    if isinstance(v, (list, dict)):
        return strictjson.dumps(_cell(v))
    if isinstance(v, bytes):
        return v.hex()
    return str(v)


def format_table(t: pa.Table) -> str:
    """An aligned plain-text rendering of ``t`` (header, rule, one line per row, row count)."""
    import pyarrow as pa

    names = t.column_names
    rows = [[_text(v) for v in row.values()] for row in t.to_pylist()]
    widths = [max([len(n)] + [len(r[i]) for r in rows]) for i, n in enumerate(names)]
    numeric = [pa.types.is_integer(f.type) or pa.types.is_floating(f.type) for f in t.schema]

    def line(cells: list[str]) -> str:
        return "  ".join(
            c.rjust(w) if num else c.ljust(w) for c, w, num in zip(cells, widths, numeric, strict=True)
        ).rstrip()

    out = [line(names), line(["-" * w for w in widths])] + [line(r) for r in rows]
    out.append(f"({t.num_rows} row{'s' if t.num_rows != 1 else ''})")
    return "\n".join(out) + "\n"


def _csv(t: pa.Table) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(t.column_names)
    for row in t.to_pylist():
        w.writerow(["" if v is None else _text(v) for v in row.values()])
    return buf.getvalue()


def _json(t: pa.Table) -> str:
    return strictjson.dumps([_cell(r) for r in t.to_pylist()], indent=1) + "\n"


@handle_errors
def command(
    args: Annotated[
        list[str],
        typer.Argument(
            help="Run A, optionally run B, then the query (views: docs/sql.md).",
            metavar="RUN_A [RUN_B] QUERY",
            show_default=False,
        ),
    ],
    fmt: Annotated[
        Format, typer.Option("--format", "-f", metavar="FORMAT", help="Output format: table|csv|json|parquet.")
    ] = Format.table,
    output: Annotated[
        Path | None,
        typer.Option("--output", "-o", metavar="FILE", help="Write the result to this file instead of stdout."),
    ] = None,
    allow_missing_ranks: Annotated[
        bool, typer.Option("--allow-missing-ranks", help="Open runs even if some ranks are missing.")
    ] = False,
    allow_incomplete: Annotated[bool, typer.Option("--allow-incomplete", help=ALLOW_INCOMPLETE_HELP)] = False,
    allow_file_access: Annotated[
        bool,
        typer.Option(
            "--allow-file-access",
            help="Let the query read and write files other than the runs' shards (off: it can read only the runs).",
        ),
    ] = False,
    engine: _engine.EngineOption = "local",
    master: _engine.MasterOption = None,
    conf: _engine.ConfOption = None,
) -> None:
    """Run a SQL query over one or two runs' views: a_records, pairs, first_divergence, step_summary, ..."""
    if len(args) not in (2, 3):
        fail(f'sql takes RUN_A [RUN_B] "QUERY", got {len(args)} argument(s); quote the query as one argument')
    *runs, sql = args
    problem = _engine.check(engine, master, conf)
    if problem:
        fail(problem)
    if engine == "spark":
        result = _engine.spark_query(runs, sql, allow_missing_ranks, allow_incomplete, allow_file_access, master, conf)
    else:
        # Imported here: DuckDB takes longer to import than most bisects take to run.
        from detfp_analyze.sql import connect, query

        con = connect(
            runs[0],
            runs[1] if len(runs) == 2 else None,
            allow_missing_ranks=allow_missing_ranks,
            allow_incomplete=allow_incomplete,
            allow_file_access=allow_file_access,
        )
        try:
            result = query(con, sql)
        finally:
            con.close()
    if fmt is Format.parquet:
        if output is None:
            fail("--format parquet writes binary data; pass --output FILE.parquet")
        import pyarrow.parquet as pq

        write_output(output, lambda path: pq.write_table(result, path), "--output")
        return
    text = {Format.table: format_table, Format.csv: _csv, Format.json: _json}[fmt](result)
    if output is None:
        # On a terminal (names from the trace escaped; JSON escapes them itself); a file (-o) holds the data as it is.
        echo(text)
    else:
        write_output(output, text, "--output")
