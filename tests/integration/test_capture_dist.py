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

from detfp_analyze.io.reader import open_run
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


def _collective_worker(rank: int, world: int, init: str, out: str, q) -> None:
    """Two ranks: a coalesced all-reduce (``_coalescing_manager``, as Megatron-Core's DDP reduces
    its buckets), then a step whose data-parallel gradient reduction capture does not see (a
    functional all-reduce through the op overload itself, as compiled code calls it) while its
    tp reduction is seen."""
    import torch.distributed.distributed_c10d as c10d

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        ones = [dist.new_group([r]) for r in range(world)]  # every rank creates every group, in order
        tp = ones[rank]  # a tensor-parallel group of one rank: its reduction changes nothing
        net = torch.nn.Linear(4, 1, bias=False)
        w = net.weight
        opt = torch.optim.SGD([w], lr=0.1)
        with Session(out, "boundaries", group_names={"dp": dist.group.WORLD, "tp": tp}) as s:
            s.watch(net)
            s.watch_optimizer(opt)
            with s.step(0):
                a, b = torch.full((4,), float(rank + 1)), torch.full((2,), float(10 * (rank + 1)))
                with c10d._coalescing_manager():
                    dist.all_reduce(a)
                    dist.all_reduce(b)
            with s.step(1):
                net(torch.full((1, 4), float(rank + 1))).sum().backward()
                dist.all_reduce(w.grad, group=tp)  # seen: over tp
                pg = dist.group.WORLD.group_name
                red = torch.ops._c10d_functional.all_reduce.default(w.grad, "sum", pg)
                w.grad.copy_(torch.ops._c10d_functional.wait_tensor.default(red))  # unseen: over dp
                opt.step()
        q.put((rank, a.tolist(), b.tolist()))
    finally:
        dist.destroy_process_group()


@pytest.mark.multirank
def test_coalesced_block_and_a_layout_whose_reduction_capture_did_not_see(tmp_path):
    """A coalesced block is one call: its inputs at the block's exit, its outputs once the block
    completed (the reduced values, not the rank's own inputs); and ``certify`` names the
    data-parallel group no gradient reduction capture saw ran over, while one over tp was seen."""
    from detfp_analyze.single.certify import certify
    from detfp_capture import digest

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
    q = ctx.Queue()
    init = tempfile.mktemp(dir=tmp_path)
    procs = [ctx.Process(target=_collective_worker, args=(r, 2, init, str(tmp_path / "run"), q)) for r in range(2)]
    for p in procs:
        p.start()
    got = {r: (a, b) for r, a, b in (q.get(timeout=240) for _ in procs)}
    for p in procs:
        p.join(timeout=60)
    assert got == {r: ([3.0] * 4, [30.0] * 2) for r in (0, 1)}
    runs = open_run(tmp_path / "run").scan("records").filter(pl.col("kind") == "collective").collect()
    for rank in (0, 1):
        rows = runs.filter((pl.col("rank") == rank) & (pl.col("step") == 0)).sort("seq")
        assert rows.select("name", "role", "arg").rows() == [
            ("all_reduce_coalesced@dp", "input", "tensors[0]"),
            ("all_reduce_coalesced@dp", "input", "tensors[1]"),
            ("all_reduce_coalesced@dp", "output", "tensors[0]"),
            ("all_reduce_coalesced@dp", "output", "tensors[1]"),
        ]
        want = [torch.full((4,), float(rank + 1)), torch.full((2,), 10.0 * (rank + 1)), torch.full((4,), 3.0), torch.full((2,), 30.0)]
        have = [f"{hi:016x}{lo:016x}" for hi, lo in rows.select("digest_hi", "digest_lo").rows()]
        assert have == [digest.fingerprint(t).digest for t in want]
    problems = [p for p in certify(tmp_path / "run").problems if p.kind == "reduction_not_captured"]
    assert [(p.rank, p.step) for p in problems] == [(0, 1), (1, 1)]
    for p in problems:
        assert "step 1 reduced gradients over tp but none over the data-parallel group dp (ranks 0,1)" in p.detail
