"""Verdicts where a difference crosses ranks inside the model (2 ranks over gloo, forked).

A hand-written row-parallel layer computes its partial product and all-reduces it; in run B,
rank 1 changes its partial product (a module's own code, before the collective), at step 1.

* ``seen``: the all-reduce runs inside the layer's forward through ``torch.distributed``, which
  capture records. At level boundaries rank 1 is the origin in that layer (its collective's
  input differs while everything before it matched: the layer's own code made it), rank 0 a
  receiver at the all-reduce, pattern ``single_rank`` (issue 28, item 5).
* ``unseen``: the layer returns its partial product and its parent all-reduces it through the
  process group's method bound before the session opened (capture wraps ``ProcessGroup``'s
  methods while it is open: a method bound earlier is what a C++ extension's collective is to it).
  Rank 1 is the origin at the layer's output; rank 0's first difference is the next layer's
  input, a receiver through the cross-rank test, and its ``depends_on`` names a collective the
  forward ran, not a DDP or FSDP gradient reduction (issue 28, item 9).
"""

from __future__ import annotations

import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed import distributed_c10d

from detfp_capture import Session
from tests.fixtures.fault_child import FORKSERVER_PRELOAD
from tests.fixtures.zoo.harness import expect, pair

pytestmark = pytest.mark.multirank

STEPS, PLANT = 2, 1


class _Row(torch.nn.Module):
    def __init__(self, seen: bool, change: bool) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 4))
        self.seen, self.change = seen, change

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x @ self.w  # this rank's partial product
        if self.change:
            y = y * 1.0001
        if self.seen:
            dist.all_reduce(y)
        return y


class _Model(torch.nn.Module):
    def __init__(self, seen: bool, change: bool) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(4, 8)
        self.row = _Row(seen, change)
        self.out = torch.nn.Linear(4, 2)
        # Bound now, before the session wraps the class's methods: a collective capture does not see.
        self._allreduce = distributed_c10d._get_default_group().allreduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.row(self.inp(x))
        if not self.row.seen:
            # A collective capture does not see (into a copy: an in-place write capture does not
            # see either would leave the cached digest of the row's output in place).
            y = y.clone()
            self._allreduce([y]).wait()
        return self.out(y)


def _worker(rank: int, init: str, root: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    try:
        for scenario in ("seen", "unseen"):
            for run in ("a", "b"):
                torch.manual_seed(0)
                model = _Model(scenario == "seen", False)
                with Session(f"{root}/{scenario}/{run}", "boundaries") as s:
                    s.watch(model)
                    for step in range(STEPS):
                        model.row.change = run == "b" and rank == 1 and step == PLANT
                        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step))
                        with s.step(step):
                            s.metric("loss", model(x).sum().detach())
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("exchange")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
    init = tempfile.mktemp(dir=root)
    procs = [ctx.Process(target=_worker, args=(r, init, str(root))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
    assert [p.exitcode for p in procs] == [0, 0]
    return root


def test_a_modules_own_change_to_a_collectives_input_is_the_origin_in_that_module(runs):
    res = pair(runs / "seen" / "a", runs / "seen" / "b")
    d = res.diagnosis
    expect(d.pattern == "single_rank" and d.origin_ranks == (1,), "single_rank on rank 1", res)
    r0, r1 = res.rank(0).effective, res.rank(1).effective
    expect(
        (r1.verdict, r1.step, r1.module, r1.kind, r1.role) == ("origin", PLANT, "row", "collective", "input"),
        "rank 1: origin in the row layer, at its all-reduce's input",
        res,
    )
    expect(
        (r0.verdict, r0.module, r0.op, r0.role) == ("receiver", "row", "all_reduce@world", "output"),
        "rank 0: receiver at the all-reduce",
        res,
    )


def test_a_receiver_through_an_unseen_forward_collective_depends_on_that_collective(runs):
    res = pair(runs / "unseen" / "a", runs / "unseen" / "b")
    d = res.diagnosis
    expect(d.pattern == "single_rank" and d.origin_ranks == (1,), "single_rank on rank 1", res)
    r0, r1 = res.rank(0).effective, res.rank(1).effective
    expect((r1.verdict, r1.module, r1.kind) == ("origin", "row", "module_output"), "rank 1: origin at row", res)
    expect((r0.verdict, r0.module, r0.kind) == ("receiver", "out", "module_input"), "rank 0: receiver", res)
    dep = r0.depends_on or ""
    expect("forward" in dep and "DDP" not in dep and "group world" in dep, f"depends_on: {dep}", res)
