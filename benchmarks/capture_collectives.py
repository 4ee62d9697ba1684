"""Capture's host cost per collective (microseconds), this tree against a baseline tree, in one run.

What a recorded collective costs the training thread beyond the collective itself: at level
``boundaries`` capture wraps every call (this tree: the ProcessGroup method it ends in, the
public name read from the calling frames, a ``Work`` of its own whose wait records the outputs;
before: a Python wrapper per public name), records its inputs and outputs, and the flush and the
writer thread take their share. Measured on a one-rank gloo group in a child process per
(tree, level), so the collectives cost little and capture's work is most of the difference:
each step runs ``--calls`` rounds of six collectives the way training code calls them
(``all_reduce``, ``all_gather_into_tensor``, ``reduce_scatter_tensor``, ``broadcast``, an async
``all_reduce`` waited for, and a block of two all-reduces in the coalescing manager) on small
tensors (``--numel`` floats), captured blocks of ``--steps`` steps alternating with plain ones:

    host us/collective = (captured block - plain block) / collectives in the block

on the process's CPU time (the writer thread counts; the wall clock is printed next to it). A
coalesced block counts as one collective (one record: what its exit launches; the baseline
recorded two, digested before they ran). The parent runs the children of both trees interleaved in
a shuffled order per round (``--rounds``) and prints the medians and after/before.

    .venv/bin/python benchmarks/capture_collectives.py --baseline /path/to/other/worktree
    .venv/bin/python benchmarks/capture_collectives.py          # this tree only

On a shared machine children scatter by +-20%: read a ratio between 0.9x and 1.1x as no change.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import benchlib

LEVELS = ("boundaries", "ops")
#: Collectives per round of ``step`` (a coalesced block counts once).
PER_ROUND = 6


def step(calls: int, numel: int) -> None:
    """``calls`` rounds of the six collectives, on fresh small tensors."""
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    for _ in range(calls):
        t = torch.ones(numel)
        dist.all_reduce(t)
        dist.all_gather_into_tensor(torch.empty(numel), t)
        dist.reduce_scatter_tensor(torch.empty(numel), t)
        dist.broadcast(t, 0)
        dist.all_reduce(t, async_op=True).wait()
        u = torch.ones(numel)
        with c10d._coalescing_manager():
            dist.all_reduce(t)
            dist.all_reduce(u)


def child(args) -> dict:
    """Blocks of captured and plain steps in this process; the medians per collective."""
    benchlib.import_tree(Path(args.tree))
    import warnings

    import torch
    import torch.distributed as dist

    from detfp_capture import Session
    from detfp_capture._sources import steps as _steps

    warnings.simplefilter("ignore")  # torch's deprecation warnings of the legacy names
    _steps.FLUSH_SECONDS = float("inf")  # flushes where a block ends
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="detfp-coll-") as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=0, world_size=1)
        try:
            session = Session(str(Path(tmp) / "run"), level=args.level)
            n = [0]

            def captured() -> None:
                for _ in range(args.steps):
                    with session.step(n[0]):
                        step(args.calls, args.numel)
                    n[0] += 1
                session._flush_safely()  # private: the benchmark's own accounting (as capture_host.py)
                benchlib.wait_for_writer(session, poll=0.0005)

            def plain() -> None:
                for _ in range(args.steps):
                    step(args.calls, args.numel)

            for _ in range(args.warmup):
                captured()
                plain()
            per_cpu, per_wall = [], []
            collectives = args.steps * args.calls * PER_ROUND
            for _ in range(args.blocks):
                c0, w0 = time.process_time(), time.perf_counter()
                captured()
                c1, w1 = time.process_time(), time.perf_counter()
                plain()
                c2, w2 = time.process_time(), time.perf_counter()
                per_cpu.append(((c1 - c0) - (c2 - c1)) / collectives * 1e6)
                per_wall.append(((w1 - w0) - (w2 - w1)) / collectives * 1e6)
            session.close()
        finally:
            dist.destroy_process_group()
    return {"us": statistics.median(per_cpu), "wall_us": statistics.median(per_wall)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    benchlib.side_by_side_arguments(p, LEVELS, rounds=3)
    p.add_argument("--steps", type=int, default=10, help="steps per captured or plain block")
    p.add_argument("--calls", type=int, default=20, help="rounds of the six collectives per step")
    p.add_argument("--numel", type=int, default=256, help="floats per tensor")
    p.add_argument("--blocks", type=int, default=5, help="captured/plain block pairs per child")
    p.add_argument("--warmup", type=int, default=1)
    args = p.parse_args(argv)
    if min(args.steps, args.calls, args.numel, args.blocks) < 1:
        p.error("--steps, --calls, --numel and --blocks must be at least 1")
    if args.child:
        print(json.dumps(child(args)))
        return 0
    print(benchlib.machine_line(), flush=True)
    options = {k: getattr(args, k) for k in ("steps", "calls", "numel", "blocks", "warmup")}
    trees, levels, got = benchlib.run_side_by_side(p, args, LEVELS, __file__, options)
    print(
        f"host cost per collective, us of CPU time (median of {args.rounds} interleaved child processes; "
        f"{args.calls * PER_ROUND} collectives of {args.numel} floats per step, one-rank gloo)"
    )
    print(
        f"{'level':<12}"
        + "".join(f"{s + ' us':>14}{s + ' wall us':>16}" for s in trees)
        + ("" if len(trees) == 1 else f"{'after/before':>14}")
    )
    for lv in levels:
        line = f"{lv:<12}"
        us = {}
        for s in trees:
            runs = got[(s, lv)]
            us[s] = statistics.median(r["us"] for r in runs)
            line += f"{us[s]:>14.1f}{statistics.median(r['wall_us'] for r in runs):>16.1f}"
        if len(trees) > 1:
            line += f"{us['after'] / us['before']:>13.2f}x" if us["before"] > 0 else f"{'-':>14}"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
