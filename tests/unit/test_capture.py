"""Session: no perturbation, record order and keys, recompute, selectors, errors, kernels."""

from __future__ import annotations

import json
import struct
import warnings

import polars as pl
import pytest
import torch

from detfp_analyze.errors import IncompleteRunError
from detfp_analyze.io.reader import open_run
from detfp_capture import Session
from detfp_capture.errors import ConfigError, RunExistsError
from tests.fixtures.models import Net, digest_hi, read, train

LEVELS = ("metrics", "boundaries", "ops")


@pytest.fixture(scope="module")
def baseline() -> tuple[list[int], list[bytes]]:
    return train(steps=3)


@pytest.mark.parametrize("level", LEVELS)
def test_no_perturbation_every_level(tmp_path, baseline, level):
    # Losses and parameters bitwise equal with capture on, checkpointing and dropout included.
    with Session(tmp_path / "r", level) as s:
        got = train(s, steps=3)
    assert got[0] == baseline[0]
    assert got[1] == baseline[1]
    recs = read(tmp_path / "r")
    assert recs.height > 0
    assert (recs["status"] != "error").all()


def test_no_perturbation_with_rows_moments_dumps_kernels(tmp_path, baseline):
    with Session(tmp_path / "r", "ops", rows="head", moments=True, dumps="head", kernels="1") as s:
        got = train(s, steps=3)
    assert got == baseline


def test_metrics_level_records(tmp_path):
    with Session(tmp_path / "r", "metrics") as s:
        losses, _ = train(s, steps=2)
    m = read(tmp_path / "r", "metrics")
    assert m["name"].to_list() == ["loss", "loss"]
    assert m["bits"].to_list() == losses
    assert [struct.unpack("<Q", struct.pack("<d", v))[0] for v in m["value"]] == losses
    recs = read(tmp_path / "r")
    assert set(recs["kind"]) == {"state", "rng_state", "batch", "param"}
    # The state the run starts from, once, first in step 0: every parameter (and the optimizer's state).
    state = recs.filter(pl.col("kind") == "state")
    assert (state["step"] == 0).all() and state["seq"].max() < recs.filter(pl.col("kind") == "rng_state")["seq"].min()
    assert state.filter(pl.col("arg") == "param")["name"].to_list() == [n for n, _ in Net().named_parameters()]
    # The data fed to the root module: the cheapest evidence that a run's input differs.
    batch = recs.filter(pl.col("kind") == "batch")
    assert batch.select("step", "module", "role").rows() == [(0, "", "input"), (1, "", "input")]
    params = recs.filter(pl.col("kind") == "param")
    assert (params["phase"] == "step").all()
    assert params.filter(pl.col("step") == 0)["name"].to_list() == [n for n, _ in Net().named_parameters()]
    rng = recs.filter(pl.col("kind") == "rng_state")
    assert rng["name"].to_list() == ["cpu", "cpu"] and (rng["phase"] == "step").all()
    ev = read(tmp_path / "r", "events")
    assert ev["type"].to_list() == ["step_begin", "step_end", "step_begin", "step_end"]
    man = json.loads((tmp_path / "r/manifest/rank=0/segment-00000.json").read_text())
    assert man["start_step"] == 0 and man["capture"]["level"] == "metrics"


def test_boundaries_order_phases_and_recompute(tmp_path):
    with Session(tmp_path / "r", "boundaries") as s:
        train(s, steps=1)
    r = read(tmp_path / "r")
    seqs = r["seq"].to_list()
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    fwd = r.filter((pl.col("phase") == "forward") & pl.col("kind").is_in(["module_input", "module_output", "batch"]))
    assert fwd.select("kind", "module").rows()[:4] == [
        ("batch", ""),
        ("module_input", "emb"),
        ("module_output", "emb"),
        ("module_input", "b0"),
    ]
    # The checkpointed block is re-run in backward and labelled as recompute; the original forward ran once.
    rec = r.filter(pl.col("phase") == "recompute")
    assert set(rec["module"]) >= {"b1", "b1.fc1"}
    assert r.filter((pl.col("phase") == "forward") & (pl.col("module") == "b1.fc1")).height == 2
    # Backward records come from tensor hooks: gradients in and out of modules.
    bwd = r.filter(pl.col("phase") == "backward")
    assert {"grad_out[0]", "grad_in[0]"} <= set(bwd["arg"])
    # Optimizer boundary: param before and after share one call; grads and states with stable keys.
    opt = r.filter(pl.col("phase") == "optimizer")
    p = opt.filter((pl.col("kind") == "param") & (pl.col("name") == "head.weight"))
    assert p["role"].to_list() == ["input", "output"] and p["occurrence"].to_list() == [0, 0]
    assert "head.weight.exp_avg" in set(opt.filter(pl.col("kind") == "optimizer_state")["name"])
    assert "recompute_mismatch" not in set(read(tmp_path / "r", "events")["type"])


