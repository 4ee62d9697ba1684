"""A tiny GPT with a mixture-of-experts layer, trained with DDP, instrumented by detfp.

Run it single-process (``python examples/train_tiny.py --steps 3``) or under
``torchrun --nproc_per_node 2 examples/train_tiny.py --out traces/a --level boundaries``.
Without ``--out`` capture is off and the script is plain PyTorch; with it every rank
writes its fingerprint stream through ``detfp_capture.Session``.

Model: token + position embedding, two pre-norm transformer blocks (causal attention,
then a top-2 MoE feed-forward: router -> stable sort of (token, expert) pairs by expert
-> per-expert MLP -> ``index_add_`` combine into the residual stream), dropout, each block
under ``torch.utils.checkpoint``, an LM head tied to the embedding, AdamW, a switch-style
load-balancing loss. Data comes from a seeded generator indexed by a loader position that
checkpoints save, so a resumed run can reproduce the uninterrupted one bit for bit.

``--plant`` injects one known cause of divergence (see PLANTS) so the analysis has a
right answer to find; ``--save-ckpt`` / ``--resume`` [``--no-restore-rng``] exercise
resume alignment.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import random
import struct
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

#: Plantable causes of divergence, each with what the analysis should conclude.
PLANTS = {
    "nondet_op": "MoE combine index_add_ sums duplicate indices in a per-process random order (like GPU atomics): "
    "origin at that op on every rank",
    "data_rank": "one token of one rank's batch differs (--plant-rank): source on that rank",
    "moe_permute": "tokens dispatched to each expert in a per-process random order, same combine result: "
    "a permutation in the dispatch probe",
    "uninit": "a torch.empty buffer partly written, then read: an 'uninitialized' hazard",
    "async_early": "an all_reduce(async_op=True) whose tensor is read before wait(): an 'async_pending' hazard",
}


# ----------------------------------------------------------------------------- planted nondeterminism
#
# The combine of a real MoE on a GPU is an index_add_ whose duplicate indices are summed
# by float atomics in whatever order the threads arrive. On CPU index_add_ is sequential,
# so the plant reproduces the effect inside one custom op: the dispatcher (and so the
# capture) sees a single call whose inputs are identical across runs and whose output is
# not -- exactly the signature of a nondeterministic kernel.

_NONDET_GEN: list[torch.Generator] = []  # seeded from os.urandom once per process when planted


@torch.library.custom_op("detfp_example::index_add", mutates_args=())
def nondet_index_add(base: torch.Tensor, index: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """``base.index_add(0, index, source)`` with the order of the additions shuffled per process."""
    if not _NONDET_GEN:
        _NONDET_GEN.append(torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little")))
    order = torch.randperm(index.numel(), generator=_NONDET_GEN[0]).to(index.device)
    return base.index_add(0, index[order], source[order])


@nondet_index_add.register_fake
def _(base, index, source):
    return torch.empty_like(base)


def _nondet_index_add_backward(ctx, grad):
    (index,) = ctx.saved_tensors
    return grad, None, grad.index_select(0, index)


def _nondet_index_add_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[1])


nondet_index_add.register_autograd(_nondet_index_add_backward, setup_context=_nondet_index_add_setup)


# ----------------------------------------------------------------------------- model


class Plant:
    """Which plant is active in the current step (set by the training loop, read by the model)."""

    def __init__(self, names: str | None, step: int, rank: int) -> None:
        self.names = frozenset(names.split(",")) if names else frozenset()
        self.start = step
        self.rank = rank
        self.active = False
        # Per-process seed for the moe_permute plant: two launches dispatch differently.
        self.gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little"))

    def on(self, name: str) -> bool:
        return self.active and name in self.names


class Attention(nn.Module):
    def __init__(self, d: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.drop = nn.Dropout(dropout)
        self.p = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.p if self.training else 0.0)
        return self.drop(self.proj(y.transpose(1, 2).reshape(b, t, d)))


class Expert(nn.Module):
    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(d, hidden)
        self.down = nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class MoE(nn.Module):
    """Top-k routed experts: route, dispatch (sorted by expert), run, combine with index_add_."""

    def __init__(self, d: int, hidden: int, experts: int, top_k: int, plant: Plant, probe) -> None:
        super().__init__()
        self.router = nn.Linear(d, experts, bias=False)
        self.experts = nn.ModuleList(Expert(d, hidden) for _ in range(experts))
        self.top_k = top_k
        self.plant = plant
        self.probe = probe

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = x.shape
        h = x.reshape(-1, shape[-1])
        n_tok, n_exp = h.shape[0], len(self.experts)
        probs = self.router(h).softmax(dim=-1)
        gate, chosen = probs.topk(self.top_k, dim=-1)  # (tokens, k)
        gate = gate / gate.sum(dim=-1, keepdim=True)
        self.probe("moe.router_map", chosen)

        # Dispatch: (token, expert) pairs sorted by expert; stable, so ties keep token order.
        flat_expert = chosen.reshape(-1)
        order = torch.argsort(flat_expert, stable=True)
        counts = torch.bincount(flat_expert, minlength=n_exp)
        if self.plant.on("moe_permute"):
            order = self._permute_within_experts(order, counts)
        token = order // self.top_k
        dispatched = h[token]
        self.probe("moe.dispatch", dispatched)

        if self.plant.on("uninit"):
            # The bug: a per-expert load table allocated with empty() and one slot too many;
            # the spare slot is never written but the max() below reads it.
            load = torch.empty(n_exp + 1, dtype=torch.float32, device=h.device)
            load[:n_exp] = counts.to(torch.float32)
            self.peak_load = load.max()

        # Every expert runs, even on zero tokens, so all parameters get a gradient (DDP needs it).
        outs = []
        start = 0
        for e, n in enumerate(counts.tolist()):
            outs.append(self.experts[e](dispatched[start : start + n]))
            start += n
        expert_out = torch.cat(outs) * gate.reshape(-1)[order].unsqueeze(-1)

        if self.plant.on("nondet_op"):
            y = torch.ops.detfp_example.index_add(h, token, expert_out)
        else:
            y = h.index_add(0, token, expert_out)

        # Switch-transformer load-balancing loss: fraction routed x mean router probability.
        frac = counts.to(probs.dtype) / (n_tok * self.top_k)
        balance = n_exp * (frac * probs.mean(dim=0)).sum()
        return y.reshape(shape), balance

    def _permute_within_experts(self, order: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        # Shuffle the pairs inside each expert's segment: each token still meets its experts in
        # the same relative order, so the combine is bitwise unchanged; only the dispatch differs.
        pieces, start = [], 0
        for n in counts.tolist():
            perm = torch.randperm(n, generator=self.plant.gen).to(order.device)
            pieces.append(order[start : start + n][perm])
            start += n
        return torch.cat(pieces)


class Block(nn.Module):
    def __init__(self, d, heads, hidden, experts, top_k, dropout, plant, probe) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = Attention(d, heads, dropout)
        self.ln2 = nn.LayerNorm(d)
        self.moe = MoE(d, hidden, experts, top_k, plant, probe)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + self.attn(self.ln1(x))
        m, balance = self.moe(self.ln2(x))
        # The MoE combine already added its input (the residual of ln2(x)); add the block residual.
        return x + self.drop(m), balance


class TinyGPT(nn.Module):
    def __init__(
        self,
        vocab=256,
        d=64,
        heads=4,
        layers=2,
        hidden=128,
        experts=4,
        top_k=2,
        seq=32,
        dropout=0.1,
        plant: Plant | None = None,
        probe=None,
        recompute: bool = True,
    ) -> None:
        super().__init__()
        plant = plant or Plant(None, 0, 0)
        probe = probe or (lambda name, t: None)
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(
            Block(d, heads, hidden, experts, top_k, dropout, plant, probe) for _ in range(layers)
        )
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied LM head
        self.recompute = recompute
        # GPT-2 style small init: with a tied head, N(0, 1) embeddings would give huge logits.
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.tok(idx) + self.pos(pos))
        balance = x.new_zeros(())
        for block in self.blocks:
            if self.recompute and self.training:
                # Non-reentrant checkpointing restores the RNG, so recompute repeats the dropout masks.
                x, b = checkpoint(block, x, use_reentrant=False)
            else:
                x, b = block(x)
            balance = balance + b
        return self.head(self.ln_f(x)), balance / len(self.blocks)


# ----------------------------------------------------------------------------- data


class TokenStream:
    """Deterministic batches: batch number ``position`` of ``rank`` is a pure function of the seed.

    Saving ``position`` in a checkpoint is all a resume needs to continue the same stream.
    """

    def __init__(self, seed: int, rank: int, batch: int, seq: int, vocab: int, device: torch.device) -> None:
        self.seed, self.rank, self.batch, self.seq, self.vocab, self.device = seed, rank, batch, seq, vocab, device
        self.position = 0

    def next(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.rank * 10_007 + self.position)
        self.position += 1
        # A learnable pattern (each token predicts the next as t + stride mod vocab) with noise.
        start = torch.randint(0, self.vocab, (self.batch, 1), generator=g)
        stride = torch.randint(1, 8, (self.batch, 1), generator=g)
        seq = (start + stride * torch.arange(self.seq + 1)) % self.vocab
        noise = torch.rand(self.batch, self.seq + 1, generator=g) < 0.1
        seq = torch.where(noise, torch.randint(0, self.vocab, seq.shape, generator=g), seq)
        return seq.to(self.device)


# ----------------------------------------------------------------------------- capture glue


class NullSession:
    """Capture off: the Session API doing nothing, so the loop has a single code path."""

    def watch(self, model):
        return model

    def watch_optimizer(self, optimizer):
        return optimizer

    def step(self, n):
        return contextlib.nullcontext()

    def microbatch(self, i):
        return contextlib.nullcontext()

    def metric(self, name, value):
        pass

    def probe(self, name, tensor, rows=False):
        pass

    def close(self):
        pass


def make_session(args, start_step: int):
    if not args.out:
        return NullSession()
    from detfp_capture import Session

    options = {"level": args.level}
    if args.kernels:
        options["kernels"] = args.kernels
    if args.moments:
        options["moments"] = True
    if args.capture_steps:
        options["steps"] = args.capture_steps
    if args.poison:
        options["poison"] = True
    if start_step:
        options["start_step"] = start_step
    if args.digest_version:
        options["digest_version"] = args.digest_version
    return Session(args.out, **options)


# ----------------------------------------------------------------------------- checkpoints


def rng_states(device: torch.device) -> dict:
    states = {"cpu": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict, device: torch.device) -> None:
    torch.set_rng_state(states["cpu"])
    random.setstate(states["python"])
    if device.type == "cuda" and "cuda" in states:
        torch.cuda.set_rng_state_all(states["cuda"])


def ckpt_path(directory: str, rank: int) -> Path:
    return Path(directory) / f"rank{rank}.pt"


def save_checkpoint(directory, rank, world, step, model, optimizer, data, device) -> None:
    path = ckpt_path(directory, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {
        "step": step,
        "world_size": world,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "rng": rng_states(device),
        "data_position": data.position,
    }
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- training


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="trace directory; capture is off without it")
    p.add_argument("--level", default="boundaries", choices=["metrics", "boundaries", "ops"])
    p.add_argument("--capture-steps", help="steps to capture, e.g. '2' or '0-3,5' (default: all)")
    p.add_argument("--kernels", help="steps whose kernel identities are captured (Session kernels=)")
    p.add_argument("--moments", action="store_true", help="record sum/absmax moments")
    p.add_argument("--rows", action="store_true", help="row digests on the MoE router/dispatch probes")
    p.add_argument("--steps", type=int, default=3, help="train until this absolute step (exclusive)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--microbatches", type=int, default=1)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--backend", default=None, help="process-group backend (default gloo; nccl on cuda if asked)")
    p.add_argument("--no-recompute", action="store_true", help="disable activation checkpointing")
    p.add_argument("--no-deterministic", action="store_true", help="leave torch.use_deterministic_algorithms off")
    p.add_argument("--plant", help="inject known causes of divergence, comma-separated: " + ", ".join(PLANTS))
    p.add_argument("--plant-step", type=int, default=1, help="first step the plant is active")
    p.add_argument("--plant-rank", type=int, default=1, help="rank for --plant data_rank")
    p.add_argument("--save-ckpt", nargs=2, metavar=("K", "DIR"), help="save a checkpoint at the start of step K")
    p.add_argument("--resume", metavar="DIR", help="resume from a checkpoint saved by --save-ckpt")
    p.add_argument("--no-restore-rng", action="store_true", help="resume without restoring RNG states (a bug)")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--poison", action="store_true", help="capture's poison mode for empty() allocations")
    p.add_argument("--digest-version", type=int, help="digest version of the trace (default: capture's, 2)")
    args = p.parse_args(argv)
    unknown = set(args.plant.split(",")) - set(PLANTS) if args.plant else set()
    if unknown:
        p.error(f"--plant {args.plant}: unknown {sorted(unknown)}; choose from {', '.join(PLANTS)}")
    return args


def setup_distributed(args, device: torch.device) -> tuple[int, int]:
    """Join the torchrun job if launched by torchrun; a world of 1 otherwise (no DDP)."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        backend = args.backend or "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend)
        return dist.get_rank(), dist.get_world_size()
    if args.plant and "async_early" in args.plant.split(","):
        # The plant needs a process group; a private one-rank group is enough.
        dist.init_process_group(args.backend or "gloo", store=dist.HashStore(), rank=0, world_size=1)
    return 0, 1


