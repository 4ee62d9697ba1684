"""Golden tests for tensor subclasses: a planted change in one part of an MX-style quantized
weight (one byte of its e8m0 ``scale``, or of its ``qdata``) is found at its step and call, the
report names the part that differs and the parts that are equal (text, JSON, HTML), and an
identical pair stays identical.

The runs are real captures of a tiny model whose frozen weight is ``tests.fixtures.subclasses
.Blocked``; the plant changes the weight between steps through numpy, a write no capture sees
(as an extension kernel's would be), so the first record that differs is the first one holding it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from detfp_analyze.bisect import bisect
from detfp_analyze.bisect.components import note
from detfp_analyze.bisect.result import REPORT_VERSION, Component, Divergence
from detfp_analyze.io.reader import open_run
from detfp_analyze.render.html import render_html
from detfp_analyze.render.report import render_text
from detfp_capture import Session
from tests.fixtures.subclasses import bump, quant_weight

PLANT = 1


class Quant(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(quant_weight(), requires_grad=False)
        self.out = torch.nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.mm(x, self.weight))


def run(out: Path, level: str, part: str = "", **opts) -> Path:
    """Three steps; before step ``PLANT`` one byte of ``part`` of the weight gets +1."""
    torch.manual_seed(0)
    model = Quant()
    opt = torch.optim.SGD(model.out.parameters(), lr=0.1)
    with Session(out, level, **opts) as s:
        s.watch(model)
        s.watch_optimizer(opt)
        for step in range(3):
            if step == PLANT and part:
                bump(getattr(model.weight, part), 1)
            x = torch.randn(4, 64, generator=torch.Generator().manual_seed(step))
            with s.step(step):
                loss = model(x).square().mean()
                s.metric("loss", loss)
                loss.backward()
                opt.step()
                opt.zero_grad()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("components")
    jobs = {
        "a": ("ops", ""),
        "b": ("ops", ""),
        "scale": ("ops", "scale"),
        "qdata": ("ops", "qdata"),
        "metrics.a": ("metrics", ""),
        "metrics.scale": ("metrics", "scale"),
    }
    out = {name: run(root / name, lvl, part) for name, (lvl, part) in jobs.items()}
    out["moments.a"] = run(root / "moments.a", "ops", moments=True)
    out["moments.scale"] = run(root / "moments.scale", "ops", "scale", moments=True)
    return out


def _bisect(runs: dict[str, Path], a: str, b: str):
    return bisect(open_run(runs[a]), open_run(runs[b]))


def test_an_identical_pair_with_subclass_parts_is_identical(runs):
    assert _bisect(runs, "a", "b").status == "identical"
    assert _bisect(runs, "moments.a", "a").status == "identical"  # moments change no digest


def test_a_scale_change_is_named_at_the_op_that_reads_it(runs):
    res = _bisect(runs, "a", "scale")
    d = res.rank(0).first
    assert (d.step, d.phase, d.op, d.role, d.arg, d.verdict) == (
        PLANT,
        "forward",
        "aten::mm.default",
        "input",
        "args[1]::scale",
        "unobserved_producer",
    )
    assert (d.dtype, d.shape) == ("torch.float8_e8m0fnu", (64, 2))  # the part's own, not the outer float32
    assert d.component == "scale" and res.diff.component == "scale"
    assert d.components == (Component("qdata", "same"), Component("scale", "differs"))
    text = render_text(res)
    assert "components: scale of input args[1] differs, qdata equal" in text
    assert "difference at rank 0: values in component scale" in text
    doc = json.loads(json.dumps(res.to_json_dict()))
    assert doc["report_version"] == REPORT_VERSION == 3
    first = doc["ranks"][0]["first"]
    assert (first["component"], first["components"]) == (
        "scale",
        [{"name": "qdata", "state": "same"}, {"name": "scale", "state": "differs"}],
    )
    assert doc["diff"]["component"] == "scale"
    assert "scale of input args[1] differs, qdata equal" in render_html(res)


def test_a_qdata_change_is_named_with_its_scale_equal(runs):
    d = _bisect(runs, "a", "qdata").rank(0).first
    assert (d.step, d.op, d.arg, d.component) == (PLANT, "aten::mm.default", "args[1]::qdata", "qdata")
    assert note(d) == "qdata of input args[1] differs, scale equal"


def test_a_parameter_scale_change_is_named_by_the_parameter(runs):
    # Level metrics records the weight only at step end: the parameter names the whole.
    d = _bisect(runs, "metrics.a", "metrics.scale").rank(0).first
    assert (d.step, d.kind, d.op, d.arg) == (PLANT, "param", "weight", "param::scale")
    assert note(d) == "scale of weight differs, qdata equal"


def test_moments_of_the_part_give_the_size_of_the_difference(runs):
    res = _bisect(runs, "moments.a", "moments.scale")
    d = res.rank(0).first
    assert d.arg == "args[1]::scale" and d.diff.abs_dsum is not None and d.diff.abs_dsum > 0
    assert "magnitude unknown" not in render_text(res)


def test_swapping_the_runs_names_the_same_part(runs):
    d = _bisect(runs, "scale", "a").rank(0).first
    assert d.arg == "args[1]::scale" and note(d) == "scale of input args[1] differs, qdata equal"


def _div(**kw) -> Divergence:
    base = dict(
        step=0, microbatch=-1, phase="forward", module="m", kind="op", op="aten::mm.default", occurrence=0,
        role="input", arg="args[1]", presence="both", verdict="unobserved_producer", diff_kind="values",
        hazards=(), seq_a=1, seq_b=1,
    )  # fmt: skip
    return Divergence(**{**base, **kw})


def test_the_note_for_a_whole_whose_parts_all_match_and_for_parts_without_evidence():
    whole = _div(components=(Component("_local_tensor", "same"),))
    assert note(whole) == "input args[1] differs with every part equal: its layout (non-tensor parts) differs"
    part = _div(
        arg="value::_local_tensor::scale",
        kind="param",
        op="w",
        component="_local_tensor::scale",
        components=(
            Component("_local_tensor::qdata", "unknown"),
            Component("_local_tensor::scale", "differs"),
            Component("_local_tensor::amax", "only_b"),
        ),
    )
    assert note(part) == (
        "_local_tensor::scale, _local_tensor::amax of w differ, _local_tensor::qdata without evidence"
    )
    assert note(_div()) is None
