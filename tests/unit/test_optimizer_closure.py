"""A forward and backward that run inside ``optimizer.step(closure)``: Lightning's automatic
optimization, L-BFGS. The phases come from what runs, not from the enclosing call: the closure's
forward is phase ``forward`` (its root's input the ``batch``), its backward ``backward``; the
optimizer's records keep their meaning (parameters before and after the update, gradients as the
update reads them: after each closure call). Before the fix the forward was phase ``optimizer``,
no batch was recorded, and one changed sample read as an ``unobserved_producer``.
"""

from __future__ import annotations

import sys

import polars as pl
import pytest
import torch

from detfp_analyze.bisect import bisect
from detfp_analyze.io.reader import open_run
from detfp_capture import Session
from detfp_capture._launch.cli import main as launcher_main
from tests.fixtures.models import read


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _train(session: Session | None, opt_name: str = "sgd", steps: int = 2, plant: bool = False) -> list[float]:
    """``steps`` steps whose forward and backward run in the closure; returns the losses."""
    model = _model()
    if opt_name == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    else:
        opt = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=3, history_size=2)
    if session is not None:
        session.watch(model)
        session.watch_optimizer(opt)
    g = torch.Generator().manual_seed(1)
    losses: list[float] = []
    for step in range(steps):
        x, y = torch.randn(3, 4, generator=g), torch.randn(3, 1, generator=g)
        if plant and step == 1:
            x[0, 0] += 1.0

        def closure(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            losses.append(float(loss))
            return loss

        if session is None:
            opt.step(closure)
        else:
            with session.step(step):
                opt.step(closure)
    return losses


@pytest.mark.parametrize("level", ["boundaries", "ops"])
def test_the_closure_is_a_forward_and_a_backward(tmp_path, level):
    plain = _train(None)
    with Session(tmp_path / "r", level) as s:
        assert _train(s) == plain  # the wrapped closure computes what the closure computes
    r = read(tmp_path / "r").filter(pl.col("step") == 1).sort("seq")
    batch = r.filter(pl.col("kind") == "batch")
    assert batch.select("phase", "module", "arg").rows() == [("forward", "", "args[0]")]
    boundaries = r.filter(pl.col("kind").is_in(["module_input", "module_output"]))
    assert set(boundaries["phase"]) == {"forward", "backward"}
    if level == "ops":
        ops = r.filter(pl.col("kind") == "op")
        assert "aten::addmm.default" in set(ops.filter(pl.col("phase") == "forward")["name"])
        # The update itself (SGD's add_ of the gradients) stays the optimizer's.
        assert "aten::add_.Tensor" in set(ops.filter(pl.col("phase") == "optimizer")["name"])
    opt = r.filter(pl.col("phase") == "optimizer")
    params_in = opt.filter((pl.col("kind") == "param") & (pl.col("role") == "input"))
    grads = opt.filter(pl.col("kind") == "grad")
    params_out = opt.filter((pl.col("kind") == "param") & (pl.col("role") == "output"))
    # Parameters before the update, then the closure, then its gradients, then the update.
    assert params_in["seq"].max() < batch["seq"][0] < grads["seq"].min()
    assert grads["seq"].max() < params_out["seq"].min()
    assert grads.height == params_in.height == 4


def test_lbfgs_calls_its_closure_several_times_per_step(tmp_path):
    plain = _train(None, "lbfgs")
    with Session(tmp_path / "r", "boundaries") as s:
        assert _train(s, "lbfgs") == plain
    r = read(tmp_path / "r").filter(pl.col("step") == 1)
    calls = r.filter(pl.col("kind") == "batch")["occurrence"].to_list()
    assert len(calls) >= 2 and calls == list(range(len(calls)))  # one forward per closure call
    grads = r.filter((pl.col("kind") == "grad") & (pl.col("name") == "0.weight"))
    assert grads["occurrence"].to_list() == calls  # the gradients after each call
    params = r.filter((pl.col("kind") == "param") & (pl.col("name") == "0.weight") & (pl.col("phase") == "optimizer"))
    assert params["role"].to_list() == ["input", "output"]  # before and after the whole step


def test_a_changed_sample_is_a_source_at_the_batch(tmp_path):
    for name, plant in (("a", False), ("b", False), ("data", True)):
        with Session(tmp_path / name, "boundaries") as s:
            _train(s, plant=plant)
    a = open_run(tmp_path / "a")
    assert bisect(a, open_run(tmp_path / "b")).status == "identical"
    f = bisect(a, open_run(tmp_path / "data")).rank(0).effective
    assert (f.verdict, f.kind, f.phase, f.step) == ("source", "batch", "forward", 1)


SCRIPT = """
import sys, torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
g = torch.Generator().manual_seed(1)
for step in range(3):
    x, y = torch.randn(3, 4, generator=g), torch.randn(3, 1, generator=g)
    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss
    opt.step(closure)
"""


def test_the_launcher_counts_closure_steps_and_records_their_batch(tmp_path):
    """Under the launcher the step begins at the optimizer step (before the closure's forward)
    and ends after it; each step's batch is recorded in its forward."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    argv = sys.argv
    try:
        assert launcher_main(["--out", str(tmp_path / "r"), "--level", "boundaries", "--", str(script)]) == 0
    finally:
        sys.argv = argv
    r = read(tmp_path / "r")
    batch = r.filter(pl.col("kind") == "batch").sort("step")
    assert batch.select("step", "phase").rows() == [(0, "forward"), (1, "forward"), (2, "forward")]
    assert not r.filter((pl.col("phase") == "optimizer") & (pl.col("kind") == "module_input")).height
