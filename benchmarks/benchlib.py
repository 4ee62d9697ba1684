"""What the benchmarks share: the machine they ran on, measured child processes, planted answers.

Every script in this folder runs as ``python benchmarks/<script>.py``, so this folder is its
``sys.path[0]`` and ``import benchlib`` needs no path edit. Standard library only at import
(the bisect benchmarks' children import it, and must not pay for torch):

* ``Machine`` / ``machine()`` / ``machine_line()``: the CPU model, the instruction set the
  digest's level GEMM depends on (AVX2, AVX-512, VNNI, from /proc/cpuinfo's flags), the cores and
  the load average, printed at the top of every benchmark so a figure names the machine it came from;
* ``run_measured``: a command as a child process, with its own wall time, CPU time and peak
  RSS (``Measured``), forked from a small launcher so the benchmark's memory is not counted;
* ``bisect_cli``: the whole ``detfp-analyze bisect --json`` process, measured, its answer read;
* ``check_planted``: whether a bisect named each rank's planted first divergence;
* ``byte_compile``: compile a tree's packages once where the environment writes no bytecode;
* ``time_gemms``: the time capture spends in the digest's level GEMM, in this process;
* ``wait_for_writer``: until a capture session's writer thread has written what it was handed;
* ``import_tree``: a baseline tree's packages imported ahead of the installed ones (``--baseline``);
* ``side_by_side_arguments``, ``run_side_by_side``: a side-by-side benchmark's levels and trees,
  one child process per (tree, level) in its child mode, and the rounds of children in a
  shuffled order.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "ROOT",
    "Machine",
    "Measured",
    "bisect_cli",
    "byte_compile",
    "check_planted",
    "import_tree",
    "instruction_set",
    "load_average",
    "machine",
    "machine_line",
    "run_measured",
    "run_side_by_side",
    "side_by_side_arguments",
    "time_gemms",
    "wait_for_writer",
]

#: The root of the tree this folder belongs to (its packages are the ones measured by default).
ROOT = Path(__file__).resolve().parents[1]

#: /proc/cpuinfo flag -> the name printed, in order: the vector and int8 dot-product extensions
#: that decide how fast the digest's level GEMM runs (``detfp_capture._digest.core.route``).
_ISA = {"avx2": "AVX2", "avx512f": "AVX-512", "avx512_vnni": "AVX-512 VNNI", "avx_vnni": "AVX-VNNI"}


@dataclass(frozen=True)
class Machine:
    """The facts about this machine every benchmark prints before its figures."""

    #: The CPU model (/proc/cpuinfo's ``model name``; else ``platform.processor()``; "?" if neither).
    cpu: str
    #: The vector extensions among ``_ISA`` the CPU reports, e.g. ("AVX2", "AVX-512", "AVX-512 VNNI").
    isa: tuple[str, ...]
    #: Logical CPUs of the machine, and those this process may run on (its affinity).
    cores: int
    usable: int
    #: The 1, 5 and 15 minute load averages ("?" where the system has none).
    load: str


def instruction_set(flags: Iterable[str]) -> tuple[str, ...]:
    """The names of ``_ISA`` whose /proc/cpuinfo flag is among ``flags``, in ``_ISA``'s order."""
    have = set(flags)
    return tuple(name for flag, name in _ISA.items() if flag in have)


def _cpuinfo() -> tuple[str | None, list[str]]:
    """(model name, flags) of the first processor in /proc/cpuinfo; (None, []) without one."""
    model, flags = None, []
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip().lower()
                if key == "model name" and model is None:
                    model = value.strip()
                elif key == "flags" and not flags:
                    flags = value.split()
                if model is not None and flags:
                    break
    except OSError:
        pass
    return model, flags


def load_average() -> str:
    """The 1, 5 and 15 minute load averages, e.g. "1.2 0.9 0.8" ("?" where the system has none)."""
    try:
        return " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "?"


def machine() -> Machine:
    """This machine's facts, read now (the load average changes; read it again at the end)."""
    model, flags = _cpuinfo()
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 0
    return Machine(
        cpu=model or platform.processor() or "?",
        isa=instruction_set(flags),
        cores=os.cpu_count() or 0,
        usable=usable,
        load=load_average(),
    )


