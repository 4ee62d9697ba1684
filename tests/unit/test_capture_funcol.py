"""Functional collectives and tensors whose producer has not completed (one gloo rank, in process).

A functional collective (``torch.distributed._functional_collectives``) returns an
``AsyncCollectiveTensor`` before its collective has written the buffer; so does a module that
returns it (torch's ``RowwiseParallel``). Capture must take nothing of such a tensor before the
program waits for it. With one rank the collective is done at once, so these tests play the
rest of the write themselves: ``_late`` writes into the buffer through ``.data`` (no version
bump, as a collective's own write from C++) after the module returned and before the program's
wait. Every record of the result must then hold the value the program finally reads.
"""

from __future__ import annotations

import polars as pl
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from detfp_capture import Session
from tests.fixtures.models import digest_hi, read


def _buffer(t: torch.Tensor) -> torch.Tensor:
    """The buffer an ``AsyncCollectiveTensor`` wraps (torch's own accessor)."""
    return t._get_acs_underlying_tensor()


class _Row(torch.nn.Module):
    """A row-parallel module: its partial result, summed over the group, returned unwaited."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return funcol.all_reduce(x * 2, "sum", dist.group.WORLD)


class _Late(torch.nn.Module):
    """The collective's write still landing after the module returned (no wait, no version bump)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _buffer(x).data.add_(5)
        return x


