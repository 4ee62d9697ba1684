"""Step-time overhead of detfp capture at each level, next to PyTorch's DebugMode, in one run.

Two models, each measured on its own: ``gpt2``, a GPT-2-shaped decoder (benchmarks/gpt2_shaped.py:
width 256, 4 layers, 4 heads, vocabulary 512, sequence 128, batch 8, AdamW), the gated row, where
"what does capture cost a training job" has a meaningful answer; and ``tiny``, the example model
(examples/train_tiny.py, a 33 ms step of ~1,600 ops), a reported row: there capture's Python cost
per record is held against the model's own Python cost per op, not against real work.

Every configuration trains its own copy of the model (same initial weights, same data) in its own
process, and the configurations take turns step by
step in a shuffled order per round, so machine noise (other processes, frequency scaling)
lands on all of them alike, while each pays for its own garbage collection. Reported: the
amortized step time of each configuration (the mean over its timed steps, the flush of the
records those steps buffered included: capture resolves digests in bulk every
``flush_records`` records, so a median step would leave that work out) and its ratio over no
capture; then the ratio of detfp's ops-level overhead to DebugMode's (DebugMode with
``log_tensor_hashes(hash_fn="hash_tensor", hash_inputs=True)``: one hash of every input and
output of every op, the closest thing PyTorch ships to an op-level fingerprint stream).

The whole measurement is repeated in fresh processes (``--trials``, default 3): the table gives
the median over trials and their range (on a shared machine the range is the honest error bar).

Then where the overhead goes, per captured level: the bytes digested per step (from the trace
the run wrote: every digested record's numel x element size), the time those bytes take at this
machine's ``clone()`` bandwidth (measured in the same run: the floor of any design that reads every
recorded byte once), the records per step (every record of the timed steps, those counted but not
digested included), the whole overhead per record, and the rest per record once the floor is
taken off (microseconds: hooks, bookkeeping, the flush, and the digest's arithmetic beyond one
read of its bytes; on a CPU that arithmetic is most of it at level boundaries, see ``--profile``).

The host cost per record alone (tiny tensors, so the digest's arithmetic is negligible), this tree
against another one side by side: ``benchmarks/capture_host.py --baseline <tree>``. The whole step
against another tree: ``--baseline <tree>`` adds ``<level>@base`` for every captured level, the
same configuration with the other tree's ``detfp_capture`` imported, interleaved step by step with
this tree's in the same run, and prints this tree's step time over the baseline's per level.

Targets (issue 31, on the gpt2 row): metrics < 1.02x, boundaries < 1.10x, ops overhead <= 0.30 of
DebugMode's. The capture levels use digest version 2 (the default); ``--with-v1`` adds the
levels boundaries and ops with digest version 1 (configs ``boundaries-v1``, ``ops-v1``),
interleaved in the same run, so the two versions' costs are compared under the same load (the
targets are checked on version 2).

    .venv/bin/python benchmarks/capture_overhead.py [--models gpt2,tiny] [--rounds 12] [--threads 1] [--with-v1]
    .venv/bin/python benchmarks/capture_overhead.py --device cuda --models gpt2 --width 2048 --seq 1024
    .venv/bin/python benchmarks/capture_overhead.py --profile ops --models gpt2   # where the time goes
    .venv/bin/python benchmarks/capture_overhead.py --baseline /tmp/detfp-base --configs metrics,boundaries
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import importlib.util
import io
import json
import os
import pstats
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import benchlib
from benchlib import ROOT

CONFIGS = ("none", "metrics", "boundaries", "ops", "debugmode")
#: Capture levels with digest version 1 (``--with-v1``): ``<level>-v1``.
V1_CONFIGS = ("boundaries-v1", "ops-v1")
CAPTURED = ("metrics", "boundaries", "ops", *V1_CONFIGS)
TARGETS = {"metrics": 1.02, "boundaries": 1.10}
OPS_SHARE = 0.30  # detfp's ops-level overhead over DebugMode's, at most
MODELS = ("gpt2", "tiny")
GATED = "gpt2"
#: Size of the clone() bandwidth measurement: (CPU, device), see ``clone_bandwidth``.
CLONE_MIB = (4, 256)
#: Shape of each model unless given on the command line.
SHAPES = {
    "gpt2": {"vocab": 512, "width": 256, "layers": 4, "heads": 4, "hidden": 1024, "seq": 128, "batch": 8},
    "tiny": {"vocab": 256, "width": 64, "layers": 2, "heads": 4, "hidden": 128, "seq": 32, "batch": 8},
}


def load_example():
    spec = importlib.util.spec_from_file_location("train_tiny", ROOT / "examples" / "train_tiny.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_tiny"] = module  # the example's custom op registration needs a stable module
    spec.loader.exec_module(module)
    return module


class Runner:
    """One configuration: a model copy, its optimizer and data, and how a step is wrapped."""

    def __init__(self, tt, config: str, args, out_root: Path) -> None:
        self.config = config
        self.device = torch.device(args.device)
        self.session = tt.NullSession()
        if config.split("@")[0] in CAPTURED:
            from detfp_capture import Session

            level, _, version = config.split("@")[0].partition("-v")
            options = {"digest_version": int(version)} if version else {}
            self.session = Session(str(out_root / config), level=level, **options)
        session = self.session
        torch.manual_seed(args.seed)
        self.gpt2 = args.model == "gpt2"
        if self.gpt2:
            from gpt2_shaped import GPT2Shaped

            self.model = GPT2Shaped(args.vocab, args.width, args.layers, args.heads, args.seq).to(self.device)
        else:
            probe = None if getattr(args, "no_probes", False) else (lambda name, t: session.probe(name, t))
            self.model = tt.TinyGPT(
                vocab=args.vocab,
                d=args.width,
                layers=args.layers,
                heads=args.heads,
                hidden=args.hidden,
                seq=args.seq,
                probe=probe,
            ).to(self.device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.data = tt.TokenStream(args.seed, 0, args.batch, args.seq, args.vocab, self.device)
        self.session.watch(self.model)
        self.session.watch_optimizer(self.optimizer)
        self.step_no = 0
        self.modes: list[object] = []  # DebugMode instances, kept so their logs are not freed inside the timing

    def _wrap(self):
        if self.config != "debugmode":
            return self.session.step(self.step_no)
        from torch.utils._debug_mode import DebugMode

        stack = contextlib.ExitStack()
        mode = stack.enter_context(DebugMode())
        stack.enter_context(DebugMode.log_tensor_hashes(hash_fn="hash_tensor", hash_inputs=True))
        self.modes.append(mode)
        return stack

    def step(self) -> float:
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        with self._wrap():
            tokens = self.data.next()
            if self.gpt2:
                logits = self.model(tokens[:, :-1])
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
                self.session.metric("loss", loss)
            else:
                logits, balance = self.model(tokens[:, :-1])
                lm_loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
                loss = lm_loss + 0.01 * balance
                self.session.metric("loss", loss)
                self.session.metric("lm_loss", lm_loss)
                self.session.metric("load_balancing_loss", balance)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.session.metric("grad_norm", grad_norm)
            self.session.metric("lr", 1e-3)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        sync()
        dt = time.perf_counter() - t0
        self.step_no += 1
        self.modes.clear()
        return dt

    def flush(self) -> float:
        """Flush what capture has buffered (resolve the digests, hand the window to the writer);
        returns the time it took. Capture flushes by itself every ``flush_records`` records (about
        every 14 steps at level ops here), a cost a per-step median would never show: the table
        charges each configuration the flush of exactly the records of its timed steps."""
        flush = getattr(self.session, "_flush_safely", None)  # private: the benchmark's own accounting
        if flush is None:
            return 0.0
        t0 = time.perf_counter()
        flush()
        return time.perf_counter() - t0

    def drain(self) -> float:
        """Flush and wait until the writer thread has written everything (untimed, after the
        warm-up: its first window also creates the Parquet writers, a one-time cost that would
        otherwise land on the first timed steps as contention for the interpreter lock)."""
        self.flush()
        benchlib.wait_for_writer(self.session, poll=0.005)
        return 0.0

    def close(self) -> None:
        self.session.close()


def _worker(config: str, args, out_root: str, conn) -> None:
    """One configuration in its own process: step on each request, answer with the step time."""
    if config.endswith("@base"):
        benchlib.import_tree(args.baseline)  # the other tree's detfp_capture, before anything imports it
    from detfp_capture import _config
    from detfp_capture._sources import steps as _steps

    # Only the record-count flushes (and the final one, see Runner.flush) are charged here: a tree
    # before issue 43 also flushed a window 20 s old (interleaved with the other configurations, a
    # configuration's own steps are a small fraction of the wall clock, so that timer fired far
    # more often per step than in a real run), this one a window of FLUSH_STEPS steps.
    _steps.FLUSH_SECONDS = float("inf")
    _config.FLUSH_STEPS = 1 << 62
    gemm = benchlib.time_gemms()
    torch.set_num_threads(args.threads)
    runner = Runner(load_example(), config, args, Path(out_root))
    if args.cpu is not None and hasattr(os, "sched_setaffinity"):
        # Every configuration's training thread on the same core (cores of a shared machine
        # differ by more than the effects measured here); pinned after the Runner is built, so
        # threads it started (the capture's writer) keep the whole machine, as in a real job.
        os.sched_setaffinity(0, {args.cpu})
    try:
        tree0 = benchlib.tree_seconds()
        while (cmd := conn.recv()) in ("step", "flush", "drain", "gemm"):
            if cmd == "gemm":  # seconds in the digest's arithmetic since the drain (the timed steps)
                conn.send(gemm[0] + benchlib.tree_seconds() - tree0)
                continue
            conn.send(runner.step() if cmd == "step" else runner.flush() if cmd == "flush" else runner.drain())
            if cmd == "drain":
                gemm[0] = 0.0
                tree0 = benchlib.tree_seconds()
    finally:
        runner.close()
        conn.send("closed")


def measure(args, tt, out_root: Path) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Each configuration runs in its own process (its own heap: the garbage collector's work is
    paid by the configuration that caused it, as in a real job), and they take turns step by
    step, one at a time, in a shuffled order per round. Returns the step times per configuration
    and the seconds each spent in the digest's GEMMs over its timed steps (``benchlib.time_gemms``)."""
    import multiprocessing as mp

    configs = [c for c in CONFIGS + V1_CONFIGS if c in args.configs]
    configs += [f"{c}@base" for c in CAPTURED if f"{c}@base" in args.configs]
    ctx = mp.get_context("spawn")
    workers = {}
    for c in configs:
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_worker, args=(c, args, str(out_root), child), daemon=True)
        proc.start()
        workers[c] = (proc, parent)
    times: dict[str, list[float]] = {c: [] for c in configs}
    order_rng = random.Random(0)  # fixed shuffle: reruns interleave the same way

    def call(c: str, cmd: str) -> float:
        conn = workers[c][1]
        conn.send(cmd)
        return conn.recv()

    try:
        for _ in range(args.warmup):
            for c in configs:
                call(c, "step")
        for c in configs:  # untimed: the warm-up steps' records are not the timed steps' cost
            call(c, "drain")
        for _ in range(args.rounds):
            order = list(configs)
            order_rng.shuffle(order)
            for c in order:
                times[c].append(call(c, "step"))
        for c in configs:
            # The records still buffered are the timed steps' too: their flush is charged to the
            # last step, so the mean step time is the amortized cost (flushes included).
            times[c][-1] += call(c, "flush")
        gemm = {c: call(c, "gemm") for c in configs}
    finally:
        for proc, conn in workers.values():
            with contextlib.suppress(Exception):
                conn.send("stop")
                conn.recv()
            proc.join(timeout=60)
    return times, gemm


