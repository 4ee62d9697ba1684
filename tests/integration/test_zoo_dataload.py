"""The zoo's data-pipeline member: Hugging Face ``Trainer`` with DataLoader workers, two ranks, no detfp code.

``tests/fixtures/zoo/trainer_train.py --workers 2`` under ``python -m detfp_capture`` on each of two
ranks (DDP over gloo, set up by accelerate), every run of the member in one launch
(``launch_many.py``). The main process receives each batch a worker delivers whenever it arrives
(unpickling it, rebuilding its tensors over shared memory with ``empty`` + ``set_``), so at level
ops those ops fell into whichever step the workers' timing put them in: identical pairs were
``structural`` at ``aten::empty.memory_format`` in 4 runs in 9.

Scenarios, each with its exact answer:

* ``identical`` at ops, repeated: run ``a`` against five more identical runs, three of which slow
  worker 0 down (20, 50 and 100 ms per sample: the same batches, delivered at other steps and in
  another order); every pair must be ``identical``. On e3ea1c8 each slowed pair fails every time
  and an unslowed one about once in three (so the repeats alone would catch it about nine times
  in ten, the slowed ones always);
* ``identical`` at boundaries, and ``onoff`` at both levels (capture on vs off: rank 0's losses
  and the final parameters bitwise equal);
* ``kernel``: the split-K order of ``transformer.h.0.mlp.c_fc`` reversed on rank 1 from step 1 ->
  rank 1 ``origin`` there, rank 0 a ``receiver`` of DDP's gradient reduction, ``single_rank`` [1];
* ``data``: one token of rank 1's batch of step 1 changed (built in a worker) -> rank 1 ``source``
  (the batch: at ops as the DataLoader delivered it, before Trainer's ops read it, in step 0,
  where accelerate's loader fetches it, one batch ahead; at boundaries where the model takes it),
  rank 0 a ``receiver``, cause ``data``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.fixtures.zoo.harness import (
    ZOO,
    check_identical,
    check_one_rank_data,
    check_one_rank_kernel,
    expect,
    launch_runs,
    run_checks,
)

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(900)]

SCRIPT = str(ZOO / "trainer_train.py")
LEVELS = ("boundaries", "ops")
PLANT = 1
BASE = ["--workers", "2", "--steps", "2"]
#: The identical runs compared with ``a`` at level ops: name -> worker 0's delay per sample (s).
REPEATS = {"r1": 0.05, "r2": 0.0, "r3": 0.02, "r4": 0.0, "r5": 0.1}
PLANTS = {"kernel": ["--order", "rev", "--order-rank", "1"], "data": ["--data-step", "1", "--data-rank", "1"]}
ORIGIN = {
    "boundaries": ("transformer.h.0.mlp.c_fc", "module_output", "Conv1D"),
    "ops": ("transformer.h.0.mlp.c_fc", "op", "plain_zoo::split_k_mm.default"),
}


@pytest.fixture(scope="module")
def zoo(tmp_path_factory) -> Path:
    pytest.importorskip("transformers", reason="the zoo needs the development install (requirements-dev.txt)")
    root = tmp_path_factory.mktemp("zoo_dataload")
    runs = {"off": ["--", SCRIPT, str(root / "off.json"), *BASE]}
    for lvl in LEVELS:
        names: dict[str, list[str]] = {"a": [], **PLANTS}
        names.update(
            {name: ["--slow-worker", str(s)] if s else [] for name, s in REPEATS.items()} if lvl == "ops" else {"b": []}
        )
        for name, extra in names.items():
            out = root / lvl / name
            runs[f"{lvl}.{name}"] = ["--out", str(out), "--level", lvl, "--", SCRIPT, f"{out}.json", *BASE, *extra]
    launch_runs(root, runs)
    return root


def _identical(root: Path, lvl: str) -> None:
    others = list(REPEATS) if lvl == "ops" else ["b"]
    failures = []
    for name in others:
        try:
            check_identical(root / lvl / "a", root / lvl / name)
        except AssertionError as exc:
            failures.append(f"a vs {name} (worker 0 delayed {REPEATS.get(name, 0)} s): {exc}")
    assert not failures, "\n".join(failures)


def _onoff(root: Path, lvl: str) -> None:
    want = json.loads((root / "off.json").read_text())
    assert len(want["losses"]) == 2
    for name in ("a", *(REPEATS if lvl == "ops" else ["b"])):
        got = json.loads((root / lvl / f"{name}.json").read_text())
        expect(got == want, f"capture on ({lvl}/{name}) vs off: {got} != {want}")


def _kernel(root: Path, lvl: str) -> None:
    check_one_rank_kernel(root / lvl / "a", root / lvl / "kernel", PLANT, ORIGIN[lvl])


def _data(root: Path, lvl: str) -> None:
    # At ops the batch as the loader delivered it is the first record of the data: accelerate's
    # data loader fetches one batch ahead, so step 1's batch is received during step 0.
    if lvl == "ops":
        step, batch, what = PLANT - 1, "DataLoader", "a DataLoader delivered"
    else:
        step, batch, what = PLANT, "GPT2LMHeadModel", "fed to GPT2LMHeadModel"
    check_one_rank_data(root / lvl / "a", root / lvl / "data", step, batch, what, PLANT)


CHECKS: dict[str, Callable[[Path, str], None]] = {
    "identical": _identical,
    "onoff": _onoff,
    "kernel": _kernel,
    "data": _data,
}


@pytest.mark.parametrize("level", LEVELS)
def test_zoo_trainer_with_dataloader_workers(zoo, level):
    """Every scenario at one level; all failures reported together."""
    run_checks(CHECKS, CHECKS, zoo, level)
