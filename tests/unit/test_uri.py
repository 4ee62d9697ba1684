"""Run locations as URIs (``detfp_analyze.io.uri``): the mapping and validation, without a network.

Runs on object stores are opened in ``test_remote_runs.py`` (an in-memory pyarrow file system)
and ``tests/integration/test_s3_runs.py`` (moto's S3 server); here the URIs' mapping to pyarrow's
spelling and the resolution of a scheme.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from detfp_analyze.errors import NotARunError
from detfp_analyze.io.reader import open_run
from detfp_analyze.io.uri import arrow_uri, filesystem, is_remote, local_path, scheme, spark_uri

SAMPLES = Path(__file__).resolve().parents[2] / "sample_traces"


@pytest.mark.parametrize(
    ("text", "want"),
    [("/data/run", None), ("run", None), ("C:/run", None), ("file:///x", "file"), ("S3A://b/k", "s3a"), ("hdfs://nn/x", "hdfs")],
)
def test_scheme(text, want):
    assert scheme(text) == want
    assert is_remote(text) == (want not in (None, "file"))


@pytest.mark.parametrize(
    ("text", "want"),
    [("/data/run", "/data/run"), ("file:///data/run", "/data/run"), ("file:/data/run", "/data/run"),
     ("file://localhost/data/run", "/data/run"), ("file:///data/a%20b", "/data/a b")],
)  # fmt: skip
def test_local_path(text, want):
    assert local_path(text, "x") == want


def test_a_file_uri_on_another_host_and_a_remote_uri_are_not_local_paths():
    with pytest.raises(NotARunError, match=r"^x: a file URI on another host \(nas\)"):
        local_path("file://nas/data/run", "x")
    with pytest.raises(NotARunError, match=r"^x: a s3a:// URI is not a local path"):
        local_path("s3a://bucket/run", "x")


@pytest.mark.parametrize(
    ("text", "want"),
    [("s3a://b/k/run", "s3://b/k/run"), ("s3n://b/run", "s3://b/run"), ("s3://b/run", "s3://b/run"),
     ("gs://b/run", "gs://b/run"), ("hdfs://nn:8020/run", "hdfs://nn:8020/run"), ("/data/run", "/data/run")],
)  # fmt: skip
def test_arrow_uri_spells_hadoops_s3_as_pyarrows(text, want):
    assert arrow_uri(text) == want


def test_filesystem_of_local_paths_and_file_uris(tmp_path):
    from pyarrow import fs

    for text in (str(tmp_path), tmp_path.as_uri()):
        f, path = filesystem(text, "x")
        assert isinstance(f, fs.LocalFileSystem) and path == str(tmp_path)


def test_filesystem_names_a_scheme_pyarrow_cannot_resolve():
    with pytest.raises(NotARunError, match=r"^x: cannot open nosuch:// \(.+\); check the URI and its credentials$"):
        filesystem("nosuch://b/run", "x")


def test_spark_uri_gives_local_paths_a_file_scheme_and_keeps_uris():
    assert spark_uri("/data/rank=1/p.parquet") == "file:///data/rank=1/p.parquet"
    assert spark_uri(Path("/data/x")) == "file:///data/x"
    for uri in ("s3a://b/run", "hdfs://nn/run", "file:///x"):
        assert spark_uri(uri) == uri


def test_open_run_takes_a_file_uri():
    a = SAMPLES / "ops/a"
    by_uri, by_path = open_run(a.resolve().as_uri()), open_run(a)
    assert by_uri.ranks == by_path.ranks and by_uri.files("records") == by_path.files("records")
