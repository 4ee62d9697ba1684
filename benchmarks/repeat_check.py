"""Cost of a repeat check relative to one forward+backward of the module it checks.

Model: a GPT-2-shaped decoder (token + position embedding, pre-norm blocks of causal
self-attention and a 4x GELU MLP, dropout, final LayerNorm, LM head tied to the embedding),
default width 256, 4 layers, 4 heads, vocab 512, sequence 128, batch 8 (issue 17's
representative model). T is the median time of one plain forward+backward (cross-entropy
loss, gradients set to None first). The check is ``repeat_check(loss_of_batch, runs=3,
level=...)`` on the same model: snapshot, three captured calls with backward, their
restores, two bisects; each level's figure is the median over ``--trials`` checks, after one
untimed check that pays for the first session's imports. Plain steps and checks take turns,
so machine noise lands on both. Target (issue 17): a 3-run check at level ops well under 10 T.

    .venv/bin/python benchmarks/repeat_check.py [--trials 5] [--threads 1] [--device cpu]
    .venv/bin/python benchmarks/repeat_check.py --levels ops --runs 3 --width 512
    CUBLAS_WORKSPACE_CONFIG=:4096:8 python benchmarks/repeat_check.py --device cuda --deterministic
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

import benchlib

TARGET = 10.0


class Block(nn.Module):
    def __init__(self, d: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.heads, self.drop = heads, nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        att = self.drop(att.masked_fill(~mask, float("-inf")).softmax(-1))
        y = (att @ v).transpose(1, 2).reshape(b, s, d)
        x = x + self.drop(self.proj(y))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))


class GPT(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, seq: int, dropout: float = 0.1) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads, dropout) for _ in range(layers))
        self.ln, self.drop = nn.LayerNorm(d), nn.Dropout(dropout)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.drop(self.tok(tokens) + self.pos(pos))
        for blk in self.blocks:
            x = blk(x)
        return self.ln(x) @ self.tok.weight.t()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--levels", default="ops,boundaries,metrics")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--deterministic",
        action="store_true",
        help="torch.use_deterministic_algorithms(True) (on CUDA: embedding backward uses float atomics otherwise)",
    )
    ap.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    args = ap.parse_args()
    print(benchlib.machine_line(), file=sys.stderr if args.json else sys.stdout, flush=True)  # --json: stdout is JSON
    torch.set_num_threads(args.threads)
    if args.deterministic:
        torch.use_deterministic_algorithms(True)
    from detfp_guards import repeat_check

    dev = torch.device(args.device)
    torch.manual_seed(0)
    model = GPT(args.vocab, args.width, args.layers, args.heads, args.seq).to(dev)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen).to(dev)
    x, y = tokens[:, :-1], tokens[:, 1:]

    def loss_of_batch() -> torch.Tensor:
        return F.cross_entropy(model(x).flatten(0, 1), y.flatten())

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def plain() -> float:
        model.zero_grad(set_to_none=True)
        sync()
        t0 = time.perf_counter()
        loss_of_batch().backward()
        sync()
        return time.perf_counter() - t0

    def check(level: str) -> float:
        model.zero_grad(set_to_none=True)
        sync()
        t0 = time.perf_counter()
        res = repeat_check(loss_of_batch, runs=args.runs, level=level)
        sync()
        dt = time.perf_counter() - t0
        if not res.ok:
            raise SystemExit(f"repeat check at level {level} found a difference:\n{res.report}")
        return dt

    levels = [s for s in args.levels.split(",") if s]
    for _ in range(2):
        plain()
    for level in levels:
        check(level)  # the first session of a process imports the dispatch machinery
    times: dict[str, list[float]] = {"plain": [], **{lv: [] for lv in levels}}
    for _ in range(args.trials):
        times["plain"].append(plain())
        for level in levels:
            times[level].append(check(level))
            times["plain"].append(plain())
    t = statistics.median(times["plain"])
    rows = {lv: statistics.median(times[lv]) for lv in levels}
    if args.json:
        print(json.dumps({"T_s": t, **{f"{lv}_s": v for lv, v in rows.items()}, "runs": args.runs}, sort_keys=True))
        return
    shape = f"width {args.width}, {args.layers} layers, {args.heads} heads, vocab {args.vocab}, seq {args.seq}, batch {args.batch}"
    print(f"GPT-2-shaped decoder ({shape}) on {args.device}, {args.threads} thread(s), {args.trials} trials")
    print(f"T = one forward+backward: {t * 1e3:.1f} ms (median of {len(times['plain'])})")
    print(f"{'level':<12}{args.runs}-run check   / T   (range / T)")
    for lv, v in rows.items():
        lo, hi = min(times[lv]) / t, max(times[lv]) / t
        print(f"{lv:<12}{v * 1e3:9.1f} ms  {v / t:6.2f}x  ({lo:.2f}-{hi:.2f})")
    if "ops" in rows:
        verdict = "within" if rows["ops"] / t < TARGET else "OVER"
        print(
            f"target: a {args.runs}-run check at level ops well under {TARGET:.0f} T: {verdict} ({rows['ops'] / t:.2f}x)"
        )


if __name__ == "__main__":
    main()
