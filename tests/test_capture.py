"""Session: no perturbation, record order and keys, recompute, selectors, errors, kernels."""

from __future__ import annotations

import json
import struct
import warnings

import polars as pl
import pytest
import torch

from detfp_capture import Session
from detfp_capture.errors import ConfigError, RunExistsError
from tests.test_capture_models import Net, read, train

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
    assert set(recs["kind"]) == {"rng_state", "param"}
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
    from detfp_capture import _state
    from detfp_capture._staging import Staging

    def broken(*a, **k):
        raise RuntimeError("planted failure")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Session(tmp_path / "r", "ops") as s:
            # Digests fail: single ones, and staged ones (which then fall back to single ones).
            monkeypatch.setattr(_state.digest, "start", broken)
            monkeypatch.setattr(Staging, "put_many", broken)
            got = train(s, steps=3)
    assert got == baseline
    assert sum("capture disabled" in str(w.message) for w in caught) == 1
    ev = read(tmp_path / "r", "events")
    err = ev.filter(pl.col("type") == "capture_error")
    assert err.height == 1 and "planted failure" in err["detail"][0]
    assert "capture_disabled" in set(ev["type"])


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
    with Session(tmp_path / "r", "ops", flush_records=64) as s:
        train(s, steps=1)
    files = sorted((tmp_path / "r/records/rank=0").glob("*.parquet"))
    assert len(files) > 5
    r = read(tmp_path / "r")
    assert r["seq"].is_unique().all()


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
    comp = r.filter(pl.col("kind") == "compiled")
    assert comp["role"].to_list() == ["input", "output"] and comp["compiled"].all()
    fwd_ops = r.filter((pl.col("kind") == "op") & (pl.col("phase") == "forward"))
    # Inside the compiled region nothing is recorded; the loss ops after it are.
    assert "aten::addmm.default" not in set(fwd_ops["name"])
    assert "aten::mean.default" in set(fwd_ops["name"])


@pytest.mark.parametrize("max_runs", [256, 0])  # levels padded by slices, or by one index gather
def test_batched_step_boundary_digests_equal_single_digests(monkeypatch, max_runs):
    from detfp_capture import _batchdigest, digest
    from detfp_capture._batchdigest import start_many

    monkeypatch.setattr(_batchdigest, "_MAX_RUNS", max_runs)

    g = torch.Generator().manual_seed(3)
    ts = [
        torch.randn(300, generator=g),
        torch.randn(257, generator=g),  # 1028 bytes: two level-0 rows
        torch.randn(64, 64, generator=g),
        torch.randn(100, 70, generator=g).t(),  # non-contiguous
        torch.randn(5, generator=g),  # small: the digest arena path
        torch.zeros(0),
        torch.randn(70000, generator=g),  # three levels
        torch.randn(128, 1024, generator=g),  # 512 KiB of whole rows: hashed in place, no copy
        torch.randn(256, 300, generator=g)[:, :256],  # same size, not contiguous: copied
        torch.randn(33, 9, dtype=torch.float64, generator=g),
        torch.randn(64, 64, generator=g).to(torch.bfloat16),
        torch.arange(500),  # int64: pointer check, single path
        torch.randn(4, 4, generator=g, requires_grad=True) * 2,
        torch.randn(16 * 256 * 3, generator=g),  # 48 rows: no padding at level 1, a run with the next
        torch.randn(16 * 256 * 2 + 1, generator=g),
    ]
    batched = digest.resolve(start_many(ts))
    single = digest.resolve([digest.start(t, pointer_check=t.dtype is torch.int64) for t in ts])
    assert [a.digest for a in batched] == [b.digest for b in single]


