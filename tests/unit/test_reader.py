"""open_run / Run: every bad-input case with its exact message, scans, pruning and supersession."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from detfp_analyze.errors import (
    DuplicateRankError,
    IncompleteRunError,
    ManifestError,
    MissingRankError,
    NotARunError,
    SchemaVersionError,
    ShardError,
)
from detfp_analyze.io.reader import open_run, polars_schema
from detfp_format import contract
from detfp_format.arrowschema import arrow_schema
from tests.fixtures.shards import write_run

FIX_RUN = "pass the directory given to detfp_capture.Session(...) or --out"


@pytest.fixture
def run(tmp_path) -> Path:
    """Two ranks, steps 0..2, one records file per step, one metric per step."""
    return write_run(
        tmp_path / "run",
        {r: {"records": [dict(step=s) for s in range(3)], "metrics": [dict(step=s, value=s / 3) for s in range(3)]}
         for r in range(2)},
    )  # fmt: skip


def _manifest_path(run: Path, rank: int = 0, segment: int = 0) -> Path:
    return run / contract.manifest_relpath(rank, segment)


def _edit_manifest(run: Path, which: int = 0, **changes) -> None:
    p = _manifest_path(run, which)
    m = json.loads(p.read_text())
    m.update(changes)
    p.write_text(json.dumps(m))


def _err(exc_type, path) -> str:
    with pytest.raises(exc_type) as info:
        open_run(path)
    return str(info.value)


# ---------------------------------------------------------------------- bad layout
def test_missing_path(tmp_path):
    p = str(tmp_path / "nope")
    assert _err(NotARunError, p) == f"{p}: no such directory; {FIX_RUN}"


def test_not_a_directory(tmp_path):
    p = tmp_path / "file"
    p.write_text("")
    assert _err(NotARunError, p) == f"{p}: not a directory; {FIX_RUN}"


def test_no_manifest_dir(tmp_path):
    assert _err(NotARunError, tmp_path) == f"{tmp_path}: not a detfp run (no manifest/ directory); {FIX_RUN}"


def test_no_manifest_files(tmp_path):
    (tmp_path / "manifest" / "rank=0").mkdir(parents=True)
    (tmp_path / "manifest" / "rank=0" / ".segment-00000.json.1.tmp").write_text("{")
    assert _err(NotARunError, tmp_path) == (
        f"{tmp_path}: not a detfp run (no manifest/rank=N/segment-N.json files); {FIX_RUN}"
    )


# ----------------------------------------------------------------------- manifests
def test_manifest_not_json(run):
    _manifest_path(run, 1).write_text('{"rank": 1,')
    assert _err(ManifestError, run) == (
        f"{run}/manifest/rank=1/segment-00000.json: not valid JSON (Expecting property name enclosed in double "
        "quotes at line 1); restore the file or re-run the capture"
    )


def test_manifest_not_an_object(run):
    _manifest_path(run).write_text("[1, 2]")
    assert _err(ManifestError, run) == (
        f"{run}/manifest/rank=0/segment-00000.json: not a JSON object; restore the file or re-run the capture"
    )


def test_manifest_missing_keys(run):
    p = _manifest_path(run)
    m = json.loads(p.read_text())
    del m["git"], m["env"]
    p.write_text(json.dumps(m))
    assert _err(ManifestError, run) == (
        f"{run}/manifest/rank=0/segment-00000.json: missing key(s) env, git; the file was not written by a detfp "
        "capture of this schema, re-run the capture"
    )


def test_unknown_schema_version(run):
    _edit_manifest(run, schema_version=2)
    assert _err(SchemaVersionError, run) == (
        f"{run}/manifest/rank=0/segment-00000.json: schema_version 2 is not supported (this detfp reads "
        "schema_version 1); analyze it with the detfp release that wrote it, or re-run the capture with this one"
    )


def test_unknown_digest_version(run):
    _edit_manifest(run, 1, digest_version=7)
    assert _err(SchemaVersionError, run) == (
        f"{run}/manifest/rank=1/segment-00000.json: digest_version 7 is not supported (this detfp reads "
        "digest_version 1 or 2); analyze it with the detfp release that wrote it, or re-run the capture with this one"
    )


def test_bad_world_size_value(run):
    _edit_manifest(run, world_size="2")
    assert _err(ManifestError, run) == (
        f'{run}/manifest/rank=0/segment-00000.json: world_size is "2", expected an integer in 1..1048576; '
        "re-run the capture"
    )


def test_manifest_rank_disagrees_with_its_path(run):
    _edit_manifest(run, 1, rank=0)
    assert _err(ManifestError, run) == (
        f"{run}/manifest/rank=1/segment-00000.json: says rank 0 segment 0 but its path says rank 1 segment 0; "
        "move it to manifest/rank=0/segment-00000.json or re-run the capture"
    )


def test_duplicate_rank_segment(run):
    shutil.copy(_manifest_path(run, 1), run / "manifest" / "rank=1" / "segment-0.json")
    assert _err(DuplicateRankError, run) == (
        f"{run}/manifest/rank=1/segment-00000.json: a second manifest for rank 1 segment 0; delete the stray copy"
    )


def test_inconsistent_world_size(run):
    _edit_manifest(run, 1, world_size=4)
    assert _err(ManifestError, run) == (
        f"{run}: manifests disagree (world_size 2 on rank(s) 0; world_size 4 on rank(s) 1); one run directory "
        "holds one job, move the other job's ranks to their own directory"
    )


def test_missing_rank_and_allow_missing_ranks(tmp_path):
    p = write_run(tmp_path / "r", {0: {"records": [{}]}, 2: {"records": [{}]}, 5: {}}, world_size=7)
    assert _err(MissingRankError, p) == (
        f"{p}: missing rank(s) 1, 3-4, 6 of world size 7 (no manifest); pass allow_missing_ranks=True "
        "(--allow-missing-ranks) to analyze the ranks present"
    )
    r = open_run(p, allow_missing_ranks=True)
    assert r.ranks == (0, 2, 5) and r.missing_ranks == (1, 3, 4, 6)
    with pytest.raises(MissingRankError, match=r"rank 1 is not in this run \(ranks present: 0, 2, 5\)"):
        r.manifest(1)


def test_shards_of_a_rank_without_manifest_are_ignored_when_tolerated(tmp_path):
    p = write_run(tmp_path / "r", {0: {"records": [{}]}, 1: {"records": [{}, {}]}}, world_size=2)
    shutil.rmtree(p / "manifest" / "rank=1")
    r = open_run(p, allow_missing_ranks=True)
    assert r.missing_ranks == (1,) and r.scan("records").collect().height == 1


def test_manifest_rank_outside_world_size(tmp_path):
    p = write_run(tmp_path / "r", {0: {}, 3: {}}, world_size=2)
    assert _err(ManifestError, p) == (
        f"{p}: manifests for rank(s) 3 outside world size 2; remove them or check that they belong to this run"
    )


# -------------------------------------------------------------------------- shards
def test_shard_not_parquet(run):
    bad = run / "records" / "rank=1" / "part-s00000-w0000009.parquet"
    bad.write_bytes(b"PAR1 this is not really parquet")
    msg = _err(ShardError, run)
    assert msg.startswith(f"{run}/records/rank=1/part-s00000-w0000009.parquet: not a Parquet file (")
    assert msg.endswith("); delete it or re-run the capture")


def test_truncated_shard(run):
    f = run / "records" / "rank=0" / "part-s00000-w0000001.parquet"
    f.write_bytes(f.read_bytes()[:100])
    assert _err(ShardError, run).startswith(f"{run}/records/rank=0/part-s00000-w0000001.parquet: not a Parquet")


def _foreign_shard(run: Path, table: str, drop=(), retype=None, rank: int = 0, values=None) -> Path:
    """A shard written directly with pyarrow (a third-party producer), optionally broken."""
    good = pq.read_table(sorted((run / table / f"rank={rank}").glob("*.parquet"))[0])
    cols = {n: good.column(n) for n in good.column_names if n not in drop}
    if retype:
        for name, typ in retype.items():
            cols[name] = pa.array(good.column(name).to_pylist(), typ)
    for name, vals in (values or {}).items():
        cols[name] = pa.array(vals, good.schema.field(name).type)
    path = run / table / f"rank={rank}" / "part-s00000-w0000099.parquet"
    pq.write_table(pa.table(cols), path)
    return path


def test_shard_missing_columns(run):
    _foreign_shard(run, "records", drop=("digest_hi", "hazards"))
    assert _err(ShardError, run) == (
        f"{run}/records/rank=0/part-s00000-w0000099.parquet: missing column(s) digest_hi, hazards of table "
        "records; the shard was not written to this contract; delete it or re-run the capture"
    )


def test_shard_wrong_type(run):
    _foreign_shard(run, "metrics", retype={"bits": pa.int64()})
    assert _err(ShardError, run) == (
        f"{run}/metrics/rank=0/part-s00000-w0000099.parquet: column bits has type int64, the contract says uint64; "
        "the shard was not written to this contract; delete it or re-run the capture"
    )


def test_shard_rank_disagrees_with_partition(run):
    src = run / "records" / "rank=0" / "part-s00000-w0000002.parquet"
    shutil.copy(src, run / "records" / "rank=1" / "part-s00000-w0000007.parquet")
    assert _err(ShardError, run) == (
        f"{run}/records/rank=1/part-s00000-w0000007.parquet: rank column holds 0 but the file is in partition "
        "rank=1; move it to its rank's partition or re-run the capture"
    )


def test_shard_null_in_non_nullable_column(run):
    # A foreign producer whose columns are all optional: nulls are caught from footer statistics.
    _foreign_shard(run, "records", values={"dtype": [None]})
    assert _err(ShardError, run) == (
        f"{run}/records/rank=0/part-s00000-w0000099.parquet: column dtype holds nulls, the contract does not allow "
        "them; delete it or re-run the capture"
    )


def test_shard_partition_outside_world_size(run):
    (run / "events" / "rank=2").mkdir(parents=True)
    assert _err(ShardError, run) == (
        f"{run}/events/rank=2: rank 2 is outside world size 2; delete the partition or check that it belongs "
        "to this run"
    )


def test_shard_schema_version_metadata(run):
    good = pq.read_table(sorted((run / "records" / "rank=0").glob("*.parquet"))[0])
    t = good.replace_schema_metadata({b"detfp.schema_version": b"9"})
    pq.write_table(t, run / "records" / "rank=0" / "part-s00000-w0000050.parquet")
    assert _err(SchemaVersionError, run) == (
        f"{run}/records/rank=0/part-s00000-w0000050.parquet: schema version 9 is not supported (this detfp reads "
        "schema version 1); analyze it with the detfp release that wrote it"
    )


def test_stray_files_are_ignored(run):
    part = run / "records" / "rank=0"
    (part / ".part-s00000-w0000003.parquet.123.tmp").write_bytes(b"half a file")
    (part / "_SUCCESS").write_bytes(b"")
    (part / "notes.txt").write_text("hello")
    (run / "README").write_text("a run")
    r = open_run(run)
    assert [p.name for p in r.files("records", [0])] == [f"part-s00000-w000000{i}.parquet" for i in range(3)]


def test_foreign_producer_with_optional_fields_and_large_types_is_accepted(run):
    schema = arrow_schema("events")
    fields = [pa.field(f.name, pa.large_string() if f.type == pa.string() else f.type) for f in schema]
    row = {"rank": 1, "segment": 0, "step": 4, "seq": 0, "type": "hazard", "name": "uninitialized", "module": "",
           "count": None, "detail": None}  # fmt: skip
    t = pa.Table.from_pylist([row], schema=pa.schema(fields))
    (run / "events" / "rank=1").mkdir(parents=True)
    pq.write_table(t, run / "events" / "rank=1" / "anything.parquet", compression="snappy")
    # Dropped into a run whose commit logs do not list it, the file is refused as uncommitted;
    # a producer that writes no commit log makes a legacy run, read as it is.
    with pytest.raises(IncompleteRunError, match=r"anything\.parquet was written but never committed"):
        open_run(run)
    for log in run.glob("manifest/rank=*/*.commits"):
        log.unlink()
    r = open_run(run)
    df = r.scan("events").collect()
    assert df.to_dicts() == [row] and df.schema == polars_schema("events")
    assert r.completeness.legacy_ranks == (0, 1) and r.completeness.complete


# ---------------------------------------------------------------------------- scans
def test_run_fields_and_manifest(run):
    r = open_run(str(run))
    assert (r.label, r.path, r.world_size, r.ranks, r.missing_ranks) == (str(run), run.resolve(), 2, (0, 1), ())
    assert r.tables == frozenset({"records", "metrics"})
    assert r.manifest()["rank"] == 0 and r.manifest(1)["rank"] == 1
    assert r.segments(1) == (0,)
    assert [s.step_min for s in r.shards["records"]] == [0, 1, 2, 0, 1, 2]


def test_scan_selects_ranks_and_steps_and_prunes_files(run):
    r = open_run(run)
    df = r.scan("records", ranks=[1], steps=range(1, 3)).select("rank", "step").collect()
    assert df.rows() == [(1, 1), (1, 2)]
    assert r.scan("records", ranks=0, steps=2).collect().height == 1
    assert r.scan("metrics", steps=[0, 2]).select("step").collect()["step"].to_list() == [0, 2, 0, 2]
    assert len(r._select("records", [0], 1)) == 1  # footer step ranges prune files before any read
    assert r.scan("records", steps=range(10, 20)).collect().height == 0


def test_absent_table_is_an_empty_typed_frame(run):
    r = open_run(run)
    for table in ("events", "kernels", "dumps"):
        df = r.scan(table).collect()
        assert df.height == 0 and df.schema == polars_schema(table)
    assert r.files("dumps") == []
    with pytest.raises(KeyError, match="unknown table 'recs'"):
        r.scan("recs")


def test_metric_bits_round_trip(run):
    df = open_run(run).scan("metrics").filter(pl.col("rank") == 0).collect()
    assert [float.fromhex(v.hex()) for v in df["value"]] == [0.0, 1 / 3, 2 / 3]
    assert df["bits"].to_list() == [struct.unpack("<Q", struct.pack("<d", s / 3))[0] for s in range(3)]


def test_later_segment_supersedes_rows_from_its_start_step(tmp_path):
    p = tmp_path / "r"
    write_run(p, {r: {"records": [dict(step=s, module="first") for s in range(6)]} for r in range(2)})
    # Rank 0 resumed from step 2, rank 1 from step 4; segment 2 of rank 0 resumed again from step 5.
    write_run(p, {0: {"records": [dict(step=s, module="second") for s in range(2, 6)]}}, segment=1, start_step=2,
              world_size=2)  # fmt: skip
    write_run(p, {1: {"records": [dict(step=s, module="second") for s in range(4, 6)]}}, segment=1, start_step=4,
              world_size=2)  # fmt: skip
    write_run(p, {0: {"records": [dict(step=5, module="third")]}}, segment=2, start_step=5, world_size=2)
    r = open_run(p)
    assert r.segments(0) == (0, 1, 2) and r.manifest(0)["segment"] == 2
    assert r.supersession() == ((0, 0, 2), (0, 1, 5), (1, 0, 4))
    df = r.scan("records").select("rank", "step", "module").collect()
    assert df.rows() == [
        (0, 0, "first"), (0, 1, "first"), (0, 2, "second"), (0, 3, "second"), (0, 4, "second"), (0, 5, "third"),
        (1, 0, "first"), (1, 1, "first"), (1, 2, "first"), (1, 3, "first"), (1, 4, "second"), (1, 5, "second"),
    ]  # fmt: skip
    assert r.scan("records", ranks=[1], steps=4).select("module").collect().item() == "second"
    assert len(r.files("records", [0])) == 6 + 4 + 1


def test_segment_without_start_step_supersedes_nothing(tmp_path):
    p = tmp_path / "r"
    write_run(p, {0: {"records": [dict(step=0)]}})
    write_run(p, {0: {"records": [dict(step=0)]}}, segment=1)
    assert open_run(p).scan("records").collect().height == 2


@settings(max_examples=25, deadline=None)
@given(
    st.lists(
        st.tuples(st.one_of(st.none(), st.integers(0, 6)), st.sets(st.integers(0, 6), min_size=1, max_size=4)),
        min_size=1,
        max_size=4,
    )
)
def test_supersession_matches_a_reference_model(tmp_path_factory, segments):
    """Each (start_step, steps) is one launch of rank 0; a row survives unless a later launch starts at or before it."""
    p = tmp_path_factory.mktemp("seg")
    for seg, (start, steps) in enumerate(segments):
        write_run(p, {0: {"metrics": [dict(step=s) for s in sorted(steps)]}}, segment=seg, start_step=start)
    expected = sorted(
        (seg, s)
        for seg, (_, steps) in enumerate(segments)
        for s in steps
        if not any(st_ is not None and st_ <= s for st_, _ in segments[seg + 1 :])
    )
    got = sorted(open_run(p).scan("metrics").select("segment", "step").collect().rows())
    assert got == expected
    for lo, hi in ((0, 2), (3, 6)):
        sub = sorted(open_run(p).scan("metrics", steps=range(lo, hi + 1)).select("segment", "step").collect().rows())
        assert sub == [r for r in expected if lo <= r[1] <= hi]


def test_open_run_reads_footers_only(run, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("open_run must not read shard data")

    monkeypatch.setattr(pq, "read_table", refuse)
    monkeypatch.setattr(pq.ParquetFile, "read", refuse)
    monkeypatch.setattr(pq.ParquetFile, "read_row_group", refuse)
    r = open_run(run)
    assert sum(s.num_rows for s in r.shards["records"]) == 6


def test_footer_parse_matches_pyarrow_reader(run):
    # The reader parses each footer from the bytes it read (footer_bytes.parse_footer): the same
    # metadata, statistics included, as pyarrow reading the file itself.
    from detfp_analyze.io import footer_bytes

    shards = sorted(run.glob("*/rank=*/*.parquet"))
    assert shards
    for p in shards:
        md = footer_bytes.read_footer(None, p)
        assert not isinstance(md, str), md
        assert md.equals(pq.read_metadata(p))


def test_files_pruned_by_steps_are_the_windows_holding_them(tmp_path):
    # Engines that hand files to another reader (Spark pays per file opened) ask for the windows
    # of the steps they read: exactly the shards whose rows hold one of those steps.
    from detfp_analyze.testing.seedpair import SeedSpec, write_seed_run

    spec = SeedSpec(ranks=2, steps=12, records=4, layout=(("dp", 2),), step_time=5.0)  # 4 steps a window
    write_seed_run(tmp_path / "a", spec, workers=1)
    r = open_run(tmp_path / "a")
    every = r.files("records")
    steps_of = {p: set(pq.read_table(p, columns=["step"]).column("step").to_pylist()) for p in every}
    assert len(every) == 2 * 3 and all(len(s) == 4 for s in steps_of.values())
    for steps in (5, range(3, 9), [11], range(0, 12), [0, 11]):
        want = set([steps] if isinstance(steps, int) else steps)
        lo, hi = min(want), max(want)
        got = r.files("records", [1], steps)
        assert got == [p for p in every if "rank=1" in str(p) and any(lo <= s <= hi for s in steps_of[p])]
    assert r.files("records", None, range(20, 30)) == []
