"""ShardWriter, prepare_run_dir and write_manifest: round trips, atomicity, failure, backpressure."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from detfp_analyze.errors import IncompleteRunError
from detfp_analyze.io.reader import open_run
from detfp_format import contract
from detfp_format.arrowschema import SCHEMA_VERSION_KEY, TABLE_KEY, arrow_schema
from detfp_format.errors import RunExistsError, SchemaError
from detfp_format.writer import ShardWriter, build_table, prepare_run_dir, write_manifest
from tests.fixtures.shards import default_manifest, split_digest, write_run

REPO = Path(__file__).resolve().parents[2]


def _records(n: int, step: int = 0, **over: list) -> dict[str, list]:
    cols = {
        "step": [step] * n,
        "seq": list(range(n)),
        "microbatch": [-1] * n,
        "phase": ["forward"] * n,
        "module": ["layer.0"] * n,
        "kind": ["op"] * n,
        "name": ["aten::mm.default"] * n,
        "occurrence": list(range(n)),
        "role": ["output"] * n,
        "arg": ["out[0]"] * n,
        "dtype": ["torch.float32"] * n,
        "shape": [[2, 3]] * n,
        "numel": [6] * n,
        "status": ["ok"] * n,
        "digest_hi": [(1 << 64) - 1 - i for i in range(n)],
        "digest_lo": [i for i in range(n)],
        "hazards": [[] for _ in range(n)],
        "compiled": [False] * n,
    }
    cols.update(over)
    return cols


def _wait_until(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.01)


# ----------------------------------------------------------------------------- schema
def test_arrow_schema_covers_contract_with_docs_and_version():
    for table, cols in contract.TABLES.items():
        schema = arrow_schema(table)
        assert schema.names == [c.name for c in cols]
        for c, f in zip(cols, schema, strict=True):
            assert f.nullable == c.nullable
            assert f.metadata[b"doc"] == c.doc.encode()
        assert schema.metadata[SCHEMA_VERSION_KEY] == str(contract.SCHEMA_VERSION).encode()
        assert schema.metadata[TABLE_KEY] == table.encode()
    assert arrow_schema("records").field("shape").type == pa.list_(pa.int64())
    assert arrow_schema("dumps").field("data").type == pa.large_binary()


# ------------------------------------------------------------------------- round trip
def test_round_trip_keeps_digests_and_computes_key_hashes(tmp_path):
    with ShardWriter(tmp_path, rank=3, segment=2) as w:
        assert w.write_window({"records": _records(5)}) == 0
    assert not w.failed and w.files_written == 1 and w.rows_written == 5
    path = tmp_path / contract.shard_relpath("records", 3, 2, 0)
    t = pq.read_table(path)
    assert t.schema.metadata[SCHEMA_VERSION_KEY] == b"1"
    d = t.to_pydict()
    assert d["rank"] == [3] * 5 and d["segment"] == [2] * 5
    assert d["digest_hi"] == [(1 << 64) - 1 - i for i in range(5)]
    assert d["digest_lo"] == list(range(5))
    assert d["error"] == [None] * 5 and d["rows"] == [None] * 5
    for i in range(5):
        ck = contract.call_key(-1, "forward", "layer.0", "op", "aten::mm.default", i)
        assert d["call_hash"][i] == contract.key_hash(ck)
        assert d["key_hash"][i] == contract.key_hash(contract.record_key(ck, "output", "out[0]"))


CALL_COLUMNS = ("step", "microbatch", "phase", "module", "kind", "name", "occurrence", "compiled")


@given(st.lists(st.integers(0, 4), min_size=1, max_size=40), st.booleans(), st.booleans())
@settings(max_examples=60, deadline=None)
def test_indexed_columns_build_the_table_their_expansion_builds(index, share, partial):
    # Call columns given once per call (``Indexed``, as the capture hands them over) build the
    # same table as the plain lists they stand for: values, call and key hashes, bounds.
    from detfp_format.indexed import Indexed, column_bounds

    calls = [
        {"step": 3 + c % 2, "microbatch": c % 2 - 1, "phase": ["forward", "backward"][c % 2], "module": f"m.{c}",
         "kind": "op", "name": f"aten::f{c % 3}.default", "occurrence": c, "compiled": c == 4}
        for c in range(5)
    ]  # fmt: skip
    plain = _records(len(index), arg=[f"args[{i % 3}]" for i in range(len(index))])
    indexed = dict(plain)
    for col in CALL_COLUMNS[: 4 if partial else None]:
        idx = index if share else list(index)  # one shared index list, or copies of it
        plain[col] = [calls[i][col] for i in index]
        indexed[col] = Indexed([c[col] for c in calls], idx)
    for col in CALL_COLUMNS[4 if partial else None :]:
        plain[col] = indexed[col] = [calls[i][col] for i in index]
    want = build_table("records", plain, 1, 0)
    assert build_table("records", indexed, 1, 0).equals(want)
    used = sorted(set(index))  # (the capture's values are its calls': every one is used)
    steps = Indexed([calls[i]["step"] for i in used], [used.index(i) for i in index])
    assert column_bounds(steps) == (min(plain["step"]), max(plain["step"]))
    assert Indexed([5, 6], [1, 0, 1]).expand() == [6, 5, 6] and len(Indexed([5], [0, 0])) == 2


def test_given_hashes_are_kept(tmp_path):
    with ShardWriter(tmp_path, 0, 0) as w:
        w.write_window({"records": _records(2, call_hash=[7, 7], key_hash=[8, 9])})
    d = pq.read_table(tmp_path / contract.shard_relpath("records", 0, 0, 0)).to_pydict()
    assert d["call_hash"] == [7, 7] and d["key_hash"] == [8, 9]


@settings(max_examples=15, deadline=None)
@given(st.lists(st.integers(0, (1 << 128) - 1), min_size=1, max_size=20))
def test_digest_round_trip_is_bit_exact(tmp_path_factory, digests):
    root = tmp_path_factory.mktemp("run")
    write_run(root, {0: {"records": [dict(step=1, digest=d) for d in digests]}})
    df = open_run(root).scan("records").select("digest_hi", "digest_lo").collect()
    back = [(hi << 64) | lo for hi, lo in df.iter_rows()]
    assert back == digests
    assert [split_digest(d) for d in digests] == list(df.iter_rows())


def test_one_file_per_nonempty_table_per_window(tmp_path):
    metrics = {"step": [0], "seq": [9], "microbatch": [-1], "name": ["loss"], "occurrence": [0],
               "value": [1.5], "bits": [4609434218613702656], "dtype": ["torch.float32"]}  # fmt: skip
    with ShardWriter(tmp_path, 0, 0) as w:
        w.write_window({"records": _records(1), "metrics": metrics, "events": {}})
        w.write_window({"records": _records(0)})
        w.write_window({"records": _records(1, step=1)})
    names = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file())
    assert names == [
        "manifest/rank=0/segment-00000.commits",
        "metrics/rank=0/part-s00000-w0000000.parquet",
        "records/rank=0/part-s00000-w0000000.parquet",
        "records/rank=0/part-s00000-w0000002.parquet",
    ]


# ------------------------------------------------------------------------- validation
def test_unknown_column_table_and_ragged_columns_raise_in_caller(tmp_path):
    with ShardWriter(tmp_path, 0, 0) as w:
        with pytest.raises(SchemaError, match=r"records: unknown column\(s\) \['digest'\]"):
            w.write_window({"records": _records(1, digest=["ab"])})
        with pytest.raises(SchemaError, match="unknown table 'recs'"):
            w.write_window({"recs": {}})
        with pytest.raises(SchemaError, match=r"different lengths \[1, 2\]"):
            w.write_window({"records": _records(1, seq=[0, 1])})
        cols = _records(1)
        del cols["dtype"]
        with pytest.raises(SchemaError, match=r"missing non-nullable column\(s\) \['dtype'\]"):
            w.write_window({"records": cols})
    assert not w.failed


def test_null_in_non_nullable_column_is_refused():
    with pytest.raises(SchemaError, match=r"records\.dtype: null in a non-nullable column"):
        build_table("records", _records(1, dtype=[None]), 0, 0)


# ---------------------------------------------------------------------------- failure
def test_failed_write_disables_writer_calls_on_error_once_and_never_raises(tmp_path):
    (tmp_path / "records").write_text("a file where the table directory should be")
    messages: list[str] = []
    w = ShardWriter(tmp_path, 0, 0, on_error=messages.append)
    assert w.write_window({"records": _records(1)}) == 0
    _wait_until(lambda: w.failed)
    assert w.write_window({"records": _records(1)}) is None  # dropped, no exception
    assert w.close(timeout=10)
    assert len(messages) == 1 and messages[0] == w.error
    assert w.error.startswith(f"rank 0: writing window 0 to {tmp_path} failed: ")
    assert "\n" not in w.error
    assert w.dropped_windows == 2 and w.files_written == 0


def test_value_of_wrong_type_fails_the_writer_not_the_caller(tmp_path):
    w = ShardWriter(tmp_path, 0, 0)
    w.write_window({"records": _records(1, numel=["six"])})
    assert w.close(timeout=10)
    assert w.failed
    assert "ArrowInvalid" in w.error or "ArrowTypeError" in w.error


def test_broken_on_error_callback_does_not_kill_the_thread(tmp_path):
    (tmp_path / "records").write_text("x")

    def boom(msg: str) -> None:
        raise RuntimeError("callback bug")

    w = ShardWriter(tmp_path, 0, 0, on_error=boom)
    w.write_window({"records": _records(1)})
    w.write_window({"records": _records(1)})
    assert w.close(timeout=10) and w.failed


# ---------------------------------------------------------------------- backpressure
def test_bounded_queue_blocks_the_producer(tmp_path):
    gate = threading.Event()
    w = ShardWriter(tmp_path, 0, 0, max_pending_windows=2)
    real_write = w._write
    w._write = lambda window, tables: (gate.wait(), real_write(window, tables))  # type: ignore[method-assign]
    returned: list[int] = []

    def produce() -> None:
        for i in range(5):
            w.write_window({"records": _records(1, step=i)})
            returned.append(i)

    t = threading.Thread(target=produce, daemon=True)
    t.start()
    # One window is held by the writer thread, two wait in the queue, the fourth put blocks.
    _wait_until(lambda: len(returned) == 3 and w._queue.full())
    time.sleep(0.2)
    assert len(returned) == 3 and t.is_alive()
    gate.set()
    t.join(10)
    assert returned == [0, 1, 2, 3, 4]
    assert w.close(timeout=10) and w.files_written == 5


def test_close_drains_everything_queued(tmp_path):
    w = ShardWriter(tmp_path, 1, 0, max_pending_windows=1)
    for i in range(8):
        w.write_window({"records": _records(2, step=i)})
    assert w.close(timeout=30)
    assert w.windows_written == 8 and len(list((tmp_path / "records" / "rank=1").glob("*.parquet"))) == 8
    with pytest.raises(SchemaError, match="after close"):
        w.write_window({"records": _records(1)})


# --------------------------------------------------------------------------- SIGKILL
_KILLED_WRITER = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {repo!r})
    from detfp_format.writer import ShardWriter, write_manifest
    from tests.fixtures.shards import default_manifest
    from tests.unit.test_writer import _records
    root = sys.argv[1]
    write_manifest(root, default_manifest(0, 1))
    w = ShardWriter(root, 0, 0, max_pending_windows=2)
    step = 0
    while True:
        w.write_window({{"records": _records(500, step=step)}})
        step += 1
    """
)