def machine_line(m: Machine | None = None) -> str:
    """One line for the top of a benchmark's output: CPU, instruction set, cores, load."""
    m = m if m is not None else machine()
    isa = ", ".join(m.isa) if m.isa else f"none of {', '.join(_ISA.values())}"
    cores = f"{m.cores} cores" + ("" if m.usable == m.cores else f" ({m.usable} usable)")
    return f"CPU {m.cpu} ({platform.machine()}); instruction set: {isa}; {cores}; load average {m.load}"


@dataclass(frozen=True)
class Measured:
    """One child process, measured by ``run_measured``."""

    #: Its exit status.
    code: int
    #: What it printed on stdout.
    stdout: str
    #: Its wall time, in seconds, from its fork to its exit.
    wall: float
    #: Its user + system CPU seconds (all its threads; steadier than wall time on a shared machine).
    cpu: float
    #: Its own peak resident memory, MiB (``ru_maxrss``; not the benchmark's).
    peak_mib: float


#: Runs a command as its own child and writes that child's wall time, CPU seconds and peak RSS
#: to a file. On Linux a process keeps, as its ``ru_maxrss``, the peak RSS of the image it was
#: started from (the benchmark, forked or vforked, before its exec), so a child started from the
#: benchmark reads at least the benchmark's own peak; the measured command is forked from this
#: small launcher instead, whose image is a bare interpreter's.
_LAUNCHER = """
import json, os, sys, time
out, cmd = sys.argv[1], sys.argv[2:]
t0 = time.perf_counter()
pid = os.fork()
if pid == 0:
    try:
        os.execv(cmd[0], cmd)
    finally:
        os._exit(127)
_, status, u = os.wait4(pid, 0)
with open(out, "w") as f:
    json.dump({"wall": time.perf_counter() - t0, "kib": u.ru_maxrss, "cpu": u.ru_utime + u.ru_stime}, f)
sys.exit(os.waitstatus_to_exitcode(status))
"""


def run_measured(cmd: Sequence[str], env: Mapping[str, str] | None = None) -> Measured:
    """Run ``cmd`` (an executable's path first) as a child of ``_LAUNCHER``; ``env``: variables
    added to this process's environment (e.g. ``PYTHONPATH`` of a baseline tree).

    The child runs in the temporary directory: a benchmark started from a repository root must
    not have that root shadow a baseline tree put first on ``PYTHONPATH``."""
    with tempfile.TemporaryDirectory() as tmp:
        stats_file = Path(tmp) / "rusage.json"
        proc = subprocess.Popen(
            [sys.executable, "-c", _LAUNCHER, str(stats_file), *cmd],
            stdout=subprocess.PIPE,
            text=True,
            env=None if env is None else {**os.environ, **env},
            cwd=tempfile.gettempdir(),
        )
        # Read stdout before waiting: an output larger than the pipe's buffer would block the child.
        out = proc.stdout.read() if proc.stdout else ""
        code = proc.wait()
        stats = json.loads(stats_file.read_text()) if stats_file.exists() else {"wall": 0.0, "kib": 0, "cpu": 0.0}
    # Linux: ru_maxrss in KiB.
    return Measured(code, out, stats["wall"], stats["cpu"], stats["kib"] / 1024)


def bisect_cli(a: Path, b: Path, env: Mapping[str, str] | None = None, flags: Sequence[str] = ()) -> dict[str, Any]:
    """The whole ``detfp-analyze bisect A B --json`` process (imports included) with ``flags``,
    measured (``run_measured``): ``seconds`` (its wall time), ``first`` (rank as a string ->
    [step, seq_a, verdict] of its first divergence), ``report`` (the JSON text), ``wall``,
    ``cpu``, ``peak_mib``; ``error`` instead of the first three when it exits with neither 0 nor 1.
    The command is the one installed next to this interpreter (a baseline tree: ``env``'s
    ``PYTHONPATH``); ``a`` and ``b`` absolute, as the child runs elsewhere."""
    exe = Path(sys.executable).with_name("detfp-analyze")
    m = run_measured([str(exe), "bisect", str(a), str(b), "--json", *flags], env)
    stats = {"wall": m.wall, "peak_mib": m.peak_mib, "cpu": m.cpu}
    if m.code not in (0, 1):
        return {"error": f"exit {m.code}", **stats}
    first = {
        str(r["rank"]): [r["first"]["step"], r["first"]["seq_a"], r["first"].get("verdict")]
        for r in json.loads(m.stdout).get("ranks", ())
        if r.get("first")
    }
    return {"seconds": m.wall, "first": first, "report": m.stdout, **stats}


