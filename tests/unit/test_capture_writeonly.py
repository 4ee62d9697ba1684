"""Level ops: write-only destinations are never evidence, and collectives' in-place writes.

The prior contents of an ``out=`` argument, of a ``copy_``/``fill_``/``zero_`` destination, or
of a buffer fresh from ``empty*`` that an ``index_put_`` fills are garbage that differs between
processes (DDP's bucket views, FSDP2's all-gather buffers). Two runs whose only difference is
that garbage must bisect ``identical``; the same difference read by a real read-modify-write op
must still be found. Without ``use_deterministic_algorithms``: its NaN fill hides the class.
"""

from __future__ import annotations

import polars as pl
import torch
from torch.distributed import distributed_c10d as c10d
from torch.utils._python_dispatch import TorchDispatchMode

from detfp_analyze.bisect import bisect
from detfp_analyze.io.reader import open_run
from detfp_capture import Session
from tests.fixtures.models import read


def _program(out, garbage: float, *, read_it: bool = False, poison: bool = False) -> None:
    """Ops whose destinations hold ``garbage`` (which differs between the two runs)."""
    x = torch.arange(8, dtype=torch.float32)
    dests = [torch.full((8,), garbage) for _ in range(4)]
    idx = torch.tensor([3, 1, 0, 2])
    keep = torch.full((8,), garbage)
    with Session(out, "ops", poison=poison) as s, s.step(0):
        torch.mul(x, 2.0, out=dests[0])
        dests[1].copy_(x)
        dests[2].fill_(1.5)
        dests[3].zero_()
        # The inverse-permutation idiom (Mixtral's routing): an index_put_ into fresh memory.
        inv = torch.empty_like(idx)
        inv[idx] = torch.arange(4)
        y = (dests[0] + dests[1] + dests[2] + dests[3]).sum() + inv.float().sum()
        if read_it:
            keep.add_(x)  # a read-modify-write of the garbage: a real difference
        y.clone()


def _pair(tmp_path, **kw):
    a, b = tmp_path / "a", tmp_path / "b"
    _program(a, 7.0, **kw)
    _program(b, -3.0, **kw)
    return open_run(a), open_run(b)


def test_write_only_destinations_are_recorded_but_never_compared(tmp_path):
    run_a, run_b = _pair(tmp_path, poison=True)  # poison: empty_like's garbage differs per run
    res = bisect(run_a, run_b)
    assert res.status == "identical", res.ranks
    r = read(tmp_path / "a")
    dest = r.filter(pl.col("role") == "dest").sort("seq")
    assert dest.select("name", "arg", "status").rows() == [
        ("aten::mul.out", "kwargs.out", "skipped"),
        ("aten::copy_.default", "args[0]", "skipped"),
        ("aten::fill_.Scalar", "args[0]", "skipped"),
        ("aten::zero_.default", "args[0]", "skipped"),
        ("aten::index_put_.default", "args[0]", "skipped"),
    ]
    # What the ops wrote is evidence, and no hazard was raised for the fresh buffer it filled.
    outs = r.filter(pl.col("name").is_in(["aten::mul.out", "aten::index_put_.default"]) & (pl.col("role") == "output"))
    assert (outs["status"] == "ok").all() and outs.height == 2
    ev = pl.read_parquet(tmp_path / "a" / "events")
    assert ev.filter(pl.col("type") == "hazard").height == 0


def test_a_read_of_the_garbage_is_still_a_divergence(tmp_path):
    run_a, run_b = _pair(tmp_path, read_it=True)
    res = bisect(run_a, run_b)
    assert res.status == "diverged"
    first = res.ranks[0].first
    assert (first.op, first.role, first.verdict) == ("aten::add_.Tensor", "input", "unobserved_producer")


class _LateWrite(TorchDispatchMode):
    """Below the capture's mode: let an all-reduce write its tensor after it returns, as a real
    backend does from its own thread (with one rank the sum would change nothing)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func._schema.name == "c10d::allreduce_":
            args[0][0].add_(100.0)
        return out


def test_inplace_collective_digests_its_input_before_the_asynchronous_write(tmp_path, gloo1):
    """c10d schemas carry no alias annotations: an all-reduce still writes its tensor, later, on
    the backend's thread. The digest of the value it reduces (here the output of the mul_ just
    before it, waiting for a batch) must be taken before the collective starts, and the value it
    wrote at its completion; the backend's own ``c10d::`` op is not a record of the program."""
    from detfp_capture import digest

    t = torch.ones(1 << 12)
    with _LateWrite(), Session(tmp_path / "r", "ops") as s, s.step(0):
        t.mul_(3.0)
        # c10d's own function, as DDP's comm hooks and FSDP2 call it.
        work = c10d.all_reduce(t, async_op=True)
        work.wait()
        t.add_(1.0)
    r = read(tmp_path / "r").sort("seq")
    mul_out = r.filter((pl.col("name") == "aten::mul_.Tensor") & (pl.col("role") == "output"))
    red = r.filter(pl.col("name") == "all_reduce@world")
    assert red["role"].to_list() == ["input", "output"]
    assert r.filter(pl.col("name").str.starts_with("c10d::")).height == 0
    for row, value in ((mul_out, 3.0), (red[0], 3.0), (red[1], 103.0)):
        assert row["status"].to_list() == ["ok"]
        want = digest.fingerprint(torch.full((1 << 12,), value)).digest
        assert f"{row['digest_hi'][0]:016x}{row['digest_lo'][0]:016x}" == want
