"""The comparison rule is one definition: its polars and SQL renderings agree on every input.

Property tests evaluate each rule expression on random record pairs (every status, role,
digest, argument and hazard combination, sides absent) in polars and in DuckDB, and require the
same value row by row; golden cases pin the answers that matter.
"""

from __future__ import annotations

import duckdb
import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from detfp_analyze import rule
from detfp_analyze.rule import expr
from detfp_analyze.rule.to_polars import to_polars
from detfp_analyze.rule.to_sql import suffixed, to_sql

STATUS = st.sampled_from(["ok", "skipped", "error"])
DIGEST = st.sampled_from([None, 0, 1, (1 << 64) - 1])
ARGS = st.sampled_from([None, "00aa", "00bb"])
HAZARDS = st.sampled_from([None, [], ["uninitialized"]])


@st.composite
def side(draw, present=True):
    if not present:
        return dict(status=None, digest_hi=None, digest_lo=None, args_digest=None, hazards=None)
    return dict(
        status=draw(STATUS),
        digest_hi=draw(DIGEST),
        digest_lo=draw(DIGEST),
        args_digest=draw(ARGS),
        hazards=draw(HAZARDS),
    )


@st.composite
def pair(draw):
    present = draw(st.sampled_from([(True, True), (True, False), (False, True)]))
    a, b = draw(side(present[0])), draw(side(present[1]))
    row = {f"{k}_a": v for k, v in a.items()} | {f"{k}_b": v for k, v in b.items()}
    row["role"] = draw(st.sampled_from(["input", "output", "value", "dest"]))
    row["arg"] = draw(st.sampled_from(["args[0]", "out"]))
    row["state"] = draw(st.sampled_from(rule.STATES))
    row["hazard_a"] = bool(a["hazards"])
    row["hazard_b"] = bool(b["hazards"])
    return row


SIDE_COLUMNS = (
    ("status", pl.String),
    ("digest_hi", pl.UInt64),
    ("digest_lo", pl.UInt64),
    ("args_digest", pl.String),
    ("hazards", pl.List(pl.String)),
)
SCHEMA = {
    "role": pl.String,
    "arg": pl.String,
    "state": pl.String,
    **{f"{c}_{s}": t for s in "ab" for c, t in SIDE_COLUMNS},
    "hazard_a": pl.Boolean,
    "hazard_b": pl.Boolean,
}
PAIR_EXPRS = {
    "match": rule.MATCH,
    "value": rule.VALUE,
    "hazard": rule.HAZARD,
    "tensors": rule.TENSORS_EQUAL,
    "args": rule.ARGS_EQUAL,
}
# One run's record: the same columns without suffix (side a's values).
RECORD_EXPRS = {"evidence": rule.RECORD_EVIDENCE, "hazard": rule.RECORD_HAZARD} | {
    f"sig{i}": e for i, e in enumerate(rule.SIGNATURE)
}


def both_engines(frame: pl.DataFrame, exprs: dict[str, expr.Expr]) -> tuple[list[tuple], list[tuple]]:
    by_polars = frame.select(**{k: to_polars(e) for k, e in exprs.items()}).rows()
    con = duckdb.connect()
    con.register("t", frame.to_arrow())
    cols = ", ".join(f"{to_sql(e, suffixed)} AS {k}" for k, e in exprs.items())
    by_sql = con.execute(f"SELECT {cols} FROM t").fetchall()
    con.close()
    return by_polars, by_sql


@settings(max_examples=40, deadline=None)
@given(st.lists(pair(), min_size=1, max_size=60))
def test_pair_rule_is_the_same_in_polars_and_sql(rows):
    frame = pl.DataFrame(rows, schema=SCHEMA)
    by_polars, by_sql = both_engines(frame, PAIR_EXPRS)
    assert by_polars == by_sql


