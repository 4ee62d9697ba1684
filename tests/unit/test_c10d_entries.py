"""Every collective of torch.distributed is classified: a new one in torch fails here, not in a user's trace.

Capture records collectives at the ProcessGroup's methods (``detfp_capture._sources.c10d``). Two
lists follow torch, and these tests walk torch itself:

* every attribute of ``ProcessGroup`` is either a method capture records (``METHODS``) or one
  through which no tensor of the program passes (``NOT_COMMUNICATING``);
* every function of ``torch.distributed.distributed_c10d`` that reaches a communicating method,
  directly or through another such function (read from its source), is in ``ENTRIES``: what
  its calls are named after, or why they are not records (object collectives, barriers, the
  set-up of groups).

Then, on a one-rank gloo group, every collective entry point is called (the public name, an
alias bound before the session opened, and ``torch.distributed``'s own ``all_gather_single`` /
``reduce_scatter_single``) and recorded once, under the name the program called.
"""

from __future__ import annotations

import ast
import inspect

import polars as pl
import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d_mod

from detfp_capture import Session
from detfp_capture._sources import c10d
from tests.fixtures.models import read

#: ProcessGroup attributes a program's tensors pass through: METHODS and the coalescing bracket.
_COMMUNICATING = set(c10d.METHODS) | {"barrier", "monitored_barrier", "_start_coalescing", "_end_coalescing"}


def test_every_process_group_attribute_is_classified():
    attrs = {n for n in dir(dist.ProcessGroup) if not n.startswith("__")}
    unknown = sorted(attrs - set(c10d.METHODS) - c10d.NOT_COMMUNICATING)
    assert not unknown, (
        f"torch's ProcessGroup has attributes capture does not classify: {unknown}; add each to "
        "c10d.METHODS (a collective: which arguments it reads and writes) or c10d.NOT_COMMUNICATING"
    )
    assert not set(c10d.METHODS) & c10d.NOT_COMMUNICATING
    assert set(c10d.METHODS) <= attrs, "a recorded method is gone from this torch"


def _communicating_functions() -> dict[str, tuple[set[str], set[str]]]:
    """distributed_c10d's functions that reach a communicating ProcessGroup method, with the
    methods and the functions of that module each calls."""
    tree = ast.parse(inspect.getsource(c10d_mod))
    calls: dict[str, tuple[set[str], set[str]]] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            attrs, names = set(), set()
            for sub in ast.walk(node):
                if isinstance(sub, ast.Call):
                    if isinstance(sub.func, ast.Attribute):
                        attrs.add(sub.func.attr)
                    elif isinstance(sub.func, ast.Name):
                        names.add(sub.func.id)
            calls[node.name] = (attrs & _COMMUNICATING, names)
    reach = {n for n, (a, _) in calls.items() if a}
    grew = True
    while grew:
        grew = False
        for n, (_, names) in calls.items():
            if n not in reach and names & reach:
                reach.add(n)
                grew = True
    return {n: calls[n] for n in reach}


def test_every_communicating_function_of_torch_distributed_is_classified():
    found = _communicating_functions()
    assert len(found) > 20, "the source walk found almost nothing: the test is broken"
    unknown = sorted(set(found) - set(c10d.ENTRIES))
    assert not unknown, (
        f"torch.distributed has functions that communicate which capture does not classify: {unknown}; "
        "add each to c10d.ENTRIES"
    )
    gone = sorted(set(c10d.ENTRIES) - set(found))
    assert not gone, f"classified functions no longer communicate (or are gone) in this torch: {gone}"
    # Every public one is reachable as torch.distributed.<name>.
    public = [n for n in c10d.ENTRIES if not n.startswith("_")]
    assert [n for n in public if not hasattr(dist, n)] == []


