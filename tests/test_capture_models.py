"""Tiny models and a training loop shared by the capture tests (CPU, a few milliseconds per step)."""

from __future__ import annotations

import struct
from pathlib import Path

import polars as pl
import torch
from torch.utils.checkpoint import checkpoint

from detfp_analyze.reader import open_run


class Block(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(d, 2 * d)
        self.fc2 = torch.nn.Linear(2 * d, d)
        self.drop = torch.nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.fc2(torch.nn.functional.gelu(self.fc1(x))))


class Net(torch.nn.Module):
    """Embedding -> two residual blocks (the second under activation checkpointing) -> head."""

    def __init__(self, d: int = 8, vocab: int = 16, ckpt: bool = True) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.b0 = Block(d)
        self.b1 = Block(d)
        self.head = torch.nn.Linear(d, vocab)
        self.ckpt = ckpt

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        x = self.b0(x)
        x = checkpoint(self.b1, x, use_reentrant=False) if self.ckpt else self.b1(x)
        return self.head(x)


def bits(x: torch.Tensor) -> int:
    return struct.unpack("<Q", struct.pack("<d", float(x)))[0]


def train(session=None, steps: int = 3, ckpt: bool = True, microbatches: int = 1) -> tuple[list[int], list[bytes]]:
    """Train Net for ``steps`` steps; returns loss bits and final parameter bytes."""
    torch.manual_seed(0)
    model = Net(ckpt=ckpt)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if session is not None:
        session.watch(model)
        session.watch_optimizer(opt)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for step in range(steps):
        ctx = session.step(step) if session is not None else _null()
        with ctx:
            for mb in range(microbatches):
                mctx = session.microbatch(mb) if session is not None and microbatches > 1 else _null()
                with mctx:
                    tokens = torch.randint(0, 16, (4, 6), generator=gen)
                    logits = model(tokens)
                    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 16), tokens.reshape(-1))
                    if session is not None:
                        session.metric("loss", loss)
                    loss.backward()
                    losses.append(bits(loss.detach()))
            opt.step()
            opt.zero_grad(set_to_none=True)
    params = [p.detach().numpy().tobytes() for p in model.parameters()]
    return losses, params


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *a: object) -> None:
        return None


def read(path: Path, table: str = "records") -> pl.DataFrame:
    """One table of a run, rank 0, in execution order."""
    return open_run(path).scan(table).collect().sort("seq")


def digest_hi(t: torch.Tensor) -> int:
    """The ``digest_hi`` column value of ``t``'s digest as it is now."""
    from detfp_capture import digest

    return int(digest.fingerprint(t).digest[:16], 16)
