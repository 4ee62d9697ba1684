"""docs/sql.md documents every public view and column, and every SQL example in it runs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from detfp_analyze.sql import connect, view_docs
from detfp_analyze.testing.synth import Plant, SynthSpec, write_pair

DOC = (Path(__file__).parent.parent / "docs" / "sql.md").read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def con(tmp_path_factory):
    root = tmp_path_factory.mktemp("sqldocs")
    p = write_pair(root / "a", root / "b", SynthSpec(ranks=2, steps=2, records=200), Plant(rank=1, step=1, index=20))
    c = connect(p.a, p.b)
    yield c
    c.close()


def test_every_public_view_and_column_is_in_the_doc(con):
    views = [v for (v,) in con.sql("SELECT view_name FROM duckdb_views() WHERE NOT internal").fetchall()]
    public = sorted(v for v in views if not v.startswith(("_", "b_")))
    assert {"a_records", "pairs", "first_divergence", "metric_pairs", "step_summary", "records"} <= set(public)
    for v in public:
        assert f"`{v}`" in DOC, f"docs/sql.md does not document view {v}"
        for (col,) in con.sql(f"SELECT column_name FROM (DESCRIBE {v})").fetchall():
            assert f"`{col}`" in DOC, f"docs/sql.md does not document column {v}.{col}"


def test_sql_files_document_each_view():
    for file in ("run.sql", "union_a.sql", "union_ab.sql", "compare.sql"):
        for v in view_docs(file):
            assert v.doc, f"{file}: view {v.name} has no header comment"


@pytest.mark.parametrize("sql", re.findall(r"```sql\n(.*?)```", DOC, flags=re.S))
def test_sql_examples_run(con, sql):
    for stmt in (s for s in sql.split(";") if s.strip()):
        con.sql(stmt).fetchall()
