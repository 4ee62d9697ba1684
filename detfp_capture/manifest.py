"""Collect one rank's run manifest: everything bitwise determinism depends on (torch imported lazily).

``collect_manifest`` returns a dict with exactly ``contract.MANIFEST_KEYS``; each part is
gathered by its own small function that never raises (an unknown fact is ``null``), so a
broken CUDA install or a missing ``git`` cannot stop a training run from starting. torch is
imported inside the functions that need it: this module is importable (and testable) on
the analysis side too. Nothing here talks to other ranks; each rank describes itself and
the analysis compares the manifests.
"""

from __future__ import annotations

import json
import os
import platform
import re
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from detfp_format import commitlog, contract

__all__ = [
    "ENV_NAMES",
    "ENV_PREFIXES",
    "LIBRARIES",
    "OPTION_MARKERS",
    "SECRET_MARKERS",
    "SECRET_NAMES",
    "collect_manifest",
    "determinism_settings",
    "earlier_digest_version",
    "git_info",
    "looks_secret",
    "numerics_env",
    "redact_command",
    "resumed_config",
]

#: Environment-variable prefixes whose variables can change numerics (kernels, algorithms, threads).
ENV_PREFIXES = (
    "CUBLAS",
    "CUBLASLT_",
    "CUDA_",
    "CUDNN_",
    "DNNL_",
    "GOMP_",
    "KMP_",
    "MKL_",
    "NCCL_",
    "NVTE_",
    "OMP_",
    "ONEDNN_",
    "OPENBLAS_",
    "PYTORCH_",
    "TORCH_",
    "TORCHINDUCTOR_",
    "TRITON_",
    "ATEN_",
    "MIOPEN_",
    "ROCBLAS_",
    "HIPBLASLT_",
)
#: Individual variables that change numerics or ordering.
ENV_NAMES = ("NVIDIA_TF32_OVERRIDE", "PYTHONHASHSEED", "LD_PRELOAD", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
#: Name fragments of variables and command-line options that hold credentials: never recorded,
#: even under a numerics prefix (manifests are shared with whoever reads the trace).
SECRET_MARKERS = (
    "TOKEN",
    "SECRET",
    "PASSWORD",
    "PASSWD",
    "PASSPHRASE",
    "CREDENTIAL",
    "KEY",
    "AUTH",
    "COOKIE",
    "SESSION",
    "SIGNATURE",
    "PRIVATE",
    "CONNECTION_STRING",
    "SAS",
)
#: Whole names of cloud and tracking-service credentials that no fragment above catches.
SECRET_NAMES = frozenset(
    (
        "AWS_ACCESS_KEY_ID",
        "AZURE_CLIENT_ID",
        "AZURE_TENANT_ID",
        "GOOGLE_APPLICATION_CREDENTIALS",
        "MLFLOW_TRACKING_USERNAME",
        "MLFLOW_TRACKING_URI",
        "WANDB_BASE_URL",
        "NETRC",
    )
)
#: Option-name fragments redacted on the command line: narrower than SECRET_MARKERS, because an
#: option like ``--key-dim 64`` or ``--session-dir`` is part of how the run was made.
OPTION_MARKERS = ("TOKEN", "SECRET", "PASSWORD", "PASSWD", "PASSPHRASE", "CREDENTIAL", "API_KEY", "APIKEY",
                  "ACCESS_KEY", "PRIVATE_KEY")  # fmt: skip
_REDACTED = "<redacted>"
# user:password@ inside a URL (a rendezvous endpoint, a tracking URI) is a credential too.
_URL_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)[^/@\s]*@")
_GIT_TIMEOUT_S = 10.0


def looks_secret(name: str, markers: Sequence[str] = SECRET_MARKERS) -> bool:
    """True when an environment variable (or, with OPTION_MARKERS, an option) name looks like a credential."""
    upper = name.upper().lstrip("-").replace("-", "_")
    return upper in SECRET_NAMES or any(m in upper for m in markers)


