"""repeat_check: planted varying-order ops are caught where they are, deterministic modules pass,
and the check leaves parameters, gradients, buffers, optimizer and RNG state as documented."""

from __future__ import annotations

import copy
import itertools
import random
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch.testing._internal.two_tensor import TwoTensor

from detfp_capture.errors import ConfigError
from detfp_guards import NotReproducibleError, assert_bitwise_reproducible, repeat_check
from tests.fixtures.planted import PermutedSum, ShuffledEmbedding, shuffled_index_add, shuffled_rows


def _bits(t: torch.Tensor) -> bytes:
    t = t.detach().contiguous().reshape(-1)
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _state_bits(model: torch.nn.Module, opt: torch.optim.Optimizer | None = None) -> dict:
    """Every parameter, gradient (or None), buffer and optimizer state tensor, as bytes."""
    out = {}
    for name, p in model.named_parameters():
        out[f"p:{name}"] = _bits(p)
        out[f"g:{name}"] = None if p.grad is None else _bits(p.grad)
    for name, b in model.named_buffers():
        out[f"b:{name}"] = _bits(b)
    if opt is not None:
        names = {id(p): n for n, p in model.named_parameters()}
        for p, st in opt.state.items():
            for k, v in st.items():
                out[f"o:{names[id(p)]}.{k}"] = _bits(v) if isinstance(v, torch.Tensor) else v
        for i, g in enumerate(opt.param_groups):
            out[f"lr:{i}"] = g["lr"]
    return out


# ----------------------------------------------------------------------------- planted ops
def test_forward_op_with_varying_order_is_the_origin_with_its_ulp_size(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), PermutedSum(32))
    res = repeat_check(model, torch.randn(8, 16), out_dir=tmp_path)
    assert not res.ok and res.pair == (0, 1)
    assert (res.verdict, res.op, res.module) == ("origin", "detfp_planted::permuted_sum.default", "1")
    assert res.divergence.phase == "forward" and res.divergence.role == "output"
    # The detail pass dumped that op only and measured the difference.
    assert res.detailed and res.diff.kind == "values" and res.diff.confirmed == "bytes"
    assert res.diff.max_ulp >= 1 and res.diff.n_differing >= 1
    assert res.kernels is not None and res.kernels.same
    assert res.traces == (tmp_path / "detail-0", tmp_path / "detail-1")
    assert "NOT bitwise reproducible" in res.report and "origin" in res.report and "ULP" in res.report
    assert f"detfp-analyze bisect {tmp_path / 'detail-0'} {tmp_path / 'detail-1'} --depth kernel" in res.report
    assert str(res) == res.report


def test_backward_only_atomics_are_caught_in_the_backward():
    torch.manual_seed(0)
    emb = ShuffledEmbedding(10, 8)
    tokens = torch.randint(0, 10, (4, 32))  # many repeated tokens: their gradients add up in the shuffled op
    pos = torch.randn(32, 8)  # so that a token's gradient differs by position
    res = repeat_check(lambda t: (emb(t) + pos).tanh().mean(), tokens)
    assert not res.ok and res.backward
    assert (res.verdict, res.op, res.divergence.phase) == (
        "origin",
        "detfp_planted::shuffled_index_add.default",
        "backward",
    )
    assert res.diff.max_ulp is not None


def test_rows_in_a_varying_order_are_a_permutation():
    x = torch.randn(64, 8)
    res = repeat_check(lambda: shuffled_rows(x) * 2, backward=False)
    assert not res.ok and res.op == "detfp_planted::shuffled_rows.default"
    assert res.diff.kind == "permutation" and res.diff.rows_differing > 0


def test_lower_levels_name_the_module_or_the_output():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), PermutedSum(8))
    x = torch.randn(3, 4)
    res = repeat_check(model, x, level="boundaries", detail=False)
    assert not res.ok and (res.verdict, res.divergence.kind, res.module) == ("origin", "module_output", "1")
    assert "magnitude" not in res.report.splitlines()[2]
    # Level metrics sees only what the call returned; a returned number is compared as a metric.
    # The order of the additions alternates between calls, with values whose float32 sum depends
    # on it ((1 + 1e8) - 1e8 = 0, (-1e8 + 1e8) + 1 = 1): a random order (permuted_sum) over few
    # distinct values gives the same sum often enough to make the check pass by chance.
    calls, vals = itertools.count(), torch.tensor([1.0, 1e8, -1e8])

    def alternating_sum() -> float:
        v = vals if next(calls) % 2 == 0 else vals.flip(0)
        return ((v[0] + v[1]) + v[2]).item()

    res = repeat_check(alternating_sum, level="metrics")
    assert not res.ok and res.divergence is None
    assert res.bisect.ranks[0].verdict == "metric_only" and res.bisect.ranks[0].metric_name == "output"


