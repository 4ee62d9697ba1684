"""The hostile-input corpus: real captures damaged by property-based mutation, each with its outcome.

Runs A, B (the same job) and C (B with rank 1's batch changed at step 2) are captured once for
the module (``tests/fixtures/hostile.py``). Every case damages a fresh copy of B (the identical
pair) or of C (the diverged pair) and runs ``bisect --json`` on it, on the default path (commit
lines' folds, stored rollups) and, where the damage is to a shard's content, on the records path
(``--no-step-sums --no-stored-rollups``, which reads every record). The outcome must be exit 2
with one line, or the undamaged pair's answer; an answer given while the files no longer hold
what was committed (the answer came from the commit lines alone) must come with a ``certify``
that fails. Some classes must be refused outright (a truncated shard, a shard of another table,
rows that are not the committed ones on the records path). Mutations are drawn by hypothesis
(derandomized: the same cases every run), from the files the captures wrote:

* shard bytes (data pages and footers of every table), truncations;
* a foreign shard (another rank's, window's or table's, or one from another run) put in place of
  a shard with its commit line restated as a faulty writer would (size, footer checksum);
* a shard rewritten with other rows (a digest changed, a row dropped, two rows swapped, a status
  changed), its commit line restated (rows too, when the count changes);
* commit logs: bytes, truncation, lines dropped, repeated or swapped, rows or folds restated
  with a fresh checksum, a bare ``NaN``, an unknown record, a garbage line;
* manifests: bytes, keys dropped, values retyped, a bare ``NaN``, a repeated key, nesting;
* the run index: bytes of each of its files, a file dropped or truncated, a stale index.

The test ``test_the_corpus_holds_at_least_150_cases`` counts the distinct cases that ran.
"""

from __future__ import annotations

import json
import zlib
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from detfp_format import commitlog
from tests.fixtures.hostile import capture_pair, content, decided, invoke, reset, restate, same

TABLES = ("records", "rollups", "metrics", "events", "args")
_SETTINGS = dict(deadline=None, derandomize=True, database=None,
                 suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])  # fmt: skip
RECORDS_PATH = ("--no-step-sums", "--no-stored-rollups")
#: Which pair a case damages: mostly the identical one (B), whose bisect reads least; C diverged.
_RUNS = st.sampled_from(["b", "b", "b", "c"])


class Corpus:
    """The captures, the undamaged answers and the working copy every case damages."""

    def __init__(self, root: Path) -> None:
        self.runs = capture_pair(root / "runs")
        self.work = root / "work"
        self.tally: Counter[str] = Counter()
        self.seen: set[str] = set()
        self.truth: dict[tuple[str, tuple[str, ...]], tuple] = {}
        self.content = {n: content(self.runs[n]) for n in ("b", "c")}
        for name in ("b", "c"):
            for flags in ((), RECORDS_PATH):
                got = invoke("bisect", self.runs["a"], self.runs[name], "--json", *flags)
                assert got.code == (0 if name == "b" else 1), got
                self.truth[(name, flags)] = decided(got.doc())
        assert self.truth[("c", ())][0] == "diverged" and self.truth[("b", ())][0] == "identical"

    def files(self, name: str, table: str | None = None) -> list[Path]:
        base = self.runs[name]
        found = sorted(base.glob(f"{table or '*'}/rank=*/*.parquet"))
        return [p.relative_to(base) for p in found]

    def fresh(self, name: str) -> Path:
        reset(self.runs[name], self.work)
        return self.work

    def case(self, cls: str, what: str) -> None:
        self.tally[cls] += 1
        self.seen.add(f"{cls}: {what}")

    def judge(self, name: str, *, must_refuse: bool = False, records: bool = False, why: str = "") -> None:
        """Bisect A against the damaged copy of ``name``: refused, or the undamaged answer (with a
        failing certify when the files no longer hold what was committed); ``must_refuse``: only
        refused will do; ``records``: the records path too, which must refuse a content change."""
        changed = None  # read from the files only when an answer needs it
        for flags in ((), RECORDS_PATH) if records else ((),):
            got = invoke("bisect", self.runs["a"], self.work, "--json", *flags)
            if got.refused:
                continue
            assert not must_refuse, (why, flags, got)
            assert got.code in (0, 1), (why, flags, got)
            assert decided(got.doc()) == self.truth[(name, flags)], (why, flags, got)
            if changed is None:
                changed = not same(content(self.work), self.content[name])
            if changed:
                # Answered from what was committed while a file holds something else: the records
                # path reads every record and must have refused; the default path must leave a
                # certify that fails.
                assert not flags, (why, "the records path answered on rows that are not the committed ones", got)
                cert = invoke("certify", self.work, "--json")
                assert cert.refused or (
                    cert.code == 1 and any(p["kind"] in ("step_sums",) for p in cert.doc()["problems"])
                ), (why, cert)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return Corpus(tmp_path_factory.mktemp("hostile"))


