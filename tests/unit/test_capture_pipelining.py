"""``torch.distributed.pipelining`` in one process: two stages of an interleaved schedule on one rank.

A stage that infers its shapes (the default) runs its module once on tensors made from metadata
(``torch.empty``: garbage that differs between processes) and takes ``torch.autograd.grad`` of
it; the pass is thrown away. The stages run their block under activation checkpointing. Capture records none of it: an identical pair is identical at every
level, the job's numbers are those without capture, and no hook raised inside the backward
inference (the two-rank schedules are in ``tests/integration/test_zoo_pipelining.py``).
"""

from __future__ import annotations

import struct

import polars as pl
import pytest
import torch
from torch.utils.checkpoint import checkpoint

from detfp_analyze.bisect import bisect
from detfp_analyze.io.reader import open_run
from detfp_capture import Session
from tests.fixtures.models import read


class _Checkpointed(torch.nn.Module):
    """A stage whose block runs under activation checkpointing (recomputed in the stage's backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.block = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.block, x, use_reentrant=False)


def _train(session: Session | None, poison_seed: float) -> list[str]:
    from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B

    torch.manual_seed(0)
    blocks = [_Checkpointed() for _ in range(2)]
    holder = torch.nn.ModuleDict({f"stage{i}": b for i, b in enumerate(blocks)})
    stages = [PipelineStage(b, i, 2, torch.device("cpu")) for i, b in enumerate(blocks)]
    schedule = ScheduleInterleaved1F1B(stages, 2, loss_fn=lambda o, t: ((o - t) ** 2).mean())
    opt = torch.optim.SGD(holder.parameters(), lr=0.1)
    if session is not None:
        session.watch(holder)
        session.watch_optimizer(opt)
    # What empty memory holds differs between processes: make it differ between the two runs.
    torch.full((1 << 16,), poison_seed).sum()
    out = []
    for step in range(2):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(4, 4, generator=g), torch.randn(4, 4, generator=g)
        with session.step(step) if session is not None else torch.enable_grad():
            losses: list[torch.Tensor] = []
            schedule.step(x, target=y, losses=losses)
            opt.step()
            opt.zero_grad()
        out.append(struct.pack("<f", float(torch.stack(losses).sum().detach())).hex())
    return out


@pytest.mark.parametrize("level", ["boundaries", "ops"])
def test_shape_inference_is_not_recorded(tmp_path, gloo1, level):
    plain = _train(None, 0.0)
    for run, seed in (("a", 1.5), ("b", -7.0)):
        with Session(tmp_path / run, level, poison=level == "ops") as s:
            assert _train(s, seed) == plain
    assert bisect(open_run(tmp_path / "a"), open_run(tmp_path / "b")).status == "identical"
    ev = read(tmp_path / "a", "events")
    assert ev.filter(pl.col("type").is_in(["capture_error", "hazard"])).height == 0
    # Each stage's forward is recorded once per microbatch and step, not once more for inference.
    fwd = read(tmp_path / "a").filter((pl.col("kind") == "batch") & (pl.col("module") == "stage1"))
    assert fwd.height == 2 * 2
