"""Golden equivalence: SQL ``first_divergence`` and ``bisect`` name the same record on every rank.

Both engines take the comparison rule from ``detfp_analyze.rule`` and the scope from
``detfp_analyze.bisect.scope``; this proves they agree where it matters, on every bundled sample
pair and every synthetic plant (``detfp_analyze.testing.plants.HOWS`` and its modifiers), plus
random edits of tiny runs (a property test). "The same record" is the rank's ``first``
(step, key_hash) and, past a likely false root, its ``next_clean``. A future engine (Spark) adds
itself to ``ENGINES``-style checks here with the same cases.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from detfp_analyze import rule
from detfp_analyze.bisect import bisect
from detfp_analyze.bisect.result import BisectResult, Divergence
from detfp_analyze.io.reader import open_run
from detfp_analyze.rule.expr import Case, Lit
from detfp_analyze.sql import connect
from detfp_format.contract import call_key, key_hash, record_key
from tests.fixtures.pairs import PLANTS, SAMPLE_PAIRS, SAMPLES, build_pair, template


def record_key_of(d: Divergence | None) -> tuple[int, int] | None:
    """(step, key_hash) of a divergence (bisect reports the call-site key, SQL the hash)."""
    if d is None:
        return None
    return d.step, key_hash(
        record_key(call_key(d.microbatch, d.phase, d.module, d.kind, d.op, d.occurrence), d.role, d.arg)
    )


def by_bisect(res: BisectResult) -> dict[int, tuple]:
    return {r.rank: (record_key_of(r.first), record_key_of(r.next_clean)) for r in res.ranks if r.first is not None}


def by_sql(a, b) -> dict[int, tuple]:
    with connect(a, b) as con:
        rows = con.sql("SELECT rank, step, key_hash, next_step, next_key_hash FROM first_divergence").fetchall()
    return {r: ((s, k), None if ns is None else (ns, nk)) for r, s, k, ns, nk in rows}


def assert_same_records(a, b) -> BisectResult:
    res = bisect(a, b)
    assert by_sql(a, b) == by_bisect(res)
    return res


def test_every_sample_run_is_in_a_pair():
    """A run added to sample_traces/ joins the golden test (its pair goes into SAMPLE_PAIRS)."""
    runs = {str(m.parent.parent.relative_to(SAMPLES)) for m in SAMPLES.glob("*/*/manifest/rank=0")}
    assert runs == {r for pair in SAMPLE_PAIRS for r in pair}


@pytest.mark.parametrize(("a", "b"), SAMPLE_PAIRS, ids=[f"{a}:{b}" for a, b in SAMPLE_PAIRS])
def test_sample_pairs(a, b):
    res = assert_same_records(open_run(SAMPLES / a), open_run(SAMPLES / b))
    assert res.diverged == (b != "resume/restored")


@pytest.fixture
def planted(planted_pairs):
    """The pairs of ``PLANTS`` (``conftest.planted_pairs``: written once per session, shared with
    the Spark engine's equivalence test)."""
    return planted_pairs


@pytest.mark.parametrize("name", [*PLANTS, "identical"])
def test_synthetic_plants(planted, name):
    p = planted[name]
    missing = bool(p.plant and p.plant.missing_ranks)
    a, b = open_run(p.a, allow_missing_ranks=missing), open_run(p.b, allow_missing_ranks=missing)
    res = assert_same_records(a, b)
    # And both name the planted record (the generator's answer) on every rank that diverged.
    got = {r.rank: (r.first.step, record_key_of(r.first)[1], r.first.verdict) for r in res.ranks if r.first}
    assert got == {e.rank: (e.step, e.key_hash, e.verdict) for e in p.expected}


def test_hazard_plant_names_the_false_root_and_the_next_clean_record(planted):
    res = bisect(planted["hazard"].a, planted["hazard"].b)
    r1 = res.rank(1)
    assert r1.first.hazards == ("uninitialized",) and r1.next_clean is not None and not r1.next_clean.hazards


LABELS = [r["label"] for r in template(0)]
EDIT = st.sampled_from(["change", "after", "extra", "extra_view", "drop", "hazard", "error", "skip", "args"])


def edit_of(kind: str, label: str) -> dict:
    """One edit of run B's records (tests.fixtures.pairs vocabulary)."""
    row = next(r for r in template(0) if r["label"] == label)
    extra = dict(module=row.get("module", ""), name="aten::clone.default", role="output", arg="out[0]")
    return {
        "change": {"change": (label,)},
        "after": {"after": label},
        "extra": {"extra_before": {label: [extra]}},
        "extra_view": {"extra_before": {label: [dict(extra, name="aten::view.default", status="skipped")]}},
        "drop": {"drop": (label,)},
        "hazard": {"change": (label,), "set": {label: {"hazards": ["uninitialized"]}}},
        "error": {"set": {label: {"status": "error", "digest": None, "error": "boom"}}},
        "skip": {"change": (label,), "set": {label: {"status": "skipped", "digest": None}}},
        "args": {"set": {label: {"args_digest": "00000000000000b2"}}},
    }[kind]


@settings(max_examples=15, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.integers(0, 1), st.integers(0, 2), EDIT, st.sampled_from(LABELS)), min_size=1, max_size=3))
def test_random_edits(edits):
    """Up to three edits of run B (values, extra calls, missing records, hazards, digest errors,
    skipped digests, arguments) on two ranks and three steps: the engines agree on every rank."""
    by_site: dict[tuple[int, int], dict] = {}
    for rank, step, kind, label in edits:
        by_site.setdefault((rank, step), edit_of(kind, label))  # one edit per rank-step
    with tempfile.TemporaryDirectory() as d:
        a, b = build_pair(Path(d), world=2, steps=range(3), edits_b=by_site, open_runs=False)
        assert_same_records(str(a), str(b))


