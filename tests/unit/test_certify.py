"""certify: one golden case per problem kind, with the exact JSON, plus the CLI's exit codes."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from detfp_analyze.cli import app
from detfp_analyze.single.certify import CHECKS, Problem, certify
from tests.fixtures.shards import hexdigest, write_run


def step(rank: int, s: int, records: list[dict] | None = None, events: list[dict] | None = None) -> dict:
    """Events and records of one well-formed step: step_begin, records, extra events, step_end."""
    recs = records if records is not None else [dict(step=s, role="input"), dict(step=s)]
    return {
        "records": recs,
        "events": [dict(step=s, type="step_begin"), *(events or []), dict(step=s, type="step_end", count=len(recs))],
    }


def merge(*parts: dict) -> dict:
    out: dict[str, list] = {}
    for p in parts:
        for t, rows in p.items():
            out.setdefault(t, []).extend(rows)
    return out


def clean(world: int = 2, steps: int = 2) -> dict:
    return {r: merge(*(step(r, s) for s in range(steps))) for r in range(world)}


def problems(path) -> list[dict]:
    return certify(path).to_json_dict()["problems"]


def test_clean_run_is_ok(tmp_path):
    write_run(tmp_path / "r", clean())
    res = certify(tmp_path / "r")
    assert res.to_json_dict() == {"status": "ok", "problems": [], "notes": []}
    assert (res.ranks, res.steps) == (2, 2)


def test_missing_rank(tmp_path):
    ranks = clean(world=3)
    del ranks[1]
    write_run(tmp_path / "r", ranks, world_size=3)
    assert problems(tmp_path / "r") == [
        {
            "kind": "missing_rank",
            "rank": 1,
            "step": None,
            "module": None,
            "detail": "no manifest for rank 1 of world size 3",
        }
    ]


def test_incomplete_step(tmp_path):
    ranks = clean()
    # Rank 1 crashed inside step 1: begin without end.
    ranks[1]["events"] = [e for e in ranks[1]["events"] if not (e["step"] == 1 and e["type"] == "step_end")]
    write_run(tmp_path / "r", ranks)
    assert problems(tmp_path / "r") == [
        {
            "kind": "incomplete_step",
            "rank": 1,
            "step": 1,
            "module": None,
            "detail": "step_begin without step_end: the capture stopped inside the step (crash, error or kill)",
        }
    ]


def test_step_missing_on_one_rank(tmp_path):
    ranks = {0: merge(step(0, 0), step(0, 1)), 1: step(1, 0)}
    write_run(tmp_path / "r", ranks)
    (p,) = problems(tmp_path / "r")
    assert (p["kind"], p["rank"], p["step"]) == ("incomplete_step", 1, 1)
    assert p["detail"].startswith("no step_begin/step_end events")


def test_sequence(tmp_path):
    recs = [dict(step=0, seq=5, role="input"), dict(step=0, seq=5)]  # repeated seq
    ranks = {
        0: {"records": recs, "events": [dict(step=0, seq=1, type="step_begin"), dict(step=0, seq=9, type="step_end")]}
    }
    write_run(tmp_path / "r", ranks)
    assert problems(tmp_path / "r") == [
        {
            "kind": "sequence",
            "rank": 0,
            "step": 0,
            "module": None,
            "detail": "records: seq 5 follows 5 in segment 0 (1 violation(s)); seq must strictly increase within (rank, segment)",
        }
    ]


@pytest.mark.parametrize(
    "etype", ["pending_collective", "recompute_mismatch", "capture_error", "capture_disabled", "truncation"]
)
def test_event_kinds(tmp_path, etype):
    ranks = clean()
    ranks[0] = merge(
        step(0, 0), step(0, 1, events=[dict(step=1, type=etype, name="x", module="m.sub", detail="what happened")])
    )
    write_run(tmp_path / "r", ranks)
    assert problems(tmp_path / "r") == [
        {"kind": etype, "rank": 0, "step": 1, "module": "m.sub", "detail": "what happened"}
    ]


@pytest.mark.parametrize("hazard", ["uninitialized", "async_pending", "nonblocking_pending", "pointer_like"])
def test_hazard_on_records_and_events(tmp_path, hazard):
    recs = [
        dict(step=0, role="input"),
        dict(step=0, module="layers.0", name="aten::empty.memory_format", hazards=[hazard]),
        dict(step=0, module="layers.0", name="aten::empty.memory_format", hazards=[hazard]),
    ]
    ev = [dict(step=0, type="hazard", name=hazard, module="layers.0", detail="flagged at capture")]
    ranks = {0: step(0, 0, recs, ev), 1: step(1, 0)}
    write_run(tmp_path / "r", ranks)
    got = problems(tmp_path / "r")
    assert len(got) == 1
    p = got[0]
    assert (p["kind"], p["rank"], p["step"], p["module"]) == (hazard, 0, 0, "layers.0")
    assert p["detail"].startswith("2 record(s) flagged, first: op aten::empty.memory_format out[0] (seq 1)")
    assert p["detail"].endswith("; 1 hazard event(s), first: flagged at capture")


def test_digest_error(tmp_path):
    recs = [dict(step=0, status="error", error="DigestError: bad storage", digest_hi=None, digest_lo=None)]
    write_run(tmp_path / "r", {0: step(0, 0, recs)})
    assert problems(tmp_path / "r") == [
        {
            "kind": "digest_error",
            "rank": 0,
            "step": 0,
            "module": None,
            "detail": "1 record(s) could not be digested, first: aten::mm.default out[0]: DigestError: bad storage",
        }
    ]


def test_determinism_all_ranks_once_and_cuda_rules(tmp_path):
    cuda = {"versions": {"cuda": "12.4"}, "host": {"device_count": 8}, "env": {}}
    det = {"deterministic_algorithms": False, "cudnn_benchmark": True, "cudnn_deterministic": False}
    over = {
        0: {**cuda, "determinism": det},
        1: {**cuda, "determinism": {**det, "cudnn_benchmark": False}, "env": {"CUBLAS_WORKSPACE_CONFIG": ":0:0"}},
    }
    write_run(tmp_path / "r", clean(), manifest_overrides=over)
    got = [(p["rank"], p["detail"].split(";")[0]) for p in problems(tmp_path / "r")]
    assert got == [
        (None, "torch.backends.cudnn.deterministic is off"),
        (None, "torch.use_deterministic_algorithms is off"),
        (0, "CUBLAS_WORKSPACE_CONFIG is unset on CUDA"),
        (0, "torch.backends.cudnn.benchmark is on (autotuned algorithm choice)"),
        (1, "CUBLAS_WORKSPACE_CONFIG=:0:0 is not a deterministic setting"),
    ]


def test_sorted_and_byte_stable(tmp_path):
    ranks = clean(world=3)
    del ranks[2]
    ranks[1] = merge(step(1, 0, events=[dict(step=0, type="capture_error", detail="boom")]), step(1, 1))
    write_run(tmp_path / "r", ranks, world_size=3)
    a = json.dumps(certify(tmp_path / "r").to_json_dict())
    b = json.dumps(certify(tmp_path / "r").to_json_dict())
    assert a == b
    kinds = [p["kind"] for p in json.loads(a)["problems"]]
    assert kinds == sorted(kinds) == ["capture_error", "missing_rank"]


def test_checks_selection(tmp_path):
    ranks = clean()
    ranks[0] = merge(step(0, 0, events=[dict(step=0, type="truncation", detail="cut")]), step(0, 1))
    write_run(tmp_path / "r", ranks)
    assert certify(tmp_path / "r", checks=["sequence", "hazards"]).status == "ok"
    assert certify(tmp_path / "r", checks=["events"]).status == "problems"
    with pytest.raises(ValueError, match="unknown certify check"):
        certify(tmp_path / "r", checks=["nope"])
    assert set(CHECKS) >= {"missing_rank", "incomplete_step", "sequence", "determinism"}
    assert Problem("a", None, 1, None, "").sort_key() < Problem("a", 0, 0, None, "").sort_key()


def test_cli_exit_codes_and_json(tmp_path):
    write_run(tmp_path / "ok", clean())
    ranks = clean()
    pending = dict(step=0, type="pending_collective", name="all_reduce", count=2)
    ranks[0] = merge(step(0, 0, events=[pending]), step(0, 1))
    write_run(tmp_path / "bad", ranks)
    runner = CliRunner()
    r = runner.invoke(app, ["certify", str(tmp_path / "ok")])
    assert r.exit_code == 0 and r.output.endswith(": ok (2 rank(s), 2 step(s) checked)\n")
    r = runner.invoke(app, ["certify", str(tmp_path / "bad"), "--json"])
    assert r.exit_code == 1
    assert json.loads(r.output) == {
        "status": "problems",
        "problems": [
            {
                "kind": "pending_collective",
                "rank": 0,
                "step": 0,
                "module": None,
                "detail": "2 async collective(s) not waited at step end (all_reduce)",
            }
        ],
        "notes": [],
    }
    r = runner.invoke(app, ["certify", str(tmp_path / "bad")])
    assert r.exit_code == 1 and "  pending_collective: rank 0 step 0: 2 async collective(s)" in r.output
    r = runner.invoke(app, ["certify", str(tmp_path / "nope")])
    assert r.exit_code == 2


def test_hazards_nobody_reads_are_not_problems(tmp_path):
    # Dropout: empty_like's output is not digested (skipped), bernoulli_ overwrites its args[0]
    # without reading it. Neither can be a false root; a consumer reading the buffer can.
    recs = [
        dict(step=0, name="aten::empty_like.default", status="skipped", hazards=["uninitialized"]),
        dict(step=0, name="aten::bernoulli_.float", role="input", hazards=["uninitialized"]),
        dict(step=0, name="aten::bernoulli_.float"),
        dict(step=0, name="aten::add.Tensor", role="input", hazards=["uninitialized"]),
        dict(step=0, name="aten::add.Tensor"),
    ]
    write_run(tmp_path / "r", {0: step(0, 0, recs)})
    (p,) = problems(tmp_path / "r")
    assert p["kind"] == "uninitialized" and "aten::add.Tensor args[0]" in p["detail"]


def test_replica_split_names_the_first_step_parameter_and_ranks(tmp_path):
    """Data-parallel replicas must hold bitwise equal parameters after every step: the first
    (step, parameter) where one rank's copy splits off is a problem. A parameter that never
    agreed across ranks (a shard) is not a replica and is left out."""

    def params(rank: int, s: int) -> list[dict]:
        drift = rank == 2 and s >= 1
        return [
            dict(step=s, kind="param", phase="step", name="w", role="value", digest=hexdigest(("w", s, drift))),
            dict(step=s, kind="param", phase="step", name="shard", role="value", digest=hexdigest(("s", rank, s))),
        ]

    ranks = {r: merge(*(step(r, s, params(r, s)) for s in range(3))) for r in range(3)}
    write_run(tmp_path / "r", ranks)
    assert problems(tmp_path / "r") == [
        {
            "kind": "replica_split",
            "rank": None,
            "step": 1,
            "module": None,
            "detail": "data-parallel replicas (ranks 0-2) split at step 1: parameter w differs on ranks 2 (equal at "
            "step 0); 1 record(s) of the group differ at that step",
        }
    ]
    # Two tensor-parallel groups: each is checked on its own (tp=0 drifts, tp=1 is clean).
    write_run(
        tmp_path / "tp",
        {r: merge(*(step(r, s, params(r, s)) for s in range(3))) for r in range(4)},
        manifest_overrides={r: {"parallel": {"tp": r % 2, "dp": r // 2}} for r in range(4)},
    )
    got = [(p["kind"], p["step"], p["detail"].split(":")[0]) for p in problems(tmp_path / "tp")]
    assert got == [("replica_split", 1, "data-parallel replicas (ranks 0,2) split at step 1")]


def test_partial_step_is_a_note_not_a_problem(tmp_path):
    """A trailing forward without an optimizer step is how most scripts end (an evaluation, a
    Trainer's end-of-training gathers): certify reports it, and still passes the run."""
    from detfp_analyze._cli.certify import format_certify

    ranks = clean()
    detail = "step 1 ended at close without an optimizer step (an evaluation or a trailing forward); its records are compared as far as both runs hold them"
    ranks[0] = merge(step(0, 0), step(0, 1, events=[dict(step=1, type="partial_step", detail=detail)]))
    write_run(tmp_path / "r", ranks)
    res = certify(tmp_path / "r")
    assert res.ok and res.problems == ()
    assert [p.to_json_dict() for p in res.notes] == [
        {"kind": "partial_step", "rank": 0, "step": 1, "module": None, "detail": detail}
    ]
    assert res.to_json_dict()["notes"][0]["kind"] == "partial_step"
    text = format_certify(res)
    assert text.splitlines()[0].endswith("ok (2 rank(s), 2 step(s) checked)")
    assert f"  note: partial_step: rank 0 step 1: {detail}" in text
    # With a real problem as well, the note stays a note.
    ranks[1] = merge(step(1, 0, events=[dict(step=0, type="capture_error", detail="boom")]), step(1, 1))
    write_run(tmp_path / "r2", ranks)
    res = certify(tmp_path / "r2")
    assert [p.kind for p in res.problems] == ["capture_error"] and [p.kind for p in res.notes] == ["partial_step"]


def test_reduction_not_captured_only_where_ranks_replicate_each_other(tmp_path):
    """A multi-rank step that reduced no gradient capture saw is a missing reduction only if the
    job is data parallel: ranks holding the same parameters (or parallel coordinates saying so).
    Pipeline stages and tensor-parallel shards hold different ones: nothing to reduce."""
    detail = "step 0 of this 2-rank job reduced no gradient that capture saw"

    def run(name: str, params: dict[int, dict[str, str]], parallel: dict[int, dict] | None = None) -> list:
        ranks = {}
        for r, ps in params.items():
            recs = [
                dict(step=0, kind="param", phase="step", name=n, role="value", digest=hexdigest(v))
                for n, v in ps.items()
            ]
            ev = [dict(step=0, type="reduction_not_captured", detail=detail)]
            ranks[r] = merge(step(r, 0, recs or None, ev), step(r, 1))
        overrides = {r: {"parallel": p} for r, p in parallel.items()} if parallel else None
        write_run(tmp_path / name, ranks, manifest_overrides=overrides)
        return sorted((p["kind"], p["rank"]) for p in problems(tmp_path / name))

    missing = [("reduction_not_captured", 0), ("reduction_not_captured", 1)]
    assert run("replicas", {0: {"w": "w0", "b": "b0"}, 1: {"w": "w0", "b": "b0"}}) == missing
    assert run("pipeline", {0: {"0.weight": "s0"}, 1: {"0.weight": "s1"}}) == []
    # Tensor parallel: the norm is replicated, the sharded weight is not.
    assert run("tensor", {0: {"norm": "ones", "w": "w0"}, 1: {"norm": "ones", "w": "w1"}}) == []
    # Nothing tells (no parameters recorded): reported.
    assert run("unknown", {0: {}, 1: {}}) == missing
    # Parallel coordinates decide: two pipeline stages, or two data-parallel ranks.
    same = {0: {"w": "w0"}, 1: {"w": "w0"}}
    assert run("pp", same, {0: {"pp": 0}, 1: {"pp": 1}}) == []
    assert run("dp", {0: {"w": "w0"}, 1: {"w": "w1"}}, {0: {"dp": 0}, 1: {"dp": 1}}) == missing