def _scrub(value: str) -> str:
    return _URL_USERINFO.sub(lambda m: m.group("scheme") + _REDACTED + "@", value)


def numerics_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The numerics-relevant variables of ``environ`` (default ``os.environ``), sorted by name.

    Variables whose names look like credentials (``looks_secret``) are dropped, and
    ``user:password@`` inside URL values is redacted.
    """
    env = os.environ if environ is None else environ
    out = {}
    for name in sorted(env):
        if looks_secret(name):
            continue
        if name in ENV_NAMES or name.startswith(ENV_PREFIXES):
            out[name] = _scrub(env[name])
    return out


def redact_command(argv: Sequence[str]) -> list[str]:
    """``argv`` with the values of credential-like options redacted.

    ``--api-key=X`` and ``--api-key X`` become ``--api-key=<redacted>`` and ``--api-key
    <redacted>``; ``NAME=value`` arguments with a credential-like name and URL userinfo are
    redacted the same way. Everything else is kept: the command line says how the run was made.
    """
    out: list[str] = []
    hide_next = False
    for arg in argv:
        arg = str(arg)
        if hide_next:
            out.append(_REDACTED)
            hide_next = False
            continue
        name, eq, _ = arg.partition("=")
        if eq and looks_secret(name, OPTION_MARKERS) and (name.startswith("-") or name.replace("_", "").isalnum()):
            out.append(f"{name}={_REDACTED}")
        elif arg.startswith("-") and looks_secret(arg, OPTION_MARKERS):
            out.append(arg)
            hide_next = True
        else:
            out.append(_scrub(arg))
    return out


def _safe(fn: Any, default: Any = None) -> Any:
    # Every fact is optional: a failing probe must not stop the training run from starting.
    try:
        return fn()
    except Exception:
        return default


def determinism_settings() -> dict[str, Any]:
    """torch's numerics settings as plain JSON values (null where unavailable): the catalogue of
    ``numerics.py`` (deterministic algorithms, cuDNN, TF32 and matmul precision, thread counts,
    every ``torch.backends`` flag that selects a kernel or a precision, the autocast state)."""
    from detfp_capture.numerics import snapshot

    return _safe(snapshot, {})


#: Libraries whose version changes kernels or defaults, by distribution name (``versions.<name>``,
#: null when not installed: a library present in one run only is a difference).
LIBRARIES = ("numpy", "triton", "transformer-engine", "flash-attn", "apex", "xformers", "torchao", "deepspeed",
             "megatron-core", "intel-extension-for-pytorch")  # fmt: skip


def _library(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def _versions() -> dict[str, Any]:
    import torch

    def nccl() -> str | None:
        if not torch.cuda.is_available():
            return None
        v = torch.cuda.nccl.version()
        return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)

    def detfp() -> str | None:
        from importlib.metadata import version

        return version("detfp")

    return {
        "torch": torch.__version__,
        "cuda": _safe(lambda: torch.version.cuda),
        "cudnn": _safe(lambda: torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None),
        "nccl": _safe(nccl),
        "python": platform.python_version(),
        "os": platform.platform(),
        "detfp": _safe(detfp),
        **{lib.replace("-", "_"): _safe(lambda lib=lib: _library(lib)) for lib in LIBRARIES},
    }


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _host() -> dict[str, Any]:
    import torch

    def devices() -> list[str]:
        if not torch.cuda.is_available():
            return []
        return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]

    local = os.environ.get("LOCAL_RANK")
    return {
        "hostname": _safe(socket.gethostname),
        "device_count": _safe(lambda: torch.cuda.device_count() if torch.cuda.is_available() else 0),
        "devices": _safe(devices, []),
        "cpu": _safe(_cpu_model),
        "local_rank": int(local) if local is not None and local.isdigit() else None,
    }


def _git(args: Sequence[str], cwd: Path) -> str | None:
    try:
        proc = subprocess.run(
            ["git", *args],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=_GIT_TIMEOUT_S,
            check=False,
            env={**os.environ, "GIT_OPTIONAL_LOCKS": "0"},  # status must not take the index lock
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def git_info(path: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """commit, dirty and root of the repository holding ``path`` (default: the training script's directory)."""
    if path is None:
        script = sys.argv[0] if sys.argv and sys.argv[0] not in ("", "-c", "-m") else ""
        path = Path(script).resolve().parent if script else Path.cwd()
    start = Path(path)
    if start.is_file():
        start = start.parent
    if not start.is_dir():
        return {"commit": None, "dirty": None, "root": None}
    root = _git(["rev-parse", "--show-toplevel"], start)
    if root is None:
        return {"commit": None, "dirty": None, "root": None}
    commit = _git(["rev-parse", "HEAD"], start)
    status = _git(["status", "--porcelain"], start)
    return {"commit": commit, "dirty": None if status is None else bool(status), "root": root}


def earlier_digest_version(run_dir: str | os.PathLike[str], rank: int, segment: int) -> int | None:
    """The digest version of ``rank``'s latest launch before ``segment`` in ``run_dir`` (from its
    manifest), or None when no earlier manifest says one: what a resumed run continues with."""
    for earlier in range(segment - 1, -1, -1):
        path = Path(run_dir) / contract.manifest_relpath(rank, earlier)
        try:
            version = json.loads(path.read_text(encoding="utf-8")).get("digest_version")
        except (OSError, ValueError, AttributeError):
            continue
        if type(version) is int:
            return version
    return None


def collect_manifest(
    *,
    rank: int,
    world_size: int,
    segment: int,
    start_step: int | None,
    parallel: Mapping[str, Any] | None = None,
    groups: Mapping[str, Sequence[int]] | None = None,
    capture: Mapping[str, Any] | None = None,
    git_path: str | os.PathLike[str] | None = None,
    digest_version: int = contract.DIGEST_VERSION,
) -> dict[str, Any]:
    """This rank's manifest: contract.MANIFEST_KEYS then MANIFEST_OPTIONAL_KEYS (see them for each
    value's meaning). ``digest_version``: the version of the run's digests (a key of
    ``contract.DIGEST_VERSIONS``)."""
    manifest = {
        "schema_version": contract.SCHEMA_VERSION,
        "digest_version": int(digest_version),
        "digest_algorithm": contract.DIGEST_VERSIONS[digest_version],
        "rank": int(rank),
        "world_size": int(world_size),
        "segment": int(segment),
        "start_step": None if start_step is None else int(start_step),
        "parallel": dict(parallel or {}),
        "groups": {str(k): [int(r) for r in v] for k, v in sorted((groups or {}).items())},
        "versions": _versions(),
        "host": _host(),
        "determinism": determinism_settings(),
        "env": numerics_env(),
        "git": git_info(git_path),
        "command": redact_command(sys.argv),
        "capture": dict(capture or {}),
        "commit_log": commitlog.COMMIT_LOG_VERSION,
        "rollups": contract.ROLLUP_VERSION,
        "shard_facts": commitlog.SHARD_FACTS_VERSION,
        "step_sums": commitlog.STEP_SUMS_VERSION,
    }
    return manifest


def resumed_config(cfg: Any, asked: int | None, out_dir: Path, rank: int, segment: int) -> Any:
    """``cfg`` for a launch appended to a run: the run's digest version (one version per trace),
    taken from its earlier launch when none was asked for; ConfigError when another was."""
    import dataclasses

    from detfp_capture._config import DIGEST_VERSION_ENV
    from detfp_capture.errors import ConfigError

    earlier = earlier_digest_version(out_dir, rank, segment)
    if earlier is None or earlier == cfg.digest_version:
        return cfg
    if asked is None and not os.environ.get(DIGEST_VERSION_ENV, "").strip():
        return dataclasses.replace(cfg, digest_version=earlier)
    raise ConfigError(
        f"digest_version={cfg.digest_version}: {out_dir} (rank {rank}) was captured with digest version {earlier}, "
        f"and a resumed run keeps its version; pass digest_version={earlier} or capture into a new directory"
    )