def _ratios(times: dict[str, list[float]]) -> dict[str, float]:
    base = statistics.fmean(times["none"])
    return {c: statistics.fmean(ts) / base for c, ts in times.items()}


def report(trials: list[dict[str, list[float]]], gated: bool) -> dict:
    """The table: per configuration the mean step time over all trials (amortized: the flushes
    of the timed steps' records are included, see ``measure``), and the median over trials of
    its ratio to no capture (each trial's ratio from its own interleaved steps), with the range
    across trials, which says how far the machine's noise moves the result. A median step would
    leave out every step that flushed, and with it the resolve of all digests."""
    ratios = [_ratios(t) for t in trials]
    configs = list(trials[0])
    rows = {}
    print(f"{'config':<16}{'ms/step':>11}{'ratio':>9}{'trials range':>18}  target")
    for c in configs:
        mean = statistics.fmean([x for t in trials for x in t[c]])
        rs = [r[c] for r in ratios]
        ratio = statistics.median(rs)
        target = TARGETS.get(c) if gated else None
        verdict = "" if target is None else (f"< {target:.2f}x " + ("met" if ratio < target else "MISSED"))
        rows[c] = {"mean_s": mean, "ratio": ratio, "ratio_trials": rs}
        span = f"{min(rs):.3f}-{max(rs):.3f}x"
        print(f"{c:<16}{mean * 1e3:>11.2f}{ratio:>8.3f}x{span:>18}  {verdict}")
    result = {"trials": len(trials), "steps": {c: len(trials[0][c]) for c in configs}, "configs": rows}
    for c in configs:
        if c.endswith("@base"):  # this tree over the baseline tree, per trial (interleaved in it)
            level = c.removesuffix("@base")
            vs = [statistics.fmean(t[level]) / statistics.fmean(t[c]) for t in trials]
            result.setdefault("this_over_baseline", {})[level] = {"median": statistics.median(vs), "trials": vs}
            print(f"{level}: this tree / baseline = {statistics.median(vs):.3f}x (trials {min(vs):.3f}-{max(vs):.3f})")
    for ops in ("ops", "ops-v1"):
        if ops not in rows or "debugmode" not in rows:
            continue
        shares = [(r[ops] - 1.0) / (r["debugmode"] - 1.0) for r in ratios if r["debugmode"] > 1.0]
        share = statistics.median(shares) if shares else float("inf")
        suffix = "" if ops == "ops" else "_v1"
        result[f"ops_over_debugmode{suffix}"] = share
        result[f"ops_over_debugmode{suffix}_trials"] = shares
        rng = f" (trials {min(shares):.3f}-{max(shares):.3f})" if shares else ""
        gate = gated and ops == "ops"  # the target is version 2's, the default
        verdict = f"  target <= {OPS_SHARE:.2f} {'met' if share <= OPS_SHARE else 'MISSED'}" if gate else ""
        print(f"{ops} overhead / DebugMode overhead = {share:.3f}{rng}{verdict}")
    return result


