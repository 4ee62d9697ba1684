"""Capture on other people's stacks, one mechanism at a time (the zoo runs them end to end).

Each test plants the case that broke on real training code and fails on the code before the fix:
a custom op under autocast at level ops (capture changed its numbers), a DTensor parameter (a
digest error), a storage freed under a waiting digest (FSDP's ``resize_(0)``: a crash), a
DistributedDataParallel created around a module watched bare (its reduction unseen), a module
compiled in place (its boundary unseen), the optimizer's hyperparameters recorded by value, and
modules FSDP2 sharded named by the class the program wrote (not the class ``fully_shard`` made).
"""

from __future__ import annotations

import struct

import polars as pl
import torch

from detfp_analyze.bisect import bisect
from detfp_analyze.io.reader import open_run
from detfp_capture import Session, digest
from tests.fixtures.models import read


@torch.library.custom_op("detfp_test::chunked_mm", mutates_args=())
def chunked_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A custom op whose Python body dispatches a matmul (autocast applies to it)."""
    return x @ w


@chunked_mm.register_fake
def _(x, w):
    return x.new_empty((x.shape[0], w.shape[1]))


def _autocast_loss(session: Session | None) -> str:
    torch.manual_seed(0)
    x, w = torch.randn(4, 8), torch.randn(8, 3)
    ctx = session.step(0) if session is not None else torch.enable_grad()
    with ctx, torch.autocast("cpu", dtype=torch.bfloat16):
        y = chunked_mm(x, w).float().sum()
    return struct.pack("<d", float(y)).hex()


def test_custom_op_under_autocast_runs_as_without_capture(tmp_path):
    """A dispatch mode runs ops with autocast excluded; the op's body must still be autocast."""
    plain = _autocast_loss(None)
    with Session(tmp_path / "r", "ops") as s:
        assert _autocast_loss(s) == plain


def test_dtensor_is_its_local_shard_and_placement(tmp_path, gloo1):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    sharded = distribute_tensor(torch.arange(8.0), mesh, [Shard(0)])
    fp = digest.fingerprint(sharded)
    assert fp.error is None and set(fp.components) == {"_local_tensor"}
    assert fp.components["_local_tensor"] == digest.fingerprint(torch.arange(8.0))
    # Same local values, another placement: another fingerprint.
    assert digest.fingerprint(distribute_tensor(torch.arange(8.0), mesh, [Replicate()])).digest != fp.digest
    assert digest.fingerprint(distribute_tensor(torch.arange(8.0), mesh, [Shard(0)])).digest == fp.digest


def test_storage_freed_under_a_waiting_digest(tmp_path):
    """FSDP frees unsharded parameters with storage.resize_(0), unseen by the dispatcher: a
    digest still waiting for its batch is taken first (it used to read freed memory)."""
    with Session(tmp_path / "r", "ops") as s, s.step(0):
        w = torch.arange(64, dtype=torch.float32)
        y = w * 2.0  # y's digest waits for a batch
        y.untyped_storage().resize_(0)
        w.sum()
    r = read(tmp_path / "r").filter((pl.col("name") == "aten::mul.Tensor") & (pl.col("role") == "output"))
    assert r["status"].to_list() == ["ok"]
    want = digest.fingerprint(torch.arange(64, dtype=torch.float32) * 2.0).digest
    assert f"{r['digest_hi'][0]:016x}{r['digest_lo'][0]:016x}" == want


