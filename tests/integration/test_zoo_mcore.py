"""The zoo's Megatron-Core member: a tiny GPT trained by Megatron-Core 0.16 on 2 CPU ranks over gloo.

Members (``tests/fixtures/zoo/mcore_train.py``): tensor parallel 2 and pipeline parallel 2 (its
own 1F1B schedule), the local layer spec with biases on (the linear layers return their bias
Parameter as a second output, ``skip_bias_add``: a gradient hook on it used to stay for good and
fire in every later backward) and Megatron's attention (``baddbmm`` of an ``empty`` buffer with
``beta=0``: not an uninitialized read). Without ``use_deterministic_algorithms``.

Scenarios, at levels boundaries and ops, each with its expected answer:

* ``identical``: two identical runs -> ``identical``;
* ``onoff``: capture on vs off -> losses and every rank's parameters bitwise equal;
* ``one``: the split-K op in the MLP's activation of layer 0 sums its chunks in another order on
  one rank from step 1. Tensor parallel, on rank 1: rank 1 ``origin`` (at that op; at level
  boundaries at the input of ``linear_fc2``, the first boundary after it), rank 0 ``receiver``
  at ``all_reduce@tp``. Pipeline parallel, on rank 0 (stage 0): rank 0 ``origin``, rank 1
  ``receiver`` at ``batch_irecv@pp``. Pattern ``single_rank``;
* ``all``: the same on every rank: tensor parallel -> ``origin`` on both, ``all_ranks_same_op``;
  pipeline parallel -> stage 1 receives before its own op runs: the verdicts of ``one``;
* ``certify``: a healthy run has no ``uninitialized`` (the attention buffer), no
  ``reduction_not_captured`` and no ``replica_split``.

Two more members train through Megatron-Core's own ``DistributedDataParallel`` (gradients in
contiguous buffers, reduced by one coalesced all-reduce per bucket group in
``finalize_model_grads``), two steps each:

* ``dp`` (data parallel 2): ``identical``, ``onoff``, ``certify`` and ``data``: one token of
  rank 1's batch changed at step 1 -> rank 1 ``source`` (the batch), rank 0 a ``receiver`` at
  ``all_reduce_coalesced@dp``, whose output is the reduced gradients (digested when the
  coalesced block completed: it used to be the rank's own input, read when ``all_reduce``
  queued it, so rank 0 was a "receiver at grad (optimizer)" and the report said the reduction
  was not captured);
* ``sp`` (tensor parallel 2 with sequence parallelism: the all-gathers and reduce-scatters
  Megatron calls through ``torch.distributed`` functions it bound at import): ``identical``,
  ``onoff``, ``certify`` and ``one`` on rank 1 -> rank 1 ``origin``, rank 0 a ``receiver`` at the
  reduce-scatter ``reduce_scatter_tensor@tp`` of ``linear_fc2`` (it used to be two origins at
  boundaries, ``all_ranks_different_ops``);
* ``sp`` again under the launcher (``python -m detfp_capture`` on each rank, no detfp code, the
  groups named by Megatron's own description of them): the same scenarios, at both levels (at
  ops the receiver used to land at gloo's own ``aten::copy_`` inside the reduce-scatter).

One launch runs every job (Megatron's import is paid once per rank); the bisects run here.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from detfp_analyze.single.certify import certify
from tests.fixtures.zoo.harness import (
    ZOO,
    check_identical,
    check_onoff,
    expect,
    launch,
    launch_runs,
    pair,
    result,
    run_checks,
)

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(900)]

SCRIPT = ZOO / "mcore_train.py"
LEVELS = ("boundaries", "ops")
#: member -> (layout, the rank the one-rank plant goes on, the receiver's kind and call).
MEMBERS: dict[str, tuple[str, int, str, str]] = {
    "tp": ("tp", 1, "collective", "all_reduce@tp"),
    "pp": ("pp", 0, "p2p", "batch_irecv@pp"),
}
STEPS = 4
PLANT = 1
_OP = "detfp_zoo::split_k_mm.default"


def plan(member: str, root: Path) -> list[dict[str, Any]]:
    lay, one, _, _ = MEMBERS[member]
    base = {"layout": lay, "steps": STEPS, "plant_step": PLANT, "order": "rev"}
    jobs = [{**base, "name": f"{member}.off"}]
    for lvl in LEVELS:
        d = root / member / lvl
        for name, kw in (("a", {}), ("b", {}), ("one", {"plant_ranks": [one]}), ("all", {"plant_ranks": [0, 1]})):
            jobs.append({**base, **kw, "name": f"{member}.{lvl}.{name}", "out": str(d / name), "level": lvl})
    return jobs


#: The members trained through Megatron's DDP: member -> its scenario (job options) besides a and b.
DDP_MEMBERS: dict[str, tuple[str, dict[str, Any]]] = {
    "dp": ("data", {"data_ranks": [1]}),
    "sp": ("one", {"plant_ranks": [1], "order": "rev"}),
}
DDP_STEPS = 2


def ddp_plan(member: str, root: Path) -> list[dict[str, Any]]:
    scenario, kw = DDP_MEMBERS[member]
    base = {"layout": member, "steps": DDP_STEPS, "plant_step": PLANT}
    jobs = [{**base, "name": f"{member}.off"}]
    for lvl in LEVELS:
        d = root / member / lvl
        for name, extra in (("a", {}), ("b", {}), (scenario, kw)):
            jobs.append({**base, **extra, "name": f"{member}.{lvl}.{name}", "out": str(d / name), "level": lvl})
    return jobs


@pytest.fixture(scope="module")
def zoo(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("zoo_mcore")
    jobs = [j for m in MEMBERS for j in plan(m, root)] + [j for m in DDP_MEMBERS for j in ddp_plan(m, root)]
    launch(SCRIPT, jobs, root, "mcore")
    return root


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> Path:
    """``sp`` under the launcher: a run without capture, then per level a, b and one (rank 1)."""
    root = tmp_path_factory.mktemp("zoo_mcore_launcher")
    root.mkdir(parents=True, exist_ok=True)
    results = str(root / "results")
    one = DDP_MEMBERS["sp"][1]
    runs: dict[str, list[str]] = {}
    for lvl in (None, *LEVELS):
        for name, extra in (("off", {}),) if lvl is None else (("a", {}), ("b", {}), ("one", one)):
            tag = name if lvl is None else f"{lvl}.{name}"
            plan_file = root / f"plan-{tag}.json"
            plan_file.write_text(
                json.dumps([{"name": tag, "layout": "sp", "steps": DDP_STEPS, "plant_step": PLANT, **extra}])
            )
            head = [] if lvl is None else ["--out", str(root / lvl / name), "--level", lvl]
            runs[tag] = [*head, "--", str(SCRIPT), str(plan_file), results]
    launch_runs(root, runs)
    return root


def _identical(root: Path, member: str, lvl: str) -> None:
    check_identical(root / member / lvl / "a", root / member / lvl / "b")


def _onoff(root: Path, member: str, lvl: str) -> None:
    check_onoff(root, f"{member}.off", [f"{member}.{lvl}.a", f"{member}.{lvl}.b"], [0, 1])


def _origin_at_plant(res: Any, rank: int, lvl: str, what: str) -> None:
    eff = res.rank(rank).effective
    expect(eff is not None and (eff.verdict, eff.step) == ("origin", PLANT), f"{what}: rank {rank} origin", res)
    if lvl == "ops":
        expect((eff.op, eff.module) == (_OP, "decoder.layers.0.mlp"), f"{what}: rank {rank} at the op", res)
    else:
        where = (eff.module, eff.kind, eff.arg)
        want = ("decoder.layers.0.mlp.linear_fc2", "module_input", "args[0]")
        expect(where == want, f"{what}: rank {rank} at the first boundary after the op", res)


def _one(root: Path, member: str, lvl: str) -> None:
    _, one, kind, call = MEMBERS[member]
    res = pair(root / member / lvl / "a", root / member / lvl / "one")
    d = res.diagnosis
    expect(res.first_step == PLANT and d.pattern == "single_rank" and d.origin_ranks == (one,), "one: pattern", res)
    _origin_at_plant(res, one, lvl, "one")
    rx = res.rank(1 - one).effective
    expect(rx is not None and (rx.verdict, rx.kind, rx.op, rx.step) == ("receiver", kind, call, PLANT), "one", res)


def _all(root: Path, member: str, lvl: str) -> None:
    if member == "pp":  # stage 1 receives stage 0's difference before its own op runs
        _, _, kind, call = MEMBERS[member]
        res = pair(root / member / lvl / "a", root / member / lvl / "all")
        expect(res.diagnosis.pattern == "single_rank" and res.diagnosis.origin_ranks == (0,), "all: pattern", res)
        _origin_at_plant(res, 0, lvl, "all")
        rx = res.rank(1).effective
        expect(rx is not None and (rx.verdict, rx.kind, rx.op) == ("receiver", kind, call), "all: rank 1", res)
        return
    res = pair(root / member / lvl / "a", root / member / lvl / "all")
    expect(res.first_step == PLANT and res.diagnosis.pattern == "all_ranks_same_op", "all: pattern", res)
    for r in (0, 1):
        _origin_at_plant(res, r, lvl, "all")


def _certify(root: Path, member: str, lvl: str) -> None:
    _certify_dir(root / member / lvl / "a")


def _data(root: Path, member: str, lvl: str) -> None:
    res = pair(root / member / lvl / "a", root / member / lvl / "data")
    d = res.diagnosis
    expect((res.first_step, d.pattern, d.origin_ranks, d.cause) == (PLANT, "single_rank", (1,), "data"), "data", res)
    r1, r0 = res.rank(1).effective, res.rank(0).effective
    expect(r1 is not None and (r1.verdict, r1.kind, r1.op) == ("source", "batch", "GPTModel"), "data: rank 1", res)
    expect(
        r0 is not None
        and (r0.verdict, r0.step, r0.kind, r0.role, r0.op)
        == ("receiver", PLANT, "collective", "output", "all_reduce_coalesced@dp")
        and r0.peers_differing == (1,),
        "data: rank 0 receives it through Megatron's coalesced gradient all-reduce",
        res,
    )
    expect(
        d.headline == "The data differs: the batch fed to GPTModel differs at step 1 on rank 1, before any computation "
        "(sample order, loader seed, shuffling, augmentation, or that rank's shard).",
        "data: first sentence",
        res,
    )


def _sp_one(res: Any, lvl: str) -> None:
    d = res.diagnosis
    expect(
        (res.first_step, d.pattern, d.origin_ranks, d.cause) == (PLANT, "single_rank", (1,), "rank_local"), "one", res
    )
    _origin_at_plant(res, 1, lvl, "one")
    r0 = res.rank(0).effective
    expect(
        r0 is not None
        and (r0.verdict, r0.kind, r0.role, r0.op, r0.module)
        == ("receiver", "collective", "output", "reduce_scatter_tensor@tp", "decoder.layers.0.mlp.linear_fc2")
        and r0.peers_differing == (1,),
        "one: rank 0 receives it through the sequence-parallel reduce-scatter",
        res,
    )
    expect(d.headline.startswith("Only rank 1 starts the difference, at "), "one: first sentence", res)


def _ddp_one(root: Path, member: str, lvl: str) -> None:
    _sp_one(pair(root / member / lvl / "a", root / member / lvl / "one"), lvl)


DDP_CHECKS: dict[str, Callable[[Path, str, str], None]] = {
    "identical": _identical,
    "onoff": _onoff,
    "certify": lambda root, member, lvl: _certify(root, member, lvl),
    "data": _data,
    "one": _ddp_one,
}


@pytest.mark.parametrize("member,level", [(m, lvl) for m in DDP_MEMBERS for lvl in LEVELS])
def test_zoo_mcore_ddp(zoo, member, level):
    """Megatron-Core's DDP members: every scenario of one member at one level."""
    run_checks(DDP_CHECKS, ("identical", "onoff", "certify", DDP_MEMBERS[member][0]), zoo, member, level)


