"""The compiled zoo: torch.compile's Inductor (C++ kernels on CPU) inside Hugging Face models, 2 ranks.

Members (``tests/fixtures/zoo/compiled_train.py``, one torchrun launch of 2 ranks over gloo):

* ``vit``: ViT under DDP with each layer's MLP compiled, bf16 autocast (the job that aborted every
  rank at level ops, issue 41), at levels metrics, boundaries and ops;
* ``llama``: Llama with each decoder layer compiled, then sharded per layer and root (FSDP2), at
  every level, in float32;
* ``gpt2``: GPT-2 compiled in place (``model.compile()``) under DDP with a compiled AdamW step, at
  level ops, in float32.

Inductor's cache: the first pair, ``vit`` at ops (``COLD``), compiles in a folder of this
launch's own, so its run ``a`` compiles every graph cold (under capture) and ``b`` loads them:
one identical pair of a cold and a warm compile on every run of the suite. Every later job uses
a folder kept between runs of the suite (``tests/cached.py``; Inductor keys its entries by the
graph, its options and the versions, so what is found is what would have been compiled), seeded
with the first pair's entries: cold-vs-warm is not their point, and a rerun of the suite on one
machine compiles nothing again (``DETFP_TEST_CACHE`` set to a fresh folder makes it). Scenarios
and their expected answers:

* ``identical``: two identical runs -> ``identical``; ``onoff``: losses and final parameters
  bitwise equal with capture on and off; ``clean``: capture never failed (no ``capture_error``),
  and at level ops the kernels Inductor generated are recorded (kind ``kernel``), in the forward,
  the backward and (``gpt2``) the compiled optimizer step;
* ``order`` (ops): the split-K custom op inside layer 0's compiled MLP sums its chunks in reverse
  on rank 1 from step 1 -> rank 1 ``origin`` at that op, rank 0 identical or a receiver,
  ``single_rank`` (at boundaries the region's bf16 output rounds the difference away: nothing to
  find there);
* ``simd``: rank 1 compiles layer 0's MLP with ``cpp.simdlen=1`` -> at ops, rank 1 ``origin`` at a
  ``kernel`` of that region (a backward reduction), named with the ATen ops it fused, at step 0;
  at boundaries, the region's bias gradient entering DDP's reduction on rank 1 (whose producer
  that level does not see: recapture at ops), rank 0 a receiver.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import polars as pl
import pytest

from detfp_analyze.io.reader import open_run
from tests import cached
from tests.fixtures.zoo.harness import ZOO, check_identical, check_onoff, expect, launch, pair, run_checks

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(1500)]

SCRIPT = ZOO / "compiled_train.py"
STEPS = 2
PLANT = 1
#: The region the plants go into.
REGION = "vit.layers.0.mlp"
#: member -> (job options, {level: scenarios}).
MEMBERS: dict[str, tuple[dict[str, Any], dict[str, tuple[str, ...]]]] = {
    "vit": (
        {"model": "vit"},
        {
            "ops": ("identical", "onoff", "clean", "order", "simd"),
            "metrics": ("identical", "onoff", "clean"),
            "boundaries": ("identical", "onoff", "clean", "simd"),
        },
    ),
    "llama": (
        {"model": "llama"},
        {lvl: ("identical", "onoff", "clean") for lvl in ("metrics", "boundaries", "ops")},
    ),
    "gpt2": ({"model": "gpt2"}, {"ops": ("identical", "onoff", "clean")}),
}
#: The pair compiled cold and warm in the launch's own Inductor cache: (member, level).
COLD = ("vit", "ops")
#: Jobs a scenario needs besides the pair ``a``/``b``.
_PLANTS = {"order": {"plant": "order", "plant_rank": 1}, "simd": {"plant": "simd", "plant_rank": 1}}


def _job(root: Path, member: str, base: dict[str, Any], lvl: str, name: str, **kw: Any) -> dict[str, Any]:
    out = str(root / member / lvl / name)
    return {**base, "name": f"{member}.{lvl}.{name}", "out": out, "level": lvl, **kw}


def plan(root: Path, kept: Path) -> list[dict[str, Any]]:
    """Every job: the ``COLD`` pair first, in the launch's Inductor cache (``root/inductor``); then
    per member its run ``a`` of its first level, the run without capture and the rest, in the
    kept cache ``kept``, which the first of them seeds with the launch's."""
    jobs = []
    for member, (opts, levels) in MEMBERS.items():
        base = {**opts, "steps": STEPS, "plant_step": PLANT}
        mine = []
        for lvl, scenarios in levels.items():
            mine += [_job(root, member, base, lvl, "a"), _job(root, member, base, lvl, "b")]
            mine += [_job(root, member, base, lvl, s, **_PLANTS[s]) for s in scenarios if s in _PLANTS]
        jobs += [mine[0], {**base, "name": f"{member}.off"}, *mine[1:]]
    cold = [j for j in jobs if j["name"] in (f"{COLD[0]}.{COLD[1]}.a", f"{COLD[0]}.{COLD[1]}.b")]
    rest = [{**j, "inductor_cache": str(kept)} for j in jobs if j not in cold]
    rest[0]["inductor_seed"] = str(root / "inductor")
    return [*cold, *rest]


