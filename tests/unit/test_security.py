"""Security of the trace path: SQL confined to the runs, no code execution, no secrets in manifests.

* ``detfp-analyze sql`` and ``connect()`` let DuckDB open the runs' shards and nothing else,
  unless ``--allow-file-access`` / ``allow_file_access=True``;
* no pickle, eval/exec/compile or torch.load anywhere in the two packages (checked on the
  token stream, so the words may appear in comments and docs);
* manifests never hold credentials: a planted set of credential-like variables and options
  never reaches the manifest file, while numerics variables do.
"""

from __future__ import annotations

import io
import json
import re
import sys
import tokenize
from pathlib import Path

import duckdb
import pytest
from typer.testing import CliRunner

from detfp_analyze import connect
from detfp_analyze.cli import app
from detfp_analyze.errors import QueryError
from detfp_analyze.sql import query
from detfp_capture.manifest import numerics_env, redact_command
from tests.fixtures.shards import write_run

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("sec")
    runs = []
    for name in ("a", "b"):
        runs.append(write_run(root / name, {0: {"records": [dict(step=0)], "metrics": [dict(step=0, value=1.0)]}}))
    (root / "outside.csv").write_text("secret,value\nroot,hunter2\n")
    return runs[0], runs[1], root / "outside.csv"


def _sql(*args):
    r = CliRunner().invoke(app, ["sql", *map(str, args)])
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    return r


# ------------------------------------------------------------------------------ SQL
ESCAPES = (
    ("SELECT * FROM read_csv('/etc/passwd')", 'Cannot access file "/etc/passwd"'),
    ("SELECT * FROM read_csv('{outside}')", "file system operations are disabled by configuration"),
    ("SELECT * FROM glob('/etc/*')", "file system operations are disabled by configuration"),
    ("COPY (SELECT 1) TO '/tmp/detfp-escape.csv'", "query refused: COPY statements are not allowed"),
    ("COPY (SELECT 1 AS x) TO '{shard}' (USE_TMP_FILE false)", "query refused: COPY statements are not allowed"),
    ("EXPORT DATABASE '/tmp/detfp-export'", "query refused: EXPORT statements are not allowed"),
    ("ATTACH '/tmp/detfp-x.db'", "query refused: ATTACH statements are not allowed"),
    ("INSTALL httpfs", "query refused: LOAD statements are not allowed"),  # DuckDB types INSTALL as LOAD
    ("LOAD httpfs", "query refused: LOAD statements are not allowed"),
    ("SET enable_external_access = true", "the configuration has been locked"),
    ("SELECT 1; COPY (SELECT 1) TO '/tmp/detfp-escape2.csv'", "query refused: COPY statements are not allowed"),
)


def test_sql_reads_only_the_runs(pair):
    a, b, outside = pair
    shard = next(a.glob("records/rank=0/*.parquet"))
    con = connect(a, b)
    try:
        for sql, why in ESCAPES:
            with pytest.raises(QueryError) as err:
                query(con, sql.format(outside=outside, shard=shard))
            assert why in str(err.value), sql
    finally:
        con.close()
    assert not Path("/tmp/detfp-escape.csv").exists() and not Path("/tmp/detfp-escape2.csv").exists()
    assert shard.read_bytes()[:4] == b"PAR1"  # untouched
    r = _sql(a, b, "SELECT * FROM read_csv('/etc/passwd')")  # the CLI: one line, exit 2
    lines = r.output.strip().splitlines()
    assert r.exit_code == 2 and len(lines) == 1 and 'Cannot access file "/etc/passwd"' in lines[0], r.output


def test_sql_views_still_work_confined_and_allow_file_access_lifts_it(pair):
    a, b, outside = pair
    r = _sql(a, b, "SELECT count(*) AS n FROM pairs", "--format", "json")
    assert r.exit_code == 0 and json.loads(r.output) == [{"n": 1}]
    r = _sql(a, f"SELECT * FROM read_csv('{outside}')", "--allow-file-access", "--format", "json")
    assert r.exit_code == 0 and json.loads(r.output) == [{"secret": "root", "value": "hunter2"}]


def test_connect_is_confined_by_default(pair):
    a, b, outside = pair
    con = connect(a, b)
    try:
        assert con.sql("SELECT count(*) FROM a_records").fetchall() == [(1,)]
        with pytest.raises(duckdb.PermissionException):
            con.sql(f"SELECT * FROM read_csv('{outside}')").fetchall()
        with pytest.raises(duckdb.PermissionException):
            con.execute("COPY (SELECT 1) TO '/tmp/detfp-escape3.csv'")
        with pytest.raises(QueryError, match="COPY statements are not allowed"):
            query(con, f"COPY (SELECT 1) TO '{a}/x.csv'")
    finally:
        con.close()
    con = connect(a, allow_file_access=True)
    try:
        assert con.sql(f"SELECT count(*) FROM read_csv('{outside}')").fetchall() == [(1,)]
    finally:
        con.close()


