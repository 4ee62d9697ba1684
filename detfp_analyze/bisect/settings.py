"""Which manifest differences can change numbers, and which first divergences each can explain.

``settings(env_diff)`` keeps the numerics-relevant entries of an environment diff (``EnvDiff``)
as ``Setting``s, each in a group of ``SETTING_GROUPS``: thread counts, precision (TF32, matmul
precision, reduced-precision reductions), autocast (its dtype per device, on or off), algorithm
selection (deterministic algorithms, cuDNN, oneDNN/mkldnn, NNPACK, the attention kernels:
every ``torch.backends`` flag the capture's catalogue records), collectives (NCCL variables),
kernels (cuBLAS, cuDNN, Triton, Inductor variables), library versions, the world layout and the
hardware. ``changed(...)`` applies the settings a run changed between steps (``setting_changed``
events, one per key) to say what differs at the step a divergence starts. Each group says why a
difference there changes numbers and which first divergences it can explain (``explains``): a
thread count can make an op an origin, never a batch differ, an argument change or a tensor
change its dtype; only autocast (or another library) changes a dtype. Host names, paths, the
git commit and the capture's own options are not settings.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from detfp_analyze.bisect.result import Divergence
from detfp_analyze.bisect.vocab import DiffKind, Pattern, Verdict
from detfp_analyze.io.envdiff import EnvDiff

__all__ = ["SETTING_GROUPS", "Change", "Setting", "changed", "explains", "parse_change", "settings"]

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
    "autocast": (
        "autocast runs the ops in another dtype (or not at all), so they compute other values",
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
#: Fragments of a catalogue key (``determinism.backends...``) that name a precision.
_PRECISION_PARTS = ("fp32_precision", "allow_tf32", "reduced_precision", "fp16_accumulation", "fp16_bf16_reduction")
#: Difference kinds that are another computation, and the groups whose change makes one (a
#: thread count rounds differently; it never changes a dtype or a shape).
_KIND_GROUPS = {
    DiffKind.DTYPE: frozenset({"autocast", "libraries"}),
    DiffKind.SHAPE: frozenset({"layout", "libraries"}),
    DiffKind.LAYOUT: frozenset({"layout", "libraries"}),
}
#: Keys that differ between launches without changing numbers (paths, bookkeeping).
_NOT_NUMERICS = ("determinism.num_interop_threads", "versions.detfp", "host.hostname", "host.local_rank")
#: Environment variables of the numerics prefixes (NCCL_*, TORCH_*) that only say how a job
#: reports, waits, times out or is launched: a launcher sets some of them (torchrun sets
#: TORCH_NCCL_ASYNC_ERROR_HANDLING), so a pair launched two ways differs there without a number
#: changing.
_NOT_NUMERICS_ENV = frozenset({
    "TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_BLOCKING_WAIT", "NCCL_BLOCKING_WAIT",
    "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_ENABLE_MONITORING",
    "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC", "TORCH_NCCL_DESYNC_DEBUG", "NCCL_DEBUG", "NCCL_DEBUG_SUBSYS",
    "NCCL_SOCKET_IFNAME", "TORCH_DISTRIBUTED_DEBUG", "TORCH_SHOW_CPP_STACKTRACES", "TORCH_CPP_LOG_LEVEL", "TORCH_LOGS",
})  # fmt: skip


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
    #: The step from which it differs, when a run changed it during the run (None: from the start).
    since: int | None = None

    @property
    def text(self) -> str:
        where = "" if self.rank is None else f" on rank {self.rank}"
        when = "" if self.since is None else f" from step {self.since}"
        return f"{self.key} differs{where}{when} ({_v(self.a)} -> {_v(self.b)})"


def _v(x: Any) -> str:
    return json.dumps(x, sort_keys=True, default=str)


def _group(key: str) -> str | None:
    if key in _NOT_NUMERICS or key.startswith(("git.", "capture.", "host.hostname")):
        return None
    if key in _THREAD_KEYS:
        return "threads"
    if key in _PRECISION:
        return "precision"
    if key.startswith("determinism.autocast."):
        return "autocast"
    if key.startswith("determinism.backends.") and any(p in key for p in _PRECISION_PARTS):
        return "precision"
    if key == "determinism.backends.cpu.capability":
        return "hardware"
    if key.startswith("determinism."):
        return "algorithms"
    if key.startswith("env."):
        name = key[4:]
        if name.endswith(("_DIR", "_PATH", "_FILE")) or name in _NOT_NUMERICS_ENV or name.startswith("TORCHELASTIC_"):
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
    restored state) is never a setting's doing, nor a changed argument other than an autocast
    cast's dtype."""
    verdicts = SETTING_GROUPS[s.group][1]
    if d is None:
        return pattern in (Pattern.NO_ORIGIN, Pattern.ALL_RANKS_DIFFERENT_OPS) or Verdict.METRIC_ONLY in verdicts
    if s.since is not None and d.step < s.since:
        return False  # changed after the difference started
    if d.diff_kind == DiffKind.ARGUMENTS and d.verdict != Verdict.SOURCE:
        # Autocast's casts take the dtype as an argument (aten::_to_copy's dtype at level ops): a
        # call whose only changed arguments are dtypes is autocast's doing; any other change is
        # the call site's.
        changes = d.diff.args_changes if d.diff is not None else ()
        return s.group == "autocast" and bool(changes) and all(c.startswith("dtype ") for c in changes)
    if d.diff_kind == DiffKind.ARGUMENTS or d.verdict == Verdict.SOURCE:
        return False
    kinds = _KIND_GROUPS.get(DiffKind(d.diff_kind))
    if kinds is not None and s.group not in kinds:
        return False
    return d.verdict in verdicts