@pytest.fixture(scope="module")
def zoo(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("zoo_compiled")
    # Inductor's cache of this launch alone for the COLD pair: whatever ran before on this
    # machine, its run a compiles cold and its run b loads, the same on every run of the suite.
    (root / "inductor").mkdir()
    env = {"TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"), "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    launch(SCRIPT, plan(root, cached.folder("inductor")), root, "all", env=env, timeout=1400)
    return root


def _identical(root: Path, member: str, lvl: str) -> None:
    check_identical(root / member / lvl / "a", root / member / lvl / "b")


def _onoff(root: Path, member: str, lvl: str) -> None:
    check_onoff(root, f"{member}.off", [f"{member}.{lvl}.a", f"{member}.{lvl}.b"], [0, 1])


def _clean(root: Path, member: str, lvl: str) -> None:
    for name in ("a", "b"):
        run = open_run(root / member / lvl / name)
        ev = pl.read_parquet(run.files("events"), hive_partitioning=False)
        bad = ev.filter(pl.col("type").is_in(["capture_error", "capture_disabled"]))
        expect(bad.height == 0, f"{member} {lvl} {name}: capture failed: {bad.rows()}")
        if lvl != "ops":
            continue
        rec = pl.read_parquet(run.files("records"), hive_partitioning=False)
        kernels = rec.filter(pl.col("kind") == "kernel")
        phases = set(kernels["phase"])
        want = {"forward", "backward"} | ({"optimizer"} if member == "gpt2" else set())
        expect(want <= phases, f"{member} {name}: kernel records in {sorted(phases)}, expected {sorted(want)}")
        expect(set(kernels["rank"]) == {0, 1}, f"{member} {name}: kernel records on ranks {set(kernels['rank'])}")
        expect((kernels["status"] == "ok").all(), f"{member} {name}: undigested kernel records")


def _order(root: Path, member: str, lvl: str) -> None:
    res = pair(root / member / lvl / "a", root / member / lvl / "order")
    d = res.diagnosis
    expect(d.pattern == "single_rank" and d.origin_ranks == (1,), "order: single_rank on rank 1", res)
    r1 = res.rank(1).effective
    expect(r1 is not None and (r1.verdict, r1.step, r1.module) == ("origin", PLANT, REGION), "order: rank 1", res)
    expect(r1 is not None and r1.op == "detfp_zoo::split_k_mm.default", "order: the custom op inside", res)
    r0 = res.rank(0)
    expect(r0.status == "identical" or r0.verdict == "receiver", "order: rank 0 identical or a receiver", res)


def _simd(root: Path, member: str, lvl: str) -> None:
    res = pair(root / member / lvl / "a", root / member / lvl / "simd")
    d = res.diagnosis
    r1 = res.rank(1).effective
    if lvl != "ops":
        # The region's reduction of a bias gradient differs; below level ops its first trace is
        # that gradient entering DDP's reduction on rank 1, whose producer the level does not see.
        expect(
            r1 is not None and (r1.verdict, r1.kind, r1.step) == ("unobserved_producer", "reduced_grad", 0),
            "simd: rank 1",
            res,
        )
        expect(r1 is not None and r1.op.startswith(f"{REGION}._orig_mod."), "simd: a parameter of the region", res)
        expect(
            res.rank(0).verdict == "receiver" and "level ops" in " ".join(d.next_steps), "simd: recapture at ops", res
        )
        return
    expect(d.pattern == "single_rank" and d.origin_ranks == (1,), "simd: single_rank on rank 1", res)
    expect(r1 is not None and (r1.verdict, r1.step, r1.module) == ("origin", 0, REGION), "simd: rank 1", res)
    assert r1 is not None
    # A kernel the region really ran on rank 1 in run A, named with the ATen ops it fused.
    rec = pl.read_parquet(open_run(root / member / lvl / "a").files("records"), hive_partitioning=False)
    ran = set(rec.filter((pl.col("rank") == 1) & (pl.col("kind") == "kernel") & (pl.col("module") == REGION))["name"])
    expect(
        r1.kind == "kernel" and r1.op in ran and r1.op.startswith("cpp_fused_") and bool(r1.fused),
        "simd: a kernel",
        res,
    )
    head = f"Only rank 1 starts the difference, at kernel {r1.op} (torch.compile, fusing aten {', '.join(r1.fused)}) in {REGION}"
    expect(d.headline.startswith(head), f"simd: headline {head!r}", res)


CHECKS: dict[str, Callable[[Path, str, str], None]] = {
    "identical": _identical,
    "onoff": _onoff,
    "clean": _clean,
    "order": _order,
    "simd": _simd,
}

_CASES = [(m, lvl) for m, (_, levels) in MEMBERS.items() for lvl in levels]


@pytest.mark.parametrize("member,level", _CASES, ids=[f"{m}-{lvl}" for m, lvl in _CASES])
def test_zoo_compiled(zoo, member, level):
    """Every scenario of one member at one level; all failures reported together."""
    run_checks(CHECKS, MEMBERS[member][1][level], zoo, member, level)
