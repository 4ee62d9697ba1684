"""Each hazard is planted and must be flagged on the record that reads it, and as an event."""

from __future__ import annotations

import polars as pl
import pytest
import torch
import torch.distributed as dist

from detfp_capture import Session
from detfp_capture._recorder.hazards import poison_pattern
from tests.fixtures.models import read


def _ops(path, name):
    return read(path).filter((pl.col("kind") == "op") & (pl.col("name") == name))


def _hazard_events(path, hazard):
    ev = read(path, "events")
    return ev.filter((pl.col("type") == "hazard") & (pl.col("name") == hazard))


def test_uninitialized_read_views_and_full_write(tmp_path):
    with Session(tmp_path / "r", "ops") as s, s.step(0):
        a = torch.empty(4)
        _ = a + 1  # read before any write: flagged
        b = torch.empty(2, 4)
        b[0].fill_(1.0)
        _ = b[0] * 2  # the written half: clean
        _ = b[1] * 3  # the unwritten half, through a view: flagged
        b[1].copy_(torch.ones(4))
        _ = b.sum()  # fully written now: clean
        c = torch.empty(3)
        c.zero_()
        _ = c - 1  # overwritten first: clean
    add = _ops(tmp_path / "r", "aten::add.Tensor").filter(pl.col("role") == "input")
    assert add["hazards"].to_list()[0] == ["uninitialized"]
    mul = _ops(tmp_path / "r", "aten::mul.Tensor").filter(pl.col("arg") == "args[0]")
    assert [h.to_list() for h in mul["hazards"]] == [[], ["uninitialized"]]
    assert _ops(tmp_path / "r", "aten::sum.default")["hazards"].to_list() == [[], []]
    sub = _ops(tmp_path / "r", "aten::sub.Tensor").filter(pl.col("arg") == "args[0]")
    assert sub["hazards"].to_list() == [[]]
    # The empty* output itself is counted but never digested (its bytes are garbage).
    empty = _ops(tmp_path / "r", "aten::empty.memory_format")
    assert set(empty["status"]) == {"skipped"}
    ev = _hazard_events(tmp_path / "r", "uninitialized")
    assert ev.height == 2 and "read while uninitialized" in ev["detail"][0]


class _Fill(torch.nn.Module):
    def forward(self, buf, x):
        return buf.copy_(x)


class _Use(torch.nn.Module):
    def forward(self, buf):
        return buf * 2