def test_in_place_kernel_on_a_nested_input(tmp_path):
    src, idx = torch.randn(200, 4), torch.randint(0, 5, (200,))
    inputs = {"out": [torch.zeros(5, 4)], "idx": idx}
    before = inputs["out"][0].clone()

    def kernel(d):
        d["out"][0].copy_(shuffled_index_add(d["out"][0], d["idx"], src))

    res = repeat_check(kernel, inputs, out_dir=tmp_path, leave="before")
    assert not res.ok and res.op == "detfp_planted::shuffled_index_add.default"
    assert torch.equal(inputs["out"][0], before)  # left as found
    ok = repeat_check(lambda d: d["out"][0].index_add_(0, d["idx"], src), inputs)
    assert ok.ok and not torch.equal(inputs["out"][0], before)  # one call's write, not three


# ----------------------------------------------------------------------------- deterministic code passes
@dataclass
class _Batch:
    tokens: torch.Tensor
    extra: list


def _zoo():
    torch.manual_seed(0)
    x = torch.randn(2, 6, 16)
    return [
        ("encoder layer, dropout on", torch.nn.TransformerEncoderLayer(16, 4, 32, dropout=0.2, batch_first=True), (x,)),
        ("decoder layer", torch.nn.TransformerDecoderLayer(16, 2, 32, batch_first=True), (x, x.flip(1))),
        ("gru", torch.nn.GRU(16, 8, batch_first=True), (x,)),
        (
            "conv + batchnorm + groupnorm",
            torch.nn.Sequential(
                torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.GroupNorm(2, 8), torch.nn.SiLU()
            ),
            (torch.randn(2, 3, 8, 8),),
        ),
        ("embedding, repeated tokens", torch.nn.Embedding(10, 8), (torch.randint(0, 10, (4, 32)),)),
        ("embedding bag", torch.nn.EmbeddingBag(10, 8, mode="mean"), (torch.randint(0, 10, (4, 6)),)),
        ("attention", torch.nn.MultiheadAttention(16, 4, batch_first=True), (x, x, x)),
    ]


def test_deterministic_modules_of_torch_are_reproducible():
    for name, module, args in _zoo():
        res = repeat_check(module, *args)
        assert res.ok, f"{name}:\n{res.report}"
        assert res.backward, name
        assert res.traces is None  # a temporary directory, removed when the check passed
    q = torch.randn(2, 2, 8, 4, requires_grad=True)
    res = repeat_check(lambda t: F.scaled_dot_product_attention(t, t, t, is_causal=True), q, runs=2)
    assert res.ok and q.grad is not None


def test_lstm_at_level_ops():
    # aten::mkldnn_rnn_layer's out[3] is a workspace the CPU kernel allocates in C++ and leaves
    # partly uninitialized: recorded without a digest (it once read as a false origin).
    torch.manual_seed(0)
    res = repeat_check(torch.nn.LSTM(16, 8, batch_first=True), torch.randn(2, 6, 16), runs=2, detail=False)
    assert res.ok, res.report


def test_nested_inputs_subclasses_and_non_leaf_inputs():
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4)
    two = TwoTensor(torch.randn(3, 4), torch.randn(3, 4))
    batch = _Batch(torch.randn(2, 4), [torch.randn(4), 2.0])
    hidden = lin(torch.randn(5, 4))  # non-leaf: the check must not backpropagate into lin's graph

    def fn(t, b, h):
        t.mul_(1.5)  # in place on a subclass input: restored before each repeat
        return {"two": t * 2, "out": [lin(b.tokens) + b.extra[0], (h * b.extra[1]).sum()]}

    a0 = two.a.clone()
    res = repeat_check(fn, two, batch, hidden)
    assert res.ok, res.report
    assert isinstance(res.value["two"], TwoTensor)
    assert torch.equal(two.a, a0 * 1.5)  # one call's write, not three
    assert lin.weight.grad is not None  # from the b.tokens branch
    hidden.sum().backward()  # the graph built before the check is intact


# ----------------------------------------------------------------------------- never perturbs
def _train_setup():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Dropout(0.3), torch.nn.Linear(16, 4)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    gen = torch.Generator().manual_seed(7)
    return model, opt, sched, gen


def _step(model, opt, sched, gen):
    x = torch.randn(6, 8, generator=gen) + random.random()
    opt.zero_grad()
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    sched.step()
    return loss.detach()


def test_training_step_leaves_the_state_one_plain_call_leaves():
    model, opt, sched, gen = _train_setup()
    _step(model, opt, sched, gen)  # optimizer state, gradients and buffers exist before the check
    twin_model, twin_opt, twin_sched, twin_gen = copy.deepcopy((model, opt, sched, gen))
    rng, py_rng = torch.get_rng_state(), random.getstate()

    res = repeat_check(lambda: _step(model, opt, sched, gen), backward=False)
    assert res.ok, res.report
    after = (_state_bits(model, opt), _bits(torch.get_rng_state()), random.getstate(), _bits(gen.get_state()))

    torch.set_rng_state(rng)
    random.setstate(py_rng)
    plain = _step(twin_model, twin_opt, twin_sched, twin_gen)
    assert after == (
        _state_bits(twin_model, twin_opt),
        _bits(torch.get_rng_state()),
        random.getstate(),
        _bits(twin_gen.get_state()),
    )
    assert _bits(res.value) == _bits(plain) and sched.last_epoch == twin_sched.last_epoch
    assert all(opt.state[p] for p in model.parameters())  # still keyed by the same parameter objects