def _bytes_at(p: Path, at: int, mask: int) -> None:
    data = bytearray(p.read_bytes())
    data[at % len(data)] ^= mask
    p.write_bytes(bytes(data))


# ------------------------------------------------------------------------------ shards
@settings(max_examples=24, **_SETTINGS)
@given(data=st.data())
def test_shard_bytes(corpus, data):
    name = data.draw(_RUNS, label="run")
    rel = data.draw(st.sampled_from(corpus.files(name)), label="shard")
    work = corpus.fresh(name)
    p = work / rel
    size = p.stat().st_size
    footer = int.from_bytes(p.read_bytes()[-8:-4], "little")
    where = data.draw(st.sampled_from(["data", "footer", "tail"]), label="where")
    lo, hi = {"data": (4, size - footer - 9), "footer": (size - footer - 8, size - 9), "tail": (size - 8, size - 1)}[where]
    flips = data.draw(st.lists(st.tuples(st.integers(lo, max(lo, hi)), st.integers(1, 255)), min_size=1, max_size=3))
    for at, mask in flips:
        _bytes_at(p, at, mask)
    corpus.case("shard bytes", f"{name} {rel} {where} {flips}")
    corpus.judge(name, records=True, why=f"{rel} {where} {flips}")


@settings(max_examples=10, **_SETTINGS)
@given(data=st.data())
def test_shard_truncated(corpus, data):
    name = data.draw(_RUNS, label="run")
    rel = data.draw(st.sampled_from(corpus.files(name)), label="shard")
    work = corpus.fresh(name)
    raw = (work / rel).read_bytes()
    keep = data.draw(st.integers(0, len(raw) - 1), label="keep")
    (work / rel).write_bytes(raw[:keep])
    corpus.case("shard truncated", f"{name} {rel} {keep}")
    corpus.judge(name, must_refuse=True, why=f"{rel} cut at {keep}")


def _parts(rel: Path) -> tuple[str, int, int]:
    table, part, fname = rel.parts
    return table, int(part.split("=")[1]), int(fname.split("-w")[1].split(".")[0])


@settings(max_examples=20, **_SETTINGS)
@given(data=st.data())
def test_foreign_shard_with_its_commit_line_restated(corpus, data):
    name = data.draw(_RUNS, label="run")
    rel = data.draw(st.sampled_from(corpus.files(name)), label="target")
    source = data.draw(st.sampled_from(["a", "b", "c"]), label="from run")
    other = data.draw(st.sampled_from(corpus.files(source)), label="source shard")
    if (source, other) == (name, rel):
        other = corpus.files(source)[0] if other != corpus.files(source)[0] else corpus.files(source)[-1]
    work = corpus.fresh(name)
    (work / rel).write_bytes((corpus.runs[source] / other).read_bytes())
    _, rank, window = _parts(rel)
    restate(work, rank, window)
    corpus.case("foreign shard", f"{name} {rel} <- {source} {other}")
    # On the records path a shard that does not hold the committed rows (another table's, another
    # run's) must be refused: judge's content check; the default path may answer from the folds.
    corpus.judge(name, records=True, why=f"{rel} <- {source}/{other}")


def _rewrite(table: pa.Table, how: str, at: int) -> pa.Table:
    i = at % table.num_rows
    rows = table.to_pylist()
    if how == "drop" and len(rows) > 1:
        del rows[i]
    elif how == "swap" and len(rows) > 1:
        j = (i + 1) % len(rows)
        rows[i], rows[j] = rows[j], rows[i]
    elif how == "digest" and "digest_hi" in table.column_names and rows[i]["digest_hi"] is not None:
        rows[i]["digest_hi"] ^= 1
    elif how == "status" and "status" in table.column_names:
        rows[i]["status"] = "error" if rows[i]["status"] != "error" else "ok"
    elif how == "bits" and "bits" in table.column_names:
        rows[i]["bits"] ^= 1
    elif how == "key" and "key_hash" in table.column_names:
        rows[i]["key_hash"] ^= 1 << 7
    return pa.Table.from_pylist(rows, schema=table.schema)


