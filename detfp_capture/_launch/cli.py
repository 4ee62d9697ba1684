"""``python -m detfp_capture --out DIR --level L [options] -- train.py ARGS``: capture without code changes.

The launcher opens a ``Session`` before the training script runs, switches it to automatic
mode (``autosteps.AutoSteps``: global module forward hooks name modules from the root module of each
forward; global optimizer step hooks count steps: step ``--start-step`` (default 0) begins at
the first forward, collective or optimizer step after launch, and each ``optimizer.step()`` of
the first optimizer that steps ends one step; the next begins at the next such forward; DDP
models get the recording comm hook on their first forward), then runs the script with
``runpy`` and ``sys.argv`` set as if it had been started directly. Works under ``torchrun``
(``torchrun ... -m detfp_capture --out DIR -- train.py``): each rank reads RANK/WORLD_SIZE.
Without RANK the session opens its part of the run directory once its process group says its
rank (``_placement``), and a framework's re-execution of the script (Lightning's DDP launcher)
runs through the launcher too, ``--followed`` (``children.py``). The Session is the public one;
the launcher takes part in it through its extension point (``mode.LaunchMode``).
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys

from detfp_capture._config import LEVELS
from detfp_capture.errors import CaptureError
from detfp_format.contract import DIGEST_VERSION, DIGEST_VERSIONS

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m detfp_capture",
        description="Run a PyTorch training script with detfp capture on, without changing its code.",
        epilog="Everything after '--' is the script (or '-m module') and its arguments.",
    )
    p.add_argument("--out", required=True, help="run directory (shared by all ranks)")
    p.add_argument("--level", default="metrics", choices=LEVELS, help="capture depth (default: metrics)")
    p.add_argument(
        "--start-step", type=int, default=0, help="number of the first step (a resumed run's checkpoint step)"
    )
    p.add_argument("--steps", default=None, help="steps to capture, e.g. '3-5,9' (default all)")
    p.add_argument("--ranks", default=None, help="ranks that capture, e.g. '0,4-7' (default all)")
    p.add_argument("--modules", default=None, help="regex of module paths to record (default all)")
    p.add_argument("--rows", default=None, help="row digests: 'all', a chunk size, or a regex of record names/modules")
    p.add_argument("--moments", default=None, help="moments: 'all' or a regex of record names/modules")
    p.add_argument("--dumps", default=None, help="regex of record names/modules to dump as raw bytes")
    p.add_argument("--kernels", default=None, help="steps whose kernels are recorded (level ops), e.g. '2'")
    p.add_argument("--poison", action="store_true", help="fill empty* allocations with a per-run pattern (level ops)")
    p.add_argument("--append", action="store_true", help="continue an existing run directory as a new segment")
    p.add_argument(
        "--overwrite", action="store_true", help="replace an earlier run in --out (refused if it is not a detfp run)"
    )
    p.add_argument("--flush-records", type=int, default=65536, help="records per flush window")
    p.add_argument(
        "--flush-steps",
        type=int,
        default=None,
        help="steps per flush window, at most (default 50; 1: commit every step)",
    )
    p.add_argument("--views", action="store_true", help="also digest view and metadata-only ops")
    # Set by the launcher on a re-execution of the script it follows (children.py): the process's
    # rank is its process group's, whatever its environment says.
    p.add_argument("--followed", action="store_true", help=argparse.SUPPRESS)
    p.add_argument(
        "--digest-version",
        type=int,
        default=None,
        choices=sorted(DIGEST_VERSIONS),
        help=f"digest version (default {DIGEST_VERSION}; 1 to compare with runs captured with version 1)",
    )
    return p


def followed_options(ns: argparse.Namespace) -> list[str]:
    """The options of a process this launch follows: its own, ``--out`` made absolute (a
    framework may start it elsewhere), and ``--followed``."""
    out = ["--out", os.path.abspath(ns.out), "--level", ns.level, "--start-step", str(ns.start_step)]
    out += ["--flush-records", str(ns.flush_records)]
    if ns.flush_steps is not None:
        out += ["--flush-steps", str(ns.flush_steps)]
    if ns.digest_version is not None:
        out += ["--digest-version", str(ns.digest_version)]
    for flag, value in (
        ("--steps", ns.steps),
        ("--ranks", ns.ranks),
        ("--modules", ns.modules),
        ("--rows", ns.rows),
        ("--moments", ns.moments),
        ("--dumps", ns.dumps),
        ("--kernels", ns.kernels),
    ):
        if value is not None:
            out += [flag, value]
    for flag, on in (
        ("--poison", ns.poison),
        ("--append", ns.append),
        ("--overwrite", ns.overwrite),
        ("--views", ns.views),
    ):
        if on:
            out.append(flag)
    return [*out, "--followed"]


def _opt(value: str | None) -> object:
    if value is None:
        return False
    if value.lower() in ("all", "true", "1", "yes"):
        return True
    if value.isdigit():
        return int(value)
    return value


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" in argv:
        i = argv.index("--")
        ours, target = argv[:i], argv[i + 1 :]
    else:
        ours, target = argv, []
    parser = build_parser()
    ns = parser.parse_args(ours)
    if not target:
        parser.error("no training script: put it after '--', e.g. python -m detfp_capture --out traces/a -- train.py")
    if target[0] == "-m" and len(target) < 2:
        parser.error("'-m' needs a module name")
    # No RANK: a framework may make this process one rank of several and start the others
    # (Lightning's DDP launcher): the rank is learned from the process group (_placement), and
    # re-executions of the script are followed (children.py). Before anything starts, a run
    # directory another launch wrote into is refused here, as prepare_run_dir refuses a rank's.
    top = "RANK" not in os.environ and not ns.followed
    from detfp_format.rundir import held_ranks

    if top and not (ns.append or ns.overwrite) and held_ranks(ns.out):
        print(
            f"detfp_capture: error: {ns.out}: already holds a trace (ranks {held_ranks(ns.out)}); choose a new run "
            "directory, pass --overwrite to replace it, or --append to continue it as a resumed run",
            file=sys.stderr,
        )
        return 2
    from detfp_capture._launch.children import Children
    from detfp_capture._launch.mode import LaunchMode
    from detfp_capture.errors import LaunchRefusedError
    from detfp_capture.session import Session

    moments = _opt(ns.moments)
    try:
        mode = LaunchMode(followed=ns.followed)
        session = Session(
            extension=mode,
            out_dir=ns.out,
            level=ns.level,
            steps=ns.steps,
            ranks=ns.ranks,
            modules=ns.modules,
            rows=_opt(ns.rows),
            moments=moments if not isinstance(moments, int) or isinstance(moments, bool) else True,
            dumps=ns.dumps,
            kernels=ns.kernels,
            poison=ns.poison,
            append=ns.append,
            overwrite=ns.overwrite,
            flush_records=ns.flush_records,
            flush_steps=ns.flush_steps,
            views=ns.views,
            start_step=ns.start_step,
            digest_version=ns.digest_version,
        )
    except CaptureError as exc:
        print(f"detfp_capture: error: {exc}", file=sys.stderr)
        return 2
    children = Children(followed_options(ns), target, mode.started_ranks)
    children.install(follow=top)
    code = 0
    try:
        if target[0] == "-m":
            sys.argv = [target[1], *target[2:]]
            runpy.run_module(target[1], run_name="__main__", alter_sys=True)
        else:
            script = target[0]
            sys.argv = [script, *target[1:]]
            sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
            runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except LaunchRefusedError as exc:
        print(f"detfp_capture: error: {exc}", file=sys.stderr)
        mode.started_ranks()  # it tried to: no trace part for this process unless it is a rank
        code = 2
    finally:
        children.restore()
        session.close()
    if code == 0:
        children.wait()
    return code