@pytest.mark.parametrize("level", LEVELS)
def test_zoo_mcore_sp_under_the_launcher(launched, level):
    """Sequence parallelism with no detfp code, under ``python -m detfp_capture`` on each rank."""
    d = launched / level
    checks = {
        "identical": lambda: check_identical(d / "a", d / "b"),
        "onoff": lambda: [
            expect(
                result(launched, f"{level}.{n}", r) == result(launched, "off", r), f"capture on vs off: {n} rank {r}"
            )
            for n in ("a", "b")
            for r in (0, 1)
        ],
        "one": lambda: _sp_one(pair(d / "a", d / "one"), level),
        "certify": lambda: _certify_dir(d / "a"),
    }
    run_checks(checks, checks)


def _certify_dir(run: Path) -> None:
    bad = [p for p in certify(run).problems if p.kind in ("uninitialized", "reduction_not_captured", "replica_split")]
    expect(not bad, f"certify of a healthy Megatron-Core run: {bad}")


CHECKS: dict[str, Callable[[Path, str, str], None]] = {
    "identical": _identical,
    "onoff": _onoff,
    "one": _one,
    "all": _all,
    "certify": _certify,
}

_CASES = [(m, lvl) for m in MEMBERS for lvl in LEVELS]


@pytest.mark.parametrize("member,level", _CASES, ids=[f"{m}-{lvl}" for m, lvl in _CASES])
def test_zoo_mcore(zoo, member, level):
    """Every scenario of one member at one level; all failures reported together."""
    run_checks(CHECKS, CHECKS, zoo, member, level)