def args_only_pair(root: Path) -> tuple[Path, Path, int]:
    """The issue's reproduction: run B is sample_traces/ops/a with the ``args_digest`` of one op
    record changed (rank 0, step 1, the first record of ``aten::sum.dim_IntList``); returns the
    runs and that record's key_hash. Before the single rule, bisect reported it and SQL
    ``first_divergence`` returned no row."""
    b = root / "b"
    shutil.copytree(SAMPLES / "ops" / "a", b)
    shard = b / "records" / "rank=0" / "part-s00000-w0000000.parquet"
    table = pq.read_table(shard)
    df = pl.from_arrow(table).with_row_index("i")
    hit = df.filter((pl.col("name") == "aten::sum.dim_IntList") & (pl.col("step") == 1)).row(0, named=True)
    args = table.column("args_digest").to_pylist()
    assert args[hit["i"]] != "00000000000000ff"
    args[hit["i"]] = "00000000000000ff"
    at = table.schema.get_field_index("args_digest")
    pq.write_table(table.set_column(at, table.schema.field(at), pa.array(args, table.schema.field(at).type)), shard)
    return SAMPLES / "ops" / "a", b, int(hit["key_hash"])


def test_an_arguments_only_difference_is_the_same_record_for_both_engines(tmp_path):
    a, b, key = args_only_pair(tmp_path)
    res = assert_same_records(open_run(a), open_run(b))
    assert by_bisect(res) == {0: ((1, key), None)}
    f = res.rank(0).first
    # The call site passed another argument: a local start, not an input made by an uncaptured producer.
    assert (f.op, f.role, f.verdict, f.diff_kind) == ("aten::sum.dim_IntList", "input", "origin", "arguments")
    assert "non-tensor arguments" in f.explanation and "input tensor" not in f.explanation
    assert res.rank(1).status == "identical"


#: The SQL rule before it was shared: arguments ignored (tensors alone decide).
_TENSORS_ONLY = Case((*rule.MATCH.whens[:-1], (rule.TENSORS_EQUAL, Lit(rule.SAME))), Lit(rule.DIFFERS))
#: An engine that reads a failed digest as a difference (align's answer before the shared rule).
_ERROR_DIFFERS = Case(tuple(w for w in rule.MATCH.whens if w[1] != Lit(rule.UNKNOWN)), rule.MATCH.default)


@pytest.mark.parametrize("old", [_TENSORS_ONLY, _ERROR_DIFFERS], ids=["args_ignored", "error_differs"])
def test_the_golden_check_catches_an_engine_with_another_rule(monkeypatch, tmp_path, planted, old):
    """The golden check can fail: the SQL views rendered from either old rule (``rule.MATCH`` is
    read when a connection is made; bisect's polars rendering was taken at import) disagree with
    bisect on the issue's reproduction or on the matching plant."""
    case = args_only_pair(tmp_path) if old is _TENSORS_ONLY else None
    monkeypatch.setattr(rule, "MATCH", old)
    if case is not None:
        a, b = open_run(case[0]), open_run(case[1])
        with pytest.raises(AssertionError):
            assert_same_records(a, b)
    p = planted["arguments" if old is _TENSORS_ONLY else "digest_error"]
    with pytest.raises(AssertionError):
        assert_same_records(p.a, p.b)