class _Use(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1  # the first real use: the wrapper waits here


X = torch.arange(8.0).reshape(2, 4)


def _run(path, level: str, **options) -> torch.Tensor:
    """One captured step of row -> late write -> use on ``X``; returns what the program got."""
    with Session(path, level, **options) as s:
        m = s.watch(torch.nn.Sequential(_Row(), _Late(), _Use()))
        with s.step(0):
            return m(X)


def test_a_module_output_of_an_unfinished_collective_is_read_at_the_programs_wait(tmp_path, gloo1):
    y = _run(tmp_path / "r", "boundaries")
    want = digest_hi(y - 1)  # what the collective left in the buffer, as the program read it
    r = read(tmp_path / "r")
    of_result = (pl.col("module") == "0") & (pl.col("role") == "output") | pl.col("module").is_in(["1", "2"])
    late = r.filter(of_result & pl.col("kind").is_in(["module_input", "module_output"])).head(4)
    assert late["module"].to_list() == ["0", "1", "1", "2"]
    assert set(late["digest_hi"]) == {want} and set(late["status"]) == {"ok"}, late


def test_a_functional_collective_is_recorded_at_boundaries_with_outputs_right_after_the_launch(tmp_path, gloo1):
    orig = torch.ops._c10d_functional.all_reduce
    with Session(tmp_path / "p", "boundaries"):
        assert torch.ops._c10d_functional.all_reduce is not orig
    assert torch.ops._c10d_functional.all_reduce is orig
    y = _run(tmp_path / "r", "boundaries")
    r = read(tmp_path / "r")
    rows = r.select("module", "kind", "name", "role", "arg").rows()
    at = rows.index(("0", "collective", "all_reduce@world", "input", "input"))
    assert rows[at + 1] == ("0", "collective", "all_reduce@world", "output", "output")
    assert rows[at + 2] == ("0", "module_output", "_Row", "output", "out")
    coll = r.filter(pl.col("kind") == "collective")
    assert coll["digest_hi"].to_list() == [digest_hi(X * 2), digest_hi(y - 1)]
    assert coll["phase"].to_list() == ["forward", "forward"]


def test_dumps_moments_and_rows_of_an_unfinished_result_keep_capture_on(tmp_path, gloo1):
    with Session(tmp_path / "r", "boundaries", dumps="^0$", moments="^0$", rows="^0$") as s:
        m = s.watch(torch.nn.Sequential(_Row(), _Late(), _Use()))
        with s.step(0):
            y = m(X)
            s.metric("result", funcol.all_reduce(X.sum(), "sum", dist.group.WORLD))
    ev = read(tmp_path / "r", "events")
    assert not ev.filter(pl.col("type").is_in(["capture_error", "capture_disabled"])).height, ev
    d = read(tmp_path / "r", "dumps").filter((pl.col("kind") == "module_output") & (pl.col("module") == "0"))
    assert d["data"].to_list() == [(y - 1).numpy().tobytes()]
    rec = (
        read(tmp_path / "r").filter((pl.col("kind") == "module_output") & (pl.col("module") == "0")).row(0, named=True)
    )
    assert rec["digest_hi"] == digest_hi(y - 1) and rec["m_sum"] == float((y - 1).sum())
    assert len(rec["rows"]) == 2
    met = read(tmp_path / "r", "metrics")
    assert met["value"].to_list() == [float(X.sum())]


def test_a_collective_never_waited_is_completed_at_the_step_end_and_reported(tmp_path, gloo1):
    x = torch.arange(4.0)
    with Session(tmp_path / "r", "boundaries", flush_records=2) as s, s.step(0):
        kept = funcol.all_reduce(x, "sum", dist.group.WORLD)  # never used in the step
        _buffer(kept).data.add_(1)
        s.probe("x", x)  # the window is full: its flush waits for the step end
    r = read(tmp_path / "r").filter(pl.col("kind") == "collective")
    assert r["role"].to_list() == ["input", "output"]
    assert r["digest_hi"].to_list() == [digest_hi(x), digest_hi(x + 1)]
    ev = read(tmp_path / "r", "events").filter(pl.col("type") == "pending_collective")
    assert ev["name"].to_list() == ["all_reduce@world"]


def test_level_ops_records_the_collective_output_before_its_first_reader(tmp_path, gloo1):
    y = _run(tmp_path / "r", "ops")
    r = read(tmp_path / "r")
    out = r.filter((pl.col("kind") == "collective") & (pl.col("role") == "output"))
    add = r.filter((pl.col("name") == "aten::add.Tensor") & (pl.col("role") == "input") & (pl.col("arg") == "args[0]"))
    assert out["seq"][0] < add["seq"][0]
    assert out["digest_hi"][0] == add["digest_hi"][0] == digest_hi(y - 1)


def test_an_async_work_output_read_before_its_wait_is_digested_at_the_wait(tmp_path, gloo1):
    with Session(tmp_path / "r", "boundaries") as s, s.step(0):
        t = torch.ones(4)
        w = dist.all_reduce(t, async_op=True)
        s.probe("early", t)
        t.data.add_(2)  # the collective's write, landing late
        w.wait()
        s.probe("late", t)
    p = read(tmp_path / "r").filter(pl.col("kind") == "probe")
    assert p["digest_hi"].to_list() == [digest_hi(t)] * 2
    assert [h.to_list() for h in p["hazards"]] == [["async_pending"], []]


def test_a_wrapper_torch_kept_while_the_session_was_open_holds_nothing_of_it_after_close(tmp_path, gloo1):
    # torch keeps op packets in sets built at import (torch.fx.node.has_side_effect for
    # wait_tensor); a module first imported while a session is open keeps our wrapper there.
    import gc
    import weakref

    kept = []
    with Session(tmp_path / "p", "boundaries") as s:
        kept += [torch.ops._c10d_functional.wait_tensor, torch.ops._c10d_functional.all_reduce, dist.all_reduce]
        ref = weakref.ref(s._rec)
        m = s.watch(torch.nn.Sequential(_Row(), _Use()))
        with s.step(0):
            m(X)
    del s, m
    gc.collect()
    assert ref() is None, gc.get_referrers(ref())
    # A kept wrapper now runs the op itself, recording nothing.
    t = torch.ones(4)
    out = kept[0](kept[1](t, "sum", dist.group.WORLD.group_name))
    assert torch.equal(out, t)
    kept[2](t)
    assert torch.equal(t, torch.ones(4))


def test_a_functional_collectives_group_is_named_at_level_ops_not_numbered(tmp_path, gloo1):
    """At level ops a ``_c10d_functional`` op's ``group_name`` is the process's own counter of
    the groups it created (a job that builds its mesh again, or creates its groups in another
    process's order, numbers them differently): its records carry the group's logical name, so
    two identical runs compare identical (a 2-D mesh's tp reduce-scatter was an ``argument``
    difference, '23' -> '27')."""
    from detfp_analyze.bisect import bisect
    from detfp_analyze.io.reader import open_run

    for run in ("a", "b"):
        tp = dist.new_group([0])  # a new group each run: a new process-local name
        with Session(tmp_path / run, "ops", group_names={"tp": tp}) as s, s.step(0):
            out = funcol.all_reduce(torch.arange(4.0) * 2, "sum", tp)
            _ = out + 1
    ops = read(tmp_path / "a").filter(pl.col("name") == "_c10d_functional::all_reduce.default")
    assert ops.height > 0
    assert bisect(open_run(tmp_path / "a"), open_run(tmp_path / "b")).status == "identical"
