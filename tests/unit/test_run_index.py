"""The run index (``io.runindex``, ``detfp-analyze index``): the same reports, never trusted stale.

* with an index and without (``--no-index``), ``bisect`` prints the same bytes (text and
  ``--json``) on every sample pair of ``sample_traces/`` and every golden plant;
* an index opened run holds the same manifests, commit-log facts and step folds as a parsed one;
* a damaged, truncated, stale (a commit log, a manifest changed, added or removed) or foreign
  (another version) index is not used: the run is opened from its files, with the same answer;
* the index is the reader's cache: the first open of a run parses its files and fills it, the
  next reads it (``--no-index`` neither reads nor writes it); it names the bytes that were
  parsed (a log appended to after the open read it leaves it stale); a run whose index can be
  written nowhere opens as before;
* a run that cannot be written is indexed in the user cache directory;
* the command's errors are one line and exit 2.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from detfp_analyze.cli import app
from detfp_analyze.io import reader, runindex, stepsums
from detfp_analyze.io.reader import index_run, open_run
from detfp_format import commitlog

SAMPLES = Path(__file__).resolve().parents[2] / "sample_traces"
SAMPLE_PAIRS = [("data_rank", "a", "b"), ("moe_permute", "a", "b"), ("nondet", "a", "b"), ("ops", "a", "b"),
                ("resume", "full", "resumed"), ("resume", "full", "restored")]  # fmt: skip


def _cli(*args: str) -> tuple[int, str]:
    res = CliRunner().invoke(app, list(args))
    return res.exit_code, res.output


def _reports(a: Path, b: Path, *index: str) -> tuple[str, str]:
    out = []
    for flags in ((), ("--json",)):
        code, text = _cli("bisect", str(a), str(b), "--allow-missing-ranks", *flags, *index)
        assert code in (0, 1), text
        out.append(text)
    return out[0], out[1]


def _same_with_and_without(monkeypatch, a: Path, b: Path) -> None:
    for run in (a, b):
        assert _cli("index", str(run))[0] == 0
    without = _reports(a, b, "--no-index")
    assert all(open_run(r, allow_incomplete=True, allow_missing_ranks=True).indexed for r in (a, b))
    assert not any(
        open_run(r, allow_incomplete=True, allow_missing_ranks=True, use_index=False).indexed for r in (a, b)
    )
    assert _reports(a, b) == without


@pytest.mark.parametrize(("pair", "x", "y"), SAMPLE_PAIRS)
def test_sample_pairs_give_the_same_reports_with_an_index(tmp_path, monkeypatch, pair, x, y):
    shutil.copytree(SAMPLES / pair, tmp_path / pair)  # the index is written beside the copy
    _same_with_and_without(monkeypatch, tmp_path / pair / x, tmp_path / pair / y)


def test_golden_plants_give_the_same_reports_with_an_index(planted_pairs, tmp_path, monkeypatch):
    for name, p in sorted(planted_pairs.items()):
        a, b = tmp_path / f"{name}-a", tmp_path / f"{name}-b"
        shutil.copytree(p.a, a)
        shutil.copytree(p.b, b)
        _same_with_and_without(monkeypatch, a, b)


@pytest.fixture
def run(tmp_path):
    from detfp_analyze.testing.seedpair import SeedSpec, write_seed_run
    from detfp_analyze.testing.synth import Plant

    spec = SeedSpec(ranks=8, steps=12, records=20, layout=(("tp", 2), ("dp", 2), ("pp", 2)), step_time=5.0)
    write_seed_run(tmp_path / "a", spec, workers=1)
    write_seed_run(tmp_path / "b", spec, Plant(rank=3, step=9, index=5), link_from=tmp_path / "a", workers=1)
    return tmp_path / "a", tmp_path / "b"


def test_an_indexed_run_holds_what_the_files_say(run, monkeypatch):
    a, _ = run
    assert index_run(a) is not None
    parsed = open_run(a, use_index=False)
    got = open_run(a)
    assert got.indexed and not parsed.indexed
    assert dict(got.manifests) == dict(parsed.manifests)
    assert got.completeness == parsed.completeness and got.shards == parsed.shards
    assert got.step_sums.usable == parsed.step_sums.usable
    assert got.step_sums.frame.equals(parsed.step_sums.frame)
    held = stepsums.pair(got, got, got.ranks, 0, 11)
    assert held is not None and stepsums.as_dict(held[0]) == stepsums.as_dict(
        stepsums.pair(parsed, parsed, parsed.ranks, 0, 11)[0]
    )  # type: ignore[index]


def _damage_truncate(a: Path) -> None:
    f = a / runindex.INDEX_DIR / "index.json"
    f.write_bytes(f.read_bytes()[:100])


def _damage_folds(a: Path) -> None:
    (a / runindex.INDEX_DIR / "folds.arrow").write_bytes(b"not arrow")


def _damage_version(a: Path) -> None:
    f = a / runindex.INDEX_DIR / "index.json"
    doc = json.loads(f.read_bytes())
    f.write_text(json.dumps({**doc, "version": runindex.INDEX_VERSION + 1}))


def _damage_value(a: Path) -> None:
    # Still valid JSON, still naming the same files with their digests: only the seal tells.
    f = a / runindex.INDEX_DIR / "index.json"
    doc = json.loads(f.read_bytes())
    i = next(i for i, v in enumerate(doc["values"]) if v.startswith('["'))  # the command, a list of strings
    doc["values"][i] = json.dumps(["tampered", *json.loads(doc["values"][i])[1:]], separators=(",", ":"))
    f.write_text(json.dumps(doc, ensure_ascii=False, separators=(",", ":")))


def _damage_folds_parseable(a: Path) -> None:
    # A folds table that reads back fine, with one fold changed: only the seal tells.
    import polars as pl

    f = a / runindex.INDEX_DIR / "folds.arrow"
    frame = pl.read_ipc(f)
    frame.with_columns(
        pl.when(pl.int_range(pl.len()) == 3).then(pl.col("n") + 1).otherwise(pl.col("n")).alias("n")
    ).write_ipc(f)


def _damage_shards_parseable(a: Path) -> None:
    # A shards table that reads back fine, with one stated size changed: only the seal tells.
    import polars as pl

    f = a / runindex.INDEX_DIR / "shards.arrow"
    frame = pl.read_ipc(f)
    frame.with_columns(
        pl.when(pl.int_range(pl.len()) == 0).then(pl.col("size") + 1).otherwise(pl.col("size")).alias("size")
    ).write_ipc(f)


def _damage_shards_missing(a: Path) -> None:
    (a / runindex.INDEX_DIR / "shards.arrow").unlink()


def _damage_seal(a: Path) -> None:
    (a / runindex.INDEX_DIR / "index.seal").unlink()


def _stale_log(a: Path) -> None:
    log = a / "manifest" / "rank=2" / "segment-00000.commits"
    log.write_bytes(log.read_bytes() + b"00000000 {}\n")


def _stale_manifest(a: Path) -> None:
    m = a / "manifest" / "rank=5" / "segment-00000.json"
    m.write_text(m.read_text().replace('"command": [', '"command": ["x", '))


def _stale_removed(a: Path) -> None:
    (a / "manifest" / "rank=7" / "segment-00000.commits").unlink()


def _stale_added(a: Path) -> None:
    shutil.copy(a / "manifest" / "rank=1" / "segment-00000.json", a / "manifest" / "rank=1" / "segment-00001.json")


@pytest.mark.parametrize(
    "damage",
    [
        _damage_truncate,
        _damage_folds,
        _damage_version,
        _damage_value,
        _damage_folds_parseable,
        _damage_shards_parseable,
        _damage_shards_missing,
        _damage_seal,
        _stale_log,
        _stale_manifest,
        _stale_removed,
        _stale_added,
    ],
)
def test_a_damaged_or_stale_index_is_not_trusted(run, monkeypatch, damage):
    a, b = run
    assert index_run(a) is not None and open_run(a).indexed
    damage(a)
    expect = _cli("bisect", str(a), str(b), "--json", "--allow-incomplete", "--no-index")
    assert _cli("index", "--check", str(a))[0] == 2
    if damage is _stale_added:  # the new manifest is judged as without an index: refused
        assert _cli("bisect", str(a), str(b), "--json", "--allow-incomplete") == expect
        assert expect[0] == 2 and "says rank 1 segment 0" in expect[1]
        return
    opened = open_run(a, allow_incomplete=True)
    assert not opened.indexed
    if damage is _stale_manifest:  # what the file says now, not what the index held
        assert opened.manifest(5)["command"][0] == "x"
    if damage is _stale_log:
        assert not opened.completeness.complete
    # That open parsed the files and filled the cache again, with what they say now.
    assert _cli("index", "--check", str(a))[0] == 0
    assert _cli("bisect", str(a), str(b), "--json", "--allow-incomplete") == expect
    assert open_run(a, allow_incomplete=True).indexed


def test_the_first_open_fills_the_cache_and_the_next_reads_it(run):
    a, b = run
    expect = _cli("bisect", str(a), str(b), "--json", "--no-index")
    assert expect[0] == 1 and not any((r / runindex.INDEX_DIR).exists() for r in (a, b))  # --no-index: nothing written
    assert not open_run(a).indexed  # parsed, and the index filled as it was
    assert (a / runindex.INDEX_DIR / "index.seal").is_file() and _cli("index", "--check", str(a))[0] == 0
    assert open_run(a).indexed
    assert _cli("bisect", str(a), str(b), "--json") == expect  # B's first open: parsed and filled
    assert _cli("index", "--check", str(b))[0] == 0
    assert _cli("bisect", str(a), str(b), "--json") == expect  # both read from the index
    assert open_run(b).indexed


def test_the_index_names_the_bytes_that_were_parsed(run, monkeypatch):
    """A commit log appended to after the open read it (a capture still writing): the index that
    open filled names the bytes it parsed, so the next open finds it stale and reads the log anew."""
    a, _ = run
    log = a / "manifest" / "rank=2" / "segment-00000.commits"
    real = reader.read_logs

    def then_appended(*args):
        got = real(*args)
        log.write_bytes(log.read_bytes() + b"00000000 {}\n")
        return got

    monkeypatch.setattr(reader, "read_logs", then_appended)
    first = open_run(a, allow_incomplete=True)
    monkeypatch.undo()
    assert not first.indexed and first.completeness.complete  # the log as it was read
    assert (a / runindex.INDEX_DIR / "index.seal").is_file()
    again = open_run(a, allow_incomplete=True)
    assert not again.indexed and not again.completeness.complete  # stale: the log is read as it is now
    assert open_run(a, allow_incomplete=True).indexed  # and the cache filled with that


def test_a_run_whose_index_can_be_written_nowhere_opens_as_before(run, monkeypatch, tmp_path):
    a, b = run
    (a / runindex.INDEX_DIR).write_text("a file where the index directory would go")
    (tmp_path / "not-a-dir").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "not-a-dir"))  # no directory can be made below it
    expect = _cli("bisect", str(a), str(b), "--json", "--no-index")
    assert not open_run(a).indexed and not open_run(a).indexed
    assert _cli("bisect", str(a), str(b), "--json") == expect
    code, out = _cli("index", str(a))
    assert code == 2 and "can be written neither beside the run nor in" in out


def test_a_huge_stray_file_is_not_read_to_fill_the_cache(run):
    """A commit log without a manifest is no part of the run; one larger than any file the reader
    parses (sparse here) is not read whole for a cache: the run opens, without an index."""
    a, _ = run
    with open(a / "manifest" / "rank=0" / "segment-00009.commits", "wb") as f:
        f.truncate(commitlog.COMMIT_LOG_MAX_BYTES + 1)
    assert not open_run(a).indexed and not (a / runindex.INDEX_DIR).exists()
    assert not open_run(a).indexed


def test_a_read_only_run_is_indexed_in_the_cache(run, monkeypatch, tmp_path):
    a, _ = run
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    blocker = a / runindex.INDEX_DIR
    blocker.write_text("a file where the index directory would go")  # beside the run: cannot be written
    got = index_run(a)
    assert (
        got is not None and got.path == runindex.cache_dir(a.resolve()) and got.path.is_relative_to(tmp_path / "cache")
    )
    assert open_run(a).indexed


@pytest.mark.parametrize(
    ("args", "expect"),
    [
        (["index", "/no/such/run"], "no such directory"),
        (["index", "--check", "{a}"], "no current run index"),
        (["index", "{empty}"], "not a detfp run"),
    ],
)
def test_index_errors_are_one_line_and_exit_2(run, tmp_path, args, expect):
    (tmp_path / "empty").mkdir()
    code, out = _cli(*[x.format(a=run[0], empty=tmp_path / "empty") for x in args])
    lines = out.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("detfp-analyze: ") and expect in lines[0], out