@pytest.mark.parametrize("own_limit", [64 << 20, 0])  # a reused layout with its own buffer, or without
def test_batch_layouts_reused_only_for_the_same_signature(monkeypatch, own_limit):
    # A step boundary repeats the same dtypes, shapes and contiguity every step: the layout of
    # the batch is cached by that signature (and, used again, gets its own buffer). New values,
    # an in-place write between two calls, a changed contiguity or an unbatchable member must
    # all still give the single digests.
    from detfp_capture import _batchdigest, digest
    from detfp_capture._batchdigest import _LAYOUTS, start_many

    monkeypatch.setattr(_batchdigest, "_OWN_LIMIT", own_limit)
    g = torch.Generator().manual_seed(7)

    def batch(contiguous: bool) -> list[torch.Tensor]:
        sq = torch.randn(64, 64, generator=g)
        return [
            torch.randn(300, generator=g),  # padded to two rows
            sq if contiguous else sq.t(),
            torch.randn(128, 1024, generator=g),  # hashed in place, between copied ones
            torch.randn((), generator=g),
            torch.randn(70000, generator=g).to(torch.bfloat16),
            torch.randn(70000, generator=g),
        ]

    _LAYOUTS.clear()
    for ts in (batch(True), batch(True), batch(False), batch(True), [*batch(True), torch.arange(9)]):
        for k in range(3):  # later calls take the cached layout when there is one
            if k == 2:
                ts[0].mul_(3)
                ts[-1][5] = 7.0
            got = digest.resolve(start_many(ts, reuse=True))
            want = digest.resolve([digest.start(t, pointer_check=t.dtype is torch.int64) for t in ts])
            assert [a.digest for a in got] == [b.digest for b in want]
    assert len(_LAYOUTS) == 2  # contiguous and transposed; never the batch with an int64 member
    assert all((lay.own is not None) == (own_limit > 0) for lay in _LAYOUTS.values())
    _LAYOUTS.clear()


@pytest.mark.parametrize("max_runs", [256, 0])
def test_staged_snapshots_digest_like_single_digests(monkeypatch, max_runs):
    # Row counts that finish at different tree levels, with and without padding, interleaved,
    # twice (the second run reuses the staging buffer).
    from detfp_capture import _batchdigest, digest
    from detfp_capture._batching import Slot
    from detfp_capture._staging import Staging

    monkeypatch.setattr(_batchdigest, "_MAX_RUNS", max_runs)
    g = torch.Generator().manual_seed(11)
    # Contiguous whole-row tensors of 256 KiB and more are hashed in place (65536 floats: 256
    # rows; 259 rows, not a multiple of 16: a zeroed gap before the next; the bfloat16 one); a
    # transposed one of that size is copied like the small ones.
    sizes = [5, 300, 4096, 256, 70000, 257, 16 * 256, 17 * 256, 1, 16384, 65536, 259 * 256, 33 * 256 + 3]
    for _ in range(2):
        ts = [torch.randn(n, generator=g) for n in sizes] + [torch.randn(40, 7, generator=g).t()]
        ts += [torch.randn(128, 512, generator=g).t(), torch.randn(256, 512, generator=g).to(torch.bfloat16)]
        before = [t.clone() for t in ts]
        st = Staging(torch.device("cpu"), cap_bytes=4 << 20)
        slots = [Slot(None) for _ in ts]
        assert st.put_many(ts, slots)
        assert len(st.direct[0]) == 3 and len(st.items[0]) == len(ts) - 3
        for t in ts:
            t.add_(1.0)  # a snapshot: later writes do not change what was recorded
        st.run_into()
        staged = digest.resolve([s.started() for s in slots])
        single = digest.resolve([digest.start(t) for t in before])
        assert [a.digest for a in staged] == [b.digest for b in single]


def test_op_arguments_kept_flat_and_untracked_digest_like_the_originals():
    # Op arguments wait for the flush as one flat tuple of plain values (nothing for the cyclic
    # collector to keep tracking), and their args digest is that of the original arguments.
    import gc

    from detfp_capture._records import args_text, flat_args

    args = [[8, 32, 64], 1.5, [[1, 2], [3], []], (4, 5), None, "sum"]
    kwargs = {"size": [1, 2], "e": [], "alpha": 2}
    kept = flat_args(args, list(kwargs.items()))
    gc.collect()
    assert not gc.is_tracked(kept)
    assert args_text(kept) == args_text((tuple(args), kwargs))
    assert flat_args([], []) is None
    assert args_text(flat_args([[4, 5]], [])) != args_text(flat_args([(4, 5)], []))  # a list is not a tuple
    assert args_text(flat_args([1], [("k", 2)])) != args_text(flat_args([1, 2], []))  # positional vs keyword


