"""Capture of tensor subclasses: every inner tensor a record of its own (``<arg>::<component>``,
before its whole), with the digests, moments, row digests, dumps and hazards of a plain tensor;
the whole's digest combined from its parts; nothing a subclass refuses is ever asked of it."""

from __future__ import annotations

import polars as pl
import pytest
import torch

from detfp_capture import Session
from detfp_capture._recorder.subclass import flattens
from detfp_capture.digest import fingerprint
from tests.fixtures.models import read
from tests.fixtures.subclasses import Blocked, Unflattenable, Wrapper, quant_weight


class Quant(torch.nn.Module):
    """A matmul with a frozen quantized weight (a subclass Parameter), then a plain Linear."""

    def __init__(self, w: torch.Tensor) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(w, requires_grad=False)
        self.out = torch.nn.Linear(w.shape[1], 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.mm(x, self.weight))


def _hi(t: torch.Tensor) -> int:
    return fingerprint(t).hi


def _events(path) -> list[str]:
    return read(path, "events")["type"].to_list()


def test_an_op_input_subclass_is_its_parts_then_its_whole(tmp_path):
    w = quant_weight()
    x = torch.randn(4, 64)
    with Session(tmp_path / "r", "ops") as s, s.step(0):
        torch.mm(x, w)
    r = read(tmp_path / "r").filter(pl.col("name") == "aten::mm.default")
    assert r.select("role", "arg", "dtype", "shape").rows() == [
        ("input", "args[0]", "torch.float32", [4, 64]),
        ("input", "args[1]::qdata", "torch.float8_e4m3fn", [64, 64]),
        ("input", "args[1]::scale", "torch.float8_e8m0fnu", [64, 2]),
        ("input", "args[1]", "torch.float32", [64, 64]),
        ("output", "out", "torch.float32", [4, 64]),
    ]
    assert r["status"].to_list() == ["ok"] * 5
    # The parts are digested like plain tensors; the whole's digest is the subclass digest of
    # docs/digest.md (combined from its parts), the value digest.start gives it.
    assert r["digest_hi"].to_list()[1:4] == [_hi(w.qdata), _hi(w.scale), _hi(w)]


def test_subclass_parameters_and_probes_at_every_level(tmp_path):
    torch.manual_seed(0)
    m = Quant(quant_weight())
    with Session(tmp_path / "r", "boundaries") as s:
        s.watch(m)
        with s.step(0):
            m(torch.randn(4, 64))
            s.probe("w", m.weight)
    r = read(tmp_path / "r")
    params = r.filter(pl.col("kind") == "param")
    # Plain parameters stay in their batch; the subclass one is its parts, then itself.
    assert params.select("name", "arg").rows() == [
        ("weight", "param::qdata"),
        ("weight", "param::scale"),
        ("weight", "param"),
        ("out.weight", "param"),
        ("out.bias", "param"),
    ]
    assert params["digest_hi"].to_list()[:3] == [_hi(m.weight.qdata), _hi(m.weight.scale), _hi(m.weight)]
    probe = r.filter(pl.col("kind") == "probe")
    assert probe["arg"].to_list() == ["value::qdata", "value::scale", "value"]
    assert "capture_error" not in _events(tmp_path / "r")


