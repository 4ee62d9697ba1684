"""Golden tests for bisect: one tiny paired run per verdict, pattern and difference kind.

Each scenario plants one divergence in run B (tests/fixtures/pairs.py) and checks
that bisect names the planted step, phase, module, op, verdict and pattern.
"""

from __future__ import annotations

import struct

import pytest

from detfp_analyze.bisect import bisect
from detfp_analyze.errors import IncomparableError, SelectionError
from tests.fixtures.pairs import build_pair
from tests.fixtures.shards import hexdigest

AR_ALL = {"change": ("ar.out",)}


def spread(step: int, world: int, origin: dict[int, dict]) -> dict:
    """Edits: ``origin`` ranks as given, every other rank receives the all-reduce output."""
    out = {(r, step): AR_ALL for r in range(world)}
    out.update({(r, step): e for r, e in origin.items()})
    return out


def test_identical(tmp_path):
    a, b = build_pair(tmp_path)
    res = bisect(a, b)
    assert res.status == "identical"
    assert res.first_step is None
    assert res.diagnosis.pattern == "identical"
    assert [r.status for r in res.ranks] == ["identical", "identical"]


def test_origin_single_rank_and_receivers(tmp_path):
    a, b = build_pair(tmp_path, world=3, edits_b=spread(1, 3, {0: {"after": "mm.out"}}))
    res = bisect(a, b)
    assert res.status == "diverged" and res.first_step == 1
    r0 = res.rank(0).first
    assert (r0.step, r0.phase, r0.module, r0.op, r0.role, r0.verdict) == (
        1,
        "forward",
        "l1",
        "aten::mm.default",
        "output",
        "origin",
    )
    for r in (1, 2):
        f = res.rank(r).first
        assert (f.op, f.kind, f.verdict, f.group, f.peers_differing) == (
            "all_reduce@dp",
            "collective",
            "receiver",
            "dp",
            (0,),
        )
    assert res.diagnosis.pattern == "single_rank"
    assert res.diagnosis.origin_ranks == (0,)
    assert res.diff_rank == 0 and res.diff.kind == "values"
    assert res.diff.confirmed == "fingerprint"
    # Discriminator: the origin mm in l1 diverged, the mm in l2 consumed it (also divergent here).
    disc = res.discriminator
    assert disc.op == "aten::mm.default" and disc.ranks == (0,)
    assert {(row.module, row.divergent) for row in disc.rows} == {("l1", 1), ("l2", 1)}


def test_all_ranks_same_op(tmp_path):
    a, b = build_pair(tmp_path, world=3, edits_b={(r, 2): {"after": "relu.out"} for r in range(3)})
    res = bisect(a, b)
    assert res.diagnosis.pattern == "all_ranks_same_op"
    assert res.diagnosis.origin_ranks == (0, 1, 2)
    assert res.diagnosis.op == "aten::relu.default"
    assert {(r.first.step, r.first.module, r.first.verdict) for r in res.ranks} == {(2, "l2", "origin")}


def test_collective_origin_when_every_peer_input_matched(tmp_path):
    a, b = build_pair(tmp_path, world=2, edits_b={(r, 0): {"change": ("ar.out", "param")} for r in range(2)})
    res = bisect(a, b)
    for r in res.ranks:
        assert (r.first.op, r.first.verdict, r.first.group_ranks) == ("all_reduce@dp", "origin", (0, 1))
    assert res.diagnosis.pattern == "all_ranks_same_op"


def test_unobserved_producer_at_a_view(tmp_path):
    a, b = build_pair(tmp_path, world=2, edits_b=spread(1, 2, {1: {"after": "view.in"}}))
    res = bisect(a, b)
    f = res.rank(1).first
    assert (f.op, f.role, f.verdict) == ("aten::view.default", "input", "unobserved_producer")
    assert f.consumer == "aten::view.default in l1"
    assert f.contradiction is not None and "upstream" in f.contradiction
    assert "aten::mm.default" in f.upstream
    assert res.rank(0).first.verdict == "receiver"
    assert res.diagnosis.pattern == "no_origin"
    assert res.diagnosis.origin_ranks == ()