def float_bits(x: float) -> str:
    return struct.pack(">d", float(x)).hex()


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not args.no_deterministic:
        torch.use_deterministic_algorithms(True)
    device = torch.device(args.device)
    if device.type == "cuda":
        local = int(os.environ.get("LOCAL_RANK", 0))
        device = torch.device("cuda", local)
    rank, world = setup_distributed(args, device)
    log = (lambda *a: None) if (args.quiet or rank != 0) else (lambda *a: print(*a, flush=True))

    plant = Plant(args.plant, args.plant_step, rank)
    probe_rows = args.rows or plant.names >= {"moe_permute"}

    def probe(name, tensor):
        session.probe(name, tensor, rows=probe_rows)

    # Same initial weights on every rank (DDP would broadcast them anyway); then a per-rank
    # RNG stream for dropout, as real jobs have.
    torch.manual_seed(args.seed)
    model = TinyGPT(seq=args.seq, plant=plant, probe=probe, recompute=not args.no_recompute).to(device)
    torch.manual_seed(args.seed + 7919 * (rank + 1))
    random.seed(args.seed + rank)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    data = TokenStream(args.seed, rank, args.batch, args.seq, 256, device)

    start_step = 0
    if args.resume:
        state = torch.load(ckpt_path(args.resume, rank), map_location=device, weights_only=False)
        if state["world_size"] != world:
            print(
                f"train_tiny: checkpoint {args.resume} was saved by {state['world_size']} ranks, "
                f"this job has {world}; relaunch with --nproc_per_node {state['world_size']}",
                file=sys.stderr,
            )
            return 2
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        data.position = state["data_position"]
        start_step = state["step"]
        if not args.no_restore_rng:
            set_rng_states(state["rng"], device)

    session = make_session(args, start_step)
    ddp = world > 1 and dist.is_initialized()
    # find_unused_parameters=True also keeps DDP from rebuilding its gradient buckets after the
    # first iteration: a resumed job's first step would otherwise flatten gradients in a
    # different bucket layout than the uninterrupted job had at that step (same values, other
    # bytes), which a bitwise comparison of the bucket all-reduce rightly reports.
    net = nn.parallel.DistributedDataParallel(model, find_unused_parameters=True) if ddp else model
    session.watch(net)
    session.watch_optimizer(optimizer)

    save_step, save_dir = (int(args.save_ckpt[0]), args.save_ckpt[1]) if args.save_ckpt else (None, None)
    warmup = 4
    try:
        for step in range(start_step, args.steps):
            if step == save_step:
                save_checkpoint(save_dir, rank, world, step, model, optimizer, data, device)
            plant.active = args.plant is not None and step >= args.plant_step
            lr = args.lr * min(1.0, (step + 1) / warmup)  # stateless schedule: a resume needs only the step
            for group in optimizer.param_groups:
                group["lr"] = lr
            with session.step(step):
                net.train()
                total = 0.0
                for mb in range(args.microbatches):
                    mb_ctx = session.microbatch(mb) if args.microbatches > 1 else contextlib.nullcontext()
                    sync_ctx = net.no_sync() if ddp and mb < args.microbatches - 1 else contextlib.nullcontext()
                    with mb_ctx, sync_ctx:
                        tokens = data.next()
                        if plant.on("data_rank") and rank == args.plant_rank:
                            tokens[0, 5] = (tokens[0, 5] + 1) % 256
                        logits, balance = net(tokens[:, :-1])
                        lm_loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
                        loss = lm_loss + 0.01 * balance
                        session.metric("loss", loss)
                        session.metric("lm_loss", lm_loss)
                        session.metric("load_balancing_loss", balance)
                        (loss / args.microbatches).backward()
                        total += loss.item() / args.microbatches
                if ddp or plant.on("async_early"):
                    # The mean loss over ranks, for the log line (as real loops do).
                    report = torch.tensor([total], dtype=torch.float64, device=device)
                    if plant.on("async_early"):
                        # The bug: the reduced buffer is read before wait() -- on a real job it
                        # may still hold this rank's own value, or a half-reduced one.
                        work = dist.all_reduce(report, async_op=True)
                        _early = report * 2.0
                        work.wait()
                    else:
                        dist.all_reduce(report)
                    total = report.item() / world
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                session.metric("grad_norm", grad_norm)
                session.metric("lr", lr)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            log(f"step {step} loss {total:.6f} bits {float_bits(total)} grad_norm {float(grad_norm):.6f}")
    finally:
        session.close()

    digest = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    print(f"rank {rank} final params sha256 {digest.hexdigest()}", flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