def test_sigkill_leaves_every_flushed_file_readable(tmp_path):
    script = tmp_path / "writer.py"
    script.write_text(_KILLED_WRITER.format(repo=str(REPO)))
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, str(script), str(run)], cwd=REPO)
    try:
        part = run / "records" / "rank=0"
        # The writer thread commits window k before it writes window k + 1's shard: six shards on
        # disk mean five committed windows however slowly the commit line follows its shard (at
        # load 15 waiting for five shards killed the writer between the fifth shard and its commit).
        _wait_until(lambda: part.is_dir() and len(list(part.glob("part-*.parquet"))) >= 6, timeout=60)
    finally:
        proc.kill()  # SIGKILL: no atexit, no close()
        proc.wait()
    with pytest.raises(IncompleteRunError, match="rank 0 segment 0: the capture never closed"):
        open_run(run)  # a launch killed mid-run is never taken for a complete trace
    r = open_run(run, allow_incomplete=True)
    n_files = len(r.files("records"))  # committed windows only (a window written, not committed, is left out)
    (gap,) = [g for g in r.completeness.gaps if g.kind == "not_closed"]  # (+ a window written, not committed)
    assert gap.first_step == n_files - 1
    raw = pl.read_parquet([str(p) for p in r.files("records")], hive_partitioning=False).select("step")
    assert n_files >= 5 and raw.height == 500 * n_files  # every committed record is there
    assert raw["step"].unique().sort().to_list() == list(range(n_files))
    # scan keeps the steps held completely: all but the last committed one (the kill may have cut it)
    assert r.scan("records").select("step").collect()["step"].unique().sort().to_list() == list(range(n_files - 1))


