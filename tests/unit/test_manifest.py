"""collect_manifest: exactly the contract keys, JSON, the determinism knobs, numerics env, git."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch

from detfp_capture.manifest import collect_manifest, determinism_settings, git_info, numerics_env
from detfp_capture.numerics import SETTINGS, Catalogue
from detfp_format import contract
from detfp_format.writer import write_manifest


def test_manifest_has_exactly_the_contract_keys_and_is_json(tmp_path):
    m = collect_manifest(
        rank=1, world_size=4, segment=2, start_step=7, parallel={"dp": 1, "dp_size": 4},
        groups={"tp": (0, 1), "dp": [1, 3]}, capture={"level": "ops"},
    )  # fmt: skip
    # settings_changed_at is written only once a setting changes during the run.
    assert list(m) == [*contract.MANIFEST_KEYS, *(k for k in contract.MANIFEST_OPTIONAL_KEYS if k != "settings_changed_at")]
    assert m["commit_log"] == 1
    assert (m["rank"], m["world_size"], m["segment"], m["start_step"]) == (1, 4, 2, 7)
    assert m["groups"] == {"dp": [1, 3], "tp": [0, 1]} and m["parallel"] == {"dp": 1, "dp_size": 4}
    assert m["schema_version"] == contract.SCHEMA_VERSION and m["digest_version"] == contract.DIGEST_VERSION
    assert m["versions"]["torch"] == torch.__version__ and m["versions"]["python"]
    assert set(m["determinism"]) >= {
        "deterministic_algorithms", "deterministic_warn_only", "cudnn_deterministic", "cudnn_benchmark",
        "cuda_matmul_allow_tf32", "cudnn_allow_tf32", "float32_matmul_precision", "fill_uninitialized_memory",
        "num_threads", "num_interop_threads", "backends.mkldnn.enabled", "autocast.cpu.dtype",
    }  # fmt: skip
    assert set(m["determinism"]) == {k for k, _ in SETTINGS} | set(Catalogue().autocast())
    assert set(m["host"]) == {"hostname", "device_count", "devices", "cpu", "local_rank"}
    assert set(m["git"]) == {"commit", "dirty", "root"}
    json.dumps(m, allow_nan=False)
    assert write_manifest(tmp_path, m).name == "segment-00002.json"


def test_determinism_settings_follow_torch():
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    threads = torch.get_num_threads()
    try:
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.set_num_threads(1)
        d = determinism_settings()
        assert d["deterministic_algorithms"] is True and d["deterministic_warn_only"] is True
        assert d["num_threads"] == 1
        torch.use_deterministic_algorithms(False)
        assert determinism_settings()["deterministic_algorithms"] is False
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.set_num_threads(threads)


def test_numerics_env_keeps_numerics_variables_sorted_and_drops_secrets():
    env = {
        "PATH": "/bin", "HOME": "/root", "NCCL_ALGO": "Ring", "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
        "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "4", "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0",
        "TORCH_HUB_TOKEN": "secret", "CUDA_VISIBLE_DEVICES": "0,1", "MKL_NUM_THREADS": "1", "USER": "me",
    }  # fmt: skip
    assert list(numerics_env(env).items()) == [
        ("CUBLAS_WORKSPACE_CONFIG", ":4096:8"), ("CUDA_VISIBLE_DEVICES", "0,1"), ("MKL_NUM_THREADS", "1"),
        ("NCCL_ALGO", "Ring"), ("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0"), ("OMP_NUM_THREADS", "4"),
        ("PYTHONHASHSEED", "0"),
    ]  # fmt: skip


def test_git_info_outside_and_inside_a_repository(tmp_path):
    outside = tmp_path / "plain"
    outside.mkdir()
    assert git_info(outside) == {"commit": None, "dirty": None, "root": None}
    repo = tmp_path / "repo"
    repo.mkdir()
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    try:
        subprocess.run([*git, "init", "-q"], cwd=repo, check=True, timeout=30)
        (repo / "train.py").write_text("print(1)\n")
        subprocess.run([*git, "add", "train.py"], cwd=repo, check=True, timeout=30)
        subprocess.run([*git, "commit", "-q", "-m", "x"], cwd=repo, check=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        pytest.skip("git is not usable here")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True).stdout.strip()
    info = git_info(repo / "train.py")
    assert info == {"commit": head, "dirty": False, "root": str(repo.resolve())}
    (repo / "train.py").write_text("print(2)\n")
    assert git_info(repo)["dirty"] is True
