"""Reliability II (issue 43): each point of the issue, as the user met it, against runs written by the
real writer (``tests/fixtures/shards.write_run``, with rollups and step folds as this release's
capture writes them). Every test here failed on e3ea1c8:

1. a shard of another run, with the committed size and footer, was trusted (a wrong answer);
2. a shard of another table committed in place of a records shard was read (a wrong answer);
3. a named pipe in place of a manifest, a commit log or an index file blocked forever;
4. a NaN metric was written as a bare ``NaN`` (invalid JSON);
5. control characters of a name reached stderr raw through matplotlib's warnings;
6. after a kill, ``window.steps`` in the JSON named steps that were not compared;
7. a commit line claiming other row counts than its shard holds gave ``complete: true``;
8. an output path that cannot be written was blamed on the trace.

(Point 9, the timing dependence, is ``tests/unit/test_flush_windows.py``.)
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

import polars as pl
import pyarrow.parquet as pq
import pytest

from detfp_analyze.io import stepsums
from detfp_format import commitlog, contract, strictjson
from tests.fixtures.hostile import deadline, invoke, restate, shard
from tests.fixtures.shards import hexdigest, write_run


def _tables(rank: int, *, changed: bool = False, nan: bool = False, module: str = "block") -> dict:
    records, metrics = [], []
    for s in range(4):
        records.append(dict(step=s, kind="batch", name="Net", role="input", arg="args[0]",
                            digest=hexdigest(("batch", rank, s, changed and rank == 1 and s == 2))))  # fmt: skip
        records.append(dict(step=s, module=module, name="aten::mm.default", role="input", arg="args[0]"))
        records.append(dict(step=s, module=module, name="aten::mm.default",
                            digest=hexdigest(("mm", rank, s, changed and rank == 1 and s >= 2))))  # fmt: skip
        metrics.append(dict(step=s, value=float("nan") if nan and changed and s >= 2 else 1.5 + s))
    return {"records": records, "metrics": metrics, "events": [dict(step=s) for s in range(4)]}


#: What the capture's manifests say of its commit lines: shard facts and step folds (write_run adds
#: the rollups' keys), so the reader takes shards from their commit lines as it does for a capture.
_AS_CAPTURED = {"commit_log": commitlog.COMMIT_LOG_VERSION, "shard_facts": commitlog.SHARD_FACTS_VERSION}


def _pair(root: Path, **kw) -> tuple[Path, Path]:
    a = write_run(root / "a", {r: _tables(r, **kw) for r in (0, 1)}, rollups=True, manifest_overrides=_AS_CAPTURED)
    b = write_run(root / "b", {r: _tables(r, changed=True, **kw) for r in (0, 1)}, rollups=True,
                  manifest_overrides=_AS_CAPTURED)  # fmt: skip
    return a, b


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return _pair(tmp_path_factory.mktemp("rel2"))


def _copy(run: Path, to: Path) -> Path:
    shutil.copytree(run, to)
    return to


# ------------------------------------------------------------------------------ 1, 2, 7
def test_a_shard_of_another_run_with_the_committed_size_and_footer_is_refused(pair, tmp_path):
    a, b = pair
    truth = invoke("bisect", a, b, "--json")
    assert truth.code == 1 and truth.doc()["ranks"][1]["first"]["step"] == 2
    # What a size-only sync leaves: B's shard of window 2 replaced by A's; the commit line states
    # the file now there (its size and footer checksum), as if the footers had coincided.
    dmg = _copy(b, tmp_path / "b")
    target = shard(dmg, "records", 1, 2)
    target.write_bytes(shard(a, "records", 1, 2).read_bytes())
    restate(dmg, 1, 2)
    for flags in ((), ("--no-step-sums",), ("--no-step-sums", "--no-stored-rollups")):
        got = invoke("bisect", a, dmg, "--json", *flags)
        assert got.refused, (flags, got)
        assert f"{target}: its records of rank 1 step 2 are not what its window committed" in got.err, got
    cert = invoke("certify", dmg, "--json")
    assert cert.code == 1
    assert {(p["kind"], p["rank"], p["step"]) for p in cert.doc()["problems"]} >= {("step_sums", 1, 2)}


def test_the_fold_of_records_is_the_contract_rollup_fold(pair):
    """The polars rendering of ``contract.rollup_hashes`` (what every read is checked with) folds a
    run's records to exactly the step folds its commit lines state."""
    a, _ = pair
    from detfp_analyze.io.reader import open_run

    run = open_run(a)
    got = stepsums.record_folds(run, [0, 1])
    committed = stepsums.as_dict(stepsums.committed(run, [0, 1], 0, 3))
    assert got and {k: v[:4] for k, v in committed.items()} == got