def test_view_output_with_matching_input_is_a_contradiction(tmp_path):
    a, b = build_pair(tmp_path, world=1, edits_b={(0, 0): {"after": "view.out"}})
    f = bisect(a, b).rank(0).first
    assert (f.op, f.role, f.verdict) == ("aten::view.default", "output", "unobserved_producer")
    assert "cannot create a difference" in f.contradiction


def test_source_batch(tmp_path):
    a, b = build_pair(tmp_path, world=2, edits_b=spread(0, 2, {1: {"change": ("batch",), "after": "mm.in0"}}))
    res = bisect(a, b)
    f = res.rank(1).first
    assert (f.kind, f.op, f.verdict) == ("batch", "batch", "source")
    assert res.diagnosis.pattern == "single_rank" and res.diagnosis.origin_ranks == (1,)


def test_structural_extra_call(tmp_path):
    extra = {"extra_before": {"relu.in": [dict(module="l2", name="aten::clone.default", role="output", arg="out[0]")]}}
    a, b = build_pair(tmp_path, world=1, edits_b={(0, 1): extra})
    res = bisect(a, b)
    f = res.rank(0).first
    assert (f.step, f.op, f.verdict, f.presence, f.diff_kind) == (
        1,
        "aten::clone.default",
        "structural",
        "b_only",
        "structure",
    )
    assert res.diagnosis.pattern == "control_flow"


def test_structural_shifted_occurrence_is_not_a_value_cascade(tmp_path):
    # B calls relu one extra time first: every relu occurrence shifts by one.
    extra = {
        "extra_before": {
            "relu.in": [
                dict(module="l2", name="aten::relu.default", role="input", arg="args[0]", digest=hexdigest("x")),
                dict(module="l2", name="aten::relu.default", role="output", arg="out[0]", digest=hexdigest("y")),
            ]
        }
    }
    a, b = build_pair(tmp_path, world=1, edits_b={(0, 0): extra})
    f = bisect(a, b).rank(0).first
    assert f.verdict == "structural"
    assert f.op == "aten::relu.default" and f.occurrence == 0


def test_metric_only(tmp_path):
    a, b = build_pair(tmp_path, world=2, metrics_b=lambda r, s: 1.0 + s + (0.25 if (r, s) == (1, 2) else 0.0))
    res = bisect(a, b)
    r1 = res.rank(1)
    assert (r1.status, r1.verdict, r1.step, r1.metric_step, r1.metric_name) == ("diverged", "metric_only", 2, 2, "loss")
    assert r1.first is None
    assert res.rank(0).status == "identical"
    assert res.diagnosis.pattern == "no_origin"
    assert res.diagnosis.verdict_counts == {"metric_only": 1}


def test_hazard_is_a_likely_false_root_and_next_is_reported(tmp_path):
    haz = {"set": {"mm.in1": {"hazards": ["uninitialized"]}}, "change": ("mm.in1",), "after": "relu.out"}
    a, b = build_pair(tmp_path, world=1, edits_b={(0, 0): haz}, edits_a={(0, 0): {"set": haz["set"]}})
    rr = bisect(a, b).rank(0)
    assert rr.first.hazards == ("uninitialized",)
    assert rr.first.op == "aten::mm.default"
    assert rr.next_clean is not None
    assert (rr.next_clean.op, rr.next_clean.verdict) == ("aten::relu.default", "origin")
    assert rr.effective is rr.next_clean


def test_arguments_difference(tmp_path):
    a, b = build_pair(
        tmp_path,
        world=1,
        edits_a={(0, 0): {"set": {k: {"args_digest": "00000000000000aa"} for k in ("relu.in", "relu.out")}}},
        edits_b={(0, 0): {"set": {k: {"args_digest": "00000000000000bb"} for k in ("relu.in", "relu.out")}}},
    )
    f = bisect(a, b).rank(0).first
    assert f.op == "aten::relu.default" and f.role == "input"
    assert f.diff_kind == "arguments"
    assert (f.diff.args_a, f.diff.args_b) == ("00000000000000aa", "00000000000000bb")


