"""The zoo's 2-D mesh members: tensor parallelism x FSDP2, and x data parallelism, on 4 ranks.

Members (``tests/fixtures/zoo/parallel_train.py``, 4 ranks over gloo under torchrun, one launch
for both, without ``use_deterministic_algorithms``), on ``init_device_mesh("cpu", (2, 2),
("dp", "tp"))``: a Hugging Face ``LlamaDecoderLayer`` tensor parallel over ``tp`` (ranks {0, 1},
{2, 3}), each ``dp`` replica (ranks {0, 2}, {1, 3}) reading its own batches, and

* ``tp_fsdp``: FSDP2 over ``dp`` (``fully_shard`` of the layer and the root): its all-gathers
  and reduce-scatters are ``torch.distributed.all_gather_single``/``reduce_scatter_single``,
  which capture did not see on torch 2.13 (no dp record at all; ``certify`` silent);
* ``tp_dp``: replicas whose every gradient a hand-written all-reduce averages over ``dp``.

Scenarios, at levels boundaries and ops, each with its exact answer:

* ``identical`` and ``onoff`` (losses and every rank's parameters bitwise equal with capture
  off), and ``certify`` of a run: no gradient reduction missed, no replica split;
* ``kernel``: the split-K order of ``mlp.down_proj`` reversed on global rank 2 from step 1: rank 2
  the ``origin`` (at boundaries the reduce-scatter's input, made by ``down_proj``'s own code; at
  ops the split-K op), rank 3 a ``receiver`` through the tp reduce-scatter, ranks 0 and 1
  ``receiver``s through the dp reduction (rank 1 from rank 3, itself a receiver), ``single_rank``
  [2]; the cause is rank 2's own code, never the reduction order (it used to be origins on ranks
  0-2 at boundaries, and cause ``collective`` "every rank of its group had matching inputs");
* ``data``: one token of replica 1's batch (ranks 2 and 3) changed from step 1: ranks 2-3
  ``source`` (the batch, named ``LlamaTP``, not FSDP2's ``FSDPLlamaTP``), ranks 0-1 ``receiver``s
  through the dp reduction, ``rank_subset`` [2, 3], cause ``data``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from detfp_analyze.single.certify import certify
from tests.fixtures.zoo.harness import ZOO, check_identical, check_onoff, expect, launch, pair, run_checks

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(900)]

SCRIPT = ZOO / "parallel_train.py"
STEPS, PLANT = 2, 1
MEMBERS = ("tp_fsdp", "tp_dp")
LEVELS = ("boundaries", "ops")
RANKS = range(4)
#: The dp reduction: member -> (its collective, the module it runs in at boundaries, at ops).
DP_REDUCTION = {"tp_fsdp": ("reduce_scatter_single@dp", "", ""), "tp_dp": ("all_reduce@dp", "", "head")}
#: Where rank 2 starts the kernel plant: level -> (module, kind, role, op).
ORIGIN = {
    "boundaries": ("layer.mlp.down_proj", "collective", "input", "reduce_scatter_tensor@tp"),
    "ops": ("layer.mlp.down_proj", "op", "output", "detfp_zoo::split_k_mm.default"),
}
HEADLINE = {
    "boundaries": "Only rank 2 starts the difference, at the input of reduce_scatter_tensor@tp in layer.mlp.down_proj "
    "(forward, step 1), which the code before it on that rank made (its coordinates: dp=1, tp=0): look at what "
    "differs there (its input data, placement, topology, reduction order).",
    "ops": "Only rank 2 starts the difference, at detfp_zoo::split_k_mm.default in layer.mlp.down_proj (forward, "
    "step 1) with matching inputs (its coordinates: dp=1, tp=0): look at what differs there (its input data, "
    "placement, topology, reduction order).",
}
DATA_HEADLINE = (
    "The data differs: the batch fed to LlamaTP differs at step 1 on ranks 2-3, before any computation (sample "
    "order, loader seed, shuffling, augmentation, or that rank's shard)."
)


def plan(member: str, root: Path) -> list[dict[str, Any]]:
    """A run without capture, then per level a, b, kernel, data."""
    base = {"family": member, "steps": STEPS, "plant_step": PLANT}
    jobs = [{**base, "name": f"{member}.off"}]
    for lvl in LEVELS:
        for name, kw in (
            ("a", {}),
            ("b", {}),
            ("kernel", {"order": "rev", "plant_ranks": [2]}),
            ("data", {"data_ranks": [2, 3]}),
        ):
            jobs.append(
                {**base, **kw, "name": f"{member}.{lvl}.{name}", "out": str(root / member / lvl / name), "level": lvl}
            )
    return jobs


@pytest.fixture(scope="module")
def zoo(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("zoo_mesh")
    launch(SCRIPT, [j for m in MEMBERS for j in plan(m, root)], root, "mesh", nproc=4)
    return root


def _identical(root: Path, member: str, lvl: str) -> None:
    check_identical(root / member / lvl / "a", root / member / lvl / "b")


def _onoff(root: Path, member: str, lvl: str) -> None:
    check_onoff(root, f"{member}.off", [f"{member}.{lvl}.a", f"{member}.{lvl}.b"], RANKS)


def _certify(root: Path, member: str, lvl: str) -> None:
    bad = [
        p for p in certify(root / member / lvl / "a").problems if p.kind in ("reduction_not_captured", "replica_split")
    ]
    expect(not bad, f"certify of a healthy 2-D mesh run: {bad}")


def _dp_receivers(res: Any, member: str, lvl: str, what: str) -> None:
    name, b_module, o_module = DP_REDUCTION[member]
    module = b_module if lvl == "boundaries" else o_module
    for r, peer in ((0, 2), (1, 3)):
        eff = res.rank(r).effective
        expect(
            eff is not None
            and (eff.verdict, eff.step, eff.kind, eff.role, eff.op, eff.module)
            == ("receiver", PLANT, "collective", "output", name, module)
            and eff.peers_differing == (peer,),
            f"{what}: rank {r} receives from rank {peer} at {name} in {module or '<root>'}",
            res,
        )


def _kernel(root: Path, member: str, lvl: str) -> None:
    res = pair(root / member / lvl / "a", root / member / lvl / "kernel")
    d = res.diagnosis
    expect((res.first_step, d.pattern, d.origin_ranks) == (PLANT, "single_rank", (2,)), "kernel: single_rank [2]", res)
    r2, r3 = res.rank(2).effective, res.rank(3).effective
    expect(
        r2 is not None and (r2.verdict, r2.step, r2.module, r2.kind, r2.role, r2.op) == ("origin", PLANT, *ORIGIN[lvl]),
        f"kernel: rank 2 origin at {ORIGIN[lvl]}",
        res,
    )
    expect(
        r3 is not None
        and (r3.verdict, r3.kind, r3.role, r3.op, r3.module)
        == ("receiver", "collective", "output", "reduce_scatter_tensor@tp", "layer.mlp.down_proj")
        and r3.peers_differing == (2,),
        "kernel: rank 3 receives through the tp reduce-scatter",
        res,
    )
    _dp_receivers(res, member, lvl, "kernel")
    expect((d.cause, d.headline) == ("rank_local", HEADLINE[lvl]), "kernel: cause and first sentence", res)


def _data(root: Path, member: str, lvl: str) -> None:
    res = pair(root / member / lvl / "a", root / member / lvl / "data")
    d = res.diagnosis
    expect(
        (res.first_step, d.pattern, d.origin_ranks) == (PLANT, "rank_subset", (2, 3)), "data: rank_subset [2, 3]", res
    )
    for r in (2, 3):
        eff = res.rank(r).effective
        expect(
            eff is not None and (eff.verdict, eff.step, eff.kind, eff.op) == ("source", PLANT, "batch", "LlamaTP"),
            f"data: rank {r} source at the batch",
            res,
        )
    _dp_receivers(res, member, lvl, "data")
    expect((d.cause, d.headline) == ("data", DATA_HEADLINE), "data: cause and first sentence", res)


CHECKS: dict[str, Callable[[Path, str, str], None]] = {
    "identical": _identical,
    "onoff": _onoff,
    "certify": _certify,
    "kernel": _kernel,
    "data": _data,
}
_CASES = [(m, lvl) for m in MEMBERS for lvl in LEVELS]


@pytest.mark.parametrize("member,level", _CASES, ids=[f"{m}-{lvl}" for m, lvl in _CASES])
def test_zoo_mesh(zoo, member, level):
    """Every scenario of one member at one level; all failures reported together."""
    run_checks(CHECKS, CHECKS, zoo, member, level)
