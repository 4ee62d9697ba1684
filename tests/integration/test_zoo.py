"""The third-party zoo: training code nobody here wrote, at every capture level.

Members (``tests/fixtures/zoo/zoo_train.py``): Hugging Face GPT-2 under DDP (watched bare in one run of
the identical pair and as the DDP wrapper in the other), Llama with Hugging Face gradient
checkpointing, a Mixtral mixture of experts under ``torch.autocast`` (bf16), Llama sharded
with FSDP2 (``fully_shard`` per layer and root), and GPT-2 compiled in place with
``model.compile()`` (Inductor on CPU); all 2 ranks over gloo under torchrun, without
``use_deterministic_algorithms``. A plain script with no detfp code runs under the launcher in
``tests/integration/test_zoo_launcher.py``.

Scenarios, each at levels metrics, boundaries and ops (the compiled member: boundaries, where
its region is recorded; every compile costs tens of seconds on 2 cores), each with its expected
answer:

* ``identical``: two identical runs -> ``identical``;
* ``onoff``: capture on vs off -> losses and final parameters bitwise equal;
* ``nondet``: a custom op inside one module sums its chunks in a per-run order from step 1 ->
  ``origin`` at that op (module, at level boundaries) on every rank, ``all_ranks_same_op``;
* ``data``: one element of rank 1's batch at step 1 -> rank 1 ``source`` at ``batch``, rank 0
  ``receiver``, ``single_rank``, origin ranks (1,);
* ``resume_norng`` / ``resume_rng``: resumed from the checkpoint after step 0 (dropout on)
  without / with the RNG state -> ``source`` at ``rng_state`` at step 1 on every rank /
  ``identical`` over the overlap.

Member ``gpt2_ddp_v1`` is ``gpt2_ddp`` at level boundaries with digest version 1 (the others use
the default, version 2): every answer must be the same on either version.

One launch (one process group) runs every job, the compiled member's last; the bisects then run here.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.zoo.harness import ZOO, check_identical, check_onoff, expect, launch, pair, run_checks

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(1200)]

SCRIPT = ZOO / "zoo_train.py"
LEVELS = ("metrics", "boundaries", "ops")
#: member -> (job options, levels, module the nondeterministic op is planted in). Run ``b`` of
#: the identical pair is watched as the wrapper (``watch(ddp_model)``) where ``a`` watched the
#: bare model, so the pair also proves both ways record the same stream; FSDP2 members watch
#: both the same way: FSDP2's own backward hooks interleave with capture's in registration
#: order, so runs watched before and after ``fully_shard`` record equal values in another order.
MEMBERS: dict[str, tuple[dict[str, Any], tuple[str, ...], str]] = {
    "gpt2_ddp": ({"model": "gpt2", "wrap": "ddp"}, LEVELS, "transformer.h.0.mlp.c_fc"),
    "llama_ddp_checkpointing": ({"model": "llama", "wrap": "ddp", "gc": True}, LEVELS, "model.layers.0.mlp.up_proj"),
    "mixtral_ddp_autocast": (
        {"model": "mixtral", "wrap": "ddp", "autocast": True},
        LEVELS,
        "model.layers.0.self_attn.q_proj",
    ),
    "llama_fsdp2": ({"model": "llama", "wrap": "fsdp2"}, LEVELS, "model.layers.0.mlp.up_proj"),
    # Digest version 1 (every other member: version 2, the default): the identical pair and the
    # planted faults must give the same answers on either version (issue 31). One level: cheap.
    "gpt2_ddp_v1": ({"model": "gpt2", "wrap": "ddp", "digest_version": 1}, ("boundaries",), "transformer.h.0.mlp.c_fc"),
    "gpt2_ddp_compile": ({"model": "gpt2", "wrap": "ddp", "compile": True}, ("boundaries",), ""),
}
SCENARIOS = ("identical", "onoff", "nondet", "data", "resume_norng", "resume_rng")
STEPS = 2
PLANT = 1


def plan(member: str, root: Path) -> list[dict[str, Any]]:
    """Every job of one member: per level a, b, nondet, data and two resumes, plus one run
    without capture. Every job routes the planted module through the split-K op (order fwd),
    so the runs differ only where a scenario says."""
    opts, levels, _ = MEMBERS[member]
    base = {**opts, "steps": STEPS, "dropout": 0.1, "plant_step": PLANT, "order": "fwd"}
    jobs = [{**base, "name": f"{member}.off"}]
    for lvl in levels:
        d = root / member / lvl
        ck = str(d / "ckpt")

        def job(name: str, lvl: str = lvl, d: Path = d, **kw: Any) -> dict[str, Any]:
            return {**base, "name": f"{member}.{lvl}.{name}", "out": str(d / name), "level": lvl, **kw}

        jobs += [
            job("a", watch="bare", save_ckpt=0, ckpt=ck),
            job("b", watch="bare" if opts["wrap"] == "fsdp2" else "wrapped"),
            job("nondet", order="rev"),
            job("data", data_rank=1, data_step=PLANT),
            job("resume_norng", load_ckpt=ck, start_step=1, restore_rng=False),
            job("resume_rng", load_ckpt=ck, start_step=1, restore_rng=True),
        ]
    return jobs


@pytest.fixture(scope="module")
def zoo(tmp_path_factory) -> Path:
    # One launch: the torch and transformers imports paid once per rank. The compiled member's
    # jobs come last, so no eager job runs in a process where dynamo has compiled anything.
    root = tmp_path_factory.mktemp("zoo")
    launch(SCRIPT, [j for m in MEMBERS for j in plan(m, root)], root, "all")
    return root


def _bisect(root: Path, member: str, lvl: str, a: str, b: str) -> Any:
    d = root / member / lvl
    return pair(d / a, d / b)


def _identical(root: Path, member: str, lvl: str) -> None:
    check_identical(root / member / lvl / "a", root / member / lvl / "b")


def _onoff(root: Path, member: str, lvl: str) -> None:
    check_onoff(root, f"{member}.off", [f"{member}.{lvl}.a", f"{member}.{lvl}.b"], [0])


def _nondet(root: Path, member: str, lvl: str) -> None:
    res = _bisect(root, member, lvl, "a", "nondet")
    target = MEMBERS[member][2]
    expect(res.first_step == PLANT and res.diagnosis.pattern == "all_ranks_same_op", "nondet: pattern", res)
    for rr in res.ranks:
        eff = rr.effective
        expect(eff is not None and eff.verdict == "origin" and eff.step == PLANT, "nondet: origin on every rank", res)
        if lvl == "ops":
            expect(eff.op == "detfp_zoo::split_k_mm.default", "nondet: the planted op", res)
        elif lvl == "boundaries" and target:
            expect(eff.module == target and eff.kind == "module_output", "nondet: the planted module", res)
        elif lvl == "boundaries":  # compiled in place: the region around it
            expect(eff.kind == "compiled", "nondet: the compiled region", res)


def _data(root: Path, member: str, lvl: str) -> None:
    res = _bisect(root, member, lvl, "a", "data")
    d = res.diagnosis
    expect(d.pattern == "single_rank" and d.origin_ranks == (1,), "data: single_rank on rank 1", res)
    r0, r1 = res.rank(0).effective, res.rank(1).effective
    expect(r1 is not None and (r1.verdict, r1.kind, r1.step) == ("source", "batch", PLANT), "data: rank 1", res)
    expect(r0 is not None and r0.verdict == "receiver", "data: rank 0 receives it", res)


def _resume_norng(root: Path, member: str, lvl: str) -> None:
    res = _bisect(root, member, lvl, "a", "resume_norng")
    for rr in res.ranks:
        eff = rr.effective
        expect(eff is not None and (eff.verdict, eff.kind, eff.step) == ("source", "rng_state", 1), "rng", res)


def _resume_rng(root: Path, member: str, lvl: str) -> None:
    res = _bisect(root, member, lvl, "a", "resume_rng")
    expect(res.status == "identical", "resume with the RNG state: identical over the overlap", res)


CHECKS: dict[str, Callable[[Path, str, str], None]] = {
    "identical": _identical,
    "onoff": _onoff,
    "nondet": _nondet,
    "data": _data,
    "resume_norng": _resume_norng,
    "resume_rng": _resume_rng,
}


_CASES = [(m, lvl) for m, (_, levels, _) in MEMBERS.items() for lvl in levels]


@pytest.mark.parametrize("member,level", _CASES, ids=[f"{m}-{lvl}" for m, lvl in _CASES])
def test_zoo(zoo, member, level):
    """Every scenario of one member at one level; all failures reported together."""
    run_checks(CHECKS, CHECKS, zoo, member, level)


def test_zoo_identical_pair_exits_0_through_the_cli(zoo):
    """The CLI a CI gate calls: exit 0 for an identical pair of a third-party stack at level ops
    (in this process: the exit status of a real process is test_example.py's and
    test_example_samples.py's)."""
    from typer.testing import CliRunner

    from detfp_analyze.cli import app

    d = zoo / "llama_fsdp2" / "ops"
    r = CliRunner().invoke(app, ["bisect", str(d / "a"), str(d / "b"), "--json"])
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    assert r.exit_code == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert json.loads(r.stdout)["status"] == "identical"


def test_zoo_v1_member_ran_digest_version_1(zoo):
    """The version-1 member's runs are version 1 and the others version 2: its answers above are
    the same questions asked of the other digest."""
    from detfp_analyze.io.reader import open_run

    v1, v2 = zoo / "gpt2_ddp_v1" / "boundaries", zoo / "gpt2_ddp" / "boundaries"
    got = [open_run(d / n).manifest(0)["digest_version"] for d in (v1, v2) for n in ("a", "nondet")]
    assert got == [1, 1, 2, 2]