class _FillThenUse(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fill, self.use = _Fill(), _Use()

    def forward(self, x, fill=True):
        buf = torch.empty(300)
        if fill:
            self.fill(buf, x)
        return self.use(buf)


def test_writes_in_modules_left_out_still_count_for_uninitialized(tmp_path):
    # modules= leaves "fill" out: its write is not recorded but the buffer is written all the
    # same, so the read in "use" is clean; without the write it is flagged.
    m = _FillThenUse()
    with Session(tmp_path / "r", "ops", modules=r"^use$|^$") as s, s.step(0):
        s.watch(m)
        m(torch.ones(300))
        m(torch.ones(300), fill=False)
    mul = _ops(tmp_path / "r", "aten::mul.Tensor").filter(pl.col("arg") == "args[0]")
    assert [h.to_list() for h in mul["hazards"]] == [[], ["uninitialized"]]
    assert _hazard_events(tmp_path / "r", "uninitialized").height == 1
    assert _ops(tmp_path / "r", "aten::copy_.default").height == 0  # not recorded


def test_uninitialized_across_steps_and_across_steps_left_out(tmp_path):
    # Allocated empty in step 0 and read in step 2. Every step captured: the read is flagged
    # whether or not step 1 filled it (the fill is seen). Step 1 left out by steps=: what it
    # did is unseen, so the state is forgotten and nothing is flagged.
    flagged = {}
    for steps, fill in ((None, False), (None, True), ("0,2", True)):
        name = f"{steps}-{fill}".replace(",", "_")
        with Session(tmp_path / name, "ops", steps=steps) as s:
            for step in range(3):
                with s.step(step):
                    if step == 0:
                        buf = torch.empty(300)
                    if step == 1 and fill:
                        buf.fill_(1.0)
                    if step == 2:
                        _ = buf * 2
        mul = _ops(tmp_path / name, "aten::mul.Tensor").filter(pl.col("arg") == "args[0]")
        flagged[(steps, fill)] = [h.to_list() for h in mul["hazards"]]
    assert flagged == {(None, False): [["uninitialized"]], (None, True): [[]], ("0,2", True): [[]]}


def test_poison_fills_fresh_allocations_per_run(tmp_path):
    got = {}
    for name in ("a", "b"):
        with Session(tmp_path / name, "ops", poison=True) as s, s.step(0):
            x = torch.empty(64, dtype=torch.uint8)
            got[name] = x.clone()
    for name, v in got.items():  # the run's 8-byte pattern, repeated
        pat = poison_pattern(str((tmp_path / name).resolve()))
        assert bytes(v.tolist()) == pat * 8
    # Two runs get two patterns, so reading such memory shows up as a divergence.
    assert not torch.equal(got["a"], got["b"])


def test_async_pending_until_wait(tmp_path, gloo1):
    with Session(tmp_path / "r", "ops") as s:
        with s.step(0):
            t = torch.ones(4)
            w = dist.all_reduce(t, async_op=True)
            _ = t * 2  # read before wait: flagged
            w.wait()
            _ = t * 3  # after wait: clean
        with s.step(1):
            dist.all_reduce(torch.ones(2), async_op=True)  # never waited
    mul = _ops(tmp_path / "r", "aten::mul.Tensor").filter(pl.col("arg") == "args[0]")
    assert [h.to_list() for h in mul["hazards"]] == [["async_pending"], []]
    assert _hazard_events(tmp_path / "r", "async_pending").height == 1
    recs = read(tmp_path / "r").filter(pl.col("kind") == "collective")
    # Output digests are taken at wait(), after the input record and the early read.
    out = recs.filter((pl.col("step") == 0) & (pl.col("role") == "output"))
    early = mul.filter(pl.col("hazards").list.len() > 0)
    assert out["seq"][0] > early["seq"][0]
    pend = read(tmp_path / "r", "events").filter(pl.col("type") == "pending_collective")
    assert pend["step"].to_list() == [1] and pend["name"][0] == "all_reduce@world"


@pytest.mark.filterwarnings("ignore:.*all_gather_into_tensor.*is deprecated:FutureWarning")
def test_async_pending_is_what_the_collective_writes_not_what_it_reads(tmp_path, gloo1):
    """A tensor an async collective only reads (an isend's activation, a gather's input) is safe
    to read before wait(): a pipeline stage's backward reads the activation it is sending."""
    with Session(tmp_path / "r", "ops") as s, s.step(0):
        x, out = torch.ones(4), torch.zeros(4)
        w = dist.all_gather_into_tensor(out, x, async_op=True)
        _ = x * 2  # the input, read before wait: clean
        _ = out * 3  # the output, read before wait: flagged
        w.wait()
    mul = _ops(tmp_path / "r", "aten::mul.Tensor").filter(pl.col("arg") == "args[0]")
    assert [h.to_list() for h in mul["hazards"]] == [[], ["async_pending"]]


def test_async_pending_on_probe_at_boundaries(tmp_path, gloo1):
    with Session(tmp_path / "r", "boundaries") as s, s.step(0):
        t = torch.ones(4)
        w = dist.all_reduce(t, async_op=True)
        s.probe("early", t)
        w.wait()
        s.probe("late", t)
    p = read(tmp_path / "r").filter(pl.col("kind") == "probe")
    assert [h.to_list() for h in p["hazards"]] == [["async_pending"], []]


def test_nonblocking_pending_until_sync_or_step_end(tmp_path, monkeypatch):
    from detfp_capture._sources import ops

    # CPU-to-CPU non_blocking copies are synchronous (not flagged, tested below); pretend these
    # involve an accelerator so the pending/sync logic runs on a CPU-only machine.
    monkeypatch.setattr(ops, "_on_accelerator", lambda args, outs: True)
    with Session(tmp_path / "r", "ops") as s:
        with s.step(0):
            src = torch.arange(6, dtype=torch.float32)
            dst = src.to(torch.float64, non_blocking=True)
            _ = dst + 1  # read before any synchronization: flagged
            buf = torch.zeros(6)
            buf.copy_(src, non_blocking=True)
            _ = buf - 1
        with s.step(1):
            _ = dst * 2  # a step boundary is a sync point: clean
    add = _ops(tmp_path / "r", "aten::add.Tensor").filter(pl.col("arg") == "args[0]")
    assert add["hazards"].to_list() == [["nonblocking_pending"]]
    sub = _ops(tmp_path / "r", "aten::sub.Tensor").filter(pl.col("arg") == "args[0]")
    assert sub["hazards"].to_list() == [["nonblocking_pending"]]
    mul = _ops(tmp_path / "r", "aten::mul.Tensor").filter(pl.col("arg") == "args[0]")
    assert mul["hazards"].to_list() == [[]]
    assert _hazard_events(tmp_path / "r", "nonblocking_pending").height == 2


def test_pointer_like_int64_flagged_at_resolve(tmp_path):
    bufs = [torch.zeros(1024) for _ in range(4)]
    ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64)
    with Session(tmp_path / "r", "metrics") as s, s.step(0):
        s.probe("ptr_table", ptrs)
        s.probe("counts", torch.arange(4, dtype=torch.int64))
    p = read(tmp_path / "r").filter(pl.col("kind") == "probe")
    assert [h.to_list() for h in p["hazards"]] == [["pointer_like"], []]
    ev = _hazard_events(tmp_path / "r", "pointer_like")
    assert ev.height == 1 and "ptr_table" in ev["detail"][0]