def clone_bandwidth(device: torch.device) -> float:
    """Bytes per second that ``clone()`` copies on this machine (best of 20): the floor for any
    design that reads every recorded byte once. On a CPU the tensor is 4 MiB, the size of the
    gpt2 row's largest activations (batch 8 x seq 128 x 1024 float32), so it is a copy from
    and to cache, as the digest of a tensor a module just wrote is a read from cache: a 128 MiB
    clone would mostly time the page faults of its fresh allocation, which no recorded tensor
    pays; on a device 256 MiB, past its caches."""
    return _best_rate(device, lambda x: x.clone())


def digest_bandwidth(device: torch.device, version: int) -> float:
    """Bytes per second that the detfp digest of ``version`` itself reads (``fingerprint``: start
    and resolve, one sync; best of 20) on the same tensor as ``clone_bandwidth``: the cost of the
    digest's arithmetic per byte."""
    from detfp_capture.digest import fingerprint

    return _best_rate(device, lambda x: fingerprint(x, version=version))


def _best_rate(device: torch.device, fn) -> float:
    mib = CLONE_MIB[device.type == "cuda"]
    x = torch.rand(mib * 2**18, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn(x)  # warm-up: the digest's weights, the allocator
    best = float("inf")
    for _ in range(20):
        sync()
        t0 = time.perf_counter()
        y = fn(x)
        sync()
        best = min(best, time.perf_counter() - t0)
        del y
    return x.numel() * x.element_size() / best


def _trace_load(run: Path, first: int, last: int) -> tuple[int, int]:
    """(records, digested bytes) of steps first..last of a captured run, read from its trace."""
    import pyarrow.parquet as pq

    files = sorted((run / "records").rglob("*.parquet"))
    if not files:
        return 0, 0
    cols = ["step", "status", "numel", "dtype"]
    table = [row for f in files for row in pq.read_table(f, columns=cols, partitioning=None).to_pylist()]
    rows = [r for r in table if first <= r["step"] <= last]
    sizes: dict[str, int] = {}
    digested = 0
    for r in rows:
        if r["status"] != "ok":
            continue
        if r["dtype"] not in sizes:
            sizes[r["dtype"]] = torch.empty((), dtype=getattr(torch, r["dtype"].removeprefix("torch."))).element_size()
        digested += r["numel"] * sizes[r["dtype"]]
    return len(rows), digested


def breakdown(
    trials: list[dict[str, list[float]]],
    gemms: list[dict[str, float]],
    runs: list[Path],
    args,
    bandwidth: float,
    digest_bw: dict[int, float],
) -> dict:
    """Where each level's overhead goes: digested bytes at clone() bandwidth, and the rest per
    record (host time: hooks, bookkeeping, the flush), from the mean step times of all trials
    and the records of the timed steps in each trial's trace; then the time the digest's GEMMs
    took inside those steps (``benchlib.time_gemms``) and the rest per record once it is taken off."""
    from detfp_capture._digest import versions

    base = statistics.fmean([x for t in trials for x in t["none"]])
    dev = torch.device(args.device)
    routes = "; ".join(f"version {v}: {versions.SCHEMES[v].route(dev)}" for v in sorted(digest_bw))
    speeds = ", ".join(f"version {v} {bw / 1e9:.1f} GB/s" for v, bw in sorted(digest_bw.items()))
    first, last = args.warmup, args.warmup + args.rounds - 1
    out = {}
    mib = CLONE_MIB[torch.device(args.device).type == "cuda"]
    print(
        f"where the overhead goes (on a {mib} MiB tensor, measured in this run: clone() {bandwidth / 1e9:.1f} GB/s, "
        f"the digest {speeds}; level functions: {routes}):\n"
        f"  us/record = overhead / records; beyond clone = (overhead - bytes at clone bw) / records;\n"
        f"  beyond digest = (overhead - bytes at digest bw) / records: bookkeeping (hooks, records, flush, copies);\n"
        f"  GEMM ms = time inside the digest's level functions, and its whole-tree function at record time (CPU,\n"
        f"  version 2), per step, timed in the steps themselves (as loaded as they are); beyond GEMM = (overhead -\n"
        f"  GEMM ms) / records: hooks, records, copies, flush (MB digested counts every digested record's bytes,\n"
        f"  also those whose digest a record shares with an earlier one of the same tensor and version)\n"
        f"{'level':<16}{'overhead ms':>12}{'records':>9}{'MB digested':>13}{'at clone bw ms':>16}"
        f"{'at digest bw ms':>17}{'us/record':>11}{'beyond clone':>14}{'beyond digest':>15}"
        f"{'GEMM ms':>10}{'beyond GEMM':>13}"
    )
    for c in [*CAPTURED, *(f"{x}@base" for x in CAPTURED)]:
        if c not in trials[0]:
            continue
        overhead = statistics.fmean([x for t in trials for x in t[c]]) - base
        loads = [_trace_load(run / c, first, last) for run in runs]
        records = statistics.fmean(n for n, _ in loads) / args.rounds
        digested = statistics.fmean(b for _, b in loads) / args.rounds
        floor = digested / bandwidth
        per_record = (overhead - floor) / records if records else float("nan")
        all_per_record = overhead / records if records else float("nan")
        at_digest = digested / digest_bw[1 if c.split("@")[0].endswith("-v1") else 2]
        rest = (overhead - at_digest) / records if records else float("nan")
        gemm = statistics.fmean(g[c] for g in gemms) / args.rounds
        beyond_gemm = (overhead - gemm) / records if records else float("nan")
        out[c] = {
            "gemm_s": gemm,
            "beyond_gemm_s_per_record": beyond_gemm,
            "overhead_s_per_record": all_per_record,
            "bytes_at_digest_bandwidth_s": at_digest,
            "beyond_digest_s_per_record": rest,
            "overhead_s": overhead,
            "records_per_step": records,
            "bytes_per_step": digested,
            "bytes_at_clone_bandwidth_s": floor,
            "host_s_per_record": per_record,
        }
        print(
            f"{c:<16}{overhead * 1e3:>12.2f}{records:>9.0f}{digested / 1e6:>13.1f}{floor * 1e3:>16.2f}"
            f"{at_digest * 1e3:>17.2f}{all_per_record * 1e6:>11.1f}{per_record * 1e6:>14.1f}{rest * 1e6:>15.1f}"
            f"{gemm * 1e3:>10.2f}{beyond_gemm * 1e6:>13.1f}"
        )
    return out


def profile(args, tt, out_root: Path) -> None:
    runner = Runner(tt, args.profile, args, out_root)
    try:
        for _ in range(args.warmup):
            runner.step()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.rounds):
            runner.step()
        prof.disable()
    finally:
        runner.close()
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf)
    total = sum(t for (_, _, t, _, _) in stats.stats.values())
    # Time inside detfp's own Python frames (tottime) and under its entry points (cumtime):
    # the first says how much is interpreter overhead, the second what each hook costs in all.
    own = sum(v[2] for (f, _, _), v in stats.stats.items() if "detfp_capture" in f)
    print(
        f"{args.profile}: {args.rounds} steps, {total:.3f} s profiled, {own:.3f} s in detfp_capture frames "
        f"({own / total:.1%}); per step {own / args.rounds * 1e3:.2f} ms"
    )
    stats.sort_stats("cumulative").print_stats("detfp_capture", 30)
    stats.sort_stats("tottime").print_stats(20)
    print(buf.getvalue())


