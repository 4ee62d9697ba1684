"""``repeat_check``: call a function several times from the same state and prove the calls bitwise identical.

Pipeline: discover and snapshot the state the function can reach (``_repeat_state``) ->
``warmup`` plain calls, each followed by a restore -> repeat k = 0..runs-1: restore the
snapshot (k > 0), open a ``Session`` on ``<out>/run-k``, call fn inside step 0, fingerprint
what it returned and what it wrote (probes ``output...``, ``written:...``; numbers become
metrics), run a backward through the output when asked (seeded, fixed output gradients),
fingerprint the gradients (``grad:...``), close -> compare run-0 with run-k through the real
``detfp_analyze.bisect`` and stop at the first pair that differs -> on a difference, a detail
pass: repeats that also take moments, row digests and raw dumps (and, at level ops, kernel
identities) of the differing record's op only, inside its module only, so the report can give
the difference kind and its size in ULP without dumping the whole model -> ``RepeatResult``.

Every repeat is one run directory (one segment, step 0): bisect compares two runs, and each
pair can be investigated by hand with ``detfp-analyze bisect <out>/run-0 <out>/run-k``.
Afterwards the state is what one call of fn from the found state leaves (the last repeat's),
or, with ``leave="before"``, exactly what was found; if fn raises, the found state is put
back and the exception propagates.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from detfp_capture.errors import CaptureError, ConfigError
from detfp_format.contract import CAPTURE_LEVELS as LEVELS
from detfp_guards._repeat_state import Found, Snapshot, discover, leafify

__all__ = ["NotReproducibleError", "RepeatResult", "assert_bitwise_reproducible", "repeat_check"]

#: What the state is after the check: what one call leaves, or what was found.
LEAVE = ("after", "before")
#: Which traces stay on disk: every repeat's, only those of a failed check, or none.
KEEP = ("all", "failed", "none")
#: Seed of the gradients fed to a non-scalar output's backward: random rather than ones, since
#: ones hide differences (the gradient of a softmax's sum is zero whatever its input).
_GRAD_SEED = 0x5EED


class NotReproducibleError(CaptureError, AssertionError):
    """``assert_bitwise_reproducible``: the repeats were not bitwise identical (the message is the report)."""

    def __init__(self, result: RepeatResult) -> None:
        super().__init__(result.report)
        #: The full result (traces, divergence, bisect result).
        self.result = result


@dataclass(frozen=True)
class RepeatResult:
    """What ``repeat_check`` found. ``str(result)`` is the report."""

    #: True when every repeat was bitwise identical to the first (records and metrics).
    ok: bool
    #: Number of repeats run in the main pass (it stops at the first repeat that differs).
    runs: int
    #: The repeats compared last: (0, k); when not ok, the first pair that differs.
    pair: tuple[int, int]
    #: Run directories of the pair the report is about (the detail pair when it reproduced the
    #: difference); None when they were not kept (``keep``).
    traces: tuple[Path, Path] | None
    #: The first divergent record (past a likely false root when bisect found a clean one);
    #: None when ok or when only a returned number (a metric) differs.
    divergence: Any
    #: ``detfp_analyze`` BisectResult of that pair.
    bisect: Any
    #: The text: a header (verdict, where, how big, traces, the command to investigate) and
    #: bisect's report of the pair.
    report: str
    #: The capture level of the repeats.
    level: str
    #: Whether a backward ran through fn's output.
    backward: bool
    #: True when the magnitude comes from a detail pass that reproduced the same record.
    detailed: bool = False
    #: What fn returned in the last call.
    value: Any = field(default=None, compare=False, repr=False)

    @property
    def op(self) -> str | None:
        """The first differing record's op (or module class, collective, probe name)."""
        return None if self.divergence is None else self.divergence.op

    @property
    def module(self) -> str | None:
        """Its module path ('' outside any module)."""
        return None if self.divergence is None else self.divergence.module

    @property
    def verdict(self) -> str | None:
        """bisect's verdict for it: origin, unobserved_producer, source, structural, ..."""
        return None if self.divergence is None else self.divergence.verdict

    @property
    def diff(self) -> Any:
        """Kind and magnitude (``ValueDiff``): values (with max ULP after a detail pass), permutation, ..."""
        return None if self.divergence is None else self.divergence.diff

    @property
    def kernels(self) -> Any:
        """Kernels under the op on both sides, when captured (level ops: detail pass, or kernels=True)."""
        return None if self.divergence is None else self.divergence.kernels

    def __str__(self) -> str:
        return self.report