def test_an_address_reused_after_a_storage_is_freed_inherits_no_hazard():
    """FSDP frees a storage under a living tensor (resize_(0)) and the allocator hands the
    address to another: the entry of the first must not flag the second (it flagged FSDP2's
    gathered parameters uninitialized in one run of an identical pair)."""
    from detfp_capture._recorder.hazards import HazardTracker, storage_key

    hz = HazardTracker(rec=None, poison=None)
    fresh = torch.empty(16)
    hz.born_empty(fresh)
    assert hz.flags(fresh) == ("uninitialized",)
    other = torch.zeros(16)
    # The same entry, as if the allocator had reused fresh's address for other's storage.
    hz.uninit[storage_key(other)] = hz.uninit.pop(storage_key(fresh))
    assert hz.flags(other) == ()
    assert not hz.uninit


def test_poison_pattern_differs_per_run_and_is_never_absorbed():
    """The poison garbage: distinct for distinct run directories, and in every float format a
    large number or a NaN (a one-byte fill such as 0x0A0A0A0A, 6.6e-33 as float32, vanished into
    any sum, so two poisoned runs of a real uninitialized read could agree bit for bit)."""
    pats = {poison_pattern(f"/tmp/runs/r{i}") for i in range(2000)}
    assert len(pats) == 2000
    for p in list(pats)[:200]:
        assert len(p) == 8 and all(0x40 <= b <= 0x7E for b in p)
        raw = torch.frombuffer(bytearray(p), dtype=torch.uint8)
        for dt in (torch.float32, torch.bfloat16, torch.float16):
            v = raw.view(dt).float()
            assert bool(((v.abs() >= 2) | v.isnan()).all()), (p.hex(), dt)


def test_poison_fills_the_whole_storage_with_the_repeating_pattern():
    from detfp_capture._recorder.hazards import HazardTracker

    pat = bytes(range(0x41, 0x49))
    hz = HazardTracker(rec=None, poison=pat)
    for n in (3, 8, 13, 64):
        t = torch.empty(n, dtype=torch.uint8)
        hz.born_empty(t)
        assert bytes(t.tolist()) == (pat * 9)[:n]