@settings(max_examples=20, **_SETTINGS)
@given(data=st.data())
def test_rows_rewritten_with_the_commit_line_restated(corpus, data):
    name = data.draw(_RUNS, label="run")
    table_name = data.draw(st.sampled_from(["records", "metrics"]), label="table")
    rel = data.draw(st.sampled_from(corpus.files(name, table_name)), label="shard")
    how = data.draw(st.sampled_from(["digest", "status", "drop", "swap", "key"] if table_name == "records"
                                    else ["bits", "drop"]), label="how")  # fmt: skip
    at = data.draw(st.integers(0, 10_000), label="row")
    work = corpus.fresh(name)
    p = work / rel
    before = pq.read_table(p)
    after = _rewrite(before, how, at)
    pq.write_table(after, p)
    table, rank, window = _parts(rel)
    delta = after.num_rows - before.num_rows

    def rows(rec: dict) -> None:
        rec["rows"][table] += delta

    restate(work, rank, window, rows if delta else None)
    corpus.case("rows rewritten", f"{name} {rel} {how} {at}")
    corpus.judge(name, records=True, why=f"{rel} {how} row {at}")


# ------------------------------------------------------------------------------ commit logs
def _log(work: Path, rank: int) -> Path:
    return work / commitlog.commit_log_relpath(rank, 0)


def _edit_line(rec: dict, how: str, n: int) -> None:
    if rec.get("t") != "window":
        return
    if how == "rows" and rec["rows"]:
        t = sorted(rec["rows"])[n % len(rec["rows"])]
        rec["rows"][t] += 1 + n % 5
    elif how == "fold" and rec.get("sums"):
        s = sorted(rec["sums"])[n % len(rec["sums"])]
        rec["sums"][s][n % 6] = (rec["sums"][s][n % 6] + 1) % (1 << 62)
    elif how == "steps" and rec.get("steps"):
        rec["steps"] = [rec["steps"][0], rec["steps"][1] + 1]
    elif how == "window":
        rec["window"] += 7
    elif how == "facts" and rec.get("shards"):
        t = sorted(rec["shards"])[n % len(rec["shards"])]
        rec["shards"][t][0] += 1


@settings(max_examples=36, **_SETTINGS)
@given(data=st.data())
def test_commit_log(corpus, data):
    name = data.draw(_RUNS, label="run")
    rank = data.draw(st.integers(0, 1), label="rank")
    how = data.draw(st.sampled_from(["bytes", "cut", "drop", "repeat", "swap", "rows", "fold", "steps", "window",
                                     "facts", "nan", "unknown", "garbage"]), label="how")  # fmt: skip
    n = data.draw(st.integers(0, 1000), label="n")
    work = corpus.fresh(name)
    log = _log(work, rank)
    lines = log.read_bytes().splitlines(keepends=True)
    k = n % len(lines)
    if how == "bytes":
        _bytes_at(log, n * 7, 1 + n % 255)
    elif how == "cut":
        log.write_bytes(log.read_bytes()[: n % log.stat().st_size])
    elif how == "drop":
        log.write_bytes(b"".join(lines[:k] + lines[k + 1 :]))
    elif how == "repeat":
        log.write_bytes(b"".join(lines[: k + 1] + lines[k:]))
    elif how == "swap" and k + 1 < len(lines):
        log.write_bytes(b"".join([*lines[:k], lines[k + 1], lines[k], *lines[k + 2 :]]))
    elif how in ("rows", "fold", "steps", "window", "facts"):
        rec = json.loads(lines[k].split(b" ", 1)[1])
        _edit_line(rec, how, n)
        lines[k] = commitlog.encode(rec)
        log.write_bytes(b"".join(lines))
    elif how == "nan":  # a bare NaN, checksummed as if it were JSON
        body = lines[k].split(b" ", 1)[1].rstrip(b"\n").replace(b"}", b',"x":NaN}', 1)
        lines[k] = b"%08x %s\n" % (zlib.crc32(body), body)
        log.write_bytes(b"".join(lines))
    elif how == "unknown":
        lines.insert(k, commitlog.encode({"t": "rewind", "window": 0}))
        log.write_bytes(b"".join(lines))
    elif how == "garbage":
        lines.insert(k, b"\x1b[2Jnot a line\n")
        log.write_bytes(b"".join(lines))
    corpus.case("commit log", f"{name} rank {rank} {how} {n}")
    corpus.judge(name, why=f"rank {rank} {how} {n}")


