"""Training loops whose forward runs inside ``optimizer.step(closure)``, and a framework that
starts its own ranks, under the launcher with no detfp code.

Members:

* ``lightning_torchrun``: Lightning (``tests/fixtures/zoo/lightning_train.py``: a tiny
  ``LightningModule``, ``Trainer(strategy="ddp", accelerator="cpu", devices=2)``, automatic
  optimization with two batches per optimizer step) under ``torchrun -m detfp_capture``;
* ``closure_torchrun``: a plain PyTorch DDP loop with L-BFGS, which calls its closure (forward
  and backward) more than once per step (``tests/fixtures/zoo/closure_train.py``), the same way;
* ``lightning_spawned``: the Lightning script under ``python -m detfp_capture`` alone: Lightning
  starts rank 1 itself by running the script again, and the launcher follows it
  (``detfp_capture/_launch/children.py``).

Scenarios and their exact answers: ``identical`` (a pair at boundaries and at ops ->
``identical``), ``onoff`` (losses and final parameters with capture on equal those with it off,
bit for bit, on both ranks), ``data`` (one element of rank 1's batch at step 1, level
boundaries -> rank 1 ``source`` at ``batch``, rank 0 ``receiver``, ``single_rank``), ``nondet``
(the split-K op's order from step 1 in ``fc1``, level ops -> ``origin`` at that op on every rank,
``all_ranks_same_op``). Each family is one launch: the torchrun members together (each rank runs
every job in turn, ``tests/fixtures/zoo/launch_many.py``), the spawned member in one process that
runs its jobs in turn while Lightning starts one rank-1 process per job.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest

from detfp_analyze.io.reader import open_run
from tests.fixtures.zoo.harness import ROOT, ZOO, check_identical, check_onoff, expect, free_ports, pair

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(600)]

LIGHTNING = ZOO / "lightning_train.py"
CLOSURE = ZOO / "closure_train.py"
#: job -> (level, script options); level None: capture off.
JOBS: dict[str, tuple[str | None, tuple[str, ...]]] = {
    "off": (None, ()),
    "boundaries.a": ("boundaries", ()),
    "boundaries.b": ("boundaries", ()),
    "boundaries.data": ("boundaries", ("--data-rank", "1")),
    "ops.a": ("ops", ()),
    "ops.b": ("ops", ()),
    "ops.nondet": ("ops", ("--order", "rev")),
}
PLANT = 1
#: The module the split-K op runs in (the same name in both scripts' models).
TARGET = "fc1"


def _runs(root: Path, member: str, script: Path, *, off: bool = True) -> list[list[str]]:
    out = []
    for job, (level, extra) in JOBS.items():
        if level is None and not off:
            continue
        tail = ["--", str(script), str(root / "results"), f"{member}.{job}", *extra]
        out.append(tail if level is None else ["--out", str(root / member / job), "--level", level, *tail])
    return out


def _launch(root: Path, argvs: list[list[str]], tag: str, nproc: int) -> None:
    """Every run in turn in one process per rank (``launch_many``): under torchrun with ``nproc``
    ranks, or (``nproc=1``) one plain process, where Lightning starts the other rank."""
    spec = [{"port": port, "argv": argv} for port, argv in zip(free_ports(len(argvs)), argvs, strict=True)]
    (root / f"runs-{tag}.json").write_text(json.dumps(spec))
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    head = [sys.executable]
    if nproc > 1:
        head += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    cmd = [*head, "-m", "tests.fixtures.zoo.launch_many", str(root / f"runs-{tag}.json")]
    log = root / f"launch-{tag}.log"
    with log.open("w") as f:
        proc = subprocess.run(cmd, env=env, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=300)
    if proc.returncode != 0:
        raise AssertionError(f"launch {tag} failed ({proc.returncode}), {log}:\n{log.read_text()[-6000:]}")


@pytest.fixture(scope="module")
def zoo(tmp_path_factory) -> Path:
    pytest.importorskip("lightning", reason="the zoo needs the development install (requirements-dev.txt)")
    root = tmp_path_factory.mktemp("loops")
    # The closure script's runs first: after Lightning's runs in the same process, the end of a
    # run of the closure script without capture (its DDP model and gloo group freed when main()
    # returns) hung now and then on one rank (seen 3 times in about 10 launches on the loaded
    # 2-core machine; never with the closure runs first, nor in the closure runs alone).
    _launch(
        root, _runs(root, "closure_torchrun", CLOSURE) + _runs(root, "lightning_torchrun", LIGHTNING), "torchrun", 2
    )
    # No run without capture here: the torchrun launch's is the same training (which process
    # starts rank 1 changes no number), and each run of this launch costs a rank-1 process.
    _launch(root, _runs(root, "lightning_spawned", LIGHTNING, off=False), "spawned", 1)
    return root


#: member -> the member whose run without capture is its ``onoff`` reference.
MEMBERS = {
    "lightning_torchrun": "lightning_torchrun",
    "closure_torchrun": "closure_torchrun",
    "lightning_spawned": "lightning_torchrun",
}


def _identical(root: Path, member: str) -> None:
    for level in ("boundaries", "ops"):
        check_identical(root / member / f"{level}.a", root / member / f"{level}.b")


def _onoff(root: Path, member: str) -> None:
    on = [f"{member}.{job}" for job, (level, _) in JOBS.items() if level is not None and job.endswith((".a", ".b"))]
    check_onoff(root, f"{MEMBERS[member]}.off", on, [0, 1])


def _data(root: Path, member: str) -> None:
    res = pair(root / member / "boundaries.a", root / member / "boundaries.data")
    d = res.diagnosis
    expect(d.pattern == "single_rank" and d.origin_ranks == (1,), "data: single_rank on rank 1", res)
    r0, r1 = res.rank(0).effective, res.rank(1).effective
    expect(
        r1 is not None and (r1.verdict, r1.kind, r1.step, r1.phase) == ("source", "batch", PLANT, "forward"),
        "data: rank 1 is the source, at its batch, in the forward",
        res,
    )
    expect(r0 is not None and (r0.verdict, r0.step) == ("receiver", PLANT), "data: rank 0 receives it", res)


def _nondet(root: Path, member: str) -> None:
    res = pair(root / member / "ops.a", root / member / "ops.nondet")
    expect(res.first_step == PLANT and res.diagnosis.pattern == "all_ranks_same_op", "nondet: pattern", res)
    for rr in res.ranks:
        f = rr.effective
        expect(
            f is not None
            and (f.verdict, f.step, f.op, f.module, f.phase)
            == ("origin", PLANT, "detfp_zoo::split_k_mm.default", TARGET, "forward"),
            f"nondet: the planted op on rank {rr.rank}",
            res,
        )


def _manifests(root: Path, member: str) -> None:
    """Both ranks captured, each as its own rank, and each manifest agrees with its groups."""
    run = open_run(root / member / "boundaries.a")
    expect(run.world_size == 2 and tuple(run.ranks) == (0, 1), f"{member}: ranks 0-1 of 2, got {run}")
    for r in (0, 1):
        m = run.manifest(r)
        expect(m["rank"] == r and m["world_size"] == 2 and m["groups"].get("world") == [0, 1], f"manifest {r}: {m}")


CHECKS = {"manifests": _manifests, "identical": _identical, "onoff": _onoff, "data": _data, "nondet": _nondet}


@pytest.mark.parametrize("member", MEMBERS)
def test_loops(zoo, member):
    """Every scenario of one member; all failures reported together."""
    failures = []
    for name, check in CHECKS.items():
        try:
            check(zoo, member)
        except AssertionError as exc:
            failures.append(f"[{name}] {exc}")
    assert not failures, "\n\n".join(failures)


def test_the_closure_runs_as_a_forward_and_a_backward(zoo):
    """Inside ``optimizer.step(closure)`` the forward is phase ``forward`` (the root's input the
    batch) and its backward ``backward``; the optimizer's own records keep their meaning: the
    parameters before the update, the gradients after each closure call (L-BFGS calls it more
    than once per step), the parameters and state after the update."""
    recs = (
        open_run(zoo / "closure_torchrun" / "boundaries.a")
        .scan("records")
        .filter((pl.col("rank") == 1) & (pl.col("step") == PLANT))
        .sort("seq")
        .collect()
    )
    batch = recs.filter(pl.col("kind") == "batch")
    assert set(batch["phase"]) == {"forward"} and batch["occurrence"].n_unique() >= 2  # one per closure call
    assert not recs.filter(
        (pl.col("phase") == "optimizer") & pl.col("kind").is_in(["module_input", "module_output"])
    ).height
    opt = recs.filter(pl.col("phase") == "optimizer")
    kinds = opt.select("kind", "role").unique(maintain_order=True).rows()
    assert kinds[0] == ("param", "input") and ("param", "output") in kinds and ("grad", "input") in kinds
    first_fwd, first_grad = batch["seq"].min(), opt.filter(pl.col("kind") == "grad")["seq"].min()
    assert first_fwd < first_grad  # the gradients are read after the closure computed them
