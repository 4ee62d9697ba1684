"""Module backward hooks: they never raise inside autograd, and they never outlive their call.

Planted on the shapes real stacks have: a leaf input whose gradient ``torch.autograd.grad``
computes (a pipeline stage), double backward, ``torch.func`` transforms and checkpoint around
a watched module; a module that returns its bias Parameter (Megatron-Core's ``skip_bias_add``),
over steps and over microbatches whose backwards run one after the other (a pipeline schedule);
a second backward through a retained graph.
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


def _events(path, type_: str) -> pl.DataFrame:
    return read(path, "events").filter(pl.col("type") == type_)


def _grads(path) -> pl.DataFrame:
    return read(path).filter(pl.col("phase") == "backward").select("step", "module", "kind", "occurrence", "arg", "seq")


def _unique_keys(path) -> None:
    keys = read(path).select("step", "microbatch", "phase", "module", "kind", "name", "occurrence", "role", "arg")
    assert keys.height == keys.unique().height


def test_autograd_grad_of_a_leaf_input_is_recorded_not_raised(tmp_path):
    """A watched module whose input is a leaf requiring grad, differentiated with
    ``torch.autograd.grad`` (what a pipeline stage does): torch's multi-grad hook raised here."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    x = torch.randn(3, 4, requires_grad=True)
    with Session(tmp_path / "r", "boundaries") as s:
        s.watch(m)
        with s.step(0):
            (g,) = torch.autograd.grad(m(x).sum(), [x])
    assert _events(tmp_path / "r", "capture_error").height == 0
    r = read(tmp_path / "r").filter((pl.col("module") == "") & (pl.col("arg") == "grad_in[0]"))
    assert r["phase"].to_list() == ["backward"] and r["status"].to_list() == ["ok"]
    want = torch.autograd.grad(m(x).sum(), [x])[0]
    assert torch.equal(g, want)


def _leaf_pair_step(m: torch.nn.Module, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A module of two leaf inputs, its input gradients taken by ``autograd.grad``."""
    ga, gb = torch.autograd.grad(m(a, b).sum(), [a, b])
    return ga + gb


class _Pair(torch.nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return (a * b).tanh()


def test_input_gradients_of_leaves_inside_autograd_grad_are_one_call_in_argument_order(tmp_path):
    """The engine cannot say which leaf gradients ``autograd.grad`` computes: the call's input
    gradients are recorded at the end of that backward, together and in argument order."""
    a, b = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
    m = _Pair()
    with Session(tmp_path / "w", "boundaries") as s:
        s.watch(m)
        with s.step(0):
            _leaf_pair_step(m, a, b)
    r = read(tmp_path / "w").filter(pl.col("kind") == "module_output").filter(pl.col("phase") == "backward")
    assert r["arg"].to_list() == ["grad_in[0]", "grad_in[1]"]
    assert r["occurrence"].unique().to_list() == [0]


@pytest.mark.parametrize("level", ["boundaries", "ops"])
def test_no_autograd_construct_raises_and_capture_changes_nothing(tmp_path, level):
    """autograd.grad, create_graph and double backward, torch.func transforms, checkpoint
    (reentrant and not) around a watched module: the job runs on, its numbers as without
    capture, and capture stays on (no capture_error)."""

    def job(session: Session | None) -> list[str]:
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
        x = torch.randn(3, 4)
        if session is not None:
            session.watch(m)
        out = []
        for step in range(2):
            ctx = session.step(step) if session is not None else torch.enable_grad()
            with ctx:
                params = dict(m.named_parameters())
                g = torch.func.grad(lambda p, x: torch.func.functional_call(m, p, (x,)).sum())(params, x)
                out.append(g["0.weight"].sum().detach())
                xr = x.clone().requires_grad_()
                y = m(xr).sum()
                (gx,) = torch.autograd.grad(y, [xr], create_graph=True)
                (gx.pow(2).sum() + y).backward()
                checkpoint(m, xr, use_reentrant=True).sum().backward()
                checkpoint(m, xr, use_reentrant=False).sum().backward()
                out += [xr.grad.sum(), *(p.grad.sum() for p in m.parameters())]
                m.zero_grad()
        return [struct.pack("<f", float(v.detach())).hex() for v in out]

    plain = job(None)
    with Session(tmp_path / "r", level) as s:
        assert job(s) == plain
    assert _events(tmp_path / "r", "capture_error").height == 0
    _unique_keys(tmp_path / "r")


class _SkipBias(torch.nn.Module):
    """A linear layer that returns its bias Parameter instead of adding it (``skip_bias_add``)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 4))
        self.b = torch.nn.Parameter(torch.randn(4))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x @ self.w, self.b


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = _SkipBias()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, b = self.lin(x)
        return (y + b).tanh().sum()


