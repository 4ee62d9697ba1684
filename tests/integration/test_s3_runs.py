"""Runs on S3 through the CLI, end to end, against moto's S3 server on loopback (no network).

One ``ThreadedMotoServer`` per module holds a sample pair (and an identical copy of A); the
CLI reaches it the way users reach their own endpoint: ``AWS_ENDPOINT_URL`` and the usual
credential variables, read by pyarrow's S3 file system (docs/spark.md, "Runs on object stores").
The reports must equal the local run's byte for byte, but for the run paths they print (the
URIs as given).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pyarrow
import pyarrow.fs
import pytest
from typer.testing import CliRunner

moto_server = pytest.importorskip("moto.server")
boto3 = pytest.importorskip("boto3")

SAMPLES = Path(__file__).resolve().parents[2] / "sample_traces"
BUCKET = "detfp-runs"
#: Dummy credentials: moto accepts any; no lookup of real ones (files, instance metadata).
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}


@pytest.fixture(scope="module")
def endpoint():
    """The URL of a moto S3 server on loopback holding ops/a, ops/b and same/a (a copy of ops/a)."""
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    url = f"http://{host}:{port}"
    s3 = boto3.client(
        "s3",
        endpoint_url=url,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    )
    s3.create_bucket(Bucket=BUCKET)
    for src, dst in (("ops/a", "ops/a"), ("ops/b", "ops/b"), ("ops/a", "same/a")):
        for f in sorted((SAMPLES / src).rglob("*")):
            if f.is_file():
                s3.upload_file(str(f), BUCKET, f"{dst}/{f.relative_to(SAMPLES / src).as_posix()}")
    yield url
    server.stop()


@pytest.fixture
def s3_env(endpoint, monkeypatch):
    """The environment that points pyarrow at the moto server (for in-process CLI calls)."""
    for k, v in {**CREDENTIALS, "AWS_ENDPOINT_URL": endpoint}.items():
        monkeypatch.setenv(k, v)
    return endpoint


def _invoke(*args: str):
    from detfp_analyze.cli import app

    return CliRunner().invoke(app, list(args))


def _one_attempt(real: types.ModuleType) -> types.ModuleType:
    """``pyarrow.fs`` as ``from pyarrow import fs`` then sees it: S3 file systems from
    ``FileSystem.from_uri`` make one attempt per request. (pyarrow's URI takes no retry option and
    its S3 client reads none from the environment; ``AWS_MAX_ATTEMPTS`` changes nothing.)"""

    class FileSystem:
        @staticmethod
        def from_uri(uri: str):
            got, path = real.FileSystem.from_uri(uri)
            if isinstance(got, real.S3FileSystem):
                _, (options,) = got.__reduce__()  # every option from_uri resolved, bar the retries
                got = real.S3FileSystem(**options, retry_strategy=real.AwsStandardS3RetryStrategy(max_attempts=1))
            return got, path

    proxy = types.ModuleType(real.__name__)
    proxy.__dict__.update(vars(real))
    proxy.FileSystem = FileSystem
    return proxy


def _local_json(a: Path, b: Path) -> dict:
    out = _invoke("bisect", str(a), str(b), "--json")
    return json.loads(out.stdout)


def test_bisect_of_s3_runs_through_the_cli_equals_the_local_report(endpoint):
    local = _invoke("bisect", str(SAMPLES / "ops/a"), str(SAMPLES / "ops/b"), "--json")
    env = {**os.environ, **CREDENTIALS, "AWS_ENDPOINT_URL": endpoint}
    a, b = f"s3://{BUCKET}/ops/a", f"s3a://{BUCKET}/ops/b"  # s3a: Hadoop's spelling, read as s3
    remote = subprocess.run(
        [sys.executable, "-m", "detfp_analyze", "bisect", a, b, "--json"], capture_output=True, text=True, env=env
    )
    # The remote side in a process of its own: the real console entry, the variables from its environment.
    assert (remote.returncode, remote.stderr) == (1, "") and local.exit_code == 1
    # Byte for byte but the two run paths, which are the URIs the user gave.
    want = local.stdout.replace(json.dumps(str(SAMPLES / "ops/a")), json.dumps(a))
    want = want.replace(json.dumps(str(SAMPLES / "ops/b")), json.dumps(b))
    assert remote.stdout == want


def test_an_identical_pair_on_s3_is_identical_with_the_endpoint_in_the_uri(s3_env, monkeypatch, tmp_path):
    # The endpoint as pyarrow's URI options instead of AWS_ENDPOINT_URL; the reports keep the URIs as given.
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    query = f"?endpoint_override={s3_env.removeprefix('http://')}&scheme=http"
    a, b = f"s3://{BUCKET}/ops/a{query}", f"s3://{BUCKET}/same/a/{query}"
    out = _invoke("bisect", a, b, "--json")
    assert out.exit_code == 0, out.output
    shutil.copytree(SAMPLES / "ops/a", tmp_path / "a")  # bisect refuses a run compared with itself
    doc, want = json.loads(out.stdout), _local_json(SAMPLES / "ops/a", tmp_path / "a")
    assert (doc.pop("a"), doc.pop("b")) == (a, b)
    want.pop("a"), want.pop("b")
    assert doc == want and doc["status"] == "identical"


def test_sql_summary_certify_env_over_s3_runs_equal_the_local_ones(s3_env):
    sql = "SELECT rank, step, name, role, state FROM first_divergence ORDER BY ALL"
    local = _invoke("sql", str(SAMPLES / "ops/a"), str(SAMPLES / "ops/b"), sql, "--format", "csv")
    remote = _invoke("sql", f"s3://{BUCKET}/ops/a", f"s3://{BUCKET}/ops/b", sql, "--format", "csv")
    assert remote.exit_code == 0, remote.output
    assert remote.stdout == local.stdout and remote.stdout.count("\n") > 1
    shard = _invoke("sql", f"s3://{BUCKET}/ops/a", "SELECT min(shard) AS s FROM a_records", "--format", "csv")
    assert shard.stdout.splitlines()[1] == f"s3://{BUCKET}/ops/a/records/rank=0/part-s00000-w0000000.parquet"
    for args in (("summary", "A", "--json"), ("certify", "A", "--json"), ("env", "A", "B")):
        local = _invoke(*(str(SAMPLES / f"ops/{x.lower()}") if x in ("A", "B") else x for x in args))
        remote = _invoke(*(f"s3://{BUCKET}/ops/{x.lower()}" if x in ("A", "B") else x for x in args))
        assert remote.exit_code == local.exit_code, remote.output
        assert remote.stdout.replace(f"s3://{BUCKET}/ops/a", "A").replace(f"s3://{BUCKET}/ops/b", "B") == (
            local.stdout.replace(str(SAMPLES / "ops/a"), "A").replace(str(SAMPLES / "ops/b"), "B")
        )


def test_bad_s3_runs_are_one_line_and_exit_2(s3_env, monkeypatch):
    out = _invoke("bisect", f"s3://{BUCKET}/nope", f"s3://{BUCKET}/ops/b")
    assert out.exit_code == 2
    assert out.stderr == (
        f"detfp-analyze: s3://{BUCKET}/nope: no such directory; "
        "pass the directory given to detfp_capture.Session(...) or --out\n"
    )
    # Nothing listens there: one line naming the run, no traceback. One attempt per request: the
    # same refusal and the same line, without the S3 client's ~6 s of retries and backoff.
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setattr(pyarrow, "fs", _one_attempt(pyarrow.fs))
    out = _invoke("bisect", f"s3://{BUCKET}/ops/a", f"s3://{BUCKET}/ops/b")
    assert out.exit_code == 2
    assert out.stderr.startswith(f"detfp-analyze: s3://{BUCKET}/ops/a: cannot ")
    assert out.stderr.endswith("; check the URI and its credentials\n") or out.stderr.endswith(
        "; check the URI, the network and the credentials\n"
    )
    assert out.stderr.count("\n") == 1
