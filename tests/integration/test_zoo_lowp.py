"""The zoo's low-precision members: torchao 0.18 MXFP8 training and NVFP4 weights, 2 ranks on CPU.

Members (``tests/fixtures/zoo/lowp_train.py``, one torchrun launch of 2 ranks over gloo for all
of them): ``mxfp8_ddp`` (``MXFP8TrainingOpConfig`` with the emulated kernels: every matmul
quantizes to ``MXTensor``, forward and backward; DDP), ``nvfp4_ddp`` (``NVFP4WeightOnlyConfig`` on
the fc2 layers: frozen ``NVFP4Tensor`` weights; DDP) and ``mxfp8_fsdp2`` (MXFP8 training under
FSDP2: each parameter a DTensor holding torchao's wrapper, recorded as nested parts). Levels
boundaries and ops; expected answers:

* ``identical`` (two identical runs) -> ``identical``; ``onoff`` -> losses and final parameters
  bitwise equal with capture on and off;
* ``scale``: one byte of one e8m0 scale of ``blocks.1.fc2``'s weight (MXFP8: of the ``MXTensor``
  torchao makes of it in the step-1 forward, with the dispatch modes off; NVFP4: of the parameter,
  through numpy after the step-1 optimizer) on every rank, qdata unchanged -> at ops, MXFP8: every
  rank ``unobserved_producer`` at ``aten::mm.default`` in ``blocks.1.fc2``, argument
  ``args[1]::scale``, "scale of input args[1] differs, qdata equal"; NVFP4 (at both levels): the
  parameter ``blocks.1.fc2.weight`` at step end, "scale of blocks.1.fc2.weight differs, qdata,
  per_tensor_scale equal"; at boundaries MXFP8 is an ``origin`` at module ``blocks.1.fc2``
  (nothing there holds the MX tensor), ``all_ranks_same_op``;
* ``qdata``: the same with one byte of qdata (ops) -> the qdata part named, the scale equal;
* ``rank1``: the scale change on rank 1 only -> rank 1 as in ``scale`` (an ``origin`` at
  boundaries for MXFP8, ``single_rank``), rank 0 a ``receiver`` of DDP's gradient reduction;
* ``evidence`` (MXFP8, ops): the scale change with moments and dumps of ``blocks.1.fc2`` ->
  capture stays on, the part is dumped and the difference confirmed byte for byte.

The launch runs every job; the bisects run here.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import polars as pl
import pytest

from detfp_analyze.bisect.components import note
from tests.fixtures.zoo.harness import ZOO, check_identical, check_onoff, expect, launch, pair, run_checks

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(900)]

SCRIPT = ZOO / "lowp_train.py"
TARGET = "blocks.1.fc2"
PLANT = 1
#: member -> (job options, steps, scenarios per level). NVFP4 runs a third step: its plant comes
#: after the step-1 optimizer, so rank 0 receives it through the step-2 gradient reduction.
MEMBERS: dict[str, tuple[dict[str, Any], int, dict[str, tuple[str, ...]]]] = {
    "mxfp8_ddp": (
        {"quant": "mxfp8"},
        2,
        {
            "boundaries": ("identical", "onoff", "scale", "rank1"),
            "ops": ("identical", "onoff", "scale", "qdata", "rank1", "evidence"),
        },
    ),
    "nvfp4_ddp": (
        {"quant": "nvfp4"},
        3,
        {
            "boundaries": ("identical", "onoff", "scale", "rank1"),
            "ops": ("identical", "onoff", "scale", "qdata", "rank1"),
        },
    ),
    "mxfp8_fsdp2": (
        {"quant": "mxfp8", "wrap": "fsdp2"},
        2,
        {"boundaries": ("identical", "onoff"), "ops": ("identical", "onoff", "scale")},
    ),
}
_EVIDENCE = {"capture": {"moments": True, "dumps": TARGET}}
#: Scenario -> the jobs it needs besides ``a``, ``b`` and ``off`` (job name -> options).
_JOBS: dict[str, dict[str, dict[str, Any]]] = {
    "scale": {"scale": {"plant": "scale", "plant_step": PLANT}},
    "qdata": {"qdata": {"plant": "qdata", "plant_step": PLANT}},
    "rank1": {"rank1": {"plant": "scale", "plant_step": PLANT, "plant_ranks": [1]}},
    "evidence": {"evidence_a": _EVIDENCE, "evidence": {**_EVIDENCE, "plant": "scale", "plant_step": PLANT}},
}


def plan(member: str, root: Path) -> list[dict[str, Any]]:
    opts, steps, levels = MEMBERS[member]
    base = {**opts, "steps": steps}
    jobs = [{**base, "name": f"{member}.off"}]
    for lvl, scenarios in levels.items():
        d = root / member / lvl
        named = {"a": {}, "b": {}}
        for sc in scenarios:
            named.update(_JOBS.get(sc, {}))
        jobs += [
            {**base, **o, "name": f"{member}.{lvl}.{n}", "out": str(d / n), "level": lvl} for n, o in named.items()
        ]
    return jobs


@pytest.fixture(scope="module")
def zoo(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("zoo_lowp")
    launch(SCRIPT, [j for m in MEMBERS for j in plan(m, root)], root, "lowp")
    return root


def _identical(root: Path, member: str, lvl: str) -> None:
    check_identical(root / member / lvl / "a", root / member / lvl / "b")


def _onoff(root: Path, member: str, lvl: str) -> None:
    check_onoff(root, f"{member}.off", [f"{member}.{lvl}.a", f"{member}.{lvl}.b"], [0, 1])


def _named(d: Any, member: str, lvl: str, part: str, res: Any) -> None:
    """``d`` is the planted part of the weight, named as such, with the other parts equal."""
    other = "qdata" if part == "scale" else "scale"
    if member.startswith("nvfp4"):
        want = (PLANT, "step", "param", f"{TARGET}.weight", f"param::{part}", "unobserved_producer")
        got = (d.step, d.phase, d.kind, d.op, d.arg, d.verdict)
        rest = ", ".join(p for p in ("qdata", "scale", "per_tensor_scale") if p != part)
        text = f"{part} of {TARGET}.weight differs, {rest} equal"
    elif lvl == "ops":
        want = (PLANT, "forward", TARGET, "aten::mm.default", f"args[1]::{part}", "unobserved_producer")
        got = (d.step, d.phase, d.module, d.op, d.arg, d.verdict)
        text = f"{part} of input args[1] differs, {other} equal"
    else:  # MXFP8 at boundaries: no record holds the MX tensor, the module computing with it does
        want = (PLANT, "forward", TARGET, "module_output", "origin")
        got = (d.step, d.phase, d.module, d.kind, d.verdict)
        text = None
    expect(got == want, f"{member} {lvl} {part}: {got} != {want}", res)
    expect(note(d) == text, f"{member} {lvl} {part}: note {note(d)!r} != {text!r}", res)
    if text is not None:
        expect(d.component == part and d.diff.component == part, f"{member} {lvl}: component", res)


def _planted(part: str) -> Callable[[Path, str, str], None]:
    def check(root: Path, member: str, lvl: str) -> None:
        res = pair(root / member / lvl / "a", root / member / lvl / part)
        for rr in res.ranks:
            _named(rr.effective, member, lvl, part, res)
        mx_boundaries = member.startswith("mxfp8") and lvl == "boundaries"
        want = "all_ranks_same_op" if mx_boundaries else "no_origin"
        expect(res.diagnosis.pattern == want, f"{member} {lvl} {part}: pattern {want}", res)

    return check


def _rank1(root: Path, member: str, lvl: str) -> None:
    res = pair(root / member / lvl / "a", root / member / lvl / "rank1")
    _named(res.rank(1).effective, member, lvl, "scale", res)
    r0 = res.rank(0).effective
    step0 = PLANT + 1 if member.startswith("nvfp4") else PLANT
    expect(
        r0 is not None and (r0.verdict, r0.kind, r0.step) == ("receiver", "reduced_grad", step0),
        "rank1: rank 0 receives it through the gradient reduction",
        res,
    )
    if member.startswith("mxfp8") and lvl == "boundaries":
        d = res.diagnosis
        expect(d.pattern == "single_rank" and d.origin_ranks == (1,), "rank1: single_rank on rank 1", res)


def _evidence(root: Path, member: str, lvl: str) -> None:
    """Moments and dumps on the module holding the MX tensors: capture stays on (it switched
    itself off at step 0 when dumps read an MXTensor's bytes), the parts are dumped, and the
    planted scale byte is confirmed byte for byte: one e8m0 element, one step (a factor of 2)."""
    d = root / member / lvl
    for rank in (0, 1):
        events = pl.read_parquet(d / "evidence" / "events" / f"rank={rank}" / "*.parquet")
        expect("capture_error" not in events["type"].to_list(), f"evidence: capture stayed on, rank {rank}")
    res = pair(d / "evidence_a", d / "evidence")
    for rr in res.ranks:
        x = rr.effective
        expect(x is not None and x.arg == "args[1]::scale", "evidence: the scale is named", res)
        diff = x.diff
        got = (diff.confirmed, diff.n_differing, diff.max_ulp, diff.abs_dsum is not None)
        expect(got == ("bytes", 1, 1, True), f"evidence: {got}", res)
    check_onoff(root, f"{member}.off", [f"{member}.{lvl}.evidence_a"], [0, 1])


CHECKS: dict[str, Callable[[Path, str, str], None]] = {
    "identical": _identical,
    "onoff": _onoff,
    "scale": _planted("scale"),
    "qdata": _planted("qdata"),
    "rank1": _rank1,
    "evidence": _evidence,
}
_CASES = [(m, lvl) for m, (_, _, levels) in MEMBERS.items() for lvl in levels]


@pytest.mark.parametrize("member,level", _CASES, ids=[f"{m}-{lvl}" for m, lvl in _CASES])
def test_zoo_lowp(zoo, member, level):
    """Every scenario of one member at one level; all failures reported together."""
    run_checks(CHECKS, MEMBERS[member][2][level], zoo, member, level)


def test_fsdp2_parameters_are_nested_parts_with_stable_names(zoo):
    """A DTensor holding torchao's training wrapper: its parts flatten recursively, named by the
    path of ``__tensor_flatten__`` names, the same on every rank and in every run."""
    for rank in (0, 1):
        recs = pl.read_parquet(zoo / "mxfp8_fsdp2" / "boundaries" / "a" / "records" / f"rank={rank}" / "*.parquet")
        args = recs.filter(
            (pl.col("kind") == "param") & (pl.col("name") == f"{TARGET}.weight") & (pl.col("phase") == "optimizer")
        )
        assert args["arg"].to_list()[:3] == ["group[0]::_local_tensor::_data", "group[0]::_local_tensor", "group[0]"]
        assert args["shape"].to_list()[:3] == [[32, 64], [32, 64], [64, 64]]  # the shard, then the whole