@dataclass(frozen=True)
class Change:
    """A setting one run changed during the run (a ``setting_changed`` event of one key)."""

    #: "A" or "B".
    side: str
    rank: int
    #: The first step that ran with the new value.
    step: int
    #: Its manifest key (``determinism.backends.mkldnn.enabled``).
    key: str
    old: Any
    new: Any


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def parse_change(side: str, rank: int, step: int, name: str, detail: str) -> Change | None:
    """A ``setting_changed`` event (``name`` the key, ``detail`` ``... step N: KEY: OLD -> NEW``,
    JSON values) as a ``Change``; None for an event of an earlier release naming several keys."""
    head = f": {name}: "
    if not name or head not in detail:
        return None
    rest = detail.split(head, 1)[1]
    # JSON text holds no " -> " outside a string; the first split whose sides both parse wins.
    parts = rest.split(" -> ")
    for i in range(1, len(parts)):
        old, new = " -> ".join(parts[:i]), " -> ".join(parts[i:])
        try:
            return Change(side, rank, step, f"determinism.{name}", json.loads(old), json.loads(new))
        except ValueError:
            continue
    return None if len(parts) != 2 else Change(side, rank, step, f"determinism.{name}", *map(_json_or_text, parts))


def changed(
    base: Sequence[Setting],
    changes: Sequence[Change],
    start: Callable[[str, int, str], Any],
    ranks: Sequence[int],
    step: int,
) -> tuple[Setting, ...]:
    """The settings that differ at ``step`` (where the first difference is): ``base`` (the
    manifests' values, those of the first step) with the changes each run made during the run
    applied up to ``step``. A setting both runs changed back to one value by then is left out; a
    setting that differs only from some step on says from which (``Setting.since``). ``start``:
    (side, rank, key) -> the manifest's value."""
    touched = sorted({c.key for c in changes})
    if not touched:
        return tuple(base)
    by: dict[tuple[str, int, str], list[Change]] = {}
    for c in sorted(changes, key=lambda c: c.step):
        by.setdefault((c.side, c.rank, c.key), []).append(c)

    def value(side: str, rank: int, key: str) -> tuple[Any, int | None]:
        """The value at ``step`` and the step it took effect (None: the manifest's)."""
        got = by.get((side, rank, key), [])
        done = [c for c in got if c.step <= step]
        return (done[-1].new, done[-1].step) if done else (start(side, rank, key), None)

    out = [x for x in base if x.key not in touched]
    for key in touched:
        group = _group(key)
        if group is None:
            continue
        per_rank = []
        for r in ranks:
            (va, sa), (vb, sb) = value("A", r, key), value("B", r, key)
            if _v(va) != _v(vb):
                since = max((x for x in (sa, sb) if x is not None), default=None)
                per_rank.append(Setting(key, va, vb, r, group, since))
        if per_rank and len(per_rank) == len(ranks) and len({(_v(x.a), _v(x.b), x.since) for x in per_rank}) == 1:
            out.append(replace(per_rank[0], rank=None))
        else:
            out += per_rank
    order = {g: i for i, g in enumerate(SETTING_GROUPS)}
    return tuple(sorted(out, key=lambda s: (order[s.group], s.key, -1 if s.rank is None else s.rank)))
