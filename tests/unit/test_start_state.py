"""The state a capture starts from (kind ``state``, issue 42): recorded once at the first captured
step and again after a checkpoint load the session sees; compared when both runs hold it, no
evidence when one run only does (a resumed run, another ``steps=``), and never a perturbation.
"""

from __future__ import annotations

import polars as pl
import torch

from detfp_analyze.bisect import bisect
from detfp_analyze.io.reader import open_run
from detfp_capture import Session


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(6, 4)
        self.norm = torch.nn.BatchNorm1d(4)
        self.head = torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.fc(x)))


def _train(out, *, steps=range(4), reload_at: int | None = None, bias: float | None = None, capture=None) -> list:
    torch.manual_seed(0)
    model = Net()
    if bias is not None:
        with torch.no_grad():
            model.head.bias.fill_(bias)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(1))
    losses = []
    session = Session(out, "boundaries", **(capture or {})) if out is not None else None
    try:
        if session is not None:
            session.watch(model)
            session.watch_optimizer(opt)
        for i in steps:
            if i == reload_at:
                model.load_state_dict(saved)  # a rollback the session sees
            ctx = session.step(i) if session is not None else torch.no_grad()
            with ctx:
                with torch.enable_grad():
                    loss = model(x).square().mean()
                    loss.backward()
                opt.step()
                opt.zero_grad()
            losses.append(loss.item())
    finally:
        if session is not None:
            session.close()
    return losses


def _state(run) -> pl.DataFrame:
    recs = open_run(run).scan("records").filter(pl.col("kind") == "state").collect()
    return recs.select("step", "name", "arg", "phase", "role").sort("step", "name")


def test_recorded_at_the_first_step_and_after_a_load_and_capture_changes_nothing(tmp_path):
    off = _train(None, reload_at=2)
    assert _train(tmp_path / "a", reload_at=2) == off  # capture on: the same losses, bit for bit
    st = _state(tmp_path / "a")
    assert sorted(set(st["step"])) == [0, 2]
    first = st.filter(pl.col("step") == 0)
    want = {("fc.weight", "param"), ("fc.bias", "param"), ("norm.weight", "param"), ("norm.bias", "param"),
            ("head.weight", "param"), ("head.bias", "param"), ("norm.running_mean", "buffer"),
            ("norm.running_var", "buffer"), ("norm.num_batches_tracked", "buffer")}  # fmt: skip
    assert set(zip(first["name"], first["arg"], strict=True)) == want
    assert set(first["phase"]) == {"step"} and set(first["role"]) == {"value"}
    # After the load, Adam's state exists too.
    again = st.filter(pl.col("step") == 2)
    assert {n for n, a in zip(again["name"], again["arg"], strict=True) if a == "optimizer_state"} >= {
        "head.bias.exp_avg", "head.bias.exp_avg_sq"
    }  # fmt: skip


def test_another_initial_state_is_a_source_before_step_0(tmp_path):
    _train(tmp_path / "a")
    _train(tmp_path / "b", bias=0.5)
    res = bisect(open_run(tmp_path / "a"), open_run(tmp_path / "b"))
    f = res.rank(0).first
    assert (f.kind, f.op, f.verdict, f.step) == ("state", "head.bias", "source", 0)
    assert res.diagnosis.cause == "restore" and res.diagnosis.headline.startswith(
        "The state before step 0 differs: head.bias (a parameter) in this process"
    )


def test_state_one_run_only_holds_is_no_evidence(tmp_path):
    """B captures from step 2 only (as a resumed run would): its state records at step 2 have no
    twin in A, which captured from step 0: unknown, not a structural difference."""
    _train(tmp_path / "a")
    _train(tmp_path / "b", capture={"steps": "2-3"})
    assert sorted(set(_state(tmp_path / "b")["step"])) == [2]
    res = bisect(open_run(tmp_path / "a"), open_run(tmp_path / "b"))
    assert res.status == "identical", res.diagnosis.explanation