# ------------------------------------------------------------------------------ no code execution
#: (pattern over the token stream, why it is banned). Tokens exclude comments and strings, so a
#: docstring saying "never pickle" is fine and ``pickle.loads(...)`` is not.
BANNED = (
    (r"\bimport (c?pickle|dill|marshal|shelve|joblib)\b|\bfrom (c?pickle|dill|marshal|shelve|joblib) import\b", "deserializes code"),
    (r"(?<!\. )\b(eval|exec|compile|__import__) \(", "executes text as code"),
    (r"\btorch \. load\b", "unpickles"),
    (r"\b(np|numpy) \. load\b", "may unpickle (allow_pickle)"),
    (r"\b(pd|pandas) \. read_pickle\b", "unpickles"),
    (r"\byaml \. (load|unsafe_load)\b", "constructs objects"),
    (r"\bpickle \. (loads?|Unpickler)\b", "deserializes code"),
)  # fmt: skip


def banned_uses(source: str) -> list[str]:
    """Banned constructs in Python ``source`` (comments and string literals ignored)."""
    toks = [t.string for t in tokenize.generate_tokens(io.StringIO(source).readline)
            if t.type in (tokenize.NAME, tokenize.OP)]  # fmt: skip
    text = " ".join(toks)
    return [f"{m.group(0)!r}: {why}" for pat, why in BANNED for m in re.finditer(pat, text)]


def test_the_checker_catches_what_it_bans():
    planted = "import pickle\nx = eval ('1')\nimport torch\nw = torch.load(f)\ny = pickle.loads(b)\n"
    assert len(banned_uses(planted)) == 4
    assert banned_uses('"""never pickle, never eval(x)"""\nmodel.eval()\nre.compile("x")\n# torch.load\n') == []


def test_no_pickle_eval_exec_or_torch_load_in_the_packages():
    files = sorted((REPO / "detfp_capture").rglob("*.py")) + sorted((REPO / "detfp_analyze").rglob("*.py"))
    assert len(files) > 40
    found = {str(p.relative_to(REPO)): hits for p in files if (hits := banned_uses(p.read_text(encoding="utf-8")))}
    assert found == {}


# ------------------------------------------------------------------------------ secrets
PLANTED = {
    "TORCH_HUB_TOKEN": "s3cr3t-01", "HF_TOKEN": "s3cr3t-02", "HUGGING_FACE_HUB_TOKEN": "s3cr3t-03",
    "WANDB_API_KEY": "s3cr3t-04", "AWS_ACCESS_KEY_ID": "s3cr3t-05", "AWS_SECRET_ACCESS_KEY": "s3cr3t-06",
    "AWS_SESSION_TOKEN": "s3cr3t-07", "AZURE_CLIENT_SECRET": "s3cr3t-08", "AZURE_STORAGE_CONNECTION_STRING": "s3cr3t-09",
    "GOOGLE_APPLICATION_CREDENTIALS": "s3cr3t-10", "MLFLOW_TRACKING_PASSWORD": "s3cr3t-11",
    "MLFLOW_TRACKING_TOKEN": "s3cr3t-12", "NEPTUNE_API_TOKEN": "s3cr3t-13", "COMET_API_KEY": "s3cr3t-14",
    "GITHUB_TOKEN": "s3cr3t-15", "OPENAI_API_KEY": "s3cr3t-16", "NCCL_IB_SECRET": "s3cr3t-17",
    "TORCHINDUCTOR_PASSWORD": "s3cr3t-18", "CUDA_CREDENTIALS": "s3cr3t-19", "TRITON_AUTH": "s3cr3t-20",
    "PYTORCH_PRIVATE_KEY": "s3cr3t-21", "NVTE_SIGNING_KEY": "s3cr3t-22", "TORCH_SESSION_COOKIE": "s3cr3t-23",
    "DATABRICKS_TOKEN": "s3cr3t-24", "TORCH_DIST_ENDPOINT": "https://user:s3cr3t-25@rdzv.example:29400",
}  # fmt: skip
KEPT = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NCCL_ALGO": "Ring", "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
ARGV = ["train.py", "--api-key=s3cr3t-26", "--hf-token", "s3cr3t-27", "--password", "s3cr3t-28",
        "--tracking-uri=https://u:s3cr3t-29@mlflow.example", "WANDB_API_KEY=s3cr3t-30", "--lr", "0.1", "--key-dim", "64"]  # fmt: skip


def test_planted_credentials_are_dropped_and_numerics_kept():
    env = numerics_env({**PLANTED, **KEPT, "PATH": "/bin"})
    assert env == {**KEPT, "TORCH_DIST_ENDPOINT": "https://<redacted>@rdzv.example:29400"}
    cmd = redact_command(ARGV)
    assert cmd == ["train.py", "--api-key=<redacted>", "--hf-token", "<redacted>", "--password", "<redacted>",
                   "--tracking-uri=https://<redacted>@mlflow.example", "WANDB_API_KEY=<redacted>", "--lr", "0.1",
                   "--key-dim", "64"]  # fmt: skip


def test_no_planted_secret_reaches_a_real_manifest(tmp_path, monkeypatch):
    from detfp_capture import Session

    for k, v in {**PLANTED, **KEPT}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(sys, "argv", ARGV)
    with Session(tmp_path / "r", "metrics") as s, s.step(0):
        s.metric("loss", 1.0)
    text = b"".join(p.read_bytes() for p in (tmp_path / "r").rglob("*") if p.is_file())
    assert b"s3cr3t" not in text
    manifest = json.loads((tmp_path / "r" / "manifest" / "rank=0" / "segment-00000.json").read_text())
    assert {k: manifest["env"][k] for k in KEPT} == KEPT and "--lr" in manifest["command"]
