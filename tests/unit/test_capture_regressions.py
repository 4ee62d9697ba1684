"""Regressions of the multi-rank example: tracer ops recorded from a comm-hook callback, record
order of DDP bucket outputs, phase after backward and in recompute, false hazards, close."""

from __future__ import annotations

import polars as pl
import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from torch.utils.checkpoint import checkpoint

from detfp_capture import Session
from tests.fixtures.models import Net, read


def _ddp_step(out, monkeypatch, *, inline: bool):
    """One DDP step at level ops; ``inline``: every bucket all-reduce has finished before the
    comm hook chains its callback, so the callback runs on the training thread, inside the mode."""
    orig = c10d.all_reduce

    def finished_all_reduce(*a, **k):
        w = orig(*a, **k)
        w.wait()
        return w

    if inline:
        monkeypatch.setattr(c10d, "all_reduce", finished_all_reduce)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(Net(ckpt=True), bucket_cap_mb=0.0005)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tokens = torch.randint(0, 16, (4, 6), generator=torch.Generator().manual_seed(1))
    with Session(out, "ops") as s:
        s.watch(model)
        s.watch_optimizer(opt)
        with s.step(0):
            loss = torch.nn.functional.cross_entropy(model(tokens).reshape(-1, 16), tokens.reshape(-1))
            loss.backward()
            dist.all_reduce(loss.detach().clone())  # the loss all-reduce after backward
            opt.step()
    monkeypatch.setattr(c10d, "all_reduce", orig)
    return read(out).sort("seq")


def _shape(r: pl.DataFrame) -> list[tuple]:
    return r.select("phase", "module", "kind", "name", "occurrence", "role", "arg").rows()


def test_ddp_bucket_callback_never_records_tracer_ops_and_order_is_stable(tmp_path, gloo1, monkeypatch):
    inline = _ddp_step(tmp_path / "inline", monkeypatch, inline=True)
    late = _ddp_step(tmp_path / "late", monkeypatch, inline=False)
    # The digest's own GEMM never appears: the callback ran with the dispatch mode popped.
    assert inline.filter(pl.col("name").str.contains("_int_mm")).height == 0
    assert (inline["status"] != "error").all() and (late["status"] != "error").all()
    # Completion timing does not change the record stream.
    assert _shape(inline) == _shape(late)
    # Bucket outputs (and reduced grads) land at the end of backward, before the loss all-reduce,
    # which is labelled with the phase after backward (step), not forward.
    coll = inline.filter(pl.col("kind").is_in(["collective", "reduced_grad"]))
    rows = coll.select("name", "role", "phase").rows()
    loss_ar = [i for i, (n, role, _) in enumerate(rows) if n == "all_reduce@world" and role == "input"][-1]
    assert rows[loss_ar][2] == "step"
    bucket_outs = [i for i, (n, role, ph) in enumerate(rows) if role == "output" and ph == "backward"]
    assert bucket_outs and max(bucket_outs) < loss_ar
    assert {r[2] for r in rows[:loss_ar]} == {"backward"}


def test_cpu_nonblocking_copy_is_not_pending_and_overwrites_are_not_uninitialized_reads(tmp_path):
    torch.manual_seed(0)
    drop = torch.nn.Dropout(0.5).train()
    x = torch.randn(64, 64)
    with Session(tmp_path / "r", "ops") as s, s.step(0):
        dst = torch.zeros(64, 64)
        dst.copy_(x, non_blocking=True)  # CPU to CPU: synchronous
        (dst + 1).sum()
        y = drop(x)  # empty_like + bernoulli_: written before anything reads it
        (y * 2).sum()
        e = torch.empty(8)
        e.fill_(1.0)
        e.sum()
        u = torch.empty(8)
        u.sum()  # a real read of uninitialized memory: still flagged
    r = read(tmp_path / "r")
    flagged = r.filter(pl.col("hazards").list.len() > 0)
    assert set(flagged["name"]) == {"aten::sum.default"}
    # The read (not digested: garbage is no evidence) and what the op computed from it.
    assert flagged.select("role", "status").rows() == [("input", "skipped"), ("output", "ok")]
    assert flagged["hazards"].to_list() == [["uninitialized"], ["uninitialized"]]


class _Probed(torch.nn.Module):
    def __init__(self, s: Session) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.s = s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        self.s.probe("inner", y)
        return torch.tanh(y)  # saves its output: a non-reentrant recompute runs past the probe


@pytest.mark.parametrize("reentrant", [False, True])
def test_metrics_level_probe_in_recompute_is_labelled_recompute(tmp_path, reentrant):
    x = torch.randn(2, 8, requires_grad=True)
    with Session(tmp_path / "r", "metrics") as s:
        m = _Probed(s)
        with s.step(0):
            checkpoint(m, x, use_reentrant=reentrant).sum().backward()
            s.probe("after", x.grad)
    r = read(tmp_path / "r").filter(pl.col("kind") == "probe").sort("seq")
    assert r.select("name", "phase").rows() == [("inner", "forward"), ("inner", "recompute"), ("after", "step")]


def test_close_waits_for_a_slow_writer(tmp_path, monkeypatch):
    import time

    from detfp_capture import session as session_mod

    monkeypatch.setattr(session_mod, "_CLOSE_TIMEOUT_S", 0.2)
    s = Session(tmp_path / "r", "metrics")
    w = s._writer
    orig = w._write

    def slow(window, tables):
        time.sleep(0.15)  # slower than the timeout, but always progressing
        orig(window, tables)

    monkeypatch.setattr(w, "_write", slow)
    for step in range(4):
        with s.step(step):
            s.metric("loss", float(step))
        s._flush_safely()
    s.close()
    assert sorted(read_metrics(tmp_path / "r")) == [0.0, 1.0, 2.0, 3.0]


def read_metrics(path) -> list[float]:
    from detfp_analyze.io.reader import open_run

    return open_run(path).scan("metrics").collect()["value"].to_list()