@pytest.mark.parametrize("enabled", [True, False])
def test_capture_leaves_the_garbage_collector_as_it_found_it(tmp_path, enabled):
    # Capture pauses the cyclic collector around its bulk work (flush, batches): never beyond it.
    import gc

    from detfp_capture._batching import gc_paused

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


def test_batched_digests_survive_scratch_reuse_and_small_scratch(monkeypatch):
    # The copy buffer is reused by the next batch and split into regions when a batch is bigger
    # than it: digests of earlier batches, resolved later, must be unaffected.
    from detfp_capture import digest
    from detfp_capture._batchdigest import _SCRATCH, start_many

    monkeypatch.setattr(type(_SCRATCH), "CAP", 8 << 10)
    monkeypatch.setattr(_SCRATCH, "bufs", {})
    g = torch.Generator().manual_seed(5)
    first = [torch.randn(n, generator=g) for n in (300, 700, 1500, 2100, 9000, 5)]
    second = [torch.randn(n, generator=g) for n in (301, 699, 4000)]
    pend = start_many(first)
    pend2 = start_many(second)  # overwrites the scratch bytes of the first batch
    batched = digest.resolve(pend + pend2)
    single = digest.resolve([digest.start(t) for t in first + second])
    assert [a.digest for a in batched] == [b.digest for b in single]


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
    assert counts == [counts[0]] * 4, counts  # nothing accumulates from step to step


def test_inplace_and_foreach_outputs_are_the_written_values(tmp_path):
    a = [torch.ones(300), torch.ones(400)]
    b = torch.ones(500)
    with Session(tmp_path / "r", "ops") as s, s.step(0):
        torch._foreach_add_(a, 1.0)  # returns nothing: the written list is the output
        c = b * 3  # deferred digest (large enough for the batch path)
        b.add_(1.0)  # a write: the batch runs first, so c's and b's old values are kept
        _ = c + b
    r = read(tmp_path / "r").filter(pl.col("kind") == "op")
    fe = r.filter(pl.col("name") == "aten::_foreach_add_.Scalar")
    assert fe.select("role", "arg").rows() == [
        ("input", "args[0][0]"),
        ("input", "args[0][1]"),
        ("output", "args[0][0]"),
        ("output", "args[0][1]"),
    ]
    assert fe["digest_hi"][0] != fe["digest_hi"][2]
    add_ = r.filter(pl.col("name") == "aten::add_.Tensor")
    add_ = add_ if add_.height else r.filter(pl.col("name") == "aten::add_.Scalar")
    before, after = (
        add_.filter(pl.col("role") == "input")["digest_hi"][0],
        add_.filter(pl.col("role") == "output")["digest_hi"][0],
    )
    assert before != after
    last = r.filter(pl.col("name") == "aten::add.Tensor").filter(pl.col("role") == "input")
    mul_out = r.filter((pl.col("name") == "aten::mul.Tensor") & (pl.col("role") == "output"))["digest_hi"][0]
    assert last["digest_hi"].to_list() == [mul_out, after]
    assert (r["status"] != "error").all()


@pytest.mark.parametrize("numel", [65536, 1024, 300, 10])  # hashed in place, whole rows, padded, small
def test_snapshots_keep_the_values_at_record_time(tmp_path, numel):
    from detfp_capture import digest

    lin = torch.nn.Linear(4, numel, bias=False)
    x = torch.ones(1, 4)
    with torch.no_grad():
        want = digest.fingerprint(lin(x)).digest
    with Session(tmp_path / "b", "boundaries") as s, s.step(0), torch.no_grad():
        s.watch(lin)
        lin(x).add_(1.0)  # written after the module-output record: the record keeps the old values
    out = read(tmp_path / "b").filter(pl.col("kind") == "module_output")
    assert out["digest_hi"].to_list() == [int(want[:16], 16)]
    t = torch.ones(numel)
    with Session(tmp_path / "o", "ops") as s, s.step(0):
        t.mul_(2.0)  # the in-place op's input record is what it read
    r = read(tmp_path / "o").filter(pl.col("name").str.starts_with("aten::mul_."))
    got = dict(zip(r["role"].to_list(), r["digest_hi"].to_list(), strict=True))
    assert got["input"] == int(digest.fingerprint(torch.ones(numel)).digest[:16], 16)
    assert got["output"] == int(digest.fingerprint(torch.full((numel,), 2.0)).digest[:16], 16)