# ------------------------------------------------------------------------------ manifests
def _manifest(work: Path, rank: int) -> Path:
    return work / "manifest" / f"rank={rank}" / "segment-00000.json"


@settings(max_examples=34, **_SETTINGS)
@given(data=st.data())
def test_manifest(corpus, data):
    name = data.draw(_RUNS, label="run")
    rank = data.draw(st.integers(0, 1), label="rank")
    how = data.draw(st.sampled_from(["bytes", "cut", "drop_key", "retype", "nan", "repeat_key", "nest", "huge",
                                     "negative", "bom", "trailing"]), label="how")  # fmt: skip
    n = data.draw(st.integers(0, 1000), label="n")
    work = corpus.fresh(name)
    p = _manifest(work, rank)
    text = p.read_text()
    doc = json.loads(text)
    key = sorted(doc)[n % len(doc)]
    if how == "bytes":
        _bytes_at(p, n * 13, 1 + n % 255)
    elif how == "cut":
        p.write_bytes(p.read_bytes()[: n % len(text)])
    elif how == "drop_key":
        del doc[key]
        p.write_text(json.dumps(doc))
    elif how == "retype":
        doc[key] = [doc[key]] if not isinstance(doc[key], list) else {"x": doc[key]}
        p.write_text(json.dumps(doc))
    elif how == "nan":
        p.write_text(json.dumps(doc)[:-1] + ', "z": NaN}')
    elif how == "repeat_key":  # a second "rank" (or other key) after the first: the last would win
        p.write_text(json.dumps(doc)[:-1] + f', "{key}": {json.dumps(7 if key != "rank" else 1 - rank)}}}')
    elif how == "nest":
        p.write_text(json.dumps({**doc, "env": json.loads("[" * 100 + "]" * 100)}))
    elif how == "huge":
        doc[key] = 10**40
        p.write_text(json.dumps(doc))
    elif how == "negative":
        doc[key] = -1
        p.write_text(json.dumps(doc))
    elif how == "bom":
        p.write_bytes(b"\xef\xbb\xbf" + p.read_bytes())
    elif how == "trailing":
        p.write_text(text + "\n{}")
    corpus.case("manifest", f"{name} rank {rank} {how} {key} {n}")
    corpus.judge(name, why=f"rank {rank} {how} {key}")


# ------------------------------------------------------------------------------ the run index
@settings(max_examples=20, **_SETTINGS)
@given(data=st.data())
def test_run_index(corpus, data):
    name = data.draw(_RUNS, label="run")
    which = data.draw(st.sampled_from(["index.json", "folds.arrow", "shards.arrow", "index.seal"]), label="file")
    how = data.draw(st.sampled_from(["bytes", "cut", "drop", "empty", "stale"]), label="how")
    n = data.draw(st.integers(0, 10_000), label="n")
    work = corpus.fresh(name)
    assert invoke("index", work).code == 0
    p = work / "_detfp_index" / which
    if how == "bytes":
        _bytes_at(p, n, 1 + n % 255)
    elif how == "cut":
        p.write_bytes(p.read_bytes()[: n % max(1, p.stat().st_size)])
    elif how == "drop":
        p.unlink()
    elif how == "empty":
        p.write_bytes(b"")
    elif how == "stale":  # the run changed after it was indexed: a manifest rewritten, same content
        m = _manifest(work, n % 2)
        m.write_text(json.dumps(json.loads(m.read_text()), indent=1))
    corpus.case("run index", f"{name} {which} {how} {n}")
    # The index is a cache of what the files say: damaged or stale, it is ignored, never trusted.
    got = invoke("bisect", corpus.runs["a"], work, "--json")
    assert got.code in (0, 1) and decided(got.doc()) == corpus.truth[(name, ())], (which, how, got)


def test_the_corpus_holds_at_least_150_cases(corpus):
    # Runs last in this file (one worker takes the whole file): every class above has run.
    assert len(corpus.seen) >= 150, (len(corpus.seen), corpus.tally)
    assert set(corpus.tally) == {"shard bytes", "shard truncated", "foreign shard", "rows rewritten", "commit log",
                                 "manifest", "run index"}, corpus.tally  # fmt: skip
    print(f"\nhostile corpus: {len(corpus.seen)} distinct cases: {dict(sorted(corpus.tally.items()))}")
