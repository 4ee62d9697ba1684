"""SQL views, perfetto-style: tiny inline runs -> query -> expected rows; expected-error cases."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from detfp_analyze.cli import app
from detfp_analyze.errors import QueryError
from detfp_analyze.io.reader import open_run
from detfp_analyze.sql import connect, query
from tests.fixtures.shards import hexdigest, write_run


def rec(name: str, role: str = "output", digest: str = "x", **kw) -> dict:
    return dict(step=kw.pop("step", 0), name=name, role=role, digest=hexdigest(digest), **kw)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """Rank 0: mm matches, add differs, relu only in A, gelu only in B (inserted before add in B).
    Rank 1: the later record (by key hash order) differs first in execution order.
    Rank 2: identical."""
    root = tmp_path_factory.mktemp("pair")
    a0 = [
        rec("aten::mm.default", "input", "mm.in"),
        rec("aten::mm.default", digest="mm.out"),
        rec("aten::add.Tensor", "input", "add.in"),
        rec("aten::add.Tensor", digest="add.out.a"),
        rec("aten::relu.default", digest="relu"),
    ]
    b0 = [
        rec("aten::mm.default", "input", "mm.in"),
        rec("aten::mm.default", digest="mm.out"),
        rec("aten::gelu.default", digest="gelu"),
        rec("aten::add.Tensor", "input", "add.in"),
        rec("aten::add.Tensor", digest="add.out.b"),
    ]
    # Rank 1: z_late runs first in A's order and differs; a_early runs later and differs too.
    a1 = [rec("z_late", digest="z.a"), rec("a_early", digest="e.a")]
    b1 = [rec("z_late", digest="z.b"), rec("a_early", digest="e.b")]
    same = [rec("aten::mm.default", digest="m")]
    loss = 2.5
    a = write_run(
        root / "a",
        {
            0: {"records": a0, "metrics": [dict(step=0, name="loss", value=loss)]},
            1: {"records": a1},
            2: {"records": same},
        },
    )
    b = write_run(
        root / "b",
        {
            0: {"records": b0, "metrics": [dict(step=0, name="loss", value=2.5000000000000004)]},
            1: {"records": b1},
            2: {"records": same},
        },
    )
    con = connect(a, b)
    yield a, b, con
    con.close()


def rows(con, sql: str) -> list[tuple]:
    return con.sql(sql).fetchall()


def test_pairs_keep_one_sided_records(pair):
    _, _, con = pair
    got = rows(con, "SELECT name, role, match FROM pairs WHERE rank = 0 ORDER BY coalesce(seq_a, seq_b + 0.5), name")
    assert got == [
        ("aten::mm.default", "input", "same"),
        ("aten::mm.default", "output", "same"),
        ("aten::add.Tensor", "input", "same"),
        ("aten::gelu.default", "output", "only_b"),
        ("aten::add.Tensor", "output", "differs"),
        ("aten::relu.default", "output", "only_a"),
    ]


def test_first_divergence_uses_a_order_and_places_insertions(pair):
    _, _, con = pair
    got = rows(con, "SELECT rank, step, name, match, seq_a, seq_b, call_inputs, inputs_differing FROM first_divergence")
    # Rank 0: gelu (only in B) was inserted before add's output in execution order: it comes first.
    # Rank 1: z_late executed first, although a_early sorts first by name or key.
    assert got == [
        (0, 0, "aten::gelu.default", "only_b", None, 2, 0, 0),
        (1, 0, "z_late", "differs", 0, 0, 0, 0),
    ]


def test_first_divergence_counts_the_calls_inputs(tmp_path):
    a = write_run(
        tmp_path / "a",
        {0: {"records": [rec("mm", "input", "x"), rec("mm", "input", "w", arg="args[1]"), rec("mm", digest="y")]}},
    )
    b = write_run(
        tmp_path / "b",
        {0: {"records": [rec("mm", "input", "x"), rec("mm", "input", "w", arg="args[1]"), rec("mm", digest="z")]}},
    )
    with connect(a, b) as con:
        assert rows(con, "SELECT name, role, call_inputs, inputs_differing FROM first_divergence") == [
            ("mm", "output", 2, 0)
        ]


def test_step_summary(pair):
    _, _, con = pair
    assert rows(con, "SELECT * FROM step_summary") == [
        (0, 0, 6, 3, 1, 1, 1, 0),
        (1, 0, 2, 0, 2, 0, 0, 0),
        (2, 0, 1, 1, 0, 0, 0, 0),
    ]


def test_metric_pairs_compare_bits(pair):
    _, _, con = pair
    got = rows(con, "SELECT rank, name, match, bits_b - bits_a, delta > 0 FROM metric_pairs")
    assert got == [(0, "loss", "differs", 1, True)]


def test_digest_hex_and_unions(pair):
    a, _, con = pair
    (d,) = rows(con, "SELECT digest FROM a_records WHERE rank = 2")[0]
    assert d == hexdigest("m")
    assert rows(con, "SELECT run, count(*) FROM records GROUP BY run ORDER BY run") == [("a", 8), ("b", 8)]
    assert rows(con, "SELECT count(*) FROM a_kernels") == [(0,)]
    cols = [r[0] for r in rows(con, "SELECT column_name FROM (DESCRIBE a_kernels)")]
    assert cols[:4] == ["rank", "segment", "step", "seq"] and cols[-1] == "shard"
    shard = rows(con, "SELECT DISTINCT shard FROM a_records WHERE rank = 2")[0][0]
    assert shard.startswith(str(open_run(a).path)) and "/records/rank=2/" in shard


def test_the_users_listing_holds_the_public_views_only(pair):
    """Private helpers (``_aligned``, ...) live in their own schema (issue 42: 23 of them were listed
    beside the 17 public views); the public views still read them, and they can be named qualified."""
    from detfp_analyze.sql.views import PRIVATE, two_run_views

    _, _, con = pair
    listed = sorted(r[0] for r in rows(con, "SHOW TABLES"))
    main = sorted(r[0] for r in rows(con, "SELECT view_name FROM duckdb_views() WHERE schema_name = 'main' AND NOT internal"))
    assert listed == main and not [v for v in main if v.startswith("_")]
    assert set(two_run_views()) <= set(main)
    private = {r[0] for r in rows(con, f"SELECT view_name FROM duckdb_views() WHERE schema_name = '{PRIVATE}'")}
    assert {"_aligned", "_step_walk", "_scope_window", "_a_records_src"} <= private
    assert rows(con, f"SELECT count(*) > 0 FROM {PRIVATE}._aligned") == [(True,)]


def test_every_view_and_column_documented(pair):
    _, _, con = pair
    undocumented = rows(
        con,
        "SELECT table_name, column_name FROM duckdb_columns() WHERE NOT internal AND coalesce(comment, '') = ''",
    )
    assert undocumented == []
    views = rows(con, "SELECT view_name FROM duckdb_views() WHERE NOT internal AND coalesce(comment, '') = ''")
    assert views == []


def test_single_run_connection(tmp_path):
    a = write_run(tmp_path / "a", {0: {"records": [rec("aten::mm.default")]}})
    con = connect(a)
    assert rows(con, "SELECT run, name FROM records") == [("a", "aten::mm.default")]
    with pytest.raises(QueryError, match=r"^query failed: view pairs compares two runs and this connection has one;"):
        query(con, "SELECT * FROM pairs")
    # Every two-run view is named, and a name that is no view at all keeps DuckDB's reason.
    with pytest.raises(QueryError, match=r"first_divergence, metric_pairs, pairs, step_summary$"):
        query(con, "SELECT * FROM first_divergence")
    with pytest.raises(QueryError, match=r"^query failed: Catalog Error: Table with name nope does not exist!"):
        query(con, "SELECT * FROM nope")


def test_sql_cli_says_which_views_need_two_runs(tmp_path):
    from typer.testing import CliRunner

    from detfp_analyze.cli import app

    a = write_run(tmp_path / "a", {0: {"records": [rec("aten::mm.default")]}})
    res = CliRunner().invoke(app, ["sql", str(a), "SELECT * FROM first_divergence"])
    assert res.exit_code == 2
    assert "view first_divergence compares two runs and this connection has one; pass both runs" in res.output
    assert "Did you mean" not in res.output


def test_superseded_rows_dropped_like_the_reader(tmp_path):
    # Segment 0 captured steps 0-2; a resume (segment 1) captured steps 1-2 again.
    write_run(tmp_path / "r", {0: {"records": [rec("op", step=s, digest=f"s0-{s}") for s in range(3)]}})
    write_run(
        tmp_path / "r",
        {0: {"records": [rec("op", step=s, digest=f"s1-{s}", seq=100 + s) for s in (1, 2)]}},
        segment=1,
        start_step=1,
    )
    run = open_run(tmp_path / "r")
    con = connect(run)
    got = rows(con, "SELECT step, segment, digest FROM a_records ORDER BY step")
    assert got == [(0, 0, hexdigest("s0-0")), (1, 1, hexdigest("s1-1")), (2, 1, hexdigest("s1-2"))]
    expected = run.scan("records").select("step", "segment").sort("step").collect().rows()
    assert [g[:2] for g in got] == expected


def test_query_error_is_one_line():
    con = connect.__globals__["duckdb"].connect()
    with pytest.raises(QueryError) as e:
        query(con, "SELEC 1")
    assert "\n" not in str(e.value)
    assert str(e.value).startswith('query failed: Parser Error: syntax error at or near "SELEC"')


def test_cli_formats(pair, tmp_path):
    a, b, _ = pair
    runner = CliRunner()
    q = "SELECT rank, name, match FROM first_divergence"
    r = runner.invoke(app, ["sql", str(a), str(b), q])
    assert r.exit_code == 0, r.output
    assert r.output == (
        "rank  name                match\n"
        "----  ------------------  -------\n"
        "   0  aten::gelu.default  only_b\n"
        "   1  z_late              differs\n"
        "(2 rows)\n"
    )
    r = runner.invoke(app, ["sql", str(a), str(b), q, "--format", "csv"])
    assert r.output == "rank,name,match\n0,aten::gelu.default,only_b\n1,z_late,differs\n"
    r = runner.invoke(
        app, ["sql", str(a), str(b), "SELECT digest_hi, rows FROM a_records WHERE rank = 2", "-f", "json"]
    )
    (obj,) = json.loads(r.output)
    assert obj == {"digest_hi": int(hexdigest("m")[:16], 16), "rows": None}
    out = tmp_path / "fd.parquet"
    r = runner.invoke(app, ["sql", str(a), str(b), q, "--format", "parquet", "--output", str(out)])
    assert r.exit_code == 0 and pq.read_table(out).num_rows == 2


def test_cli_errors(pair):
    a, b, _ = pair
    runner = CliRunner()
    r = runner.invoke(app, ["sql", str(a), str(b), "SELECT * FROM nope"])
    assert r.exit_code == 2
    assert r.output.startswith("detfp-analyze: query failed: Catalog Error: Table with name nope does not exist!")
    assert r.output.count("\n") == 1
    r = runner.invoke(app, ["sql", str(a), "SELECT 1", "--format", "parquet"])
    assert r.exit_code == 2 and "--output" in r.output
    r = runner.invoke(app, ["sql", "SELECT 1"])
    assert r.exit_code == 2 and "RUN_A [RUN_B]" in r.output
