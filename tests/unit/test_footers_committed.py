"""Shards stated by their commit lines (``commitlog.ShardFact``): opened by size, footers checked on read.

Each case is run on the same damage with and without the manifest key ``shard_facts`` (the
path of older runs, every footer parsed at open), and the one-line errors compared.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from detfp_analyze.bisect import bisect
from detfp_analyze.cli import app
from detfp_analyze.errors import IncompleteRunError, ShardError
from detfp_analyze.io import committed_footers, shard_scan
from detfp_analyze.io.reader import open_run
from detfp_format import commitlog, contract
from tests.fixtures.shards import flip_in_footer, hexdigest, write_run

SHARD = "records/rank=1/part-s00000-w0000001.parquet"


def _ranks(planted: bool = False) -> dict:
    out = {}
    for r in range(2):
        recs = [dict(step=s, name=n, digest=hexdigest((r, s, n))) for s in range(3)
                for n in ("aten::mm.default", "aten::add.Tensor", "aten::relu.default")]  # fmt: skip
        if planted and r == 1:
            recs[4]["digest"] = hexdigest("planted")
        out[r] = {"records": recs, "metrics": [dict(step=s, value=float(s)) for s in range(3)]}
    return out


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> dict[str, Path]:
    """Runs "a" and "b" (b differs at rank 1 step 1), each with and without ``shard_facts``."""
    root = tmp_path_factory.mktemp("committed")
    out = {}
    for name, planted in (("a", False), ("b", True)):
        out[name] = write_run(root / name, _ranks(planted), manifest_overrides={"shard_facts": 1})
        old = root / f"{name}-old"  # the same bytes as older writers' runs: no manifest key
        shutil.copytree(out[name], old)
        for m in old.glob("manifest/rank=*/*.json"):
            doc = json.loads(m.read_text())
            del doc["shard_facts"]
            m.write_text(json.dumps(doc))
        out[f"{name}-old"] = old
    return out


@pytest.fixture
def pair(written, tmp_path) -> dict[str, Path]:
    """Fresh copies of the written runs, to damage."""
    return {k: shutil.copytree(v, tmp_path / k) for k, v in written.items()}


@pytest.fixture
def parses(monkeypatch) -> list[Path]:
    """Paths whose footers the reader parses (``shard_scan.read_footer``), in order."""
    seen: list[Path] = []
    real = shard_scan.read_footer

    def spy(st, path):
        seen.append(path)
        return real(st, path)

    monkeypatch.setattr(shard_scan, "read_footer", spy)
    return seen


def _shard_count(run: Path) -> int:
    return len(list(run.glob("*/rank=*/*.parquet")))


def test_writer_commits_each_shards_size_steps_and_footer_checksum(written):
    log = commitlog.parse((written["a"] / commitlog.commit_log_relpath(1, 0)).read_bytes())
    assert sorted(log.shards) == [0, 1, 2]
    for w, facts in log.shards.items():
        assert sorted(facts) == sorted(t for t, n in log.windows[w][0].items() if n)
        for table, fact in facts.items():
            data = (written["a"] / contract.shard_relpath(table, 1, 0, w)).read_bytes()
            assert fact == commitlog.shard_fact(data, w, w) and fact.size == len(data)


def test_committed_shards_open_without_a_footer_parse_and_bisect_the_same(written, parses):
    new = open_run(written["a"])
    assert parses == []  # every shard taken from its commit line
    old = open_run(written["a-old"])
    assert len(parses) == _shard_count(written["a-old"])  # an older run: every footer parsed, as before
    for table in ("records", "metrics"):
        facts = [(s.path.relative_to(new.path), s.rank, s.segment, s.num_rows, s.step_min, s.step_max, s.window)
                 for s in new.shards[table]]  # fmt: skip
        assert facts == [
            (s.path.relative_to(old.path), s.rank, s.segment, s.num_rows, s.step_min, s.step_max, s.window)
            for s in old.shards[table]
        ]
        assert all(s.footer_crc32 is not None for s in new.shards[table])
        assert all(s.footer_crc32 is None for s in old.shards[table])
    reports = []
    for a, b in ((written["a"], written["b"]), (written["a-old"], written["b-old"])):
        text = json.dumps(bisect(a, b).to_json_dict(), sort_keys=True)
        reports.append(text.replace(str(a), "A").replace(str(b), "B"))  # the labels name the directories
    assert reports[0] == reports[1] and '"status": "diverged"' in reports[0]


def test_a_read_checks_only_the_footers_it_selects_once(written, monkeypatch):
    checked: list[Path] = []
    real = committed_footers.footer_bytes
    monkeypatch.setattr(committed_footers, "footer_bytes", lambda st, p: checked.append(p) or real(st, p))
    run = open_run(written["a"])
    run.scan("records", ranks=[1], steps=[1]).collect()
    assert [p.relative_to(run.path).as_posix() for p in checked] == [SHARD]
    run.scan("records", ranks=[1], steps=[1]).collect()
    assert len(checked) == 1  # once per opened run
    run.files("metrics", ranks=[0])
    assert len(checked) == 4  # files() checks what it hands out (SQL, Spark)


def _one_line(exc_type, fn) -> str:
    with pytest.raises(exc_type) as info:
        fn()
    msg = str(info.value)
    assert "\n" not in msg
    return msg


def _cli_error(*args) -> str:
    r = CliRunner().invoke(app, [str(a) for a in args])
    assert r.exit_code == 2, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("detfp-analyze: "), r.output
    return lines[0]


def test_a_truncated_committed_shard_gives_the_error_of_a_parsed_footer(pair):
    for name in ("a", "a-old"):
        p = pair[name] / SHARD
        p.write_bytes(p.read_bytes()[:-100])
    new = _one_line(ShardError, lambda: open_run(pair["a"]))
    old = _one_line(ShardError, lambda: open_run(pair["a-old"]))
    assert new.replace(str(pair["a"]), "RUN") == old.replace(str(pair["a-old"]), "RUN")
    assert "not a Parquet file (no Parquet magic at the end (truncated or foreign file))" in new


def test_a_shard_whose_size_disagrees_with_its_commit_is_refused(pair):
    # The same rows, another compression: a usable footer, but not the file the window committed.
    p = pair["a"] / SHARD
    t = pq.read_table(p)
    pq.write_table(t, p, compression="none")
    msg = _one_line(ShardError, lambda: open_run(pair["a"]))
    size = p.stat().st_size
    assert msg.endswith(
        f"{SHARD}: {size} bytes, its commit line says "
        f"{commitlog.parse((pair['a'] / commitlog.commit_log_relpath(1, 0)).read_bytes()).shards[1]['records'].size}"
        ": the shard was truncated, rewritten or replaced after its window was committed; "
        "delete it or re-run the capture"
    )
    assert _cli_error("bisect", pair["a"], pair["b"]) == f"detfp-analyze: {msg}"
    open_run(pair["a-old"])  # without the commit's facts the same bytes were accepted as before


def test_other_rows_than_committed_stay_the_row_mismatch_gap(pair):
    p = pair["a"] / SHARD
    pq.write_table(pq.read_table(p).slice(0, 2), p)
    msg = _one_line(IncompleteRunError, lambda: open_run(pair["a"]))
    assert "records window 1 holds 2 row(s), its commit says 3" in msg


def test_a_damaged_footer_of_the_same_size_fails_the_read_with_the_parse_error(pair):
    for name in ("b", "b-old"):
        flip_in_footer(pair[name] / SHARD, b"key_hash")  # a column name: schema check fails
    old = _one_line(ShardError, lambda: open_run(pair["b-old"]))
    run_b = open_run(pair["b"])  # opened by size: the damage is not seen yet
    new = _one_line(ShardError, lambda: bisect(open_run(pair["a"]), run_b))
    assert new.replace(str(pair["b"]), "RUN") == old.replace(str(pair["b-old"]), "RUN")
    assert "missing column(s) key_hash" in new
    assert _cli_error("bisect", pair["a"], pair["b"]).replace(str(pair["b"]), "RUN") == f"detfp-analyze: {new}".replace(
        str(pair["b"]), "RUN"
    )


def test_a_footer_that_parses_but_differs_from_its_commit_is_refused_on_read(pair):
    flip_in_footer(pair["b"] / SHARD, b"parquet-cpp")  # created_by: still a valid footer
    open_run(pair["b-old"])
    run_b = open_run(pair["b"])
    msg = _one_line(ShardError, lambda: run_b.scan("records", ranks=[1], steps=[1]))
    assert msg == (
        f"{pair['b']}/{SHARD}: its footer is not the one its commit line recorded (checksum differs): the shard "
        "was rewritten or damaged after its window was committed; delete it or re-run the capture"
    )
    run_b.scan("records", ranks=[0]).collect()  # shards the damage does not touch still read


@pytest.mark.parametrize(
    "shards",
    [
        {"records": [10, 0, 0, 5]},  # a table missing
        {"records": [10, 0, 0, 5], "metrics": [10, 0]},  # a short fact
        {"records": [10, 1, 0, 5], "metrics": [10, 0, 0, 5]},  # steps backwards
        {"records": [10, 0, 0, 1 << 32], "metrics": [10, 0, 0, 5]},  # not a CRC-32
        {"records": [-1, 0, 0, 5], "metrics": [10, 0, 0, 5]},
        [10, 0, 0, 5],
    ],
)
def test_a_malformed_shards_field_leaves_the_window_to_its_footers(shards):
    line = {"t": "window", "window": 0, "rows": {"records": 3, "metrics": 1, "events": 0}, "steps": [0, 0]}
    good = commitlog.parse(commitlog.encode({**line, "shards": {"records": [10, 0, 0, 5], "metrics": [9, 0, 0, 6]}}))
    assert good.shards == {0: {"records": (10, 0, 0, 5), "metrics": (9, 0, 0, 6)}}
    state = commitlog.parse(commitlog.encode({**line, "shards": shards}))
    assert state.windows == good.windows and state.bad_lines == 0  # the commit itself still counts
    assert state.shards == {}


def test_a_newer_shard_facts_version_is_read_through_the_footers(pair, parses):
    for m in pair["a"].glob("manifest/rank=*/*.json"):
        doc = json.loads(m.read_text())
        doc["shard_facts"] = commitlog.SHARD_FACTS_VERSION + 1
        m.write_text(json.dumps(doc))
    open_run(pair["a"])
    assert len(parses) == _shard_count(pair["a"])


def test_a_shard_under_another_padding_of_its_name_is_read_through_its_footer(pair, parses):
    # Commit lines state shards by the name the capture gives them (contract.shard_name); the
    # same bytes under a name that names the same window another way are validated from their
    # footer (not taken from the commit line), and neither the size check nor the report changes.
    def report() -> str:
        return json.dumps(bisect(pair["a"], open_run(pair["b"])).to_json_dict(), sort_keys=True)

    before = report()
    p = pair["b"] / SHARD
    p.rename(p.with_name("part-s000000-w00000001.parquet"))
    parses.clear()
    run = open_run(pair["b"])
    assert [q.name for q in parses] == ["part-s000000-w00000001.parquet"]
    moved = [s for s in run.shards["records"] if s.rank == 1 and s.window == 1]
    assert len(moved) == 1 and moved[0].footer_crc32 is None and moved[0].num_rows == 3
    assert report() == before and '"status": "diverged"' in before