class _Drifting(torch.nn.Module):
    """Adds a call counter: a recompute differs from the original forward (a planted mismatch)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.fc(x) + self.calls


def test_recompute_mismatch_detected(tmp_path):
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    m = torch.nn.Sequential(_Drifting(), torch.nn.Linear(4, 4))
    with Session(tmp_path / "r", "boundaries") as s:
        s.watch(m)
        with s.step(0):
            x = torch.randn(2, 4, requires_grad=True)
            checkpoint(m, x, use_reentrant=False).sum().backward()
    ev = read(tmp_path / "r", "events").filter(pl.col("type") == "recompute_mismatch")
    assert ev.height == 1 and ev["module"][0] == "0"
    assert "recomputed output differs" in ev["detail"][0]


def test_ops_level_records(tmp_path):
    with Session(tmp_path / "r", "ops") as s:
        train(s, steps=1)
    r = read(tmp_path / "r")
    ops = r.filter(pl.col("kind") == "op")
    names = set(ops["name"])
    assert {"aten::addmm.default", "aten::embedding.default", "aten::gelu.default"} <= names
    # Views are counted, not digested; everything else is digested.
    views = ops.filter(pl.col("name") == "aten::t.default")
    assert views.height > 0 and (views["status"] == "skipped").all()
    assert (ops.filter(pl.col("name") == "aten::addmm.default")["status"] == "ok").all()
    # Inputs precede outputs within a call, and occurrence counts calls per key.
    mm = ops.filter(
        (pl.col("name") == "aten::addmm.default") & (pl.col("module") == "b0.fc1") & (pl.col("phase") == "forward")
    )
    assert mm["role"].to_list() == ["input", "input", "input", "output"]
    assert set(mm["occurrence"]) == {0}
    # Phases: backward ops are attributed to their module through the autograd graph; recompute ops too.
    assert "b0.fc1" in set(ops.filter(pl.col("phase") == "backward")["module"])
    assert "b1.fc1" in set(ops.filter(pl.col("phase") == "recompute")["module"])
    assert "optimizer" in set(ops["phase"])
    # An input already digested at the same version reuses the digest of the op that produced it.
    out = ops.filter((pl.col("module") == "b0.fc1") & (pl.col("role") == "output") & (pl.col("phase") == "forward"))
    nxt = ops.filter((pl.col("seq") > out["seq"][0]) & (pl.col("role") == "input")).head(1)
    assert nxt["digest_hi"][0] == out["digest_hi"][0]
    # The tracer's own digest ops never appear (e.g. _int_mm or the arena copies).
    assert not any("int_mm" in n for n in names)
    assert ops.filter(pl.col("args_digest").is_not_null()).height > 0


def test_ops_records_identical_across_runs(tmp_path):
    # Two identical runs give identical streams (keys, digests): nothing process-specific leaks in.
    for name in ("a", "b"):
        with Session(tmp_path / name, "ops") as s:
            train(s, steps=1)
    cols = [
        "step",
        "seq",
        "phase",
        "module",
        "kind",
        "name",
        "occurrence",
        "role",
        "arg",
        "digest_hi",
        "digest_lo",
        "args_digest",
    ]
    a, b = read(tmp_path / "a"), read(tmp_path / "b")
    assert a.select(cols[:9]).equals(b.select(cols[:9]))
    # Dropout's empty_like mask buffer is overwritten by bernoulli_, never read: that input is
    # counted, not digested (its bytes are garbage that differs between runs), and not flagged.
    bern = a.filter((pl.col("name") == "aten::bernoulli_.float") & (pl.col("arg") == "args[0]"))
    assert bern.height > 0 and set(bern["status"]) == {"skipped"}
    assert a.filter(pl.col("hazards").list.len() > 0).height == 0
    assert a.select(cols).equals(b.select(cols))


def test_step_rank_module_selectors(tmp_path, monkeypatch):
    with Session(tmp_path / "s", "boundaries", steps="1-2", modules=r"^b0") as s:
        train(s, steps=4)
    r = read(tmp_path / "s")
    assert sorted(set(r["step"])) == [1, 2]
    mods = set(r.filter(pl.col("kind").is_in(["module_input", "module_output"]))["module"])
    assert mods and all(m.startswith("b0") for m in mods)
    assert "batch" not in set(r["kind"])
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with Session(tmp_path / "k", "ops", ranks="0-2") as s:
        train(s, steps=1)
    assert not (tmp_path / "k" / "records").exists()


def test_microbatches_and_probe(tmp_path):
    with Session(tmp_path / "r", "metrics") as s:
        train(s, steps=1, microbatches=2)
        with s.step(5):
            s.probe("router.map", torch.arange(12).reshape(3, 4), rows=True)
    m = read(tmp_path / "r", "metrics")
    assert m["microbatch"].to_list() == [0, 1]
    p = read(tmp_path / "r").filter(pl.col("kind") == "probe")
    assert p["name"].to_list() == ["router.map"] and p["step"].to_list() == [5]
    assert len(p["rows"][0]) == 3


def test_dumps_and_moments(tmp_path):
    with Session(tmp_path / "r", "boundaries", dumps=r"^head$", moments=True) as s:
        train(s, steps=1)
    d = read(tmp_path / "r", "dumps")
    assert d.height > 0 and set(d["module"]) == {"head"}
    row = d.filter(pl.col("role") == "output").row(0, named=True)
    assert len(row["data"]) == 4 * 4 * 6 * 16
    r = read(tmp_path / "r")
    assert r["m_sum"].is_not_null().all()


def test_capture_error_disables_and_training_continues(tmp_path, baseline, monkeypatch):
    from detfp_capture import digest
    from detfp_capture._digest.staging import Staging

    def broken(*a, **k):
        raise RuntimeError("planted failure")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Session(tmp_path / "r", "ops") as s:
            # Digests fail: single ones, and staged ones (which then fall back to single ones).
            monkeypatch.setattr(digest, "start", broken)
            monkeypatch.setattr(Staging, "put_many", broken)
            got = train(s, steps=3)
    assert got == baseline
    assert sum("capture disabled" in str(w.message) for w in caught) == 1
    # The trace says it is incomplete and why (the commit log's close line), and keeps the events.
    with pytest.raises(IncompleteRunError, match=r"closed incomplete: capture disabled at step 0 .*planted failure"):
        open_run(tmp_path / "r")
    ev = pl.read_parquet(open_run(tmp_path / "r", allow_incomplete=True).files("events"), hive_partitioning=False)
    err = ev.filter(pl.col("type") == "capture_error")
    assert err.height == 1 and "planted failure" in err["detail"][0]
    assert "capture_disabled" in set(ev["type"])


@pytest.mark.parametrize("where", ["gather", "op_outputs"])  # before the op runs, after it
def test_dispatch_failure_disables_capture_and_the_op_still_runs(tmp_path, monkeypatch, where):
    # The dispatch mode's own failures follow the guard's policy (spelled out there as
    # try/except): one capture_error naming the op, capture off, the op and the training go on.
    from detfp_capture._sources import dispatch

    def broken(*a, **k):
        raise RuntimeError("planted dispatch failure")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Session(tmp_path / "r", "ops") as s:
            # The op's gathering is the recorder's record path's (``_recorder.seam``); an op the
            # native entries leave to Python (``CaptureMode._pre``) calls it there.
            monkeypatch.setattr(s._rec.path if where == "gather" else dispatch, where, broken)
            got = train(s, steps=2)
    assert got == train(steps=2)
    assert sum("capture disabled" in str(w.message) for w in caught) == 1
    ev = pl.read_parquet(open_run(tmp_path / "r", allow_incomplete=True).files("events"), hive_partitioning=False)
    err = ev.filter(pl.col("type") == "capture_error")
    detail = err["detail"][0]
    assert err.height == 1 and detail.startswith("dispatch of aten.") and "planted dispatch failure" in detail


def test_kernels_table_on_cpu(tmp_path):
    with Session(tmp_path / "r", "ops", kernels="1") as s:
        train(s, steps=2)
    k = read(tmp_path / "r", "kernels")
    assert set(k["step"]) == {1}
    assert set(k["device_type"]) == {"cpu"}
    mm = k.filter(
        (pl.col("name") == "aten::addmm.default") & (pl.col("module") == "b0.fc1") & (pl.col("phase") == "forward")
    )
    assert mm.height >= 1 and mm["index"].to_list() == list(range(mm.height))
    # Each kernel row carries the call_hash of an op record of the same step.
    calls = set(read(tmp_path / "r").filter(pl.col("step") == 1)["call_hash"])
    assert set(k["call_hash"]) <= calls


def test_append_and_start_step(tmp_path):
    with Session(tmp_path / "r", "metrics") as s:
        train(s, steps=1)
    with pytest.raises(RunExistsError, match="append"):
        Session(tmp_path / "r", "metrics")
    with Session(tmp_path / "r", "metrics", append=True) as s, s.step(7):
        s.metric("loss", 1.5)
    man = json.loads((tmp_path / "r/manifest/rank=0/segment-00001.json").read_text())
    assert man["segment"] == 1 and man["start_step"] == 7


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"level": "everything"}, "unknown capture level"),
        ({"steps": "3-1"}, "range '3-1' is empty"),
        ({"ranks": "a"}, "cannot parse 'a'"),
        ({"modules": "("}, "not a valid regular expression"),
        ({"rows": 0}, "positive number"),
        ({"flush_records": 0}, "flush_records"),
        ({"dumps": True}, "regex"),
        ({"parallel": [1]}, "parallel"),
    ],
)
def test_config_errors(tmp_path, kwargs, match):
    kwargs = {"level": "metrics", **kwargs}
    with pytest.raises(ConfigError, match=match):
        Session(tmp_path / "r", **kwargs)
    assert not (tmp_path / "r").exists()


def test_metric_values_exact_across_dtypes_shapes_and_later_writes(tmp_path):
    # One flush converts every tensor metric together (grouped by device and dtype): values,
    # raw bits and order must still be each metric's own, as passed, whatever is written later.
    g = torch.Generator().manual_seed(5)
    given = [
        ("loss", torch.randn((), generator=g)),
        ("lm_loss", torch.randn(1, generator=g).to(torch.bfloat16)),
        ("grad_norm", torch.randn(1, 1, generator=g, dtype=torch.float64)),
        ("tokens", torch.tensor(2**40 + 3)),
        ("lr", 3e-4),
        ("step_count", 12),
        ("loss", torch.tensor(-0.0)),
        ("mtp_loss", torch.randn((), generator=g).to(torch.float16)),
    ]
    want = [float(v) for _, v in given]
    with Session(tmp_path / "r", "metrics") as s, s.step(0):
        for name, v in given:
            s.metric(name, v)
        for _, v in given:
            if isinstance(v, torch.Tensor):
                v.fill_(9)  # after the call: must not change what was recorded
    m = read(tmp_path / "r", "metrics")
    assert m["name"].to_list() == [n for n, _ in given]
    assert m["occurrence"].to_list() == [0, 0, 0, 0, 0, 0, 1, 0]
    assert [struct.pack("<d", v) for v in m["value"]] == [struct.pack("<d", v) for v in want]
    assert m["bits"].to_list() == [struct.unpack("<Q", struct.pack("<d", v))[0] for v in want]


def test_metric_and_probe_argument_errors(tmp_path):
    with Session(tmp_path / "r", "metrics") as s, s.step(0):
        with pytest.raises(ConfigError, match="expected a scalar"):
            s.metric("loss", torch.ones(3))
        with pytest.raises(ConfigError, match="expected a tensor"):
            s.probe("x", 3)


def test_flush_every_n_records_bounds_windows(tmp_path):
    # A window is flushed at the first call boundary once it holds flush_records records, so
    # every window but the last holds at least n, and overshoots n by less than the largest
    # single append: one op call's records, or the optimizer's after-step batch (the parameter
    # and Adam's three states, per parameter). Windows are written in order, nothing is lost.
    n = 64
    with Session(tmp_path / "r", "ops", flush_records=n) as s:
        train(s, steps=1)
    files = sorted((tmp_path / "r/records/rank=0").glob("*.parquet"))
    windows = [pl.read_parquet(f) for f in files]
    assert len(windows) > 5
    r = read(tmp_path / "r")
    params = r.filter((pl.col("kind") == "param") & (pl.col("phase") == "step"))["name"].n_unique()
    call = ["step", "microbatch", "phase", "module", "kind", "name", "occurrence"]
    largest_append = max(4 * params, r.group_by(call).len()["len"].max())
    assert largest_append < n  # else the bound below would say little
    for i, w in enumerate(windows):
        assert w.height < n + largest_append, (files[i].name, w.height)
        if i < len(windows) - 1:
            assert w.height >= n, (files[i].name, w.height)
    seqs = pl.concat([w.select("seq") for w in windows])["seq"]
    assert seqs.is_unique().all() and seqs.is_sorted()
    assert sum(w.height for w in windows) == r.height


def test_compiled_module_recorded_at_its_boundary(tmp_path):
    def run(session):
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
        cm = torch.compile(m, backend="eager")
        if session is not None:
            session.watch(cm)
        out = []
        for step in range(2):
            with session.step(step) if session is not None else torch.enable_grad():
                loss = cm(torch.randn(4, 8)).square().mean()
                loss.backward()
                out.append(loss.item())
        return out

    base = run(None)
    with Session(tmp_path / "r", "ops") as s:
        assert run(s) == base
    r = read(tmp_path / "r").filter(pl.col("step") == 1)
    # The root's input is the data (kind batch), its output the compiled region's.
    comp = r.filter(pl.col("kind").is_in(["batch", "compiled"]) & (pl.col("phase") == "forward"))
    assert comp.select("kind", "role").rows() == [("batch", "input"), ("compiled", "output")]
    assert comp["compiled"].all()
    fwd_ops = r.filter((pl.col("kind") == "op") & (pl.col("phase") == "forward"))
    # Inside the compiled region its ops are recorded too (the eager backend runs ATen ops),
    # attributed to the region; the loss ops after it as before.
    assert fwd_ops.filter(pl.col("name") == "aten::addmm.default")["module"].unique().to_list() == [""]
    assert "aten::mean.default" in set(fwd_ops["name"])


class _Mutates(torch.nn.Module):
    def forward(self, y):
        y.mul_(10)  # an input written in place inside compiled code: no dispatch mode sees it
        return y + 1


class _CompiledInside(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c = torch.compile(_Mutates(), backend="aot_eager")
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(self.c(x * 2))


@pytest.mark.parametrize("modules", [None, r"^lin$"])
def test_compiled_region_keeps_earlier_records_and_op_capture_after_it(tmp_path, modules):

    m = _CompiledInside()
    with Session(tmp_path / "r", "ops", modules=modules) as s:
        s.watch(m)
        for step in range(2):
            with s.step(step):
                m(torch.ones(2, 4)).sum()
    r = read(tmp_path / "r")
    for step in range(2):
        ops = r.filter((pl.col("kind") == "op") & (pl.col("step") == step))
        # The region left out by modules= still counts as compiled, and leaves: op capture
        # goes on after it (it once stopped for the rest of the run).
        assert "aten::addmm.default" in set(ops["name"])
        if modules is None:
            # x * 2 waits for a batch; the compiled region writes it in place: the record keeps
            # the value from before the region.
            # (The region's own ops are recorded too, in module ``c``: its multiplication by 10.)
            mul = ops.filter(
                (pl.col("name") == "aten::mul.Tensor") & (pl.col("role") == "output") & (pl.col("module") == "")
            )
            assert mul["digest_hi"].to_list() == [digest_hi(torch.full((2, 4), 2.0))]
            inside = ops.filter((pl.col("name") == "aten::mul.Tensor") & (pl.col("role") == "output"))
            assert inside.filter(pl.col("module") == "c")["digest_hi"].to_list() == [digest_hi(torch.full((2, 4), 20.0))]


@pytest.mark.parametrize("enabled", [True, False])
def test_capture_leaves_the_garbage_collector_as_it_found_it(tmp_path, enabled):
    # Capture pauses the cyclic collector around its bulk work (flush, batches): never beyond it.
    import gc

    from detfp_capture._recorder.slot import gc_paused

    was = gc.isenabled()
    try:
        gc.enable() if enabled else gc.disable()
        with pytest.raises(RuntimeError), gc_paused():
            assert not gc.isenabled()
            raise RuntimeError("inside")
        assert gc.isenabled() is enabled
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        with Session(tmp_path / "r", "ops", flush_records=16) as s:  # many flushes and batches
            s.watch(model)
            for step in range(2):
                with s.step(step):
                    model(torch.randn(4, 8)).sum().backward()
                assert gc.isenabled() is enabled
        assert gc.isenabled() is enabled
    finally:
        gc.enable() if was else gc.disable()


class _LeakBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.g, self.b = torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(self.g(self.a(x)))


@pytest.mark.parametrize("recompute", [False, True])
def test_backward_hooks_leak_no_autograd_nodes(tmp_path, recompute):
    # A hook that holds its own autograd node is a cycle through C++ that gc cannot collect:
    # graphs of captured steps must be freed like those of uncaptured ones.
    import gc

    from torch.utils.checkpoint import checkpoint

    def alive_nodes() -> int:
        gc.collect()
        return sum(1 for o in gc.get_objects() if type(o).__name__.endswith("Backward0"))

    torch.manual_seed(0)
    emb, blocks = torch.nn.Linear(8, 8), torch.nn.ModuleList([_LeakBlock(), _LeakBlock()])
    model = torch.nn.ModuleDict({"emb": emb, "blocks": blocks})
    # Every object that exists now (the suite's whole heap: torch, polars, transformers) moves
    # to the permanent generation, which gc.collect() and gc.get_objects() skip: each count
    # then costs milliseconds, not seconds, and still sees every node the steps create.
    gc.collect()
    gc.freeze()
    try:
        with Session(tmp_path / "r", "boundaries") as s:
            s.watch(model)
            counts = []
            for step in range(4):
                with s.step(step):
                    x = emb(torch.randn(4, 8))
                    for b in blocks:
                        x = checkpoint(b, x, use_reentrant=False) if recompute else b(x)
                    x.sum().backward()
                counts.append(alive_nodes())
    finally:
        gc.unfreeze()
    assert counts == [counts[0]] * 4, counts  # nothing accumulates from step to step


def _reference_mark_graph(outputs, inputs, path, since=-1):
    # The plain walk graph.mark_graph must agree with: from the outputs back to the inputs,
    # through every node, tagging the untagged ones and stopping at other modules' nodes.
    from detfp_capture._sources.context import NODE_KEY

    stop = {id(t.grad_fn) for t in inputs if t.grad_fn is not None}
    stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
    inner = path + "." if path else ""
    seen = set()
    while stack:
        n = stack.pop()
        if n is None or id(n) in seen or id(n) in stop:
            continue
        seen.add(id(n))
        owner = n.metadata.get(NODE_KEY)
        if owner is None:
            n.metadata[NODE_KEY] = path
        elif not owner.startswith(inner):
            continue
        stack.extend(nxt for nxt, _ in n.next_functions)


class _Pair(torch.nn.Module):  # two outputs
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.a(x).relu(), self.b(x) * 2


class _Wrap(torch.nn.Module):  # returns its child's output as is, or its input
    def __init__(self, child) -> None:
        super().__init__()
        self.child = child

    def forward(self, x, passthrough=False):
        return x if passthrough else self.child(x)


class _Return(torch.nn.Module):  # returns a tensor another module computed (not an input)
    def forward(self, x):
        return self.stash


class _Split(torch.nn.Module):  # two outputs from two unrelated inputs
    def forward(self, x, y):
        return x.sin() * 2, y.exp()


class _Stasher(torch.nn.Module):  # keeps an inner tensor, which another module then takes
    def forward(self, x):
        self.h = x.sin()
        return self.h.cos()


class _ReadsChildOutput(torch.nn.Module):  # its child runs before it, called by other code
    def __init__(self) -> None:
        super().__init__()
        self.stasher = _Stasher()

    def forward(self, y):
        return y * self.o  # self.o: the child's output, set by the caller


class _Tagged(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre = torch.nn.Linear(8, 8)
        self.twice = torch.nn.Linear(8, 8)
        self.pair = _Pair()
        self.wrap = _Wrap(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()))
        self.ident = _Wrap(torch.nn.Identity())
        self.shared = torch.nn.Linear(8, 8)
        self.other = torch.nn.Sequential(torch.nn.Linear(8, 8))
        self.sib, self.ret = torch.nn.Linear(8, 8), _Return()
        self.split = _Split()
        self.late = _ReadsChildOutput()

    def forward(self, x, side):
        h = self.pre(x) * side  # side: a tensor from outside the module's inputs
        h = self.twice(self.twice(h).sin())  # the same module twice
        a, b = self.pair(h)
        h = self.wrap(a + b) + self.ident(h, passthrough=True)
        h = self.other[0](h) + self.shared(h)  # self.shared is also called below, elsewhere
        self.ret.stash = self.sib(x * 3)  # x * 3 is reached only through sib's region, via ret
        h = h + self.ret(h)
        p, self.kept = self.split(h, side * 5)  # side * 5 is reached only through kept, outside
        h = h + p
        # late.stasher's region is walked before late's forward begins, and late's input is a
        # node inside it: late's walk must stop there, not jump past it to h.tanh().
        self.late.o = self.late.stasher(h.tanh())
        h = h + self.late(self.late.stasher.h)
        return self.shared(h.cos()).sum()


@pytest.mark.parametrize("model_name", ["tagged", "example"])
def test_module_tags_of_autograd_nodes_match_the_plain_walk(tmp_path, monkeypatch, model_name):
    # Backward attribution at level ops reads these tags: the walk that jumps over submodule
    # regions must tag every node exactly as walking through them does.
    import importlib.util

    from detfp_capture._sources import graph
    from detfp_capture._sources.context import NODE_KEY

    def run(name):
        torch.manual_seed(0)
        if model_name == "tagged":
            model, side = _Tagged(), torch.randn(4, 8, requires_grad=True)
            inputs = (torch.randn(4, 8, requires_grad=True), side * 1.5)
        else:
            path = "examples/train_tiny.py"
            spec = importlib.util.spec_from_file_location("train_tiny_tags", path)
            tt = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(tt)
            model = tt.TinyGPT(d=16, hidden=32, seq=8)
            inputs = (torch.randint(0, 256, (2, 8)),)
        with Session(tmp_path / name, "ops") as s, s.step(0):
            s.watch(model)
            out = model(*inputs)
            loss = out[0].sum() + out[1] if isinstance(out, tuple) else out + model.kept.sum()
            tags, stack, seen = [], [loss.grad_fn], set()
            while stack:  # every node, in a fixed order
                n = stack.pop()
                if n is None or id(n) in seen:
                    continue
                seen.add(id(n))
                tags.append((n.name(), n.metadata.get(NODE_KEY)))
                stack.extend(nxt for nxt, _ in n.next_functions)
            loss.backward()
        return tags

    got = run("jump")
    monkeypatch.setattr(graph, "mark_graph", _reference_mark_graph)
    want = run("plain")
    assert got == want
    assert len({t for _, t in got if t}) > 5  # many modules own nodes
