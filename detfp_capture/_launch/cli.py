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

from detfp_capture import _options
from detfp_capture.errors import CaptureError

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m detfp_capture",
        description="Run a PyTorch training script with detfp capture on, without changing its code.",
        epilog="Everything after '--' is the script (or '-m module') and its arguments.",
    )
    p.add_argument("--out", required=True, help="run directory (shared by all ranks)")
    # Every capture option a command line can give, its flag, type, default and help from
    # CaptureOptions (the Session's options: _options.py).
    _options.add_arguments(p)
    # Set by the launcher on a re-execution of the script it follows (children.py): the process's
    # rank is its process group's, whatever its environment says.
    p.add_argument("--followed", action="store_true", help=argparse.SUPPRESS)
    return p


def followed_options(ns: argparse.Namespace) -> list[str]:
    """The options of a process this launch follows: its own, ``--out`` made absolute (a
    framework may start it elsewhere), and ``--followed``."""
    return ["--out", os.path.abspath(ns.out), *_options.to_argv(ns), "--followed"]


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

    try:
        mode = LaunchMode(followed=ns.followed)
        session = Session(ns.out, extension=mode, **_options.from_args(ns))
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
