"""The zoo's tensor- and expert-parallel members: torch TP on a Llama layer, and an MoE layer.

Members (``tests/fixtures/zoo/parallel_train.py``, 2 ranks over gloo under torchrun, one launch
for both, without ``use_deterministic_algorithms``):

* ``tp``: a Hugging Face ``LlamaDecoderLayer`` under torch's ``SequenceParallel``,
  ``ColwiseParallel`` and ``RowwiseParallel`` (DTensor's functional collectives: all-gathers,
  reduce-scatters, all-reduces, forward and backward), watched after ``parallelize_module``;
  ``tp_early`` watches before it (as the launcher's global hooks do), at level boundaries;
* ``ep``: a top-2 MoE layer with two experts per rank, tokens dispatched and combined by the
  functional ``all_to_all_single_autograd``;
* ``cp``: context parallelism, a causal ring attention written here (each rank holds a chunk of
  the sequence; keys and values travel around the ring by ``batch_isend_irecv``, the gradients
  back), the replicated weights' gradients averaged by an all-reduce as each is accumulated.

Scenarios, at levels boundaries and ops, each with its exact answer:

* ``identical`` (two identical runs) and ``onoff`` (capture on vs off: losses and parameters
  bitwise equal);
* ``nondet``: the planted split-K op sums its chunks the other way on every rank from step 1 (TP:
  in ``mlp.down_proj``, before its reduce-scatter; EP: in the experts) -> ``origin`` on every
  rank, ``all_ranks_same_op``;
* ``onerank``: rank 1 alone changes at step 1 -> rank 1 ``origin`` where the change is, rank 0
  ``receiver`` at the collective that carried it, ``single_rank`` [1]. TP: the split-K order in
  ``mlp.down_proj`` (at boundaries the origin is that module, whose reduce-scatter input its own
  code made; at ops the split-K op). EP: the tie-break of tokens routed to one expert, so the
  dispatch moves the same rows in another order (at boundaries the origin is the MoE layer, at
  the dispatch's input, diff kind ``permutation``; at ops the ``torch.arange`` whose arguments
  changed). CP: the key projection's split-K order -> rank 1 ``origin`` there, rank 0 a
  ``receiver`` of the keys rank 1 sent it (``batch_irecv``);
* ``data`` (CP): one token of rank 1's chunk of the sequence changed from step 1 -> rank 1
  ``source`` (the batch), rank 0 a ``receiver`` at the ring's receive, ``single_rank`` [1].
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.zoo.harness import ZOO, check_identical, check_onoff, expect, launch, pair, run_checks

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(900)]

SCRIPT = ZOO / "parallel_train.py"
STEPS, PLANT = 2, 1
#: member -> (job options, levels, the one-rank plant)
MEMBERS: dict[str, tuple[dict[str, Any], tuple[str, ...], dict[str, Any]]] = {
    "tp": ({"family": "tp"}, ("boundaries", "ops"), {"order": "rev"}),
    "tp_early": ({"family": "tp", "watch": "early"}, ("boundaries",), {"order": "rev"}),
    "ep": ({"family": "ep", "rows": "^all_to_all_single@"}, ("boundaries", "ops"), {"tiebreak": True}),
    "cp": ({"family": "cp"}, ("boundaries", "ops"), {"order": "rev"}),
}
#: Where rank 1 starts the one-rank difference: level -> (module, kind, role, op) of the origin.
ORIGIN = {
    ("tp", "boundaries"): ("layer.mlp.down_proj", "collective", "input", "reduce_scatter_tensor@world"),
    ("tp", "ops"): ("layer.mlp.down_proj", "op", "output", "detfp_zoo::split_k_mm.default"),
    ("tp_early", "boundaries"): ("layer.mlp.down_proj", "module_output", "output", "Linear"),
    ("ep", "boundaries"): ("moe", "collective", "input", "all_to_all_single@world"),
    ("ep", "ops"): ("moe", "op", "output", "aten::arange.start_step"),
    ("cp", "boundaries"): ("attn.k", "module_output", "output", "SplitLinear"),
    ("cp", "ops"): ("attn.k", "op", "output", "detfp_zoo::split_k_mm.default"),
}
#: Where rank 0 receives it: (module, op, kind) of the collective's output.
RECEIVER = {
    "tp": ("layer.mlp.down_proj", "reduce_scatter_tensor@world", "collective"),
    "tp_early": ("layer.mlp", "reduce_scatter_tensor@world", "collective"),
    "ep": ("moe", "all_to_all_single@world", "collective"),
    "cp": ("attn", "batch_irecv@world", "p2p"),
}
#: Where every rank starts the all-ranks difference: (member, level) -> (module, op).
NONDET = {
    ("tp", "boundaries"): ("layer.mlp.down_proj", "reduce_scatter_tensor@world"),
    ("tp", "ops"): ("layer.mlp.down_proj", "detfp_zoo::split_k_mm.default"),
    ("tp_early", "boundaries"): ("layer.mlp.down_proj", "Linear"),
    ("ep", "boundaries"): ("moe.experts.0", "Expert"),
    ("ep", "ops"): ("moe.experts.0", "detfp_zoo::split_k_mm.default"),
    ("cp", "boundaries"): ("attn.k", "SplitLinear"),
    ("cp", "ops"): ("attn.k", "detfp_zoo::split_k_mm.default"),
}
#: Members with a one-replica data change (one token of rank 1's batch).
DATA = ("cp",)


def plan(member: str, root: Path) -> list[dict[str, Any]]:
    """Every job of one member: a run without capture, then per level a, b, nondet, onerank."""
    opts, levels, onerank = MEMBERS[member]
    base = {**opts, "steps": STEPS, "plant_step": PLANT}
    jobs = [{**base, "name": f"{member}.off"}]
    for lvl in levels:

        def job(name: str, lvl: str = lvl, **kw: Any) -> dict[str, Any]:
            out = str(root / member / lvl / name)
            return {**base, "name": f"{member}.{lvl}.{name}", "out": out, "level": lvl, **kw}

        jobs += [
            job("a"),
            job("b"),
            job("nondet", order="rev"),
            job("onerank", plant_ranks=[1], **onerank),
        ]
        if member in DATA:
            jobs.append(job("data", data_ranks=[1]))
    return jobs


@pytest.fixture(scope="module")
def zoo(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("zoo_parallel")
    launch(SCRIPT, [j for m in MEMBERS for j in plan(m, root)], root, "parallel")
    return root


def _identical(root: Path, member: str, lvl: str) -> None:
    check_identical(root / member / lvl / "a", root / member / lvl / "b")


def _onoff(root: Path, member: str, lvl: str) -> None:
    check_onoff(root, f"{member}.off", [f"{member}.{lvl}.a", f"{member}.{lvl}.b"], [0, 1])


def _site(eff: Any) -> tuple[str, str]:
    return eff.module, eff.op


def _nondet(root: Path, member: str, lvl: str) -> None:
    res = pair(root / member / lvl / "a", root / member / lvl / "nondet")
    expect(res.first_step == PLANT and res.diagnosis.pattern == "all_ranks_same_op", "nondet: pattern", res)
    for rr in res.ranks:
        eff = rr.effective
        expect(eff is not None and (eff.verdict, eff.step) == ("origin", PLANT), "nondet: origin on every rank", res)
        expect(_site(eff) == NONDET[(member, lvl)], f"nondet: at {NONDET[(member, lvl)]}", res)


def _onerank(root: Path, member: str, lvl: str) -> None:
    res = pair(root / member / lvl / "a", root / member / lvl / "onerank")
    d = res.diagnosis
    expect(res.first_step == PLANT, "onerank: the step", res)
    expect(d.pattern == "single_rank" and d.origin_ranks == (1,), "onerank: single_rank on rank 1", res)
    r1 = res.rank(1).effective
    module, kind, role, op = ORIGIN[(member, lvl)]
    expect(
        r1 is not None
        and (r1.verdict, r1.step, r1.module, r1.kind, r1.role, r1.op) == ("origin", PLANT, *ORIGIN[(member, lvl)]),
        f"onerank: rank 1 origin at {module} {kind} {role} {op}",
        res,
    )
    if (member, lvl) == ("ep", "boundaries"):
        expect(r1.diff_kind == "permutation", "onerank: the dispatch moves the same rows in another order", res)
    _receiver(res, member)


def _receiver(res: Any, member: str) -> None:
    """Rank 0 receives rank 1's difference at the collective (or the ring's receive) that carried it."""
    r0 = res.rank(0).effective
    module, op, kind = RECEIVER[member]
    expect(
        r0 is not None and (r0.verdict, r0.step, r0.kind, r0.role) == ("receiver", PLANT, kind, "output"),
        f"rank 0 receives it at a {kind}'s output",
        res,
    )
    # A receive has no peer inputs to test: the sender's data differed.
    peers = () if kind == "p2p" else (1,)
    expect(_site(r0) == (module, op) and r0.peers_differing == peers, f"rank 0 at {module} {op}", res)


def _data(root: Path, member: str, lvl: str) -> None:
    if member not in DATA:
        return
    res = pair(root / member / lvl / "a", root / member / lvl / "data")
    d = res.diagnosis
    expect((res.first_step, d.pattern, d.origin_ranks, d.cause) == (PLANT, "single_rank", (1,), "data"), "data", res)
    r1 = res.rank(1).effective
    expect(r1 is not None and (r1.verdict, r1.kind, r1.op) == ("source", "batch", "CPNet"), "data: rank 1 source", res)
    _receiver(res, member)


CHECKS: dict[str, Callable[[Path, str, str], None]] = {
    "identical": _identical,
    "onoff": _onoff,
    "nondet": _nondet,
    "onerank": _onerank,
    "data": _data,
}
_CASES = [(m, lvl) for m, (_, levels, _) in MEMBERS.items() for lvl in levels]


@pytest.mark.parametrize("member,level", _CASES, ids=[f"{m}-{lvl}" for m, lvl in _CASES])
def test_zoo_parallel(zoo, member, level):
    """Every scenario of one member at one level; all failures reported together."""
    run_checks(CHECKS, CHECKS, zoo, member, level)
