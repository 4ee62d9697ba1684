"""The cyclic collector's work that capture brings on, this tree against a baseline tree, in one run.

Capture holds a window of records until its flush. Whatever of that is tracked by Python's cyclic
collector counts toward its young collections, and what lives through two of them is promoted to
the oldest generation, where it adds to the count that triggers a *full* collection: a pass over
every object of the process (the model, torch, the user's data), tens of milliseconds here and
seconds on a large job's heap. A training step alone here allocates no net tracked objects and
triggers no collection at all; so every collection counted below is capture's doing, including
the promotion of the step's own tensors when a young collection falls inside the step.

Each child process imports ``detfp_capture`` from one tree and trains the gpt2-shaped decoder of
``capture_host.py`` (its tiny shape: a few hundred bytes per tensor) under a ``Session`` at one
level (``none``: no session) for ``--steps`` steps after a warm-up and one full collection, with a
flush every ``--window`` steps (a window of records held at once, as the session's own 20-second
flushes hold on a real job). A ``gc.callbacks`` hook counts the collections by generation and the
time spent in them. The user's collector settings are never touched. The parent runs the children
of both trees interleaved (``--rounds``) and prints, per level, the medians per 100 steps:
collections by generation, the full collections, and the milliseconds in the collector, then
after/before for the milliseconds.

    .venv/bin/python benchmarks/capture_gc.py --baseline /path/to/other/worktree
    .venv/bin/python benchmarks/capture_gc.py --levels none,ops --steps 600
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

import benchlib

LEVELS = ("none", "boundaries", "ops")


def child(args) -> dict:
    benchlib.import_tree(Path(args.tree))
    import torch

    from capture_host import SHAPE, Trainer
    from detfp_capture import Session, _config
    from detfp_capture._sources import steps as _steps

    # Record-count flushes only: a tree before issue 43 also flushed a window 20 s old,
    # this one a window of FLUSH_STEPS steps (either tree may be the one measured).
    _steps.FLUSH_SECONDS = float("inf")
    _config.FLUSH_STEPS = 1 << 62
    torch.set_num_threads(1)
    targs = types.SimpleNamespace(seed=args.seed, steps=args.window, **SHAPE)
    count = [0, 0, 0]
    spent = [0.0, 0.0, 0.0]
    began = [0.0]

    def hook(phase: str, info: dict) -> None:
        if phase == "start":
            began[0] = time.perf_counter()
        else:
            g = info["generation"]
            count[g] += 1
            spent[g] += time.perf_counter() - began[0]

    with tempfile.TemporaryDirectory(prefix="detfp-gc-") as tmp:
        session = None if args.level == "none" else Session(str(Path(tmp) / "run"), level=args.level)
        trainer = Trainer(targs, session)
        for _ in range(args.warmup):
            trainer.step()
        trainer.settle()
        gc.collect()  # start from an empty young generation and no pending promotions
        gc.callbacks.append(hook)
        try:
            for i in range(args.steps):
                trainer.step()
                if (i + 1) % args.window == 0:
                    trainer.settle()
            trainer.settle()
        finally:
            gc.callbacks.remove(hook)
        if session is not None:
            session.close()
    per100 = 100.0 / args.steps
    return {
        "level": args.level,
        "collections": [c * per100 for c in count],
        "ms": [s * 1e3 * per100 for s in spent],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    benchlib.side_by_side_arguments(p, LEVELS, rounds=3)
    p.add_argument("--steps", type=int, default=400, help="counted steps per child")
    p.add_argument("--window", type=int, default=20, help="steps per flush window")
    p.add_argument("--warmup", type=int, default=6)
    p.add_argument("--seed", type=int, default=1234)
    args = p.parse_args(argv)
    if args.steps < 1 or args.window < 1:
        p.error("--steps and --window must be at least 1")
    if args.child:
        print(json.dumps(child(args)))
        return 0
    print(benchlib.machine_line(), flush=True)
    options = {k: getattr(args, k) for k in ("steps", "window", "warmup", "seed")}
    trees, levels, got = benchlib.run_side_by_side(p, args, LEVELS, __file__, options)
    print(
        f"cyclic collector per 100 steps (median of {args.rounds} interleaved child processes, {args.steps} steps "
        f"each, a flush every {args.window} steps); collections of generation 0/1/2 and ms in the collector"
    )
    print(
        f"{'level':<12}"
        + "".join(f"{s + ' gen0/1/2':>22}{s + ' ms':>14}" for s in trees)
        + ("" if len(trees) == 1 else f"{'ms after/before':>18}")
    )
    for lv in levels:
        line = f"{lv:<12}"
        ms = {}
        for s in trees:
            runs = got[(s, lv)]
            gens = [statistics.median(r["collections"][g] for r in runs) for g in range(3)]
            ms[s] = statistics.median(sum(r["ms"]) for r in runs)
            line += f"{'/'.join(f'{g:.1f}' for g in gens):>22}{ms[s]:>14.1f}"
        if len(trees) > 1:
            line += f"{ms['after'] / ms['before']:>17.2f}x" if ms["before"] > 0 else f"{'-':>18}"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