def _skip_bias_run(out, *, change_step: int | None = None, steps: int = 4) -> None:
    torch.manual_seed(0)
    net = _Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with Session(out, "boundaries") as s:
        s.watch(net)
        s.watch_optimizer(opt)
        for step in range(steps):
            x = torch.randn(3, 4)
            with s.step(step):
                if step == change_step:
                    with torch.no_grad():
                        net.lin.w[0, 0] += 1e-3  # a write the capture does not see
                net(x).backward()
                opt.step()
                opt.zero_grad()


def test_a_parameter_returned_as_output_is_hooked_for_its_step_only(tmp_path):
    """The bias Parameter's gradient hook used to stay on the Parameter for good: every later
    backward fired every earlier step's hook, under that step's call (repeated keys)."""
    _skip_bias_run(tmp_path / "a")
    g = _grads(tmp_path / "a").filter((pl.col("module") == "lin") & (pl.col("arg") == "grad_out[1]"))
    assert g["step"].to_list() == [0, 1, 2, 3]
    _unique_keys(tmp_path / "a")


def test_a_change_after_a_parameter_output_is_a_divergence_not_a_corrupt_shard(tmp_path):
    _skip_bias_run(tmp_path / "a")
    _skip_bias_run(tmp_path / "b")
    _skip_bias_run(tmp_path / "c", change_step=2)
    assert bisect(open_run(tmp_path / "a"), open_run(tmp_path / "b")).status == "identical"
    res = bisect(open_run(tmp_path / "a"), open_run(tmp_path / "c"))
    assert res.status == "diverged" and res.first_step == 2
    eff = res.rank(0).effective
    assert (eff.step, eff.module, eff.kind) == (2, "lin", "module_output")


def test_each_microbatch_backward_serves_its_own_forward_call(tmp_path):
    """Two forwards, then their backwards one after the other (a pipeline schedule): the
    Parameter output hooked by both calls gives one record per backward, not both in the first."""
    torch.manual_seed(0)
    net = _Net()
    xs = [torch.randn(3, 4) for _ in range(2)]
    with Session(tmp_path / "r", "boundaries") as s:
        s.watch(net)
        with s.step(0):
            losses = [net(x) for x in xs]
            for loss in losses:
                loss.backward()
                s.probe("mark", torch.zeros(1))  # a record between the two backwards
    r = read(tmp_path / "r")
    mark = r.filter(pl.col("kind") == "probe")["seq"][0]
    g = r.filter((pl.col("module") == "lin") & (pl.col("arg") == "grad_out[1]"))
    assert [int(seq < mark) for seq in g["seq"]] == [1, 0]
    assert g["occurrence"].to_list() == [0, 1]
    _unique_keys(tmp_path / "r")


def test_a_second_backward_through_a_retained_graph_is_another_call(tmp_path):
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    with Session(tmp_path / "r", "boundaries") as s:
        s.watch(m)
        with s.step(0):
            y = m(x).sum()
            y.backward(retain_graph=True)
            y.backward()
    g = _grads(tmp_path / "r").filter(pl.col("arg") == "grad_out[0]")
    assert g["occurrence"].to_list() == [0, 1]
    _unique_keys(tmp_path / "r")


def test_hooks_are_removed_at_step_end(tmp_path):
    """A leaf input reused every step (a pipeline stage's receive buffer) carries no hook of an
    earlier step."""
    m = torch.nn.Linear(4, 4)
    buf = torch.randn(2, 4, requires_grad=True)
    with Session(tmp_path / "r", "boundaries") as s:
        s.watch(m)
        for step in range(3):
            with s.step(step):
                m(buf).sum().backward()
    assert not buf._backward_hooks
    g = _grads(tmp_path / "r").filter(pl.col("arg") == "grad_in[0]")
    assert g["step"].to_list() == [0, 1, 2]