def test_permutation_from_row_digests(tmp_path):
    rows = [hexdigest(i) for i in range(4)]
    a, b = build_pair(
        tmp_path,
        world=1,
        edits_a={(0, 1): {"set": {"relu.out": {"rows": rows}}}},
        edits_b={(0, 1): {"change": ("relu.out",), "set": {"relu.out": {"rows": [rows[1], rows[0], *rows[2:]]}}}},
    )
    f = bisect(a, b).rank(0).first
    assert (f.op, f.verdict, f.diff_kind) == ("aten::relu.default", "origin", "permutation")
    assert f.diff.rows_differing == 2


def _f32(values):
    return struct.pack(f"<{len(values)}f", *values)


def _next_up(x: float) -> float:
    (bits,) = struct.unpack("<I", struct.pack("<f", x))
    return struct.unpack("<f", struct.pack("<I", bits + 1))[0]


def test_values_with_moments_and_dumps_one_ulp(tmp_path):
    va = [1.0, 2.0, 3.0, 4.0]
    vb = [1.0, _next_up(2.0), 3.0, _next_up(4.0)]
    dump = dict(step=1, module="l1", name="aten::mm.default", role="output", arg="out[0]", occurrence=0)
    a, b = build_pair(
        tmp_path,
        world=1,
        edits_a={(0, 1): {"set": {"mm.out": {"m_sum": 10.0, "m_absmax": 4.0}}}},
        edits_b={(0, 1): {"after": "mm.out", "set": {"mm.out": {"m_sum": 10.5, "m_absmax": 4.25}}}},
        extra_tables_a=lambda r: {"dumps": [{**dump, "data": _f32(va)}]},
        extra_tables_b=lambda r: {"dumps": [{**dump, "data": _f32(vb)}]},
    )
    res = bisect(a, b)
    d = res.rank(0).first.diff
    assert d.kind == "values" and d.confirmed == "bytes"
    assert (d.abs_dsum, d.d_absmax) == (0.5, 0.25)
    assert (d.numel, d.n_differing, d.first_index, d.max_ulp, d.all_one_ulp) == (4, 2, 1, 1, True)
    assert res.diff.confirmed == "bytes"


def test_kernels_same_and_different(tmp_path):
    def kern(names):
        return lambda r: {
            "kernels": [dict(step=1, module="l1", name="aten::mm.default", occurrence=0, kernel=k) for k in names]
        }

    a, b = build_pair(
        tmp_path / "same",
        world=1,
        edits_b={(0, 1): {"after": "mm.out"}},
        extra_tables_a=kern(["gemm_a", "reduce"]),
        extra_tables_b=kern(["gemm_a", "reduce"]),
    )
    res = bisect(a, b, level="kernel")
    k = res.rank(0).first.kernels
    assert k.a == ("gemm_a", "reduce") and k.same
    assert bisect(a, b, level="op").rank(0).first.kernels is None
    a, b = build_pair(
        tmp_path / "diff",
        world=1,
        edits_b={(0, 1): {"after": "mm.out"}},
        extra_tables_a=kern(["gemm_a"]),
        extra_tables_b=kern(["gemm_splitk", "reduce"]),
    )
    k = bisect(a, b, level="kernel").rank(0).first.kernels
    assert not k.same and k.b == ("gemm_splitk", "reduce")