@settings(max_examples=30, deadline=None)
@given(st.lists(pair(), min_size=1, max_size=60))
def test_record_rule_is_the_same_in_polars_and_sql(rows):
    frame = pl.DataFrame(
        [{k.removesuffix("_a"): v for k, v in r.items() if not k.endswith("_b")} for r in rows if r["status_a"]]
        or [{"status": "ok", "role": "input", "arg": "args[0]", "hazards": None, "args_digest": None}],
        schema={k.removesuffix("_a"): t for k, t in SCHEMA.items() if not k.endswith("_b")},
    )
    by_polars, by_sql = both_engines(frame, RECORD_EXPRS)
    # SIGNATURE parts are compared as text (polars casts integers the way DuckDB does).
    assert [tuple(None if v is None else str(v) for v in r) for r in by_polars] == [
        tuple(None if v is None else str(v) for v in r) for r in by_sql
    ]


def ok(hi=1, lo=2, args=None, **kw):
    return dict(status="ok", digest_hi=hi, digest_lo=lo, args_digest=args, hazards=[], **kw)


ABSENT = dict(status=None, digest_hi=None, digest_lo=None, args_digest=None, hazards=None)


@pytest.mark.parametrize(
    ("a", "b", "role", "want"),
    [
        (ok(), ok(), "output", "same"),
        (ok(), ok(lo=3), "output", "differs"),
        (ok(args="00aa"), ok(args="00bb"), "input", "differs"),  # arguments only: the call differs
        (ok(args=None), ok(args="00bb"), "input", "differs"),
        (ok(), dict(ok(), status="error", digest_hi=None, digest_lo=None), "output", "unknown"),
        (dict(ok(), status="error"), dict(ok(), status="error"), "output", "unknown"),  # two errors never match
        (dict(ok(), status="skipped"), ok(), "output", "unknown"),
        (ok(), ok(), "dest", "unknown"),  # a write-only destination is never evidence
        (ok(), ABSENT, "output", "only_a"),
        (ABSENT, ok(), "output", "only_b"),
    ],
)
def test_match_golden(a, b, role, want):
    row = {f"{k}_a": v for k, v in a.items()} | {f"{k}_b": v for k, v in b.items()}
    row |= {"role": role, "arg": "out", "state": "same", "hazard_a": False, "hazard_b": False}
    frame = pl.DataFrame([row], schema=SCHEMA)
    by_polars, by_sql = both_engines(frame, {"match": rule.MATCH})
    assert by_polars == by_sql == [(want,)]


@pytest.mark.parametrize(
    ("state", "a", "b", "want"),
    [
        ("differs", ok(), ok(lo=3), True),
        ("only_b", ABSENT, ok(), True),  # a digested record more on one side
        ("only_b", ABSENT, dict(ok(), status="skipped"), False),  # a view or allocation more: no value
        ("reordered", ok(), ok(), False),  # the same value elsewhere in the order
        ("reordered", ok(), ok(lo=3), True),
        ("unknown", ok(), dict(ok(), status="error"), False),
    ],
)
def test_value_golden(state, a, b, want):
    row = {f"{k}_a": v for k, v in a.items()} | {f"{k}_b": v for k, v in b.items()}
    row |= {"role": "output", "arg": "out", "state": state, "hazard_a": False, "hazard_b": False}
    frame = pl.DataFrame([row], schema=SCHEMA)
    by_polars, by_sql = both_engines(frame, {"value": rule.VALUE})
    assert by_polars == by_sql == [(want,)]


def test_vocabulary_is_one_list():
    assert rule.STATES == ("same", "differs", "only_a", "only_b", "unknown", "reordered", "shifted")
    assert set(rule.DIVERGENT) == set(rule.STATES) - {"same", "unknown"}
    assert set(rule.STRUCTURAL) < set(rule.DIVERGENT) and set(rule.ONE_SIDED) < set(rule.STRUCTURAL)
    assert rule.check_state("shifted") == "shifted"
    with pytest.raises(ValueError, match=r"'a_only' is not one of same, differs"):
        rule.check_state("a_only")


def test_spark_dialect_spells_null_safe_equality_and_list_size():
    text = to_sql(rule.MATCH, dialect="spark")
    assert "<=>" in text and "IS NOT DISTINCT FROM" not in text
    assert "size(" in to_sql(rule.RECORD_HAZARD, suffixed, dialect="spark")
    with pytest.raises(ValueError, match="dialect 'oracle'"):
        to_sql(rule.MATCH, dialect="oracle")
