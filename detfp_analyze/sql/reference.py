"""The view reference of docs/sql.md, generated from the views' own documentation.

Each public view documented under its own heading (``### `a_records` `` or ``#### `pairs` ``) gets
its header comment as the paragraph below the heading and a table of every column (name, DuckDB
type, the ``@column`` or contract doc), all read from a live connection: the ``COMMENT ON`` text
that ``connect`` copies from the ``.sql`` files. ``update(doc, con)`` rewrites those sections and
leaves every other line alone; a test fails when docs/sql.md differs from ``update``'s answer.
Regenerate with ``python -m detfp_analyze.sql.reference --write docs/sql.md``.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import duckdb

__all__ = ["update", "view_section"]

_HEADING = re.compile(r"^(#{3,4}) `(\w+)`$")


def view_section(con: duckdb.DuckDBPyConnection, view: str) -> list[str]:
    """The doc paragraph and column table of ``view`` as Markdown lines."""
    row = con.execute("SELECT comment FROM duckdb_views() WHERE view_name = ?", [view]).fetchone()
    if row is None:
        raise LookupError(
            f"no view {view!r} in the connection: docs/sql.md documents a view that connect() no longer makes"
        )
    (doc,) = row
    cols = con.execute(
        "SELECT column_name, data_type, comment FROM duckdb_columns() WHERE table_name = ? ORDER BY column_index",
        [view],
    ).fetchall()
    if view.startswith("a_"):  # one section documents both runs' views
        doc = (doc or "").replace(" of run a", " of run a (`b_*`: the same for run b)", 1)
    lines = [doc or "", "", "| column | type | meaning |", "|---|---|---|"]
    lines += [f"| `{c}` | {t} | {(d or '').replace('|', '&#124;')} |" for c, t, d in cols]
    return lines


def update(doc: str, con: duckdb.DuckDBPyConnection) -> str:
    """``doc`` with every single-view section regenerated from ``con`` (a two-run connection)."""
    views = {v for (v,) in con.execute("SELECT view_name FROM duckdb_views() WHERE NOT internal").fetchall()}
    lines = doc.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        out.append(lines[i])
        m = _HEADING.match(lines[i])
        i += 1
        if not m or m.group(2) not in views:
            continue
        # Skip the old paragraph and table: up to the next heading or the blank line after the table.
        j = i
        while j < len(lines) and not lines[j].startswith("#"):
            if lines[j].startswith("|") and (j + 1 == len(lines) or not lines[j + 1].startswith("|")):
                j += 1
                break
            j += 1
        out += ["", *view_section(con, m.group(2))]
        i = j
    return "\n".join(out)


def _main(argv: list[str]) -> int:
    from detfp_analyze.sql.views import connect

    if len(argv) != 2 or argv[0] != "--write":
        print("usage: python -m detfp_analyze.sql.reference --write docs/sql.md", file=sys.stderr)
        return 2
    root = Path(__file__).resolve().parents[2]
    path = Path(argv[1])
    with connect(root / "sample_traces/ops/a", root / "sample_traces/ops/b") as con:
        path.write_text(update(path.read_text(encoding="utf-8"), con), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
