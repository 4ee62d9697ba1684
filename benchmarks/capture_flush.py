"""The capture's flush on its own: milliseconds per flush of the records of a few training steps.

A flush (docs/capture.md, "Performance guidance") runs on the training thread: it starts the
digests still waiting for a batch, resolves every pending digest (one finalize and one
device-to-host copy per device), builds the columns of each table and hands the window to the
writer thread. ``capture_overhead.py`` charges it to the amortized step time, where it is a few
percent and lost in the noise of interleaved processes; here it is timed alone, in one process:
``--steps`` steps of the example model (examples/train_tiny.py) are captured without a flush,
the writer is drained (so its thread does not compete for the interpreter lock), and then one
flush is timed, by the wall clock and by the training thread's CPU time (the second is what a
shared machine disturbs least). Repeated ``--flushes`` times; reported: the median and range of
the flush, per flush and per captured step, and the records per flush.

Most of a flush at level ops is the digest GEMMs of the tensors still waiting for a batch (the
staged snapshots), which are memory-bound and noisy on a shared machine. ``--after-batches``
runs those untimed first, so the timed part is what follows them: finalizing and fetching the
digests, turning them into the columns, handing the window to the writer (the Python side).

    .venv/bin/python benchmarks/capture_flush.py [--level ops] [--steps 4] [--flushes 15]
    .venv/bin/python benchmarks/capture_flush.py --after-batches   # resolve + columns only
    .venv/bin/python benchmarks/capture_flush.py --profile         # where a flush spends its time
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import tempfile
import time
from pathlib import Path

import torch

import benchlib
from capture_overhead import SHAPES, Runner, load_example  # the same model and step (this folder)


def _drain(runner: Runner) -> None:
    """Wait until the writer thread has written every window handed to it."""
    benchlib.wait_for_writer(runner.session, poll=0.002)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--level", default="ops", choices=("metrics", "boundaries", "ops"))
    p.add_argument("--steps", type=int, default=4, help="captured steps per flush")
    p.add_argument("--flushes", type=int, default=15, help="timed flushes")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps and one flush first")
    p.add_argument("--threads", type=int, default=1)
    for name, default in SHAPES["tiny"].items():  # the example model's shape, as capture_overhead.py has it
        p.add_argument(f"--{name}", type=int, default=default, help=f"model {name} (default {default})")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--device", default="cpu")
    p.add_argument("--after-batches", action="store_true", help="run the waiting digest batches untimed first")
    p.add_argument("--profile", action="store_true", help="cProfile the timed flushes")
    p.set_defaults(model="tiny")  # capture_overhead.Runner's model: the example's
    args = p.parse_args(argv)
    print(benchlib.machine_line(), flush=True)
    torch.set_num_threads(args.threads)
    tt = load_example()
    times: list[float] = []
    cpu: list[float] = []
    records: list[int] = []
    prof = cProfile.Profile() if args.profile else None
    with tempfile.TemporaryDirectory(prefix="detfp-flush-") as tmp:
        runner = Runner(tt, args.level, args, Path(tmp))
        try:
            for _ in range(args.warmup):
                runner.step()
            runner.flush()
            _drain(runner)
            for _ in range(args.flushes):
                for _ in range(args.steps):
                    runner.step()
                _drain(runner)
                rec = runner.session._rec  # private: the benchmark's own accounting
                records.append(len(rec.records))
                if args.after_batches:
                    rec.enter()  # the tracer's busy state, as the flush itself holds it
                    try:
                        rec.run_deferred(staging=True)
                    finally:
                        rec.leave()
                if prof is not None:
                    prof.enable()
                c0, t0 = time.thread_time(), time.perf_counter()
                runner.session._flush_safely()  # private: the benchmark's own accounting
                times.append(time.perf_counter() - t0)
                cpu.append(time.thread_time() - c0)
                if prof is not None:
                    prof.disable()
        finally:
            runner.close()
    what = "flush after the digest batches" if args.after_batches else "flush"
    print(
        f"level {args.level}: {args.flushes} timed runs ({what}) of {args.steps} steps each "
        f"(~{statistics.median(records)} records per flush; example width {args.width}, batch {args.batch} x seq {args.seq})"
    )
    for label, xs in (("wall", times), ("thread cpu", cpu)):
        m = statistics.median(xs)
        print(
            f"{what}, {label}: {m * 1e3:.2f} ms (range {min(xs) * 1e3:.2f}-{max(xs) * 1e3:.2f}); "
            f"per captured step {m / args.steps * 1e3:.3f} ms; per record {m / statistics.median(records) * 1e6:.2f} us"
        )
    if prof is not None:
        buf = io.StringIO()
        stats = pstats.Stats(prof, stream=buf)
        stats.sort_stats("cumulative").print_stats(25)
        stats.sort_stats("tottime").print_stats(15)
        print(buf.getvalue())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