def test_staged_int64_pointer_checks_match_single_digests():
    # int64 boundary tensors are snapshotted like the others; their pointer check runs for the
    # whole batch at once and must say what digest.start's per-tensor check says.
    from detfp_capture import digest
    from detfp_capture._batching import Slot
    from detfp_capture._staging import Staging

    g = torch.Generator().manual_seed(5)
    ptrs = torch.randint(1 << 28, 1 << 44, (300,), generator=g) * 16  # multi-row, pointer-like
    ts = [
        torch.randint(0, 256, (8, 33), generator=g),  # token ids: not pointers
        torch.randn(100, generator=g),
        ptrs,
        torch.cat([ptrs[:50], torch.tensor([7])]),  # one value spoils it (the last)
        torch.tensor([1 << 40]),  # one pointer-like value
        ptrs[:128].clone(),  # exactly one 1024-byte row
        torch.arange(0, 4096 * 16, 16) + (1 << 33),  # 512 KiB of whole rows: still a snapshot
    ]
    st = Staging(torch.device("cpu"))
    slots = [Slot(None) for _ in ts]
    assert st.put_many(ts, slots) and not st.direct[0]
    st.run_into()
    staged = digest.resolve([s.started() for s in slots])
    single = digest.resolve([digest.start(t, pointer_check=t.dtype is torch.int64) for t in ts])
    assert [(a.digest, a.pointer_like) for a in staged] == [(b.digest, b.pointer_like) for b in single]
    assert [f.pointer_like for f in staged] == [False, False, True, False, True, True, True]


@pytest.mark.parametrize("n", [5, 40])  # finalized on the host (<= 32 digests), on the device
def test_bulk_resolve_of_batched_rows_matches_resolve(n):
    # The flush resolves batched rows in bulk (_resolve.resolve_rows): same digests as the
    # general resolve, for rows in any order and from two batches at once.
    from detfp_capture import digest
    from detfp_capture._batchdigest import start_many
    from detfp_capture._batching import Slot
    from detfp_capture._resolve import resolve_rows

    g = torch.Generator().manual_seed(n)
    ts = [torch.randn(1 + 37 * i, generator=g) for i in range(n)]
    a, b = [Slot(None) for _ in ts], [Slot(None) for _ in ts]
    start_many(ts, a)
    start_many([t * 2 for t in ts], b)
    items = [*a[::-1], *b[::2]]
    want = [f.digest for f in digest.resolve([s.started() for s in items])]
    assert resolve_rows(items) == want


def test_args_digest_memo_keeps_values_that_compare_equal_apart():
    # Memoized across flushes, the args digest must still tell apart arguments that Python
    # considers equal but whose text differs: -0.0 and 0.0, True and 1 and 1.0, a float and
    # the string of its hex text.
    from detfp_capture._records import RecordBuffer, args_text, flat_args, record_columns

    variants = [[0.0], [-0.0], [1], [True], [1.0], [(1.0).hex()], [float("nan")], [[1, 2]], [[1, 2.0]]]
    for _ in range(2):  # the second pass reads the memo
        buf = RecordBuffer()
        for i, v in enumerate(variants):
            call = (0, -1, "forward", "", "op", "aten::x", i, flat_args(v, []), False)
            buf.add(call, i, "output", "out", "torch.float32", (1,), 1, None, ())
        got = record_columns(buf)[0]["args_digest"]
        assert got == [args_text(flat_args(v, [])) for v in variants]
        assert len(set(got)) == len(variants)


def test_int64_probe_keeps_its_pointer_check_when_staging_fails(tmp_path, monkeypatch):
    # int64 tensors are staged like the others; when staging cannot take them, the digest taken
    # instead must still check for device-pointer tables.
    from detfp_capture._staging import Staging

    def broken(*a, **k):
        raise RuntimeError("staging unavailable")

    monkeypatch.setattr(Staging, "put_many", broken)
    table = torch.arange(0, 64 * 16, 16) + (1 << 33)
    with Session(tmp_path / "r", "boundaries") as s, s.step(0):
        s.probe("table", table)
    r = read(tmp_path / "r").filter(pl.col("kind") == "probe")
    assert r["hazards"].to_list() == [["pointer_like"]]