# ------------------------------------------------------------------ run dir, manifest
def test_prepare_run_dir_is_create_only_unless_append(tmp_path):
    run = tmp_path / "nested" / "run"
    assert prepare_run_dir(run, 0, append=False) == 0
    write_manifest(run, default_manifest(0, 2))
    with pytest.raises(RunExistsError) as exc:
        prepare_run_dir(run, 0, append=False)
    assert str(exc.value) == (
        f"{run}: already holds a trace for rank 0 (segment 0); choose a new run directory, "
        "pass overwrite=True (--overwrite) to replace it, or append=True (--append) to continue it as a resumed run"
    )
    assert prepare_run_dir(run, 1, append=False) == 0  # each rank looks only at its own partition
    assert prepare_run_dir(run, 0, append=True) == 1
    write_manifest(run, default_manifest(0, 2, segment=1, start_step=5))
    assert prepare_run_dir(run, 0, append=True) == 2


def test_prepare_run_dir_counts_shards_without_manifest(tmp_path):
    write_run(tmp_path, {0: {"records": [{}]}}, segment=3, manifests=False)
    assert prepare_run_dir(tmp_path, 0, append=True) == 4
    with pytest.raises(RunExistsError):
        prepare_run_dir(tmp_path, 0, append=False)


def test_prepare_run_dir_refuses_a_file(tmp_path):
    f = tmp_path / "f"
    f.write_text("")
    with pytest.raises(RunExistsError, match="exists and is not a directory"):
        prepare_run_dir(f, 0, append=True)