def test_a_shard_of_another_table_committed_in_place_is_refused(pair, tmp_path):
    a, b = pair
    dmg = _copy(b, tmp_path / "b")
    # The window the bisect reads (rank 1's first difference is at step 2).
    target = shard(dmg, "records", 1, 2)
    target.write_bytes(shard(dmg, "events", 1, 2).read_bytes())
    restate(dmg, 1, 2)  # a buggy writer: the line restated with the new size and checksum
    got = invoke("bisect", a, dmg, "--json")  # e3ea1c8: "structural ... no_origin"
    assert got.refused and f"{target}: missing column(s)" in got.err, got
    cert = invoke("certify", dmg, "--json")
    assert cert.refused and "missing column(s)" in cert.err, cert


def test_row_counts_are_checked_against_the_commit_and_the_footer(pair, tmp_path):
    a, b = pair
    # A commit line claiming 5 more rows than its shard holds (checksum recomputed): its own step
    # folds count the rows the shard holds, so the line contradicts itself.
    dmg = _copy(b, tmp_path / "b1")

    def more(rec: dict) -> None:
        rec["rows"]["records"] += 5

    restate(dmg, 1, 1, more)
    got = invoke("bisect", a, dmg, "--json")
    assert got.refused and "window 1's rows differ from its step folds" in got.err, got
    # Rows and folds restated together: the footer's row count is compared when the shard is read.
    dmg2 = _copy(b, tmp_path / "b2")

    def both(rec: dict) -> None:
        rec["rows"]["records"] += 5
        step = sorted(rec["sums"])[0]
        rec["sums"][step][0] += 5

    restate(dmg2, 1, 2, both)
    got = invoke("bisect", a, dmg2, "--json")
    assert got.refused and "holds 3 row(s), its commit line says 8" in got.err, got
    assert invoke("certify", dmg2, "--json").refused


def test_every_read_of_a_slice_checks_the_blocks_it_covers(tmp_path):
    """A slice of stored rollups' blocks (a step of more than one block) carries the fold of the
    blocks it covers: what the walk reads of it must fold to exactly that."""
    from detfp_analyze.bisect import blocks as _blocks
    from detfp_analyze.io.reader import open_run

    n = contract.ROLLUP_BLOCK * 3

    def recs(flip: bool) -> list[dict]:
        return [dict(step=0, name="aten::add.Tensor", occurrence=i, digest=hexdigest((i, flip and i == n - 5)))
                for i in range(n)]  # fmt: skip

    a = write_run(tmp_path / "a", {0: {"records": recs(False)}}, rollups=True)
    b = write_run(tmp_path / "b", {0: {"records": recs(True)}}, rollups=True)
    ra, rb = open_run(a), open_run(b)
    ba = _blocks.block_rollup(ra.scan("rollups")).collect()
    bb = _blocks.block_rollup(rb.scan("rollups")).collect()
    sl = _blocks.slices(ba, bb, {0: [0]})[(0, 0)]
    assert sl.cut and sl.folds is not None
    for side, run in enumerate((ra, rb)):
        lo, hi = sl.span(side)
        rows = run.scan("records").filter(pl.col("seq").is_between(lo, hi)).collect()
        got = stepsums.fold(rows).row(0, named=True)
        assert (got["n"], got["n_err"], got["kx"], got["vx"]) == tuple(sl.fold(side))
    # And a bisect of the pair, which reads that slice, answers.
    assert invoke("bisect", a, b, "--json").code == 1


# ------------------------------------------------------------------------------ 3
@pytest.mark.parametrize("what", ["manifest", "commit_log", "index"])
def test_a_named_pipe_never_blocks(pair, tmp_path, what):
    a, b = pair
    dmg = _copy(b, tmp_path / "b")
    if what == "index":
        assert invoke("index", dmg).code == 0
        p = dmg / "_detfp_index" / "folds.arrow"
    elif what == "manifest":
        p = dmg / "manifest" / "rank=1" / "segment-00000.json"
    else:
        p = dmg / commitlog.commit_log_relpath(1, 0)
    p.unlink()
    os.mkfifo(p)
    with deadline(30):  # e3ea1c8 blocked here forever
        got = invoke("bisect", a, dmg, "--json", seconds=30)
    if what == "index":  # a cache that cannot be read is ignored
        assert got.code == 1, got
    else:
        assert got.refused and "not a regular file" in got.err, got