def test_ddp_created_after_watching_the_bare_model(tmp_path, gloo1):
    def run(out, order: str) -> None:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
        ddp = None
        if order == "ddp_first":
            ddp = torch.nn.parallel.DistributedDataParallel(model)
        with Session(out, "boundaries") as s:
            s.watch(model)
            ddp = ddp or torch.nn.parallel.DistributedDataParallel(model)
            for step in range(2):
                with s.step(step):
                    ddp(torch.ones(2, 4)).sum().backward()

    for order in ("watch_first", "ddp_first"):
        run(tmp_path / order, order)
        red = read(tmp_path / order).filter(pl.col("kind") == "reduced_grad")
        assert set(red["name"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}, order
    assert bisect(open_run(tmp_path / "watch_first"), open_run(tmp_path / "ddp_first")).status == "identical"


def test_module_compiled_in_place_is_recorded_at_its_boundary(tmp_path):
    def run(session: Session | None) -> list[float]:
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
        m[0].compile(backend="eager")
        if session is not None:
            session.watch(m)
        out = []
        for step in range(2):
            with session.step(step) if session is not None else torch.enable_grad():
                loss = m(torch.randn(4, 8)).square().mean()
                loss.backward()
                out.append(loss.item())
        return out

    base = run(None)
    with Session(tmp_path / "r", "boundaries") as s:
        assert run(s) == base
    r = read(tmp_path / "r").filter((pl.col("step") == 1) & (pl.col("phase") == "forward"))
    region = r.filter(pl.col("module") == "0")
    assert region.select("kind", "role").rows() == [("compiled", "input"), ("compiled", "output")]


def test_optimizer_hyperparameters_are_named_by_value(tmp_path):
    def run(out, wd: float) -> None:
        torch.manual_seed(0)
        m = torch.nn.Linear(4, 2)
        opt = torch.optim.AdamW(m.parameters(), lr=0.1, weight_decay=wd)
        with Session(out, "boundaries") as s:
            s.watch(m)
            s.watch_optimizer(opt)
            with s.step(0):
                m(torch.ones(3, 4)).sum().backward()
                opt.step()

    run(tmp_path / "a", 0.01)
    run(tmp_path / "b", 0.02)
    res = bisect(open_run(tmp_path / "a"), open_run(tmp_path / "b"))
    f = res.rank(0).first
    assert (f.verdict, f.phase, f.kind, f.diff_kind) == ("origin", "optimizer", "param", "arguments")
    assert f.diff.args_changes == ("weight_decay 0.01 -> 0.02",)
    assert res.diagnosis.pattern == "single_process"


def test_a_setting_changed_mid_run_is_an_event_env_and_certify_report(tmp_path):
    from typer.testing import CliRunner

    from detfp_analyze.cli import app
    from detfp_analyze.single.certify import certify

    threads = torch.get_num_threads()
    try:
        for name, change in (("a", False), ("b", True)):
            torch.set_num_threads(1)
            with Session(tmp_path / name, "metrics") as s:
                for step in range(3):
                    if change and step == 2:
                        torch.set_num_threads(2)
                    with s.step(step):
                        s.metric("loss", 1.0)
    finally:
        torch.set_num_threads(threads)
    # The manifests agree (the settings of the first step); the change is an event.
    assert open_run(tmp_path / "b").manifest(0)["determinism"]["num_threads"] == 1
    out = CliRunner().invoke(app, ["env", str(tmp_path / "a"), str(tmp_path / "b")])
    assert out.exit_code == 1
    assert "run B [rank 0] before step 2: num_threads: 1 -> 2" in out.output
    kinds = {p.kind: p.detail for p in certify(tmp_path / "b").problems}
    assert "num_threads: 1 -> 2" in kinds["setting_changed"]


def test_capture_does_not_change_which_ops_autograd_runs(tmp_path):
    """AccumulateGrad steals a gradient nothing else holds, and copies it otherwise
    (new_empty_strided + copy_): a digest waiting for its batch must not hold a backward
    output, or capture changes the program's own ops (and, racing the batch, differently in
    two runs of the same job)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Names(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(f"{func._schema.name}.{func._overloadname}")
            return func(*args, **(kwargs or {}))

    def backward(emb: torch.nn.Module) -> None:
        emb(torch.tensor([[1, 2, 3]])).sum().backward()

    torch.manual_seed(0)
    emb = torch.nn.Embedding(16, 8)
    out = emb(torch.tensor([[1, 2, 3]])).sum()
    with Names() as plain:
        out.backward()
    emb.weight.grad = None
    with Session(tmp_path / "r", "ops") as s:
        s.watch(emb)
        with s.step(0):
            backward(emb)
    r = read(tmp_path / "r").filter((pl.col("phase") == "backward") & (pl.col("kind") == "op"))
    # (backward() makes its seed gradient before the engine runs: not a backward-phase record.)
    want = [n for n in dict.fromkeys(plain.names) if n != "aten::ones_like.default"]
    assert list(dict.fromkeys(r["name"])) == want
    assert "aten::new_empty_strided.default" not in want


def test_mapping_batches_are_flattened_like_dicts():
    """``BatchEncoding`` and other ``UserDict`` batches are Mappings, not dicts: their tensors
    are module inputs all the same, in the mapping's own order."""
    from collections import UserDict

    from detfp_capture._sources.modules import flatten_tensors

    ids, mask = torch.ones(2, 3), torch.zeros(2, 3)
    out: list = []
    flatten_tensors(UserDict(input_ids=ids, extra={"mask": mask}), "kwargs.batch", out)
    assert [(k, t is v) for (k, t), v in zip(out, (ids, mask), strict=True)] == [
        ("kwargs.batch.input_ids", True),
        ("kwargs.batch.extra.mask", True),
    ]


def test_modules_sharded_by_fsdp2_keep_their_class_name(tmp_path, gloo1):
    """``fully_shard`` swaps a module's class for a generated ``FSDP<Name>``: the batch and the
    module records name ``Name``, as an unsharded run of the same model does (a report said
    "the batch fed to FSDPLlama")."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.l(x)

    names = {}
    for label in ("plain", "fsdp"):
        m = Tiny()
        if label == "fsdp":
            mesh = init_device_mesh("cpu", (1,))
            fully_shard(m.l, mesh=mesh)
            fully_shard(m, mesh=mesh)
            assert type(m).__name__ == "FSDPTiny"
        with Session(tmp_path / label, "boundaries") as s:
            s.watch(m)
            with s.step(0):
                m(torch.ones(2, 4)).sum().backward()
        r = read(tmp_path / label).filter(pl.col("kind").is_in(["batch", "module_output"]))
        names[label] = r.select("kind", "name", "module").unique(maintain_order=True).rows()
    assert names["fsdp"] == names["plain"] == [("batch", "Tiny", ""), ("module_output", "Linear", "l"), ("module_output", "Tiny", "")]