def test_leave_before_and_exceptions_restore_the_found_state():
    model, opt, sched, gen = _train_setup()
    _step(model, opt, sched, gen)
    found = (_state_bits(model, opt), _bits(torch.get_rng_state()), _bits(gen.get_state()), sched.last_epoch)
    res = repeat_check(lambda: _step(model, opt, sched, gen), backward=False, leave="before")
    assert res.ok
    assert (_state_bits(model, opt), _bits(torch.get_rng_state()), _bits(gen.get_state()), sched.last_epoch) == found

    calls = []

    def flaky():
        _step(model, opt, sched, gen)
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        repeat_check(flaky, backward=False)
    assert (_state_bits(model, opt), _bits(torch.get_rng_state()), _bits(gen.get_state()), sched.last_epoch) == found


def test_a_cache_built_by_the_first_call_is_structural_until_warmed_up():
    torch.manual_seed(0)

    class Cached(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.table = None

        def forward(self, x):
            if self.table is None:
                self.table = torch.linspace(0, 1, 4).exp()
            return self.lin(x) * self.table

    m, x = Cached(), torch.randn(2, 4)
    res = repeat_check(m, x, detail=False)
    assert not res.ok and res.verdict == "structural" and "warmup=1" in res.report
    m.table = None
    assert repeat_check(m, x, warmup=1).ok


# ----------------------------------------------------------------------------- API
def test_assert_raises_an_assertion_error_with_the_report(tmp_path):
    torch.manual_seed(0)
    model = PermutedSum(8)
    with pytest.raises(NotReproducibleError) as info:
        assert_bitwise_reproducible(model, torch.randn(2, 8), out_dir=tmp_path, detail=False)
    assert isinstance(info.value, AssertionError)
    assert str(info.value) == info.value.result.report and "permuted_sum" in str(info.value)
    assert (tmp_path / "run-0").is_dir() and (tmp_path / "run-1").is_dir()
    with pytest.raises(ConfigError, match="already holds repeat traces"):
        repeat_check(model, torch.randn(2, 8), out_dir=tmp_path)
    ok = assert_bitwise_reproducible(torch.nn.Linear(8, 2), torch.randn(2, 8), out_dir=tmp_path / "ok", keep="failed")
    assert ok.ok and ok.traces is None and not (tmp_path / "ok" / "run-0").exists()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"runs": 1}, "runs=1: expected an int >= 2"),
        ({"level": "kernels"}, "level='kernels': unknown capture level"),
        ({"leave": "later"}, "leave='later'"),
        ({"keep": "some"}, "keep='some'"),
        ({"warmup": -1}, "warmup=-1"),
    ],
)
def test_bad_options_are_config_errors(options, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        repeat_check(torch.nn.Identity(), torch.ones(1), **options)


def test_a_training_step_with_backward_left_on_says_so():
    lin = torch.nn.Linear(2, 1)

    def step():
        loss = lin(torch.ones(1, 2)).sum()
        loss.backward()
        return loss

    with pytest.raises(ConfigError, match="pass backward=False"):
        repeat_check(step)
    assert lin.weight.grad is None  # restored after the failure


# ----------------------------------------------------------------------------- capture pieces it relies on
def test_watch_all_names_later_modules_and_never_records_a_watched_one_twice(tmp_path):
    import polars as pl

    from detfp_analyze.io.reader import open_run
    from detfp_capture import Session

    watched = torch.nn.Linear(2, 2)
    with Session(tmp_path / "r", level="boundaries") as session:
        session.watch(watched)
        session.watch_all()
        with session.step(0):
            later = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
            later(watched(torch.ones(1, 2)))
    outputs = (
        open_run(str(tmp_path / "r"))
        .scan("records")
        .filter((pl.col("kind") == "module_output") & (pl.col("phase") == "forward"))
        .select("module", "name")
        .collect()
        .rows()
    )
    assert sorted(outputs) == [("", "Linear"), ("", "Sequential"), ("0", "Linear"), ("1", "ReLU")]


def test_a_module_built_inside_the_checked_call():
    # nn.init's uniform_ writes a tensor fresh from torch.empty: its destination is write-only
    # (recorded without a digest), so the garbage it held never reads as a difference.
    res = repeat_check(lambda: torch.nn.Linear(8, 8)(torch.ones(2, 8)), runs=2, detail=False)
    assert res.ok, res.report


def test_loading_the_pytest_plugin_imports_no_torch():
    import subprocess
    import sys

    code = "import sys, detfp_guards.pytest_plugin; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "False"
