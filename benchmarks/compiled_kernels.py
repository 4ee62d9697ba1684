"""Cost of recording compiled code kernel by kernel: a compiled training step with capture at level
ops (every Inductor kernel and every ATen call inside the compiled blocks recorded), and at level
boundaries, each as a ratio to the same compiled step without capture.

Model: the GPT-2-shaped decoder of ``gpt2_shaped.py`` without dropout (token + position embedding, pre-norm blocks of causal
self-attention and a 4x GELU MLP, final LayerNorm, LM head), each block compiled with Inductor
(``torch.compile(block)``: C++ kernels on a CPU, Triton on CUDA), AdamW; default width 256,
4 layers, 4 heads, vocab 512, sequence 128, batch 8. One child process per configuration and
trial (``off``: no session; ``boundaries``, ``ops``: a session capturing every other step,
``steps=`` the odd ones), in a shuffled order; each compiles (Inductor's cache, warm after the
first child, is a temporary folder of this run), takes ``--warmup`` steps, then times
``--steps`` steps. The figure of a level is the median of a captured step divided by the median
of the uncaptured steps between them in the same process (side by side, step by step: a loaded
machine slows both alike), the median over ``--trials`` (the range printed); the uncaptured
steps of a session against the ``off`` child's say what an open session costs a step it leaves
out. The ``ops`` child also counts a step's records: those of compiled kernels (kind ``kernel``)
and the ATen calls inside the compiled blocks.

    .venv/bin/python benchmarks/compiled_kernels.py [--trials 3] [--steps 10] [--threads 1]
    .venv/bin/python benchmarks/compiled_kernels.py --width 512 --layers 2 --device cuda
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import benchlib

CONFIGS = ("off", "boundaries", "ops")


def _child(args: argparse.Namespace) -> dict:
    """One configuration in this process: its step times and, at ops, what a step recorded."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    from gpt2_shaped import GPT2Shaped  # benchmarks/ is this script's sys.path[0]

    # The capture benchmarks' GPT-2-shaped decoder without dropout, each block compiled (torchtitan's way).
    model = GPT2Shaped(args.vocab, args.width, args.layers, args.heads, args.seq, dropout=0.0)
    for i, block in enumerate(model.h):
        model.h[i] = torch.compile(block)
    dev = torch.device(args.device)
    model = model.to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(dev) for _ in range(4)]
    session = None
    out = Path(args.out) / args.child
    total = args.warmup + args.steps
    captured = set(range(args.warmup + 1, total, 2))  # every other timed step
    if args.child != "off":
        from detfp_capture import Session

        session = Session(out, args.child, steps=sorted(captured))
        session.watch(model)
        session.watch_optimizer(opt)

    def step(i: int) -> None:
        ctx = session.step(i) if session is not None else None
        if ctx is not None:
            ctx.__enter__()
        idx = batches[i % len(batches)]
        loss = F.cross_entropy(model(idx).flatten(0, 1), idx.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if ctx is not None:
            ctx.__exit__(None, None, None)

    for i in range(args.warmup):
        step(i)
    on, off = [], []
    for i in range(args.warmup, total):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step(i)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        (on if session is not None and i in captured else off).append(time.perf_counter() - t0)
    result: dict = {"uncaptured": statistics.median(off), "captured": statistics.median(on) if on else None}
    if session is not None:
        session.close()
    if args.child == "ops":
        from detfp_analyze.io.reader import open_run

        rec = open_run(out).scan("records").collect()
        last = rec.filter(rec["step"] == rec["step"].max())
        inside = last.filter(last["module"].str.starts_with("h."))
        result["kernel_records"] = int((last["kind"] == "kernel").sum())
        result["op_records_in_blocks"] = int((inside["kind"] == "op").sum())
        result["records"] = last.height
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=3, help="children per configuration (figures: medians and range)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per child")
    p.add_argument(
        "--warmup", type=int, default=3, help="untimed steps per child (the compile, the first session step)"
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads per child")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--width", type=int, default=256, help="model width")
    p.add_argument("--layers", type=int, default=4, help="compiled blocks")
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.add_argument("--vocab", type=int, default=512, help="vocabulary")
    p.add_argument("--seq", type=int, default=128, help="sequence length")
    p.add_argument("--batch", type=int, default=8, help="batch size")
    p.add_argument("--json", default=None, help="also write the figures here")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child is not None:
        print(json.dumps(_child(args)))
        return 0
    print(benchlib.machine_line())
    print(
        f"model: GPT-2-shaped, width {args.width}, {args.layers} compiled blocks, {args.heads} heads, vocab {args.vocab}, "
        f"seq {args.seq}, batch {args.batch}, AdamW; {args.device}, {args.threads} thread(s); "
        f"{args.trials} trial(s) x {args.steps} timed steps after {args.warmup}"
    )
    keys = ("steps", "warmup", "threads", "device", "width", "layers", "heads", "vocab", "seq", "batch")
    own = [x for k in keys for x in (f"--{k}", str(getattr(args, k)))]
    per: dict[str, list[dict]] = {c: [] for c in CONFIGS}
    with tempfile.TemporaryDirectory(prefix="detfp-compiled-bench-") as tmp:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(Path(tmp) / "inductor"), OMP_NUM_THREADS=str(args.threads))
        order = random.Random(0)
        for trial in range(args.trials):
            configs = list(CONFIGS)
            order.shuffle(configs)
            for c in configs:
                out = Path(tmp) / f"t{trial}"
                cmd = [sys.executable, __file__, *own, "--child", c, "--out", str(out)]
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
                if proc.returncode != 0:
                    print(proc.stderr[-3000:], file=sys.stderr)
                    return 1
                per[c].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    rows = []
    off_ms = statistics.median(r["uncaptured"] for r in per["off"]) * 1e3
    print(f"{'off':>10}: {off_ms:8.1f} ms/step uncaptured (no session)")
    for c in CONFIGS[1:]:
        ratios = [r["captured"] / r["uncaptured"] for r in per[c]]
        idle = [r["uncaptured"] / o["uncaptured"] for r, o in zip(per[c], per["off"], strict=True)]
        ms = statistics.median(r["captured"] for r in per[c]) * 1e3
        row = {"level": c, "step_ms": ms, "ratio": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
        row["unselected_vs_off"] = statistics.median(idle)
        rows.append(row)
        print(
            f"{c:>10}: {ms:8.1f} ms/step captured  {row['ratio']:6.3f}x the uncaptured steps beside it "
            f"(range {row['min']:.3f}-{row['max']:.3f}); its uncaptured steps {row['unselected_vs_off']:.3f}x off's"
        )
    ops = per["ops"][-1]
    print(
        f"level ops records per step: {ops['records']} ({ops['kernel_records']} of compiled kernels, "
        f"{ops['op_records_in_blocks']} of ATen calls inside the compiled blocks)"
    )
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "ops_step": ops}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
