"""Level ops: inputs an op does not read are not uninitialized reads, and an argument difference
is never a likely false root.

Megatron-Core's attention computes its scores with ``baddbmm(buffer, q, k^T, beta=0)`` on a
buffer fresh from ``empty``: torch documents that with ``beta=0`` the input is ignored. A
collective's output fresh from ``empty`` is written, not read. And where an op does read
unwritten bytes, a call whose non-tensor arguments differ (``alpha``) differs for a reason no
garbage explains: bisect (and the SQL view) name it, not a later record.
"""

from __future__ import annotations

import polars as pl
import pytest
import torch
import torch.distributed as dist

from detfp_analyze.bisect import bisect
from detfp_analyze.io.reader import open_run
from detfp_analyze.single.certify import certify
from detfp_analyze.sql import connect
from detfp_capture import Session
from tests.fixtures.models import read


def _hazard_events(path) -> pl.DataFrame:
    return read(path, "events").filter(pl.col("type") == "hazard")


def _scores(out, alpha: float = 0.5, beta: float = 0.0) -> None:
    """Attention scores as Megatron-Core computes them, and the other ``beta`` ops."""
    torch.manual_seed(0)
    q, k = torch.randn(2, 3, 4), torch.randn(2, 3, 4)
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    with Session(out, "ops", poison=True) as s, s.step(0):  # poison: the garbage differs per run
        scores = torch.baddbmm(torch.empty(2, 3, 3), q, k.transpose(1, 2), beta=beta, alpha=alpha)
        p = scores.softmax(-1)
        y = torch.addmm(torch.empty(3, 5), a, b, beta=beta)
        inplace = torch.empty(2, 3, 3).baddbmm_(q, k.transpose(1, 2), beta=beta)
        (p.sum() + y.sum() + inplace.sum()).clone()


def test_an_input_ignored_for_beta_0_is_neither_evidence_nor_an_uninitialized_read(tmp_path):
    _scores(tmp_path / "a")
    _scores(tmp_path / "b")
    assert bisect(open_run(tmp_path / "a"), open_run(tmp_path / "b")).status == "identical"
    assert _hazard_events(tmp_path / "a").height == 0
    assert not [p for p in certify(tmp_path / "a").problems if p.kind == "uninitialized"]
    r = read(tmp_path / "a").filter(pl.col("arg") == "args[0]")
    got = r.filter(pl.col("name").str.contains("addmm|baddbmm")).select("name", "role", "status", "hazards").rows()
    assert got == [
        ("aten::baddbmm.default", "input", "skipped", []),
        ("aten::addmm.default", "input", "skipped", []),
        ("aten::baddbmm_.default", "dest", "skipped", []),
    ]
    # The output is written from q and k alone: evidence, with no hazard.
    out = read(tmp_path / "a").filter((pl.col("name") == "aten::baddbmm.default") & (pl.col("role") == "output"))
    assert out.select("status", "hazards").rows() == [("ok", [])]


def test_with_beta_1_the_same_input_is_an_uninitialized_read(tmp_path):
    _scores(tmp_path / "a", beta=1.0)
    ev = _hazard_events(tmp_path / "a")
    assert ev.filter(pl.col("detail").str.starts_with("aten::baddbmm.default args[0]")).height == 1
    assert ev.filter(pl.col("detail").str.starts_with("aten::addmm.default args[0]")).height == 1


def test_an_alpha_change_at_an_ignored_input_is_the_origin(tmp_path):
    """Issue 28 item 4: the argument change used to be set aside as a likely false root in favour
    of a later record "whose producer was not captured"."""
    _scores(tmp_path / "a", alpha=0.5)
    _scores(tmp_path / "b", alpha=0.25)
    res = bisect(open_run(tmp_path / "a"), open_run(tmp_path / "b"))
    first = res.rank(0).first
    assert (first.op, first.verdict, first.hazards) == ("aten::baddbmm.default", "origin", ())
    assert res.rank(0).next_clean is None


def _garbage_read(out, alpha: float) -> None:
    """``add`` reads a buffer half written since ``empty``: a real uninitialized read."""
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    with Session(out, "ops") as s, s.step(0):
        buf = torch.empty(2, 3)
        buf[0] = 1.0
        y = torch.add(buf, x, alpha=alpha)
        (y[0] * 2).sum()


def test_an_argument_difference_is_never_a_likely_false_root(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    _garbage_read(a, 0.5)
    _garbage_read(b, 0.25)
    assert _hazard_events(a).height == 1  # the read itself is still flagged
    res = bisect(open_run(a), open_run(b))
    r0 = res.rank(0)
    assert (r0.first.op, r0.first.verdict, r0.first.hazards) == ("aten::add.Tensor", "origin", ())
    assert r0.next_clean is None
    with connect(open_run(a), open_run(b)) as con:
        rows = con.sql("SELECT step, likely_false_root, next_step FROM first_divergence").fetchall()
    assert rows == [(0, False, None)]


@pytest.mark.usefixtures("gloo1")
@pytest.mark.filterwarnings("ignore:.*all_gather_into_tensor.*is deprecated:FutureWarning")
def test_a_collective_output_fresh_from_empty_is_written_not_read(tmp_path):
    x = torch.arange(4, dtype=torch.float32)
    with Session(tmp_path / "r", "ops") as s, s.step(0):
        out = torch.empty(4)
        dist.all_gather_into_tensor(out, x)
        out.sum()
    assert _hazard_events(tmp_path / "r").height == 0
    r = read(tmp_path / "r").filter(pl.col("name").str.starts_with("aten::sum"))
    assert r["hazards"].to_list() == [[], []]
