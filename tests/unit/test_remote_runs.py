"""Runs on another file system (``detfp_analyze.io.store``), without a network.

Sample pairs are copied into an in-memory pyarrow file system (fsspec's ``memory``, wrapped
in ``pyarrow.fs.PyFileSystem``) and opened with ``open_run(path, filesystem=fs)``: every read
then goes through pyarrow's file system layer (listing, manifests, commit logs, footers,
``pyarrow.dataset`` scans, DuckDB over registered datasets), as it does for ``s3://``. The
results must equal those of the local copy byte for byte, but for the run labels the report
embeds; bad input must fail with the local run's one-line errors (the label aside).
"""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path

import pytest

pafs = pytest.importorskip("pyarrow.fs")
fsspec = pytest.importorskip("fsspec")

from detfp_analyze import bisect  # noqa: E402
from detfp_analyze.errors import DetfpError, NotARunError  # noqa: E402
from detfp_analyze.io.reader import open_run  # noqa: E402
from detfp_analyze.sql.views import connect, query  # noqa: E402
from detfp_analyze.testing.plants import Plant  # noqa: E402
from detfp_analyze.testing.synth import SynthSpec, write_pair  # noqa: E402

SAMPLES = Path(__file__).resolve().parents[2] / "sample_traces"
PAIRS = {"ops": ("a", "b"), "resume": ("full", "resumed")}


def _upload(fs, src: Path, dst: str) -> None:
    for f in sorted(src.rglob("*")):
        if f.is_file():
            path = f"{dst}/{f.relative_to(src).as_posix()}"
            fs.create_dir(path.rsplit("/", 1)[0])
            with fs.open_output_stream(path) as out:
                out.write(f.read_bytes())


@pytest.fixture(scope="module")
def mem():
    """(file system, root): the sample pairs in memory, under a root of their own (fsspec's memory
    file system is one store per process)."""
    handler = pafs.FSSpecHandler(fsspec.filesystem("memory"))
    fs = pafs.PyFileSystem(handler)
    root = f"/detfp-{uuid.uuid4().hex[:8]}"
    for pair, names in PAIRS.items():
        for n in names:
            _upload(fs, SAMPLES / pair / n, f"{root}/{pair}/{n}")
    _upload(fs, SAMPLES / "ops" / "a", f"{root}/same/a")
    yield fs, root
    fs.delete_dir(root)


def _report(a, b) -> tuple[str, tuple[str, str]]:
    """The JSON report without the two run labels, and the labels."""
    doc = bisect(a, b).to_json_dict()
    labels = (doc.pop("a"), doc.pop("b"))
    return json.dumps(doc, indent=2, sort_keys=True), labels


@pytest.fixture(scope="module")
def same_a(tmp_path_factory) -> Path:
    """A local copy of ops/a: the identical pair's B (bisect refuses a run compared with itself)."""
    dst = tmp_path_factory.mktemp("same") / "a"
    shutil.copytree(SAMPLES / "ops" / "a", dst)
    return dst


@pytest.mark.parametrize(("pair", "remote_b"), [("ops", "ops/b"), ("resume", "resume/resumed"), ("ops", "same/a")])
def test_bisect_over_a_pyarrow_file_system_equals_the_local_copy(mem, same_a, pair, remote_b):
    fs, root = mem
    name_a = PAIRS[pair][0]
    local_b = same_a if remote_b == "same/a" else SAMPLES / remote_b
    want, _ = _report(open_run(SAMPLES / pair / name_a), open_run(local_b))
    ra = open_run(f"{root}/{pair}/{name_a}", filesystem=fs)
    rb = open_run(f"{root}/{remote_b}", filesystem=fs)
    got, labels = _report(ra, rb)
    assert got == want
    assert labels == (f"{root}/{pair}/{name_a}", f"{root}/{remote_b}")  # the paths as given
    assert json.loads(got)["status"] == ("identical" if remote_b == "same/a" else "diverged")


def test_bisect_with_stored_rollups_and_slices_over_a_pyarrow_file_system(mem, tmp_path):
    # A synthetic pair as the capture writes it now (rollups table, several row groups): the
    # stored-rollup narrowing and the walk's seq-sliced reads go through pyarrow datasets too.
    fs, root = mem
    spec = SynthSpec(ranks=4, steps=3, records=600)
    pair = write_pair(tmp_path / "a", tmp_path / "b", spec, Plant(rank=2, step=1, index=400, also_ranks=(3,)))
    base = f"{root}/synth-{uuid.uuid4().hex[:6]}"
    _upload(fs, pair.a, f"{base}/a")
    _upload(fs, pair.b, f"{base}/b")
    want, _ = _report(open_run(pair.a), open_run(pair.b))
    got, _ = _report(open_run(f"{base}/a", filesystem=fs), open_run(f"{base}/b", filesystem=fs))
    assert got == want
    diverged = sorted(r["rank"] for r in json.loads(got)["ranks"] if r["status"] != "identical")
    assert diverged == [e.rank for e in pair.expected] and pair.origin_ranks == (2, 3)