def test_moments_rows_and_dumps_of_a_subclass_are_its_parts_and_capture_stays_on(tmp_path):
    # Dumps used to read the whole tensor's bytes (view(dtype), which an MX tensor refuses):
    # capture switched itself off at step 0 and the trace held no record.
    w = quant_weight()
    with Session(tmp_path / "r", "ops", moments=True, rows=True, dumps=r"aten::mm") as s, s.step(0):
        torch.mm(torch.randn(4, 64), w)
    assert "capture_error" not in _events(tmp_path / "r")
    r = read(tmp_path / "r").filter(pl.col("name") == "aten::mm.default").sort("seq")
    by_arg = {row["arg"]: row for row in r.iter_rows(named=True)}
    scale = by_arg["args[1]::scale"]
    assert scale["m_sum"] == pytest.approx(float(w.scale.to(torch.float64).sum()))
    assert scale["rows"] is not None and len(scale["rows"]) == 64
    assert by_arg["args[1]"]["m_sum"] is None and by_arg["args[1]"]["rows"] is None  # the whole: its parts say
    dumps = read(tmp_path / "r", "dumps")
    assert sorted(dumps["arg"].to_list()) == ["args[0]", "args[1]::qdata", "args[1]::scale", "out"]
    got = dumps.filter(pl.col("arg") == "args[1]::scale")["data"].item()
    assert got == w.scale.view(torch.uint8).numpy().tobytes()


def test_nested_subclasses_flatten_recursively_with_stable_names(tmp_path):
    w = Wrapper(quant_weight())
    with Session(tmp_path / "r", "ops") as s, s.step(0):
        s.probe("w", w)
    r = read(tmp_path / "r").filter(pl.col("kind") == "probe")
    assert r["arg"].to_list() == ["value::inner::qdata", "value::inner::scale", "value::inner", "value"]
    # The outer whole's digest holds its non-tensor part too (the label: a DTensor's mesh).
    assert r["digest_hi"].to_list() == [_hi(w.inner.qdata), _hi(w.inner.scale), _hi(w.inner), _hi(w)]
    assert _hi(w) != _hi(Wrapper(quant_weight(), label="other"))


def test_a_subclass_that_cannot_be_flattened_is_one_error_record(tmp_path):
    bad = Unflattenable(quant_weight().qdata, quant_weight().scale)
    with Session(tmp_path / "r", "boundaries") as s, s.step(0):
        s.probe("bad", bad)
        s.probe("after", torch.ones(3))
    r = read(tmp_path / "r").filter(pl.col("kind") == "probe")
    assert r.select("name", "arg", "status").rows() == [("bad", "value", "error"), ("after", "value", "ok")]
    assert "cannot flatten" in r["error"][0]


def test_a_part_read_while_uninitialized_flags_the_subclass_and_its_parts(tmp_path):
    with Session(tmp_path / "r", "ops") as s, s.step(0):
        w = quant_weight()
        w.scale = torch.empty(64, 2, dtype=torch.float8_e8m0fnu)  # never written: garbage
        torch.mm(torch.randn(4, 64), w)
    r = read(tmp_path / "r").filter((pl.col("name") == "aten::mm.default") & pl.col("arg").str.starts_with("args[1]"))
    assert r["arg"].to_list() == ["args[1]::qdata", "args[1]::scale", "args[1]"]
    assert all("uninitialized" in h for h in r["hazards"].to_list())
    assert r["status"].to_list() == ["skipped"] * 3  # garbage is never evidence


def test_a_metric_given_as_a_subclass_is_read_from_its_inner_tensor(tmp_path):
    with Session(tmp_path / "r", "metrics") as s, s.step(0):
        s.metric("loss", Wrapper(torch.tensor(1.5)))
    assert read(tmp_path / "r", "metrics")["value"].to_list() == [1.5]
    assert "capture_error" not in _events(tmp_path / "r")


def test_an_async_collective_tensor_is_not_split_into_parts():
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    assert not flattens(AsyncCollectiveTensor(torch.ones(3)))
    assert flattens(quant_weight()) and not flattens(torch.nn.Parameter(torch.ones(2)))
    assert isinstance(quant_weight(), Blocked)


def test_an_async_collective_tensor_digests_as_its_buffer():
    # The public digest of an AsyncCollectiveTensor is its buffer's (awaited.collective_result):
    # it failed with a TypeError (a missing argument) until mypy ran on _digest/pending.py.
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    t = torch.arange(10.0)
    got = fingerprint(AsyncCollectiveTensor(t))
    assert got.error is None and got == fingerprint(t)
