"""docs/sql.md documents every public view and column, and every SQL example in it runs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from detfp_analyze.sql import connect, view_docs
from detfp_analyze.sql import views as sql_views
from detfp_analyze.sql.reference import update, view_section
from detfp_analyze.testing.synth import Plant, SynthSpec, write_pair

DOC = (Path(__file__).parent.parent.parent / "docs" / "sql.md").read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def con(tmp_path_factory):
    root = tmp_path_factory.mktemp("sqldocs")
    p = write_pair(root / "a", root / "b", SynthSpec(ranks=2, steps=2, records=200), Plant(rank=1, step=1, index=20))
    c = connect(p.a, p.b)
    yield c
    c.close()


def test_every_public_view_and_column_is_in_the_doc(con):
    """Each public view has its own section whose paragraph and column table (name, type, doc, in
    order) are exactly what the connection documents; the union views share one section."""
    views = [v for (v,) in con.sql("SELECT view_name FROM duckdb_views() WHERE NOT internal").fetchall()]
    public = sorted(v for v in views if not v.startswith(("_", "b_")))
    assert {"a_records", "pairs", "first_divergence", "metric_pairs", "step_summary", "records"} <= set(public)
    assert update(DOC, con) == DOC, (
        "docs/sql.md is stale: regenerate it with `python -m detfp_analyze.sql.reference --write docs/sql.md`"
    )
    unions = ("records", "metrics", "events")
    for v in public:
        heading = "### `records`, `metrics`, `events`" if v in unions else f"`{v}`\n\n"
        assert heading in DOC, f"docs/sql.md has no section for view {v}"
        if v not in unions:
            section = DOC.split(f"# `{v}`\n\n", 1)[1].split("\n#", 1)[0]
            for line in view_section(con, v):
                assert line in section.splitlines(), f"docs/sql.md, view {v}: missing {line!r}"
    union = DOC.split("### `records`, `metrics`, `events`", 1)[1].split("\n#", 1)[0]
    assert "| `run` | VARCHAR |" in union


def test_sql_files_document_each_view():
    files = sorted(p.name for p in Path(sql_views.__file__).parent.glob("*.sql"))
    assert "first_divergence.sql" in files and len(files) >= 5, files
    for file in files:
        found = view_docs(file)
        assert found, f"{file}: no view found"
        for v in found:
            assert v.doc, f"{file}: view {v.name} has no header comment"


@pytest.mark.parametrize("sql", re.findall(r"```sql\n(.*?)```", DOC, flags=re.S))
def test_sql_examples_run(con, sql):
    for stmt in (s for s in sql.split(";") if s.strip()):
        con.sql(stmt).fetchall()
