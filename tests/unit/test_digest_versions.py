"""Digest versions end to end: which version a capture writes, and which runs compare.

Capture: a Session writes the version it was asked for (``digest_version=``, the launcher's
``--digest-version``, ``DETFP_DIGEST_VERSION``; default 2) into its manifest and digests every
record with it; two live sessions of one process cannot use different versions; a bad version
fails at ``Session(...)`` in one line. Analysis: runs of version 1 stay readable and comparable
with each other; a version-1 run against a version-2 run, or a run whose launches mixed
versions, is refused in one line naming the versions and how to recapture, even when forced or
when the environment diff leaves the digest keys out.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from detfp_analyze import bisect
from detfp_analyze.errors import IncomparableError
from detfp_analyze.io.reader import open_run
from detfp_capture import Session
from detfp_capture._digest import versions
from detfp_capture._launch.cli import build_parser
from detfp_capture.digest import DigestError, fingerprint
from detfp_capture.errors import ConfigError
from detfp_format import contract
from tests.fixtures.shards import hexdigest, write_run

SAMPLES = Path(__file__).resolve().parents[2] / "sample_traces"


def _capture(path, **options) -> torch.Tensor:
    """A one-step capture of a probe; returns the probed tensor."""
    t = torch.arange(300, dtype=torch.float32)
    with Session(str(path), "metrics", **options) as s, s.step(0):
        s.probe("p", t)
    return t


def _probe_digest(path) -> str:
    r = open_run(str(path)).scan("records").collect().filter(pl_name("p")).row(0, named=True)
    return f"{r['digest_hi']:016x}{r['digest_lo']:016x}"


def pl_name(name: str):
    import polars as pl

    return pl.col("name") == name


@pytest.mark.parametrize("version", [None, 1, 2])
def test_a_session_writes_and_digests_with_its_version(tmp_path, version):
    kw = {} if version is None else {"digest_version": version}
    t = _capture(tmp_path / "r", **kw)
    want = version or contract.DIGEST_VERSION
    m = open_run(str(tmp_path / "r")).manifest(0)
    assert (m["digest_version"], m["digest_algorithm"]) == (want, contract.DIGEST_VERSIONS[want])
    assert _probe_digest(tmp_path / "r") == fingerprint(t, version=want).digest
    assert versions.active().version == contract.DIGEST_VERSION  # released at close


def test_the_environment_picks_the_version_and_a_bad_one_fails_at_session(tmp_path, monkeypatch):
    monkeypatch.setenv("DETFP_DIGEST_VERSION", "1")
    _capture(tmp_path / "env")
    assert open_run(str(tmp_path / "env")).manifest(0)["digest_version"] == 1
    monkeypatch.setenv("DETFP_DIGEST_VERSION", "9")
    with pytest.raises(ConfigError, match=r"^DETFP_DIGEST_VERSION='9': not a digest version; set it to one of 1, 2"):
        Session(str(tmp_path / "bad"), "metrics")
    monkeypatch.delenv("DETFP_DIGEST_VERSION")
    for bad in (3, "2", True, 0):
        with pytest.raises(ConfigError, match=r"^digest_version=.*: not a digest version; pass one of 1, 2 "):
            Session(str(tmp_path / "bad"), "metrics", digest_version=bad)
    assert not (tmp_path / "bad").exists()


def test_two_live_sessions_of_one_process_cannot_use_different_versions(tmp_path):
    first = Session(str(tmp_path / "a"), "metrics", digest_version=1)
    try:
        with pytest.raises(
            ConfigError, match=r"another capture session of this process \(or a versions\.use block\) uses version 1"
        ):
            Session(str(tmp_path / "b"), "metrics", digest_version=2)
        same = Session(str(tmp_path / "c"), "metrics", digest_version=1)  # the same version: fine
        same.close()
        assert versions.active().version == 1  # still held by the first
    finally:
        first.close()
    assert versions.active().version == contract.DIGEST_VERSION
    Session(str(tmp_path / "d"), "metrics", digest_version=2).close()


def test_use_blocks_nest_and_restore_and_never_override_a_session(tmp_path):
    with versions.use(1):
        assert versions.active().version == 1
        with versions.use(2):
            assert versions.active().version == 2
        assert versions.active().version == 1
        with pytest.raises(ConfigError, match=r"or a versions\.use block"):  # digests of a v2 trace must be v2
            Session(str(tmp_path / "a"), "metrics", digest_version=2)
    assert versions.active().version == contract.DIGEST_VERSION
    with Session(str(tmp_path / "b"), "metrics", digest_version=1):
        with (
            pytest.raises(DigestError, match="capture session of this process uses version 1; pass version="),
            versions.use(2),
        ):
            pass
        with versions.use(1):
            assert versions.active().version == 1


def test_the_launcher_takes_a_digest_version():
    assert build_parser().parse_args(["--out", "x", "--digest-version", "1"]).digest_version == 1
    assert build_parser().parse_args(["--out", "x"]).digest_version is None
    bad = subprocess.run(
        [sys.executable, "-m", "detfp_capture", "--out", "x", "--digest-version", "3", "--", "t.py"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "--digest-version: invalid choice: 3" in bad.stderr


def _run(path, version: int | dict):
    over = {"digest_version": version} if isinstance(version, int) else version
    recs = [{"step": 0, "role": "output", "digest": hexdigest(1)}]
    return write_run(path, {0: {"records": recs}, 1: {"records": recs}}, manifest_overrides=over)


def test_runs_of_version_1_compare_and_a_version_pair_is_refused_in_one_line(tmp_path):
    a1, b1, a2 = _run(tmp_path / "a1", 1), _run(tmp_path / "b1", 1), _run(tmp_path / "a2", 2)
    assert bisect(a1, b1).status == "identical"
    assert bisect(a2, _run(tmp_path / "b2", 2)).status == "identical"
    for kw in ({}, {"force": True}, {"ignore_env": ["digest_*"]}):
        with pytest.raises(IncomparableError) as err:
            bisect(a1, a2, **kw)
        msg = str(err.value)
        assert "\n" not in msg
        assert msg == (
            f"{a1} vs {a2}: digest version 1 (detfp-tlh128) vs 2 (detfp-tlh128) never compare equal; "
            f"recapture {a1} with digest version 2 (Session(digest_version=2), python -m detfp_capture "
            f"--digest-version 2) or {a2} with version 1"
        )


def test_a_run_whose_launches_mixed_versions_is_refused(tmp_path):
    mixed = _run(tmp_path / "mixed", {0: {"digest_version": 1}, 1: {"digest_version": 2}})
    with pytest.raises(IncomparableError, match=r"launches captured digests of versions 1 \(detfp-tlh128\) and 2"):
        bisect(mixed, _run(tmp_path / "b", 2))


def test_the_cli_refuses_a_version_pair_with_exit_2(tmp_path):
    from typer.testing import CliRunner

    from detfp_analyze.cli import app

    a1, a2 = _run(tmp_path / "a1", 1), _run(tmp_path / "a2", 2)
    r = CliRunner().invoke(app, ["bisect", "--force", str(a1), str(a2)])
    assert r.exit_code == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and "digest version 1 (detfp-tlh128) vs 2" in r.stderr


def test_the_sample_traces_are_version_1_and_still_compare():
    for pair in ("ops", "nondet"):
        runs = [open_run(str(SAMPLES / pair / x)) for x in ("a", "b")]
        assert {m["digest_version"] for r in runs for segs in r.manifests.values() for m in segs} == {1}
        assert bisect(*runs).status in ("identical", "diverged")


def test_a_resumed_run_keeps_its_digest_version(tmp_path, monkeypatch):
    run = tmp_path / "r"
    _capture(run, digest_version=1)
    t = torch.arange(300, dtype=torch.float32)
    with Session(str(run), "metrics", append=True) as s, s.step(1):  # no version asked: the run's
        s.probe("p", t)
    r = open_run(str(run))
    assert [m["digest_version"] for m in r.manifests[0]] == [1, 1]
    rows = open_run(str(run)).scan("records").collect().filter(pl_name("p")).select("digest_hi", "digest_lo").rows()
    assert {f"{hi:016x}{lo:016x}" for hi, lo in rows} == {fingerprint(t, version=1).digest} and len(rows) == 2
    for kw, env in (({"digest_version": 2}, None), ({}, "2")):
        if env:
            monkeypatch.setenv("DETFP_DIGEST_VERSION", env)
        with pytest.raises(ConfigError, match=r"was captured with digest version 1, and a resumed run keeps its"):
            Session(str(run), "metrics", append=True, **kw)
    assert len(open_run(str(run)).manifests[0]) == 2
