"""torch.distributed capture: collective names and groups, async waits, DDP buckets (gloo, CPU)."""

from __future__ import annotations

import contextlib
import json
import tempfile

import polars as pl
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from detfp_capture import Session
from tests.fixtures.fault_child import FORKSERVER_PRELOAD
from tests.fixtures.models import Net, bits, read


def test_collectives_named_grouped_and_restored(tmp_path, gloo1):
    orig = dist.ProcessGroup.__dict__["allreduce"]
    dp = dist.new_group([0])
    with Session(tmp_path / "r", "boundaries", group_names={"dp": dp}) as s:
        # Below the Python names: the ProcessGroup's methods every entry point ends in.
        assert dist.ProcessGroup.__dict__["allreduce"] is not orig
        with s.step(0):
            t = torch.arange(4.0)
            dist.all_reduce(t)
            dist.all_reduce(t, group=dp)
            out = [torch.zeros(4)]
            dist.all_gather(out, t)
            o = torch.zeros(4)
            dist.reduce_scatter_tensor(o, t)
            w = dist.broadcast(t, 0, async_op=True)
            w.wait()
            dist.all_reduce_coalesced([t, o])
            # P2POp validates its op against c10d's own isend: the wrapper must pass.
            dist.P2POp(dist.isend, t, 0)
    assert dist.ProcessGroup.__dict__["allreduce"] is orig
    r = read(tmp_path / "r").filter(pl.col("kind") == "collective")
    calls = r.select("name", "occurrence", "role", "arg").rows()
    assert calls == [
        ("all_reduce@world", 0, "input", "tensor"),
        ("all_reduce@world", 0, "output", "tensor"),
        ("all_reduce@dp", 0, "input", "tensor"),
        ("all_reduce@dp", 0, "output", "tensor"),
        ("all_gather@world", 0, "input", "tensor"),
        ("all_gather@world", 0, "output", "tensor_list[0]"),
        ("reduce_scatter_tensor@world", 0, "input", "input"),
        ("reduce_scatter_tensor@world", 0, "output", "output"),
        ("broadcast@world", 0, "input", "tensor"),
        ("broadcast@world", 0, "output", "tensor"),
        ("all_reduce_coalesced@world", 0, "input", "tensors[0]"),
        ("all_reduce_coalesced@world", 0, "input", "tensors[1]"),
        ("all_reduce_coalesced@world", 0, "output", "tensors[0]"),
        ("all_reduce_coalesced@world", 0, "output", "tensors[1]"),
    ]
    man = json.loads((tmp_path / "r/manifest/rank=0/segment-00000.json").read_text())
    assert man["groups"] == {"dp": [0], "world": [0]}
    # args_digest separates calls that differ only in non-tensor arguments (src, op, ...).
    assert r.filter(pl.col("name") == "broadcast@world")["args_digest"].is_not_null().all()


def _worker(rank: int, world: int, init: str, out: str, q) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        results = {}
        for label in ("plain", "captured"):
            torch.manual_seed(0)
            model = torch.nn.parallel.DistributedDataParallel(Net(ckpt=True), bucket_cap_mb=0.001)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            s = Session(out, "boundaries") if label == "captured" else None
            if s is not None:
                s.watch(model)
                s.watch_optimizer(opt)
            gen = torch.Generator().manual_seed(100 + rank)
            losses = []
            for step in range(2):
                in_step = s.step(step) if s is not None else contextlib.nullcontext()
                in_step.__enter__()
                tokens = torch.randint(0, 16, (4, 6), generator=gen)
                loss = torch.nn.functional.cross_entropy(model(tokens).reshape(-1, 16), tokens.reshape(-1))
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(bits(loss.detach()))
                # Point-to-point: rank 0 sends to 1 and receives back, batched and plain.
                t = torch.full((3,), float(rank + step))
                peer = 1 - rank
                recv = torch.zeros(3)
                works = dist.batch_isend_irecv([dist.P2POp(dist.isend, t, peer), dist.P2POp(dist.irecv, recv, peer)])
                for w in works:
                    w.wait()
                in_step.__exit__(None, None, None)
            if s is not None:
                s.close()
            results[label] = (losses, [p.detach().numpy().tobytes() for p in model.parameters()])
        q.put((rank, results["plain"] == results["captured"]))
    finally:
        dist.destroy_process_group()


@pytest.mark.multirank
def test_ddp_two_ranks_no_perturbation_and_buckets(tmp_path):
    # Forked from the forkserver that imported torch once (the one tests/integration/test_faults.py
    # uses: whichever runs first starts it), not two interpreters that import torch each.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
    q = ctx.Queue()
    init = tempfile.mktemp(dir=tmp_path)
    procs = [ctx.Process(target=_worker, args=(r, 2, init, str(tmp_path / "run"), q)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=240) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert got == {0: True, 1: True}
    r = read(tmp_path / "run")
    for rank in (0, 1):
        rr = r.filter((pl.col("rank") == rank) & (pl.col("step") == 1))
        # DDP's reduction is recorded per parameter (its buckets are DDP's packing, which a
        # resumed run's first step packs differently): the gradient before and after it.
        assert rr.filter(pl.col("kind") == "collective").height == 0
        red = rr.filter(pl.col("kind") == "reduced_grad")
        names = [n for n, _ in Net().named_parameters()]
        assert red.select("name", "role").rows() == [(n, role) for n in sorted(names) for role in ("input", "output")]
        p2p = rr.filter(pl.col("kind") == "p2p")
        assert set(p2p["name"]) == {"batch_isend@world", "batch_irecv@world"}
        assert set(p2p.filter(pl.col("name") == "batch_irecv@world")["role"]) == {"output"}
    # Reduced gradients are identical on both ranks (the reduction is the same data everywhere).
    red = r.filter((pl.col("kind") == "reduced_grad") & (pl.col("step") == 1) & (pl.col("role") == "output"))
    red = red.sort("name", "rank")
    by_rank = red.group_by("name").agg(pl.col("digest_hi").n_unique().alias("n"))
    assert (by_rank["n"] == 1).all()