#: Each collective entry point, called on a one-rank group (what it is recorded as: its own name).
def _calls(t: torch.Tensor) -> dict[str, object]:
    one = [torch.zeros_like(t)]
    return {
        "all_reduce": lambda: dist.all_reduce(t),
        "all_reduce_coalesced": lambda: dist.all_reduce_coalesced([t]),
        "all_gather": lambda: dist.all_gather(one, t),
        "all_gather_coalesced": lambda: dist.all_gather_coalesced([one], [t]),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(torch.zeros_like(t), t),
        "all_gather_single": lambda: dist.all_gather_single(torch.zeros_like(t), t),
        "_all_gather_base": lambda: dist._all_gather_base(torch.zeros_like(t), t),
        "reduce_scatter": lambda: dist.reduce_scatter(torch.zeros_like(t), [t]),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(torch.zeros_like(t), t),
        "reduce_scatter_single": lambda: dist.reduce_scatter_single(torch.zeros_like(t), t),
        "_reduce_scatter_base": lambda: dist._reduce_scatter_base(torch.zeros_like(t), t),
        "all_to_all": lambda: dist.all_to_all([torch.zeros_like(t)], [t]),
        "all_to_all_single": lambda: dist.all_to_all_single(torch.zeros_like(t), t),
        "broadcast": lambda: dist.broadcast(t, 0),
        "reduce": lambda: dist.reduce(t, 0),
        "gather": lambda: dist.gather(t, [torch.zeros_like(t)], 0),
        "scatter": lambda: dist.scatter(torch.zeros_like(t), [t], 0),
    }


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_every_collective_recorded_under_the_name_called(tmp_path, gloo1):
    t = torch.arange(4.0)
    calls = _calls(t)
    assert set(calls) == {n for n, e in c10d.ENTRIES.items() if e is c10d.Entry.COLLECTIVE}
    early = dist.reduce_scatter_tensor  # bound before the session opened (Megatron-Core does this)
    skipped = []
    with Session(tmp_path / "r", "boundaries") as s, s.step(0):
        for name, fn in calls.items():
            try:
                fn()
            except RuntimeError as exc:  # a collective this backend lacks (gloo: reduce_scatter)
                skipped.append((name, str(exc).splitlines()[0]))
        early(torch.zeros_like(t), t)
        dist.barrier()
        dist.all_gather_object([None], {"run": str(tmp_path)})  # a pickle: never a record
        dist.broadcast_object_list([{"run": str(tmp_path)}], 0)
    r = read(tmp_path / "r").filter(pl.col("kind") == "collective")
    names = [n for n in r.unique("name", maintain_order=True)["name"]]
    want = [f"{n}@world" for n in calls if n not in dict(skipped)] + ["reduce_scatter_tensor@world"]
    assert names == list(dict.fromkeys(want)), skipped
    per_call = r.group_by("name", "occurrence").agg(pl.col("role").unique().sort())
    assert all(roles.to_list() == ["input", "output"] for roles in per_call["role"])
    assert skipped == [], skipped


def test_work_of_an_async_call_is_a_work(tmp_path, gloo1):
    """FSDP2 waits only for ``isinstance(work, dist.Work)``: the handle capture returns is one,
    and waiting on it records the outputs."""
    with Session(tmp_path / "r", "boundaries") as s, s.step(0):
        out = torch.zeros(4)
        w = dist.all_gather_single(out, torch.arange(4.0), async_op=True)
        assert isinstance(w, dist.Work)
        assert w.wait()
        assert w.is_completed() and w.get_future().wait()
    r = read(tmp_path / "r").filter(pl.col("kind") == "collective")
    assert r.select("name", "role", "arg").rows() == [
        ("all_gather_single@world", "input", "input_tensor"),
        ("all_gather_single@world", "output", "output_tensor"),
    ]
    assert read(tmp_path / "r", "events").filter(pl.col("type") == "pending_collective").height == 0


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_the_backends_own_ops_inside_a_collective_are_not_the_programs(tmp_path, gloo1):
    """At level ops, what the backend runs on the caller's thread to do a collective (the c10d
    op it dispatches, gloo's ``split``/``copy_`` of a reduce-scatter, its copy out again at the
    wait torch makes) is the library's work: the program's ops are around the collective's own
    record, and the output record holds what the collective wrote."""
    from detfp_capture import digest

    with Session(tmp_path / "r", "ops") as s, s.step(0):
        x = torch.arange(8.0) * 2
        out = torch.zeros(8)
        dist.reduce_scatter_tensor(out, x)
        _ = out + 1
    r = read(tmp_path / "r")
    assert r.filter(pl.col("kind") == "op").unique("name", maintain_order=True)["name"].to_list() == [
        "aten::arange.default",
        "aten::detach.default",
        "aten::mul.Tensor",
        "aten::zeros.default",
        "aten::add.Tensor",
    ]
    rs = r.filter(pl.col("kind") == "collective")
    assert rs["role"].to_list() == ["input", "output"]
    assert [f"{hi:016x}{lo:016x}" for hi, lo in rs.select("digest_hi", "digest_lo").rows()] == [
        digest.fingerprint(x).digest
    ] * 2


def test_an_object_collectives_exchange_is_no_op_of_the_program(tmp_path, gloo1):
    """At level ops an object collective's own exchange (the c10d op it dispatches into a buffer
    it just allocated, unwritten on a receiving rank: other bytes in every run) is the library's
    work, as a barrier's is: no op record, no collective record, the program's ops around it
    recorded (a Lightning job broadcasting its log directory was an identical pair that diverged
    at ``c10d::broadcast_`` on rank 1)."""
    with Session(tmp_path / "r", "ops") as s, s.step(0):
        x = torch.arange(4.0) + 1
        dist.broadcast_object_list([{"run": str(tmp_path)}], 0)
        dist.all_gather_object([None], {"run": str(tmp_path)})
        dist.barrier()
        _ = x * 2
    r = read(tmp_path / "r")
    names = r.filter(pl.col("kind").is_in(["op", "collective"]))["name"].unique(maintain_order=True).to_list()
    assert not [n for n in names if n.startswith(("c10d::broadcast", "c10d::allgather", "broadcast", "all_gather"))]
    assert "aten::mul.Tensor" in names and "aten::add.Tensor" in names
    # A barrier's placeholder tensor (torch.empty: garbage) is recorded write-only, never digested.
    barrier = r.filter(pl.col("name") == "c10d::barrier.default")
    assert barrier["role"].to_list() == ["dest"] and barrier["digest_hi"].is_null().all(), barrier