def test_scans_over_a_pyarrow_file_system_equal_the_local_ones(mem):
    fs, root = mem
    local, remote = open_run(SAMPLES / "resume" / "resumed"), open_run(f"{root}/resume/resumed", filesystem=fs)
    assert remote.store is not None and not remote.store.local and local.store is None
    assert [str(f) for f in remote.files("records")] == [
        f"{root}/resume/resumed/{Path(f).relative_to(local.path).as_posix()}" for f in local.files("records")
    ]
    for table in ("records", "metrics", "events"):
        for kw in ({}, {"ranks": [1]}, {"steps": range(1, 3)}, {"ranks": 0, "steps": 2}):
            want = local.scan(table, **kw).collect()
            got = remote.scan(table, **kw).collect()
            assert got.schema == want.schema
            assert got.equals(want), (table, kw)


def test_sql_views_over_a_pyarrow_file_system_equal_the_local_ones(mem):
    fs, root = mem
    local = connect(SAMPLES / "ops" / "a", SAMPLES / "ops" / "b")
    remote = connect(open_run(f"{root}/ops/a", filesystem=fs), open_run(f"{root}/ops/b", filesystem=fs))
    for sql in (
        "SELECT * FROM first_divergence ORDER BY ALL",
        "SELECT * FROM pairs ORDER BY ALL",
        "SELECT * EXCLUDE (shard) FROM metrics ORDER BY ALL",
    ):
        assert query(remote, sql).equals(query(local, sql)), sql
    shards = query(remote, "SELECT DISTINCT shard FROM a_records ORDER BY shard").column(0).to_pylist()
    assert shards == [f"{root}/ops/a/records/rank={r}/part-s00000-w0000000.parquet" for r in (0, 1)]


def _same_error(local_path: Path, remote: str, fs) -> str:
    """The one-line error of the local run and of its remote copy must agree, labels aside."""
    with pytest.raises(DetfpError) as want:
        open_run(local_path)
    with pytest.raises(DetfpError) as got:
        open_run(remote, filesystem=fs)
    assert type(got.value) is type(want.value)
    assert str(got.value).replace(remote, "RUN") == str(want.value).replace(str(local_path), "RUN")
    return str(got.value)


def test_bad_input_on_a_pyarrow_file_system_gives_the_local_one_line_errors(mem, tmp_path):
    fs, root = mem
    base = f"{root}/bad-{uuid.uuid4().hex[:6]}"
    # A missing run, a directory that is not a run, a file instead of a directory.
    msg = _same_error(tmp_path / "missing", f"{base}/missing", fs)
    assert msg.startswith(f"{base}/missing: no such directory;")
    (tmp_path / "empty" / "x").mkdir(parents=True)
    fs.create_dir(f"{base}/empty/x")
    assert "not a detfp run" in _same_error(tmp_path / "empty", f"{base}/empty", fs)
    (tmp_path / "file").write_bytes(b"x")
    with fs.open_output_stream(f"{base}/file") as out:
        out.write(b"x")
    assert "not a directory" in _same_error(tmp_path / "file", f"{base}/file", fs)
    # A truncated shard and a shard whose footer is garbage.
    shard = "records/rank=1/part-s00000-w0000000.parquet"
    for name, damage in (("cut", lambda b: b[: len(b) // 2]), ("garbage", lambda b: b[:-200] + bytes(192) + b[-8:])):
        local = tmp_path / name
        shutil.copytree(SAMPLES / "ops" / "a", local)
        (local / shard).write_bytes(damage((local / shard).read_bytes()))
        _upload(fs, local, f"{base}/{name}")
        msg = _same_error(local, f"{base}/{name}", fs)
        assert msg.startswith(f"{base}/{name}/{shard}: not a Parquet file (")


class _Failing(pafs.FSSpecHandler):
    """A file system whose listings fail as an unreachable object store's do."""

    def get_file_info_selector(self, selector):
        raise OSError("When listing objects under key 'run' in bucket 'b': AWS Error NETWORK_CONNECTION")


def test_an_unreachable_file_system_is_one_line_naming_the_run(mem):
    _, root = mem
    failing = pafs.PyFileSystem(_Failing(fsspec.filesystem("memory")))
    with pytest.raises(NotARunError) as err:
        open_run(f"{root}/ops/a", filesystem=failing)
    msg = str(err.value)
    assert msg.startswith(f"{root}/ops/a: cannot read its file system (When listing objects")
    assert msg.endswith("; check the URI, the network and the credentials") and "\n" not in msg