def check_planted(
    expected: Iterable[Sequence[int]], res: Mapping[str, Any], origin_ranks: Sequence[int] | None = None
) -> str:
    """'ok' when a bisect named exactly the planted ranks, each with its planted first divergent
    step and seq, and (where both are known) the planted origin ranks; else what differs.

    ``expected``: (rank, step, seq) per rank the plant reaches; ``res``: a measurement with
    ``first`` (rank as a string -> [step, seq, ...]), optionally ``origin_ranks``, or ``error``."""
    if "error" in res:
        return str(res["error"])
    exp = {int(r): [s, q] for r, s, q in expected}
    got = {int(r): list(v[:2]) for r, v in res.get("first", {}).items()}
    if got != exp:
        wrong = sorted(set(exp) ^ set(got)) or [r for r in exp if exp[r] != got.get(r)]
        return f"MISMATCH ranks {wrong[:5]}"
    if origin_ranks is not None and "origin_ranks" in res and sorted(res["origin_ranks"]) != sorted(origin_ranks):
        return f"origin ranks {list(res['origin_ranks'])[:5]} != {list(origin_ranks)[:5]}"
    return "ok"


def byte_compile(*trees: Path) -> None:
    """Byte-compile the packages of ``trees`` once, when this environment does not write bytecode
    (PYTHONDONTWRITEBYTECODE): every child would otherwise compile detfp's sources again at start
    (~0.3 CPU s), which an installed package never does. Python still reads the compiled files."""
    if not sys.flags.dont_write_bytecode:
        return
    import compileall

    for tree in trees:
        for pkg in ("detfp_analyze", "detfp_capture"):
            if (tree / pkg).is_dir():
                compileall.compile_dir(str(tree / pkg), quiet=1)
    print("PYTHONDONTWRITEBYTECODE is set: the trees measured were byte-compiled first, as an installed package is")


def time_gemms(clock: Any = time.perf_counter) -> list[float]:
    """Time every call of the digest's level functions (each digest version's ``mm`` and
    ``mm_short``: version 1's GEMM, version 2's multilinear level) in this process from now on;
    returns the running total in seconds, by ``clock`` (``time.process_time`` for CPU time). Timed
    inside the measured steps, so it is slowed by the machine's load exactly as they are, unlike a
    best-of-N throughput: the part of capture's overhead that is the digest's arithmetic, and with
    it the rest (hooks, records, copies, the flush). On a GPU the level functions are
    asynchronous: there this is only their host (launch) time. Imports ``detfp_capture`` (and
    torch)."""
    total = [0.0]

    def timed(inner: Any) -> Any:
        def fn(*args: Any, **kwargs: Any) -> Any:
            t0 = clock()
            try:
                return inner(*args, **kwargs)
            finally:
                total[0] += clock() - t0

        return fn

    try:  # the level functions are the capture's privates
        from detfp_capture._digest import versions
    except ImportError:  # a baseline tree from before digest versions (--baseline): one GEMM, core.mm
        from detfp_capture._digest import core

        core.mm = timed(core.mm)  # the module's own callers (lanes_of, tree, mm_short) look it up there
        return total
    for sch in versions.SCHEMES.values():
        # Instance attributes: every caller (the tree, batches, staging, arenas) calls sch.mm.
        sch.mm, sch.mm_short = timed(sch.mm), timed(sch.mm_short)
    return total


def tree_seconds() -> float:
    """Seconds this process spent in the digest kernel's whole-tree function at record time (the
    native record path's route on CPU at version 2, ``_recorder/roots.py``): the rest of the
    digest's arithmetic beside ``time_gemms``'s level functions, by the wall clock. 0 where the
    tree has none (a tree without the native record path, a baseline, ``DETFP_NATIVE=0``)."""
    try:
        from detfp_capture._recorder import _hostpath  # type: ignore[attr-defined]
    except ImportError:
        return 0.0
    stats = getattr(_hostpath, "root_stats", None)
    return float(stats()[2]) if stats is not None else 0.0


def wait_for_writer(session: Any, timeout: float = 60.0, poll: float = 0.001) -> None:
    """Wait until ``session``'s writer thread has written (or dropped) every window handed to it,
    at most ``timeout`` seconds, so the writer does not compete with what is timed next. The
    writer is the Session's private: the benchmarks' own accounting (a tree without it cannot
    be measured); a session without one (no capture) returns at once."""
    writer = getattr(session, "_writer", None)
    deadline = time.monotonic() + timeout
    while writer is not None and time.monotonic() < deadline:
        if writer.windows_written + writer.dropped_windows >= writer.windows_queued:
            return
        time.sleep(poll)