def _check_options(fn: Any, runs: Any, level: Any, leave: Any, keep: Any, warmup: Any) -> None:
    if not callable(fn):
        raise ConfigError(f"repeat_check: fn={fn!r} is not callable; pass a module, a function or a bound method")
    if isinstance(runs, bool) or not isinstance(runs, int) or runs < 2:
        raise ConfigError(f"runs={runs!r}: expected an int >= 2 (the first call is compared with each later one)")
    if level not in LEVELS:
        raise ConfigError(f"level={level!r}: unknown capture level; use one of {', '.join(map(repr, LEVELS))}")
    if leave not in LEAVE:
        raise ConfigError(f"leave={leave!r}: use 'after' (state as one call leaves it) or 'before' (as found)")
    if keep is not None and keep not in KEEP:
        raise ConfigError(f"keep={keep!r}: use one of {', '.join(map(repr, KEEP))}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ConfigError(f"warmup={warmup!r}: expected a number of uncaptured calls >= 0")


def _leaves(obj: Any, path: str, out: list[tuple[str, Any]], depth: int = 0) -> None:
    """(path, tensor or number) pairs of a returned value: nested lists, tuples, dicts, dataclasses."""
    if isinstance(obj, torch.Tensor):
        out.append((path, obj))
    elif isinstance(obj, bool) or obj is None:
        return
    elif isinstance(obj, (int, float)):
        out.append((path, obj))
    elif depth > 4:
        return
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _leaves(v, f"{path}[{i}]", out, depth + 1)
    elif isinstance(obj, dict):
        for k in obj:
            _leaves(obj[k], f"{path}.{k}", out, depth + 1)
    elif hasattr(obj, "__dataclass_fields__"):
        for k in obj.__dataclass_fields__:
            _leaves(getattr(obj, k, None), f"{path}.{k}", out, depth + 1)


def _backward(outputs: list[torch.Tensor]) -> bool:
    """Backward through every output that requires grad; False when none does."""
    targets = [t for t in outputs if t.requires_grad and (t.is_floating_point() or t.is_complex())]
    if not targets:
        return False
    gen = torch.Generator().manual_seed(_GRAD_SEED)
    grads = []
    for t in targets:
        if t.numel() == 1:
            grads.append(torch.ones_like(t))  # a loss: exactly loss.backward()
            continue
        r = torch.randn(tuple(t.shape), generator=gen, dtype=torch.float64 if t.dtype == torch.float64 else None)
        g = torch.zeros_like(t)
        g.copy_(r)  # converts dtype and device, and keeps a tensor subclass's type
        grads.append(g)
    try:
        torch.autograd.backward(targets, grads)
    except RuntimeError as exc:
        raise ConfigError(
            f"backward=True: the backward through fn's output failed ({' '.join(str(exc).split())[:300]}); "
            "if fn runs its own backward (a training step), pass backward=False"
        ) from exc
    return True


class _Call:
    """One call of fn with its probes, inside an open session step."""

    def __init__(self, fn: Any, args: tuple, kwargs: dict, found: Found, backward: bool, level: str) -> None:
        self.fn, self.args, self.kwargs, self.found, self.backward = fn, args, kwargs, found, backward
        # At level ops every gradient is already the output of a recorded op (or of AccumulateGrad's
        # add_); below it, gradients are fingerprinted as probes after the call.
        self.probe_grads = level != "ops"
        self.params: list[tuple[str, torch.Tensor]] = []
        seen: set[int] = set()
        for i, m in enumerate(found.modules):
            prefix = "" if i == 0 else f"modules[{i}]."
            for name, p in m.named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    self.params.append((prefix + name, p))
        self.value: Any = None
        self.backward_ran = False

    def plain(self) -> None:
        self.value = self.fn(*self.args, **self.kwargs)
        leaves: list[tuple[str, Any]] = []
        _leaves(self.value, "output", leaves)
        if self.backward:
            self.backward_ran = _backward([t for _, t in leaves if isinstance(t, torch.Tensor)])

    def captured(self, session: Any) -> None:
        tensors = self.found.tensors
        versions = [t._version for _, t in tensors]
        self.value = self.fn(*self.args, **self.kwargs)
        leaves: list[tuple[str, Any]] = []
        _leaves(self.value, "output", leaves)
        for path, leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                session.probe(path, leaf)
            else:
                session.metric(path, leaf)
        for (label, t), v in zip(tensors, versions, strict=True):
            if t._version != v:  # fn wrote into it (an in-place kernel's destination)
                session.probe(f"written:{label}", t)
        self.backward_ran = False
        if self.backward:
            self.backward_ran = _backward([t for _, t in leaves if isinstance(t, torch.Tensor)])
        if not self.probe_grads:
            return
        for label, t in [*tensors, *self.params]:
            g = t.grad if t.is_leaf and t.requires_grad else None
            if g is not None:
                session.probe(f"grad:{label}", g)


@dataclass(frozen=True)
class _Focus:
    """The record a detail pass zooms in on, and the capture options that do it."""

    key: tuple
    options: dict[str, Any]


#: The detail pass dumps the differing op's tensors (for ULP sizes) only below this size: a dump is
#: a copy held until the flush and written out, for every call of the op, inputs included.
_DUMP_MAX_BYTES = 64 << 20


def _nbytes(div: Any) -> int:
    dtype = getattr(torch, str(div.dtype).rpartition(".")[2], None)
    if div.shape is None or not isinstance(dtype, torch.dtype):
        return 0
    n = 1
    for d in div.shape:
        n *= int(d)
    return n * dtype.itemsize


def _focus(div: Any, level: str) -> _Focus:
    name = "^" + re.escape(div.op) + "$"
    options: dict[str, Any] = {"moments": name, "rows": name}
    if _nbytes(div) <= _DUMP_MAX_BYTES:
        options["dumps"] = name
    if level == "ops":
        options["kernels"] = "0"
    if div.module and level != "metrics":
        options["modules"] = "^" + re.escape(div.module) + r"(\.|$)"
    return _Focus(_key(div), options)


def _key(div: Any) -> tuple:
    return (div.phase, div.module, div.kind, div.op, div.occurrence, div.role, div.arg)


def _first(res: Any) -> Any:
    return next((r.effective for r in res.ranks if r.effective is not None), None)


class _Runner:
    """Runs repeats into ``base/<prefix>-k`` and compares each with the first."""

    def __init__(self, base: Path, call: _Call, snap: Snapshot, level: str) -> None:
        self.base, self.call, self.snap, self.level = base, call, snap, level
        self.fresh = True  # the state is as found: the first repeat needs no restore

    def _capture(self, run_dir: Path, options: dict[str, Any]) -> Any:
        """One repeat into ``run_dir``; returns the opened run."""
        from detfp_capture import Session

        if not self.fresh:
            self.snap.restore()
        self.fresh = False
        session = Session(run_dir, level=self.level, **options)
        try:
            for m in self.call.found.modules:
                session.watch(m)
            session.watch_all()  # modules fn builds or reaches in ways the walk did not see
            for o in self.call.found.optimizers:
                session.watch_optimizer(o)
            with session.step(0):
                self.call.captured(session)
        finally:
            session.close()
        return _opened(run_dir)

    def run(self, prefix: str, runs: int, options: dict[str, Any]) -> tuple[int, Any]:
        """Repeats until one differs from the first or ``runs`` ran: (k, BisectResult of 0 vs k)."""
        # The function by its home: mypy reads ``detfp_analyze.bisect`` as the subpackage.
        from detfp_analyze.bisect import bisect

        bisect_level = "kernel" if "kernels" in options and self.level == "ops" else "op"
        run_a = self._capture(self.base / f"{prefix}-0", options)
        res: Any = None
        k = 0
        for k in range(1, runs):
            res = bisect(run_a, self._capture(self.base / f"{prefix}-{k}", options), level=bisect_level)
            if res.diverged:
                break
        return k, res


def _opened(run_dir: Path) -> Any:
    """The repeat's run, opened; a repeat whose capture switched itself off cannot prove anything."""
    import polars as pl

    from detfp_analyze import open_run

    run = open_run(str(run_dir))
    ev = run.scan("events").filter(pl.col("type") == "capture_error").collect()
    if ev.height:
        raise CaptureError(
            f"{run_dir}: capture failed during the repeat ({ev['detail'][0]}), so the repeats cannot be "
            "compared; report it with this message"
        )
    return run


def _header(ok: bool, runs: int, k: int, level: str, traces: tuple[Path, Path] | None, res: Any, note: str) -> str:
    div = _first(res)
    if ok:
        return f"detfp repeat check: {runs} runs bitwise identical (level {level})\n"
    lines = [f"detfp repeat check: NOT bitwise reproducible: run {k} differs from run 0 (level {level})"]
    if div is not None:
        diff = div.diff
        how = f"{div.diff_kind}" + (f" ({diff.detail})" if diff is not None and diff.detail else "")
        lines.append(
            f"first difference: {div.phase} {div.module or '<root>'} {div.kind}:{div.op} {div.role} {div.arg}"
            f" -- {div.verdict}, {how}"
        )
        headline = getattr(res.diagnosis, "headline", "")
        if headline:
            lines.append(f"cause: {headline}")
        if div.kernels is not None:
            lines.append(f"kernels: {', '.join(div.kernels.a) or '-'} | {', '.join(div.kernels.b) or '-'}")
        if div.verdict == "structural":
            lines.append(
                "hint: the repeats ran different ops; state the check did not restore (a cache built by the first "
                "call, a Python counter, a lazily created buffer) does this: pass warmup=1 or state=[...]"
            )
        if note:
            lines.append(note)
    if traces is not None:
        level_opt = " --depth kernel" if div is not None and div.kernels is not None else ""
        lines.append(f"investigate: detfp-analyze bisect {traces[0]} {traces[1]}{level_opt}")
    return "\n".join(lines) + "\n"


def repeat_check(
    fn: Any,
    *args: Any,
    runs: int = 3,
    backward: bool = True,
    level: str = "ops",
    out_dir: str | Path | None = None,
    keep: str | None = None,
    leave: str = "after",
    warmup: int = 0,
    kernels: bool = False,
    detail: bool = True,
    state: Any = (),
    **kwargs: Any,
) -> RepeatResult:
    """Call ``fn(*args, **kwargs)`` ``runs`` times from the same state and compare the calls bit for bit.

    Args:
        fn: a module, a function or a whole training step.
        runs: number of calls (>= 2); each later call is compared with the first, and the check
            stops at the first that differs.
        backward: backward through fn's output tensors that require grad (a scalar as
            ``loss.backward()``, others with fixed seeded gradients); pass False when fn runs
            its own backward.
        level: capture level of each call: ``"ops"`` (names the op), ``"boundaries"`` or ``"metrics"``.
        out_dir: where the run directories go (``run-k``, ``detail-k``); default a temporary directory.
        keep: which traces stay: ``"all"``, ``"failed"`` or ``"none"`` (default ``"all"`` with
            ``out_dir``, else ``"failed"``).
        leave: ``"after"``: afterwards the state is what one call leaves; ``"before"``: as found.
        warmup: uncaptured calls first (each followed by a restore), for code that builds a cache
            or picks a kernel on its first call.
        kernels: record the kernels under every op in the main pass (level ops; the detail pass
            always does).
        detail: on a difference, repeat with moments, row digests and dumps of the differing op.
        state: more objects to restore and watch: modules, optimizers, tensors, generators, or
            anything with ``state_dict``/``load_state_dict``.
        kwargs: passed to fn (names above are taken by repeat_check: wrap fn to pass those).

    Raises ConfigError for bad options or a failing backward; CaptureError when capture failed;
    whatever fn raises (the found state is restored first).
    """
    _check_options(fn, runs, level, leave, keep, warmup)
    args, kwargs = leafify(args), leafify(kwargs)
    found = discover(fn, args, kwargs, state if isinstance(state, (list, tuple)) else (state,))
    temp = out_dir is None
    if not temp and (Path(out_dir) / "run-0").exists():  # type: ignore[arg-type]
        raise ConfigError(
            f"out_dir={str(out_dir)!r} already holds repeat traces (run-0); pass a new or empty directory"
        )
    snap = Snapshot(found)
    base = Path(tempfile.mkdtemp(prefix="detfp-repeat-")) if temp else Path(out_dir)  # type: ignore[arg-type]
    keep = keep or ("failed" if temp else "all")
    call = _Call(fn, args, kwargs, found, backward, level)
    runner = _Runner(base, call, snap, level)
    main_options: dict[str, Any] = {"kernels": "0"} if kernels and level == "ops" else {}
    try:
        for _ in range(warmup):
            call.plain()
            snap.restore()
        k, res = runner.run("run", runs, main_options)
        traces = (base / "run-0", base / f"run-{k}")
        detailed, note = False, ""
        div = _first(res)
        if res.diverged and detail and div is not None and div.op is not None:
            focus = _focus(div, level)
            dk, dres = runner.run("detail", runs, focus.options)
            ddiv = _first(dres)
            if dres.diverged and ddiv is not None and _key(ddiv) == focus.key:
                res, detailed = dres, True
                traces = (base / "detail-0", base / f"detail-{dk}")
            else:
                note = (
                    f"magnitude unknown: {runs} more runs with dumps of {div.op} did not reproduce this record "
                    "(the difference is intermittent)"
                )
        if leave == "before":
            snap.restore()
    except BaseException:
        with contextlib.suppress(Exception):
            snap.restore()
        if temp or keep == "none":
            _remove(base, temp)  # only what the check wrote: out_dir itself may hold other things
        raise
    ok = not res.diverged
    kept: tuple[Path, Path] | None = traces
    if keep == "none" or (keep == "failed" and ok):
        _remove(base, temp)
        kept = None
    from detfp_analyze import render_text

    report = _header(ok, k + 1, k, level, kept, res, note) + "\n" + render_text(res)
    return RepeatResult(
        ok=ok,
        runs=k + 1,
        pair=(0, k),
        traces=kept,
        divergence=_first(res),
        bisect=res,
        report=report,
        level=level,
        backward=call.backward_ran,
        detailed=detailed,
        value=call.value,
    )


def _remove(base: Path, whole: bool) -> None:
    if not base.is_dir():
        return
    if whole:
        shutil.rmtree(base, ignore_errors=True)
        return
    for d in base.iterdir():
        if d.is_dir() and re.fullmatch(r"(run|detail)-\d+", d.name):
            shutil.rmtree(d, ignore_errors=True)


def assert_bitwise_reproducible(fn: Any, *args: Any, runs: int = 3, **options: Any) -> RepeatResult:
    """``repeat_check`` that raises ``NotReproducibleError`` (an AssertionError) whose message is the report."""
    __tracebackhide__ = True
    result = repeat_check(fn, *args, runs=runs, **options)
    if not result.ok:
        raise NotReproducibleError(result)
    return result
