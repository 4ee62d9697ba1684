"""Which manifest differences can change numbers, and which first divergences each can explain.

``settings(env_diff)`` keeps the numerics-relevant entries of an environment diff (``EnvDiff``)
as ``Setting``s, each in a group of ``SETTING_GROUPS``: thread counts, precision (TF32, matmul
precision), algorithm selection (deterministic algorithms, cuDNN), collectives (NCCL
variables), kernels (cuBLAS, cuDNN, Triton, Inductor variables), library versions, the world
layout and the hardware. Each group says why a difference there changes numbers and which
verdicts of a first divergence it can explain (``explains``): a thread count can make an op an
origin, never a batch differ or an argument change. Host names, paths, the git commit and the
capture's own options are not settings.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from detfp_analyze.bisect.result import Divergence
from detfp_analyze.bisect.vocab import DiffKind, Pattern, Verdict
from detfp_analyze.io.envdiff import EnvDiff

__all__ = ["SETTING_GROUPS", "Setting", "explains", "settings"]

#: Verdicts of a first divergence that a changed number explains: a call that computed another
#: value from the same inputs, or what carries it (a consumer, a peer, a metric).
_VALUES = frozenset({Verdict.ORIGIN, Verdict.UNOBSERVED_PRODUCER, Verdict.RECEIVER, Verdict.METRIC_ONLY})
#: ... and a setting that also selects other code (kernels, versions, layout) can change which calls run.
_CODE = _VALUES | {Verdict.STRUCTURAL}
#: Groups of numerics-relevant settings: (why a difference there changes numbers, the verdicts
#: of a first divergence it can explain). Kinds of setting, most specific first.
SETTING_GROUPS: dict[str, tuple[str, frozenset[str]]] = {
    "threads": (
        "CPU reductions, convolutions and matmuls split their work by the thread count, which changes the "
        "summation order",
        _VALUES,
    ),
    "precision": (
        "matmuls and convolutions round at another precision (TF32, matmul precision)",
        _VALUES,
    ),
    "algorithms": (
        "another kernel is selected (deterministic or not, benchmarked or not), or fresh memory is filled or not",
        _CODE,
    ),
    "collectives": (
        "the collectives reduce with another algorithm, protocol or order",
        _VALUES,
    ),
    "kernels": (
        "the math libraries pick other kernels or splits (workspace, autotuning, compiler settings)",
        _CODE,
    ),
    "libraries": (
        "another library version brings other kernels and defaults",
        _CODE,
    ),
    "layout": (
        "another parallel layout shards and reduces in another order",
        _CODE,
    ),
    "hardware": (
        "other hardware runs other kernels",
        _CODE,
    ),
}
_THREAD_KEYS = ("determinism.num_threads", "env.OMP_NUM_THREADS", "env.MKL_NUM_THREADS", "env.OPENBLAS_NUM_THREADS")
_PRECISION = ("determinism.cuda_matmul_allow_tf32", "determinism.cudnn_allow_tf32",
              "determinism.float32_matmul_precision", "env.NVIDIA_TF32_OVERRIDE", "env.TORCH_ALLOW_TF32_CUBLAS_OVERRIDE")  # fmt: skip
#: Keys that differ between launches without changing numbers (paths, bookkeeping).
_NOT_NUMERICS = ("determinism.num_interop_threads", "versions.detfp", "host.hostname", "host.local_rank")


@dataclass(frozen=True)
class Setting:
    """A numerics-relevant manifest fact that differs between A and B."""

    key: str
    a: Any
    b: Any
    #: The rank it differs on (None: every rank).
    rank: int | None
    #: One of SETTING_GROUPS.
    group: str

    @property
    def text(self) -> str:
        where = "" if self.rank is None else f" on rank {self.rank}"
        return f"{self.key} differs{where} ({_v(self.a)} -> {_v(self.b)})"


def _v(x: Any) -> str:
    return json.dumps(x, sort_keys=True, default=str)


def _group(key: str) -> str | None:
    if key in _NOT_NUMERICS or key.startswith(("git.", "capture.", "host.hostname")):
        return None
    if key in _THREAD_KEYS:
        return "threads"
    if key in _PRECISION:
        return "precision"
    if key.startswith("determinism."):
        return "algorithms"
    if key.startswith("env."):
        name = key[4:]
        if name.endswith(("_DIR", "_PATH", "_FILE")):
            return None
        if name.startswith("NCCL_"):
            return "collectives"
        if name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
            return "layout"
        return "kernels"
    if key.startswith("versions."):
        return "libraries"
    if key == "world_size" or key.startswith(("parallel.", "groups.")):
        return "layout"
    if key in ("host.cpu", "host.devices", "host.device_count"):
        return "hardware"
    return None


def settings(diffs: Sequence[EnvDiff]) -> tuple[Setting, ...]:
    """The numerics-relevant entries of an environment diff, in ``SETTING_GROUPS`` order, then by key."""
    order = {g: i for i, g in enumerate(SETTING_GROUPS)}
    out = [Setting(d.key, d.a, d.b, d.rank, g) for d in diffs if (g := _group(d.key)) is not None]
    return tuple(sorted(out, key=lambda s: (order[s.group], s.key, -1 if s.rank is None else s.rank)))


def explains(s: Setting, d: Divergence | None, pattern: str) -> bool:
    """Whether setting ``s`` can explain the first divergence ``d`` (None: no located record,
    only metrics or receivers): the kind of change the setting makes. A source (data, RNG,
    restored state) or a changed argument is never a setting's doing."""
    verdicts = SETTING_GROUPS[s.group][1]
    if d is None:
        return pattern in (Pattern.NO_ORIGIN, Pattern.ALL_RANKS_DIFFERENT_OPS) or Verdict.METRIC_ONLY in verdicts
    if d.diff_kind == DiffKind.ARGUMENTS or d.verdict == Verdict.SOURCE:
        return False
    return d.verdict in verdicts