def import_tree(tree: Path, package: str = "detfp_capture") -> None:
    """Import ``package`` from ``tree`` (a checkout's root, put ahead of the installed packages on
    this process's path: a baseline measured side by side) and check that it came from there."""
    sys.path.insert(0, str(tree))
    import importlib

    got = Path(importlib.import_module(package).__file__ or "").resolve().parents[1]
    if got != tree.resolve():
        raise SystemExit(f"imported {package} from {got}, expected {tree}")


def side_by_side_arguments(p: Any, levels: Sequence[str], rounds: int) -> None:
    """The arguments every side-by-side benchmark takes (``argparse`` parser ``p``): ``--baseline``,
    ``--levels``, ``--rounds``, and the hidden ``--child``/``--tree``/``--level`` of its children."""
    import argparse

    p.add_argument("--baseline", type=Path, help="another worktree of detfp to compare against")
    p.add_argument("--levels", default=",".join(levels), help="comma-separated subset of " + ",".join(levels))
    p.add_argument("--rounds", type=int, default=rounds, help="child processes per (tree, level), interleaved")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--tree", help=argparse.SUPPRESS)
    p.add_argument("--level", help=argparse.SUPPRESS)


def _parse_levels(text: str, allowed: Sequence[str]) -> list[str]:
    """``--levels``: a comma-separated subset of ``allowed``. Raises ValueError otherwise."""
    levels = [x.strip() for x in text.split(",") if x.strip()]
    if not levels or set(levels) - set(allowed):
        raise ValueError(f"--levels: choose from {', '.join(allowed)}")
    return levels


def _trees(baseline: Path | None) -> dict[str, Path]:
    """The trees a side-by-side benchmark measures: ``{"after": ROOT}``, with ``"before"`` first
    when ``--baseline`` names another checkout. Raises ValueError when it is not one."""
    if baseline is None:
        return {"after": ROOT}
    if not (baseline / "detfp_capture" / "__init__.py").is_file():
        raise ValueError(f"--baseline {baseline}: not a detfp tree (no detfp_capture/__init__.py)")
    return {"before": baseline.resolve(), "after": ROOT}


def _tree_child(script: str, tree: Path, level: str, options: Mapping[str, Any]) -> dict:
    """Run ``script --child --tree TREE --level LEVEL --k v ...`` (its child mode, which imports
    the tree's packages with ``import_tree``) and return the JSON object it printed last."""
    cmd = [sys.executable, str(Path(script).resolve()), "--child", "--tree", str(tree), "--level", level]
    for k, v in options.items():
        cmd += [f"--{k}", str(v)]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if out.returncode != 0:
        raise SystemExit(f"{Path(script).stem}: child for {tree} at {level} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_side_by_side(
    p: Any, args: Any, allowed: Sequence[str], script: str, options: Mapping[str, Any]
) -> tuple[dict[str, Path], list[str], dict[tuple[str, str], list[dict]]]:
    """A side-by-side benchmark's parent (arguments of ``side_by_side_arguments``; ``p.error`` on a
    bad one): its trees, its levels, and per (side, level) the JSON of each round's child."""
    try:
        levels = _parse_levels(args.levels, allowed)
        sides = _trees(args.baseline)
    except ValueError as exc:
        p.error(str(exc))
    jobs = [(side, lv) for side in sides for lv in levels]
    got = _interleaved(jobs, args.rounds, lambda side, lv: _tree_child(script, sides[side], lv, options))
    return sides, levels, got


def _interleaved(jobs: Sequence[tuple[str, str]], rounds: int, run: Any) -> dict[tuple[str, str], list[dict]]:
    """``run(side, level)`` for every job, ``rounds`` times, in a shuffled order per round (fixed
    seed): a load change on a shared machine hits every job alike."""
    import random

    got: dict[tuple[str, str], list[dict]] = {j: [] for j in jobs}
    rng = random.Random(0)
    for r in range(rounds):
        order = list(jobs)
        rng.shuffle(order)
        for side, level in order:
            got[(side, level)].append(run(side, level))
        print(f"round {r + 1}/{rounds} done", file=sys.stderr)
    return got
