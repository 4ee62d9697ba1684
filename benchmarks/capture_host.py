"""Capture's host cost per record (microseconds), this tree against a baseline tree, in one run.

Host cost per record is what capture costs beyond the digest's arithmetic: the hooks and the
dispatch mode, building records and call keys, argument digests, snapshot copies, the flush
(resolving digests, building columns) and the writer thread's work (key hashes, Arrow, Parquet).
It is measured on the GPT-2-shaped decoder of ``gpt2_shaped.py`` (the module tree and op
sequence of the gated row of ``capture_overhead.py``, so the same records per step) with tiny
tensors (width 16, sequence 8, batch 2 by default): every tensor is a few hundred bytes, so the
digest's GEMMs (and its record-time tree function) are a small remainder, timed in the same steps
and taken off (``benchlib.time_gemms``, ``benchlib.tree_seconds``).

Each measurement is a child process (its own heap, its own garbage collector) that imports
``detfp_capture`` from one tree, builds two copies of the model (same seed), one watched by a
``Session`` at the level measured and one not, and alternates blocks of ``--steps`` steps:
a captured block (its steps, then a flush, then waiting until the writer thread has written the
window: the whole cost of those records) and a plain block. Per pair of blocks:

    host us/record = (captured block - plain block - GEMM time in the block) / records in the block

on the process's CPU time (every thread, so the writer thread counts; less sensitive to the
other processes of a shared machine than the wall clock, which is printed next to it). The child
reports the median over its block pairs. The parent runs the children of both trees and both
levels interleaved, in a shuffled order per round (``--rounds``), and prints the median over
rounds: before (baseline), after (this tree) and after/before, at ``boundaries`` and ``ops``.

    .venv/bin/python benchmarks/capture_host.py --baseline /path/to/other/worktree
    .venv/bin/python benchmarks/capture_host.py                 # this tree only
    .venv/bin/python benchmarks/capture_host.py --profile ops   # cProfile of this tree's captured steps

The baseline tree is only imported (its ``detfp_capture``); the model, the data and this script
come from this tree, so both sides run exactly the same training (the children use the
Session's private ``_flush_safely`` and ``_writer``, as ``capture_overhead.py`` does: a tree
without them cannot be a baseline). A baseline checkout of any commit:

    git worktree add --detach /tmp/detfp-base <commit>
    .venv/bin/python benchmarks/capture_host.py --baseline /tmp/detfp-base
    git worktree remove --force /tmp/detfp-base

On a shared machine the children's figures scatter by +-20% (one child against the next, same
tree): compare medians over several rounds, and read a ratio between 0.9x and 1.1x as no change.
``docs/measurements/capture-host-cost.md`` has the figures and where the microseconds go.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

import benchlib
from benchlib import ROOT

LEVELS = ("boundaries", "ops")
#: The tiny shape: the gpt2 row's module tree and ops, with tensors of a few hundred bytes.
SHAPE = {"vocab": 32, "width": 16, "layers": 4, "heads": 2, "seq": 8, "batch": 2}


# ----------------------------------------------------------------------------- child
class Trainer:
    """One copy of the model, its optimizer and data; ``session`` None: no capture."""

    def __init__(self, args, session) -> None:
        import torch

        from gpt2_shaped import GPT2Shaped  # benchmarks/ is this script's sys.path[0]

        torch.manual_seed(args.seed)
        self.model = GPT2Shaped(args.vocab, args.width, args.layers, args.heads, args.seq)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.gen = torch.Generator().manual_seed(args.seed)
        self.args = args
        self.session = session
        if session is not None:
            session.watch(self.model)
            session.watch_optimizer(self.opt)
        self.n = 0

    def step(self) -> None:
        import contextlib

        import torch
        import torch.nn.functional as F

        a = self.args
        s = self.session
        with s.step(self.n) if s is not None else contextlib.nullcontext():
            tokens = torch.randint(0, a.vocab, (a.batch, a.seq + 1), generator=self.gen)
            logits = self.model(tokens[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
            if s is not None:
                s.metric("loss", loss)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        self.n += 1

    def settle(self) -> None:
        """Flush what capture buffered and wait for the writer thread to write it."""
        s = self.session
        if s is None:
            return
        s._flush_safely()  # private: the benchmark's own accounting (as capture_overhead.py)
        benchlib.wait_for_writer(s, poll=0.0005)


def _records_per_step(run: Path, steps: set[int]) -> float:
    import pyarrow.parquet as pq

    n = 0
    for f in sorted((run / "records").rglob("*.parquet")):
        col = pq.read_table(f, columns=["step"], partitioning=None).column("step").to_pylist()
        n += sum(1 for s in col if s in steps)
    return n / len(steps)


def child(args) -> dict:
    """Blocks of captured and plain steps in this process; the medians per record."""
    benchlib.import_tree(Path(args.tree))
    import torch

    from detfp_capture import Session, _config
    from detfp_capture._sources import steps as _steps

    # Record-count flushes only: a tree before issue 43 also flushed a window 20 s old,
    # this one a window of FLUSH_STEPS steps (either tree may be the one measured).
    _steps.FLUSH_SECONDS = float("inf")
    _config.FLUSH_STEPS = 1 << 62
    torch.set_num_threads(1)
    gemm = benchlib.time_gemms(time.process_time)  # host cost is CPU time here
    with tempfile.TemporaryDirectory(prefix="detfp-host-") as tmp:
        run = Path(tmp) / "run"
        session = Session(str(run), level=args.level)
        cap, plain = Trainer(args, session), Trainer(args, None)
        for _ in range(args.warmup):
            cap.step()
            plain.step()
        cap.settle()
        timed: set[int] = set()
        pairs = []
        for b in range(args.blocks):
            g0 = gemm[0] + benchlib.tree_seconds()
            c0, w0 = time.process_time(), time.perf_counter()
            for _ in range(args.steps):
                timed.add(cap.n)
                cap.step()
            cap.settle()
            c1, w1 = time.process_time(), time.perf_counter()
            g = gemm[0] + benchlib.tree_seconds() - g0  # (the tree's time: wall clock, one thread's CPU)
            for _ in range(args.steps):
                plain.step()
            c2, w2 = time.process_time(), time.perf_counter()
            pairs.append(((c1 - c0) - (c2 - c1) - g, (w1 - w0) - (w2 - w1) - g, g))
            if b == 0 and args.profile_out:
                break
        session.close()
        records = _records_per_step(run, timed)
    n = records * args.steps
    return {
        "tree": args.tree,
        "level": args.level,
        "records_per_step": records,
        "cpu_us_per_record": statistics.median(p[0] for p in pairs) / n * 1e6,
        "wall_us_per_record": statistics.median(p[1] for p in pairs) / n * 1e6,
        "gemm_us_per_record": statistics.median(p[2] for p in pairs) / n * 1e6,
    }


def profile(args) -> None:
    """cProfile the captured steps of this tree (flush and writer wait included)."""
    benchlib.import_tree(ROOT)
    import torch

    from detfp_capture import Session, _config
    from detfp_capture._sources import steps as _steps

    # Record-count flushes only: a tree before issue 43 also flushed a window 20 s old,
    # this one a window of FLUSH_STEPS steps (either tree may be the one measured).
    _steps.FLUSH_SECONDS = float("inf")
    _config.FLUSH_STEPS = 1 << 62
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="detfp-host-") as tmp:
        session = Session(str(Path(tmp) / "run"), level=args.profile)
        cap = Trainer(args, session)
        for _ in range(args.warmup):
            cap.step()
        cap.settle()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.steps):
            cap.step()
        cap.settle()
        prof.disable()
        session.close()
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf)
    stats.sort_stats("tottime").print_stats(35)
    stats.sort_stats("cumulative").print_stats("detfp_capture", 30)
    print(buf.getvalue())


# ----------------------------------------------------------------------------- parent
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    benchlib.side_by_side_arguments(p, LEVELS, rounds=5)
    p.add_argument("--blocks", type=int, default=5, help="captured/plain block pairs per child")
    p.add_argument("--steps", type=int, default=4, help="steps per block")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per model first")
    p.add_argument("--seed", type=int, default=1234)
    for k, v in SHAPE.items():
        p.add_argument(f"--{k}", type=int, default=v, help=f"model {k} (default {v})")
    p.add_argument("--profile", choices=LEVELS, help="cProfile this tree's captured steps at this level instead")
    p.add_argument("--json", help="also write the results to this JSON file")
    p.add_argument("--profile-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return 0
    print(benchlib.machine_line(), flush=True)
    if args.profile:
        profile(args)
        return 0
    options = {k: getattr(args, k) for k in ("steps", "blocks", "warmup", "seed", *SHAPE)}
    trees, levels, got = benchlib.run_side_by_side(p, args, LEVELS, __file__, options)
    shape = ", ".join(f"{k} {getattr(args, k)}" for k in SHAPE)
    print(
        f"host cost per record (CPU time of all threads, digest GEMMs taken off; median of {args.rounds} interleaved "
        f"child processes x median of {args.blocks} blocks of {args.steps} steps); gpt2-shaped, {shape}"
    )
    head = f"{'level':<12}{'records/step':>13}" + "".join(f"{s + ' us/rec':>16}" for s in trees)
    print(head + ("" if len(trees) == 1 else f"{'after/before':>14}") + f"{'(wall us/rec)':>22}")
    results: dict = {"shape": {k: getattr(args, k) for k in SHAPE}, "levels": {}}
    for lv in levels:
        med = {s: statistics.median(x["cpu_us_per_record"] for x in got[(s, lv)]) for s in trees}
        wall = {s: statistics.median(x["wall_us_per_record"] for x in got[(s, lv)]) for s in trees}
        recs = {s: got[(s, lv)][0]["records_per_step"] for s in trees}
        line = f"{lv:<12}{recs['after']:>13.0f}" + "".join(f"{med[s]:>16.1f}" for s in trees)
        if len(trees) > 1:
            line += f"{med['after'] / med['before']:>13.2f}x"
        line += "   " + " / ".join(f"{wall[s]:.1f}" for s in trees)
        print(line)
        if len(set(recs.values())) > 1:
            print(f"  note: records per step differ between the trees: {recs}")
        results["levels"][lv] = {
            s: {
                "cpu_us_per_record": med[s],
                "wall_us_per_record": wall[s],
                "records_per_step": recs[s],
                "runs": got[(s, lv)],
            }
            for s in trees
        }
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
