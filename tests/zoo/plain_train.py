"""A plain PyTorch training script with no detfp code: the zoo runs it under the launcher.

``python -m detfp_capture --out DIR --level L -- tests/zoo/plain_train.py OUT.json [options]``
(or under ``torchrun``, which makes it data parallel with DDP over gloo). It seeds inside
``main()``, sets its own determinism flags (``--deterministic``), saves and resumes
checkpoints, and has the zoo's plants behind options: a nondeterministic op (a matmul whose
chunks are summed in an order set per run), a changed sample on one rank, and a resume that
does or does not restore the RNG state. It writes the loss bits per step and a SHA-256 of the
final parameters to ``OUT.json`` (rank 0), so runs with and without capture can be compared.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import struct

import torch
import torch.distributed as dist

#: Summation order of the split-K op in this process ("fwd" or "rev"): read at run time, so the
#: dispatcher sees the same inputs and arguments in both runs, as with a real kernel.
_ORDER = ["fwd"]


@torch.library.custom_op("plain_zoo::split_k_mm", mutates_args=())
def split_k_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w`` with the inner dimension summed in 4 chunks, in the order ``_ORDER`` says."""
    k = w.shape[0]
    bounds = [(i * k // 4, (i + 1) * k // 4) for i in range(4)]
    if _ORDER[0] == "rev":
        bounds.reverse()
    out = None
    for lo, hi in bounds:
        part = x[:, lo:hi] @ w[lo:hi]
        out = part if out is None else out + part
    return out


@split_k_mm.register_fake
def _(x, w):
    return x.new_empty((x.shape[0], w.shape[1]))


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad):
    x, w = ctx.saved_tensors
    return grad @ w.t(), x.t() @ grad


split_k_mm.register_autograd(_backward, setup_context=_setup)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 32)
        self.drop = torch.nn.Dropout(0.1)
        self.fc2 = torch.nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = split_k_mm(x, self.fc1.weight.t()) + self.fc1.bias  # fc1 through the split-K op
        return self.fc2(self.drop(torch.relu(h)))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument(
        "--order", default="fwd", help="plant: the split-K op's summation order (fwd, rev) from --plant-step on"
    )
    p.add_argument("--plant-step", type=int, default=1)
    p.add_argument("--data-rank", type=int, default=None, help="plant: one changed element on this rank")
    p.add_argument("--save", default=None, help="save a checkpoint after this many steps to PATH.rankR")
    p.add_argument("--save-after", type=int, default=1)
    p.add_argument("--resume", default=None, help="resume from this checkpoint (its step count)")
    p.add_argument("--no-rng", action="store_true", help="resume without restoring the RNG state")
    p.add_argument("--deterministic", action="store_true")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.manual_seed(0)  # the script seeds itself, after the launcher started
    torch.set_num_threads(args.threads)
    if args.deterministic:
        torch.use_deterministic_algorithms(True)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        dist.init_process_group("gloo")
    model = Net()
    net = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.001) if world > 1 else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    start = 0
    if args.resume:
        ck = torch.load(f"{args.resume}.rank{rank}", weights_only=False)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        start = ck["step"]
        if not args.no_rng:
            torch.set_rng_state(ck["rng"])
    losses = []
    for step in range(start, args.steps):
        if step >= args.plant_step:
            _ORDER[0] = args.order
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
        if args.data_rank == rank and step == args.plant_step:
            x[0, 0] += 1.0
        loss = torch.nn.functional.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(struct.pack("<d", loss.item()).hex())
        if args.save and step + 1 == args.save_after:
            state = {"model": model.state_dict(), "opt": opt.state_dict(), "rng": torch.get_rng_state()}
            torch.save({**state, "step": step + 1}, f"{args.save}.rank{rank}")
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode() + t.contiguous().view(torch.uint8).numpy().tobytes())
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"losses": losses, "params": h.hexdigest()}, f)
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