def test_rank_subset_shared_coordinate(tmp_path):
    a, b = build_pair(
        tmp_path,
        world=4,
        edits_b=spread(1, 4, {1: {"after": "mm.out"}, 3: {"after": "mm.out"}}),
        parallel=lambda r: {"dp": r % 2, "tp": r // 2, "dp_size": 2, "tp_size": 2},
    )
    d = bisect(a, b).diagnosis
    assert d.pattern == "rank_subset"
    assert d.origin_ranks == (1, 3)
    assert d.shared_coordinates == {"dp": 1}


def test_skipped_and_digest_errors_are_no_evidence(tmp_path):
    skip = {"set": {"view.out": {"status": "skipped", "digest_hi": None, "digest_lo": None}}}
    a, b = build_pair(tmp_path / "skip", world=1, edits_b={(0, 1): {**skip, "change": ("view.out",)}})
    assert bisect(a, b).status == "identical"
    # A digest error (on both sides, or one) is no evidence either way, never a divergence of an
    # otherwise identical pair; the report counts the records left out.
    err = {"set": {"relu.out": {"status": "error", "error": "boom", "digest_hi": None, "digest_lo": None}}}
    a, b = build_pair(tmp_path / "err", world=1, edits_a={(0, 2): err}, edits_b={(0, 2): err})
    res = bisect(a, b)
    assert res.status == "identical"
    assert any("could not be digested" in n and "A 1, B 1" in n for n in res.notes), res.notes
    a, b = build_pair(tmp_path / "err1", world=1, edits_b={(0, 2): err})
    assert bisect(a, b).status == "identical"
    # ... but a real difference after it is still found.
    a, b = build_pair(tmp_path / "err2", world=1, edits_a={(0, 1): err}, edits_b={(0, 1): {**err, "after": "mm2.out"}})
    f = bisect(a, b).rank(0).first
    assert (f.step, f.verdict) == (1, "origin")


def test_levels_truncate(tmp_path):
    a, b = build_pair(tmp_path, world=1, edits_b={(0, 1): {"after": "mm2.out"}})
    assert bisect(a, b, level="phase").rank(0).first.module is None
    f = bisect(a, b, level="module").rank(0).first
    assert (f.module, f.op) == ("l2", None)
    r = bisect(a, b, level="step").rank(0)
    assert (r.step, r.first) == (1, None)


def test_ranks_and_steps_selection(tmp_path):
    a, b = build_pair(tmp_path, world=2, edits_b=spread(1, 2, {0: {"after": "mm.out"}}))
    res = bisect(a, b, ranks=[1])
    assert [r.rank for r in res.ranks] == [1]
    assert res.rank(1).first.verdict == "receiver"
    assert bisect(a, b, steps=(1, 2)).first_step == 1
    assert bisect(a, b, steps=(2, 2)).status == "identical"  # the plant is confined to step 1
    assert bisect(a, b, steps=range(0, 1)).status == "identical"
    with pytest.raises(SelectionError, match="rank"):
        bisect(a, b, ranks=[7])
    with pytest.raises(SelectionError, match="level"):
        bisect(a, b, level="bogus")


def test_layout_difference_is_incomparable_unless_forced(tmp_path):
    a, b = build_pair(tmp_path, world=2, manifest_b={"parallel": {"tp_size": 2}})
    with pytest.raises(IncomparableError, match=r"parallel\.tp_size differs \(null vs 2\)"):
        bisect(a, b)
    assert bisect(a, b, force=True).status == "identical"


def test_module_output_is_judged_by_its_module_input_twin(tmp_path):
    from detfp_analyze.io.reader import open_run
    from tests.fixtures.shards import write_run

    def recs(out_label: str, in_label: str, batch: bool = True) -> list[dict]:
        out_digest, in_digest = hexdigest(out_label), hexdigest(in_label)
        fed = dict(step=0, kind="batch", module="", name="Net", role="input", arg="args[0]", digest=hexdigest("x"))
        return [
            *([fed] if batch else []),
            dict(
                step=0, kind="module_input", module="blk", name="Block", role="input", arg="args[0]", digest=in_digest
            ),
            dict(step=0, kind="module_output", module="blk", name="Block", role="output", arg="out", digest=out_digest),
        ]

    a = open_run(str(write_run(tmp_path / "a", {0: {"records": recs("o", "i")}})))
    b = open_run(str(write_run(tmp_path / "b", {0: {"records": recs("o2", "i")}})))
    f = bisect(a, b).rank(0).first
    assert (f.kind, f.verdict) == ("module_output", "origin")
    assert "all 1 input(s) of Block in blk matched" in f.explanation
    # Below level ops a submodule's input is made by its parent's own code, which that level
    # does not capture: a local start there, with what to recapture.
    c = open_run(str(write_run(tmp_path / "c", {0: {"records": recs("o2", "i2")}})))
    f = bisect(a, c).rank(0).first
    assert (f.kind, f.role, f.verdict) == ("module_input", "input", "origin")
    assert "the code <root> runs between its submodules" in f.explanation and "level ops" in f.depends_on
    # Without a batch record (a root module that took no tensors) the data may have brought the
    # difference just as well: no local start is claimed, and the report says what to capture.
    na = open_run(str(write_run(tmp_path / "na", {0: {"records": recs("o", "i", batch=False)}})))
    nc = open_run(str(write_run(tmp_path / "nc", {0: {"records": recs("o2", "i2", batch=False)}})))
    f = bisect(na, nc).rank(0).first
    assert (f.kind, f.role, f.verdict) == ("module_input", "input", "unobserved_producer")
    assert "batch was not captured" in f.explanation and "session.probe('batch'" in f.depends_on
    # With ops captured, the same input differing first has an uncaptured producer.
    op = dict(step=0, kind="op", module="", name="aten::mul.Tensor", role="output", arg="out", digest=hexdigest("m"))
    d = open_run(str(write_run(tmp_path / "d", {0: {"records": [op, *recs("o", "i")]}})))
    e = open_run(str(write_run(tmp_path / "e", {0: {"records": [op, *recs("o2", "i2")]}})))
    f = bisect(d, e).rank(0).first
    assert (f.kind, f.role, f.verdict, f.consumer) == ("module_input", "input", "unobserved_producer", "Block in blk")


def test_metrics_only_capture(tmp_path):
    from detfp_analyze.io.reader import open_run
    from tests.fixtures.shards import write_run

    def run(path, loss2):
        metrics = [dict(step=s, name="loss", value=v) for s, v in ((0, 1.0), (1, 0.5), (2, loss2))]
        return open_run(str(write_run(path, {0: {"metrics": metrics}, 1: {"metrics": metrics}})))

    a, b = run(tmp_path / "a", 0.25), run(tmp_path / "b", 0.25000000000000006)
    res = bisect(a, b)
    assert [(r.rank, r.verdict, r.step, r.metric_a, r.metric_b) for r in res.ranks] == [
        (0, "metric_only", 2, 0.25, 0.25000000000000006),
        (1, "metric_only", 2, 0.25, 0.25000000000000006),
    ]
    assert res.window.steps == (0, 2)
    assert bisect(a, run(tmp_path / "c", 0.25)).status == "identical"


def test_p2p_receive_is_a_receiver(tmp_path):
    recv = {
        "extra_before": {
            "param": [
                dict(kind="p2p", phase="forward", name="recv@pp", role="output", arg="out[0]", digest=hexdigest("r"))
            ]
        }
    }
    recv_b = {"extra_before": {"param": [{**recv["extra_before"]["param"][0], "digest": hexdigest("r2")}]}}
    a, b = build_pair(
        tmp_path, world=2, edits_a={(1, 0): recv}, edits_b={(1, 0): recv_b}, groups={"dp": [0, 1], "pp": [0, 1]}
    )
    f = bisect(a, b).rank(1).first
    assert (f.kind, f.op, f.verdict, f.group) == ("p2p", "recv@pp", "receiver", "pp")
    assert "sending rank" in f.explanation


def test_step_end_parameter_without_a_batch_record_claims_no_origin(tmp_path):
    """Level metrics records the batch and the step-end parameters. When the batch is missing
    (the root module took no tensors), a parameter that differs after the step may carry a data
    difference: the verdict names what was not captured instead of blaming the step's code."""
    from detfp_analyze.io.reader import open_run
    from tests.fixtures.shards import write_run

    def run(path, value: str, batch: bool):
        fed = dict(step=0, kind="batch", module="", name="Net", role="input", arg="args[0]", digest=hexdigest("x"))
        param = dict(
            step=0, kind="param", phase="step", name="l1.weight", role="value", arg="", digest=hexdigest(value)
        )
        return open_run(str(write_run(path, {0: {"records": [*([fed] if batch else []), param]}})))

    f = bisect(run(tmp_path / "a", "p", True), run(tmp_path / "b", "q", True)).rank(0).first
    assert (f.kind, f.verdict) == ("param", "origin")
    f = bisect(run(tmp_path / "c", "p", False), run(tmp_path / "d", "q", False)).rank(0).first
    assert (f.kind, f.verdict) == ("param", "unobserved_producer")
    assert "batch was not captured" in f.explanation and "session.probe('batch'" in f.depends_on