# ------------------------------------------------------------------------------ 4
def test_json_is_strict_rfc_8259_with_non_finite_values_as_strings(tmp_path):
    a, b = _pair(tmp_path, nan=True)
    got = invoke("bisect", a, b, "--json")
    assert got.code == 1
    doc = strictjson.loads(got.out)  # e3ea1c8: "metric_b": NaN, which this (like jq) refuses
    assert doc["ranks"][1]["metric_b"] == "NaN" and doc["ranks"][1]["metric_a"] == 3.5
    out = invoke("sql", b, "SELECT value FROM metrics ORDER BY value", "--format", "json")
    assert out.code == 0, out
    assert {"value": "NaN"} in strictjson.loads(out.out)
    with pytest.raises(ValueError, match="NaN is not JSON"):
        strictjson.loads('{"x": NaN}')
    # A manifest holding a bare NaN, or a key twice, is not JSON detfp wrote.
    m = b / "manifest" / "rank=1" / "segment-00000.json"
    text = m.read_text()
    m.write_text(text.rstrip().rstrip("}") + ', "x": NaN}')
    assert "NaN is not JSON" in invoke("bisect", a, b).err
    m.write_text(text.rstrip().rstrip("}") + ', "rank": 0}')
    assert 'the name "rank" occurs twice' in invoke("bisect", a, b).err
    m.write_text(text)


# ------------------------------------------------------------------------------ 5
def test_control_characters_of_names_never_reach_stderr_raw(tmp_path):
    pytest.importorskip("matplotlib")
    a, b = _pair(tmp_path, module="blk\x1b[2J\x07")
    html = tmp_path / "r.html"
    got = invoke("bisect", a, b, "--html", html)
    assert got.code == 1
    assert got.err == f"detfp-analyze: wrote {html}\n", got.err  # e3ea1c8: Glyph 27 (\x1b) missing ... x12
    assert "\x1b" not in got.out
    page = html.read_text()
    assert "\x1b" not in page
    plots = invoke("plot", a, b, "--out", tmp_path / "plots")
    assert plots.code == 0 and "\x1b" not in plots.err + plots.out, plots


# ------------------------------------------------------------------------------ 6
def test_the_compared_range_in_json_is_what_was_compared(pair, tmp_path):
    a, _ = pair
    killed = _copy(a, tmp_path / "killed")
    for rank in (0, 1):  # killed before closing: the last committed step (3) is not held completely
        log = killed / commitlog.commit_log_relpath(rank, 0)
        log.write_bytes(b"".join(x for x in log.read_bytes().splitlines(True) if b'"t":"close"' not in x))
    got = invoke("bisect", a, killed, "--json", "--allow-incomplete")
    doc = got.doc()
    assert doc["status"] == "identical" and not doc["complete"]
    assert any("steps 3 and later not compared" in n for n in doc["notes"])
    assert doc["window"]["steps"] == [0, 2]  # e3ea1c8: [0, 3]


# ------------------------------------------------------------------------------ 8
def test_an_output_that_cannot_be_written_is_named(pair, tmp_path):
    a, b = pair
    blocker = tmp_path / "file"
    blocker.write_text("x")
    cases = [
        (("bisect", a, b, "--html", blocker / "r.html"), "--html"),
        (("export", a, b, "--perfetto", blocker / "t.json"), "--perfetto"),
        (("sql", a, "SELECT 1 AS x", "-o", blocker / "q.csv", "--format", "csv"), "--output"),
        (("sql", a, "SELECT 1 AS x", "-o", blocker / "q.parquet", "--format", "parquet"), "--output"),
    ]
    if importlib.util.find_spec("matplotlib"):
        cases.append((("plot", a, b, "--out", blocker / "plots"), "--out"))
    for args, option in cases:
        got = invoke(*args)
        assert got.refused, (args, got)
        assert got.err.startswith(f"detfp-analyze: {option} {blocker}"), got.err
        assert "cannot read a file of the trace" not in got.err


def test_the_reliability_doc_lists_the_new_refusals():
    text = (Path(__file__).resolve().parents[2] / "docs" / "reliability.md").read_text()
    for phrase in ("not what its window committed", "not a regular file", '"NaN"', "cannot write it"):
        assert phrase in text, phrase


def test_a_rewritten_footer_passes_no_check_because_its_checksum_matches(pair, tmp_path):
    """The schema of a committed shard is checked whatever its checksum says (point 2's rule):
    a footer stating a future schema version, committed with its checksum, is refused."""
    a, b = pair
    dmg = _copy(b, tmp_path / "b")
    target = shard(dmg, "records", 0, 1)
    t = pq.read_table(target)
    meta = dict(t.schema.metadata or {})
    meta[b"detfp.schema_version"] = b"9"
    pq.write_table(t.replace_schema_metadata(meta), target)
    restate(dmg, 0, 1)
    got = invoke("bisect", a, dmg, "--json", "--no-step-sums", "--no-stored-rollups")
    assert got.refused and "schema version 9 is not supported" in got.err, got
