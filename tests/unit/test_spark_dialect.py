"""The views' DuckDB SQL rewritten for Spark (``detfp_analyze.spark.dialect``), without a JVM.

Each translation is pinned by a case; every view of every ``.sql`` file translates with no
DuckDB-only construct left; a construct without a translation is refused. The rewritten views
run on Spark in ``tests/integration/test_spark_views.py``.
"""

from __future__ import annotations

import pytest

from detfp_analyze.spark.dialect import TRANSLATIONS, translate
from detfp_analyze.sql.views import rule_fragments, view_docs

CASES = [
    ("CREATE VIEW x AS SELECT 1", "CREATE OR REPLACE TEMPORARY VIEW x AS SELECT 1"),
    ("SELECT * EXCLUDE (shard) FROM t", "SELECT * EXCEPT (shard) FROM t"),
    (
        "printf('%016x%016x', digest_hi, digest_lo)",
        "concat(lpad(lower(conv(CAST(digest_hi AS STRING), 10, 16)), 16, '0'), "
        "lpad(lower(conv(CAST(digest_lo AS STRING), 10, 16)), 16, '0'))",
    ),
    ("SELECT 1 AS a UNION ALL BY NAME SELECT 2 AS a", "SELECT 1 AS a UNION ALL SELECT 2 AS a"),
    ("WITH w AS MATERIALIZED (SELECT 1)", "WITH w AS (SELECT 1)"),
    ("string_agg(sig, chr(30) ORDER BY sig)", "array_join(array_sort(collect_list(sig)), chr(30))"),
    ("list(call ORDER BY call)", "array_sort(collect_list(call))"),
    (
        "count(*) FILTER (WHERE role = 'input' AND match <> 'same') OVER (PARTITION BY rank)",
        "sum(CASE WHEN role = 'input' AND match <> 'same' THEN 1 ELSE 0 END) OVER (PARTITION BY rank)",
    ),
    ("count(*) FILTER (WHERE match = 'same') AS same", "count(*) FILTER (WHERE match = 'same') AS same"),
    ("CAST(x AS VARCHAR)", "CAST(x AS STRING)"),
    ("CAST(x AS INTEGER)", "CAST(x AS INT)"),
]


@pytest.mark.parametrize(("duck", "spark"), CASES)
def test_each_translation(duck, spark):
    assert translate(duck) == spark


def test_every_translation_has_a_case():
    import re

    hit = {t.why for t in TRANSLATIONS for duck, _ in CASES if re.search(t.pattern, duck, re.IGNORECASE)}
    assert hit == {t.why for t in TRANSLATIONS}


def test_untranslated_duckdb_construct_is_refused():
    with pytest.raises(ValueError, match="no Spark translation for"):
        translate("SELECT string_agg(x, ',') FROM t")


@pytest.mark.parametrize("file", ["run.sql", "union_a.sql", "union_ab.sql", "compare.sql", "first_divergence.sql"])
def test_every_view_translates(file):
    views = view_docs(file, "a", "spark")
    assert views
    for v in views:
        assert translate(v.sql).startswith("CREATE OR REPLACE TEMPORARY VIEW")


def test_the_rule_fragments_are_rendered_for_spark():
    """The same rule, Spark's spelling: null-safe equality and array sizes differ from DuckDB's."""
    duck, spark = rule_fragments("duckdb"), rule_fragments("spark")
    assert duck.keys() == spark.keys()
    assert "IS NOT DISTINCT FROM" in duck["match"] and "<=>" in spark["match"]
    assert "IS NOT DISTINCT FROM" not in spark["match"]