def test_write_manifest_is_atomic_sorted_and_checks_keys(tmp_path):
    path = write_manifest(tmp_path, default_manifest(2, 4, segment=1, start_step=10))
    assert path == tmp_path / "manifest" / "rank=2" / "segment-00001.json"
    text = path.read_text()
    assert json.loads(text)["start_step"] == 10
    assert list(json.loads(text)) == sorted(contract.MANIFEST_KEYS)
    assert [p.name for p in path.parent.iterdir()] == ["segment-00001.json"]
    bad = default_manifest(0, 1)
    del bad["git"]
    bad["extra"] = 1
    with pytest.raises(SchemaError, match=r"missing \['git'\], unknown \['extra'\]"):
        write_manifest(tmp_path, bad)


def test_writer_module_does_not_import_torch():
    code = "import sys, detfp_format.writer, detfp_format.arrowschema; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.strip() == "False"


def test_scan_schema_matches_contract(tmp_path):
    write_run(tmp_path, {0: {"records": [{}]}})
    df = open_run(tmp_path).scan("records").collect()
    assert df.schema["digest_hi"] == pl.UInt64 and df.schema["shape"] == pl.List(pl.Int64)
    assert os.listdir(tmp_path / "records" / "rank=0") == ["part-s00000-w0000000.parquet"]


@pytest.mark.parametrize("limit", [1, 1 << 18])
def test_key_hashes_from_memo_equal_the_contract_definition(monkeypatch, limit):
    # The writer memoizes key hashes across windows (call sites recur every step); a hit, a
    # miss and a cleared memo must all give contract.key_hash of the canonical key.
    from detfp_format import writer

    monkeypatch.setattr(writer, "_MEMO_LIMIT", limit)
    monkeypatch.setattr(writer, "_CALL_MEMO", {})
    monkeypatch.setattr(writer, "_KEY_MEMO", {})
    keys = [(-1, "forward", "blocks.0", "op", "aten::mm.default", 0), (2, "backward", "", "param", "w", 3)]
    rows = [(*keys[i % 2], ("input", "output")[i % 3 == 0], f"args[{i % 4}]") for i in range(12)]
    names = ("microbatch", "phase", "module", "kind", "name", "occurrence", "role", "arg")
    for _ in range(3):  # later windows hit the memo
        cols = {k: [r[j] for r in rows] for j, k in enumerate(names)}
        writer._fill_hashes("records", cols, len(rows))
        want_call = [contract.key_hash(contract.call_key(*r[:6])) for r in rows]
        want_key = [contract.key_hash(contract.record_key(contract.call_key(*r[:6]), r[6], r[7])) for r in rows]
        assert cols["call_hash"] == want_call
        assert cols["key_hash"] == want_key
