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
  ``reduction_not_captured`` and no ``replica_split`` (nothing is data parallel).

One launch runs every job (Megatron's import is paid once per rank); the bisects run here.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from detfp_analyze.single.certify import certify
from tests.fixtures.zoo.harness import ZOO, check_identical, check_onoff, expect, launch, pair, run_checks

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


@pytest.fixture(scope="module")
def zoo(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("zoo_mcore")
    launch(SCRIPT, [j for m in MEMBERS for j in plan(m, root)], root, "mcore")
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
    res = certify(root / member / lvl / "a")
    bad = [p for p in res.problems if p.kind in ("uninitialized", "reduction_not_captured", "replica_split")]
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