def _default_cpu() -> int | None:
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    return cpus[0] if cpus else None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {','.join(MODELS)}")
    p.add_argument("--rounds", type=int, default=12, help="timed steps per configuration")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per configuration first")
    p.add_argument("--trials", type=int, default=3, help="repeat the whole measurement in fresh processes")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (fixed for comparability)")
    p.add_argument("--device", default="cpu")
    for name in ("batch", "seq", "width", "layers", "heads", "vocab", "hidden"):
        shapes = ", ".join(f"{m} {SHAPES[m][name]}" for m in MODELS)
        p.add_argument(f"--{name}", type=int, help=f"model {name} for every model measured (default: {shapes})")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument(
        "--cpu",
        type=int,
        default=_default_cpu(),
        help="core that every configuration's training thread runs on (-1: none)",
    )
    p.add_argument("--no-probes", action="store_true", help="leave out the tiny model's two MoE probes per block")
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset of " + ",".join(CONFIGS))
    p.add_argument(
        "--with-v1", action="store_true", help=f"also {', '.join(V1_CONFIGS)}: those levels with digest version 1"
    )
    p.add_argument(
        "--profile", choices=CONFIGS + V1_CONFIGS, help="cProfile this configuration (first model) instead of the table"
    )
    p.add_argument("--json", help="also write the results to this JSON file")
    p.add_argument("--baseline", type=Path, help="another detfp tree: its capture measured beside this one's")
    args = p.parse_args(argv)
    if args.cpu is not None and args.cpu < 0:
        args.cpu = None
    if args.trials < 1 or args.rounds < 1:
        p.error("--trials and --rounds must be at least 1")
    args.configs = {c.strip() for c in args.configs.split(",")} | {"none"}
    if args.with_v1:
        args.configs |= set(V1_CONFIGS)
    unknown = args.configs - set(CONFIGS + V1_CONFIGS)
    if unknown:
        p.error(f"unknown configs {sorted(unknown)}; known: {', '.join(CONFIGS + V1_CONFIGS)}")
    if args.baseline is not None:
        if not (args.baseline / "detfp_capture" / "__init__.py").is_file():
            p.error(f"--baseline {args.baseline}: not a detfp tree (no detfp_capture/__init__.py)")
        args.baseline = args.baseline.resolve()
        args.configs |= {f"{c}@base" for c in CAPTURED if c in args.configs}
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    if not models or set(models) - set(MODELS):
        p.error(f"--models: choose from {', '.join(MODELS)}")
    print(benchlib.machine_line(), flush=True)
    torch.set_num_threads(args.threads)
    tt = load_example()
    bandwidth = clone_bandwidth(torch.device(args.device))
    digest_bw = {v: digest_bandwidth(torch.device(args.device), v) for v in (1, 2)}
    results = {"clone_bandwidth_bytes_per_s": bandwidth, "digest_bandwidth_bytes_per_s": digest_bw, "models": {}}
    with tempfile.TemporaryDirectory(prefix="detfp-bench-") as tmp:
        for model in models:
            margs = argparse.Namespace(**vars(args), model=model)
            for name, default in SHAPES[model].items():
                if getattr(margs, name) is None:
                    setattr(margs, name, default)
            if args.profile:
                profile(margs, tt, Path(tmp) / model)
                return 0
            runs = [Path(tmp) / model / f"trial{i}" for i in range(args.trials)]
            measured = [measure(margs, tt, run) for run in runs]
            trials = [t for t, _ in measured]
            gemms = [g for _, g in measured]
            shape = ", ".join(f"{k} {getattr(margs, k)}" for k in SHAPES[model])
            print(
                f"\nmodel {model} ({'gated' if model == GATED else 'reported, not gated'}; {shape}): device "
                f"{args.device}, threads {args.threads}, {args.trials} trials (fresh processes) of {args.rounds} "
                f"interleaved steps per config after {args.warmup} warm-up"
            )
            result = report(trials, gated=model == GATED)
            result["where"] = breakdown(trials, gemms, runs, margs, bandwidth, digest_bw)
            result["shape"] = {k: getattr(margs, k) for k in SHAPES[model]}
            results["models"][model] = result
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
