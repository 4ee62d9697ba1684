"""The exact commands that come after a bisect: reproduce it, look deeper, recapture the step.

Pure functions of a ``BisectResult`` and the runs' manifests (their ``command``, ``capture``,
``world_size`` and ``host`` facts); nothing is run. Each recipe is a ``Recipe(title, command,
note)`` with a shell-quoted command line, so a report can print them and a user can paste them:

* reproduce the comparison (``detfp-analyze bisect A B`` with the window used);
* render it (``plot``, ``export --perfetto``);
* what fits the diagnosis's cause (``result.CAUSES``): for a cause inside the computation (an
  op, a collective, one rank, control flow, nothing captured) narrow deeper (``--depth kernel``
  on the divergent step and ranks) and recapture the divergent step one capture level deeper,
  for A and for B: the launcher command rewritten when the run was captured with ``python -m
  detfp_capture``, otherwise the script's own command with the ``Session`` arguments to change;
  for a setting, the environment diff; for an uninitialized read, ``certify``; for a step
  offset, B recaptured with its steps numbered as A's. A data, RNG or argument difference is
  never sent to the kernel level: nothing there would say more.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from detfp_analyze.bisect.result import BisectResult
from detfp_analyze.bisect.vocab import Cause, Level, Status
from detfp_analyze.ranks import format_ranks
from detfp_format.contract import CAPTURE_LEVELS

__all__ = ["Recipe", "recipes"]

#: Causes whose next look is deeper in the computation (the kernel, a deeper capture level).
_DEEPER = frozenset(
    {Cause.OP, Cause.COLLECTIVE, Cause.RANK_LOCAL, Cause.CONTROL_FLOW, Cause.UNCAPTURED, Cause.UNDETERMINED}
)


@dataclass(frozen=True)
class Recipe:
    """One command to paste."""

    #: What it does, for a heading.
    title: str
    #: The shell command line (arguments quoted).
    command: str
    #: One line of context ("" when none).
    note: str = ""


def _q(args: Sequence[str]) -> str:
    return " ".join(shlex.quote(str(a)) for a in args)


def _window_args(result: BisectResult) -> list[str]:
    w = result.window
    out = []
    if w.steps is not None and (w.steps != w.steps_a or w.steps != w.steps_b):
        out += ["--steps", f"{w.steps[0]}-{w.steps[1]}"]
    return out


def _focus(result: BisectResult) -> tuple[int | None, tuple[int, ...]]:
    """The divergent step to open and the ranks worth opening (origin ranks, else diverged ones)."""
    steps = [r.first.step for r in result.ranks if r.first is not None]
    step = min(steps) if steps else result.first_step
    ranks = result.diagnosis.origin_ranks or tuple(r.rank for r in result.ranks if r.status == Status.DIVERGED)
    return step, tuple(ranks[:8])


def _launcher_split(command: Sequence[str]) -> tuple[list[str], list[str]] | None:
    """(the launcher's own options, the training command after ``--``), or None when the run was
    not captured through ``python -m detfp_capture``."""
    if not command or not str(command[0]).replace("\\", "/").endswith("detfp_capture/__main__.py"):
        return None
    args = list(command[1:])
    if "--" not in args:
        return None
    i = args.index("--")
    return args[:i], args[i + 1 :]


def _torchrun(manifests: Mapping[int, Mapping[str, Any]]) -> list[str]:
    if not manifests:
        return []
    world = int(next(iter(manifests.values())).get("world_size") or 1)
    if world <= 1:
        return []
    hosts = {str((m.get("host") or {}).get("hostname")) for m in manifests.values()}
    if len(hosts) <= 1:
        return ["torchrun", "--standalone", "--nproc_per_node", str(world)]
    per = world // len(hosts)
    return ["torchrun", "--nnodes", str(len(hosts)), "--nproc_per_node", str(per), "--rdzv-endpoint", "HOST:PORT"]


def _deeper(level: str | None) -> str:
    if level in CAPTURE_LEVELS:
        return CAPTURE_LEVELS[min(CAPTURE_LEVELS.index(level) + 1, len(CAPTURE_LEVELS) - 1)]
    return "ops"


def _recapture(
    tag: str, label: str, manifests: Mapping[int, Mapping[str, Any]], step: int, start: int | None = None
) -> Recipe | None:
    """Capture ``step`` again one level deeper; with ``start``, the whole run again at its own
    level with its steps numbered from ``start`` (a resume that lost its numbering)."""
    if not manifests:
        return None
    m = manifests[min(manifests)]
    command = [str(x) for x in (m.get("command") or [])]
    if not command:
        return None
    capture = m.get("capture") or {}
    if start is not None:
        return _renumbered(tag, label, manifests, command, capture.get("level") or "metrics", start)
    level = _deeper(capture.get("level"))
    kernels = level == "ops"
    out = f"{label.rstrip('/')}-step{step}-{level}"
    deeper = "with kernel identities" if capture.get("level") == "ops" else ""
    title = f"recapture step {step} of run {tag} at level {level} {deeper}".rstrip()
    split = _launcher_split(command)
    if split is not None:
        ours, script = split
        args = ["python", "-m", "detfp_capture", "--out", out, "--level", level, "--steps", str(step)]
        if kernels:
            args += ["--kernels", str(step)]
        if "--start-step" in ours[:-1]:  # a resumed launch keeps its step numbering
            args += ["--start-step", ours[ours.index("--start-step") + 1]]
        launch = _torchrun(manifests)
        if launch:
            args = [*launch, "-m", "detfp_capture", *args[3:]]
        note = "the same training command under the launcher, capturing only that step, into a new directory"
        return Recipe(title, _q([*args, "--", *script]), note)
    extra = f', kernels="{step}"' if kernels else ""
    launch = _torchrun(manifests)
    run = [*launch, *command] if launch else ["python", *command]
    note = (
        f'the script opens detfp_capture.Session itself: rerun it with Session("{out}", level="{level}", '
        f'steps="{step}"{extra}) (a new directory), everything else unchanged'
    )
    return Recipe(title, _q(run), note)


def _renumbered(
    tag: str, label: str, manifests: Mapping[int, Mapping[str, Any]], command: list[str], level: str, start: int
) -> Recipe:
    out = f"{label.rstrip('/')}-from{start}"
    title = f"recapture run {tag} with its steps numbered from {start}"
    split = _launcher_split(command)
    launch = _torchrun(manifests)
    if split is not None:
        _, script = split
        args = ["python", "-m", "detfp_capture", "--out", out, "--level", level, "--start-step", str(start)]
        if launch:
            args = [*launch, "-m", "detfp_capture", *args[3:]]
        return Recipe(title, _q([*args, "--", *script]), "the same command, its first step numbered as A's")
    run = [*launch, *command] if launch else ["python", *command]
    note = (
        f'the script opens detfp_capture.Session itself: rerun it into a new directory ("{out}") numbering its steps '
        f"from {start} (session.step({start} + i), or Session(..., start_step={start}))"
    )
    return Recipe(title, _q(run), note)


def recipes(
    result: BisectResult,
    manifests_a: Mapping[int, Mapping[str, Any]] | None = None,
    manifests_b: Mapping[int, Mapping[str, Any]] | None = None,
) -> tuple[Recipe, ...]:
    """The commands to reproduce, deepen, render and recapture ``result`` (see the module doc).

    ``manifests_a``/``manifests_b``: rank -> latest manifest of each run (``Run.manifest(r)``);
    without them the recapture recipes are left out.
    """
    a, b = result.label_a, result.label_b
    cause = result.diagnosis.cause
    incomplete = ["--allow-incomplete"] if not result.complete else []
    out = [
        Recipe("reproduce this comparison", _q(["detfp-analyze", "bisect", a, b, *_window_args(result), *incomplete]))
    ]
    if cause == Cause.SETTING:
        out.append(
            Recipe("compare the environments", _q(["detfp-analyze", "env", a, b]), "every manifest fact that differs")
        )
    elif cause == Cause.UNINITIALIZED:
        out.append(Recipe("list every uninitialized read of run B", _q(["detfp-analyze", "certify", b])))
    elif cause == Cause.STEP_OFFSET and result.resume.step_offset is not None and result.resume.start_b is not None:
        start = result.resume.start_b + result.resume.step_offset
        r = _recapture("B", b, manifests_b or {}, 0, start=start)
        if r is not None:
            out.append(r)
    step, ranks = _focus(result)
    if result.diverged and step is not None:
        sel = ["--steps", str(step)] + (["--ranks", format_ranks(ranks)] if ranks else [])
        level = result.window.level
        deeper = cause in _DEEPER
        if level != Level.KERNEL and deeper:
            out.append(
                Recipe(
                    f"narrow step {step} down to the kernel",
                    _q(["detfp-analyze", "bisect", a, b, *sel, "--depth", "kernel"]),
                    "compares the kernels launched under the divergent op when both runs captured them",
                )
            )
        out.append(Recipe("draw the pictures", _q(["detfp-analyze", "plot", a, b, "--out", "detfp-plots"])))
        out.append(
            Recipe(
                f"open step {step} as a timeline in the Perfetto UI",
                _q(["detfp-analyze", "export", a, b, "--perfetto", "trace.json", *sel]),
                "load trace.json at ui.perfetto.dev (runs locally in the browser)",
            )
        )
        for tag, label, manifests in (("A", a, manifests_a), ("B", b, manifests_b)):
            r = _recapture(tag, label, manifests or {}, step) if deeper else None
            if r is not None:
                out.append(r)
    return tuple(out)
