"""The zoo's accelerate member: ``accelerate launch --multi_gpu --num_processes 2`` over capture's launcher.

``tests/fixtures/zoo/accel_train.py``: an ``Accelerator(cpu=True, gradient_accumulation_steps=2)``
loop (accelerate's DDP over gloo, its prepared optimizer stepping once per accumulation, its
sharded data loader), no detfp code. Every run starts under one ``accelerate launch``, which
starts the ranks through torchrun; each rank runs every run in turn through the launcher's
``main`` (``launch_many.py``: what ``python -m detfp_capture`` runs), so accelerate's environment is
what the launcher sees. Without ``use_deterministic_algorithms``.

Scenarios, at levels boundaries and ops: ``identical`` and ``onoff`` (capture on vs off, losses
of every micro-batch and parameters bitwise equal); ``kernel``: the split-K order of ``proj``
reversed on rank 1 from step 1 -> rank 1 ``origin`` there, rank 0 a ``receiver`` of DDP's
gradient reduction, ``single_rank`` [1]; ``data``: one token of rank 1's first micro-batch of
step 1 changed -> rank 1 ``source`` (the batch), rank 0 a ``receiver``, cause ``data``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.fixtures.zoo.harness import (
    ZOO,
    check_identical,
    check_one_rank_data,
    check_one_rank_kernel,
    check_onoff,
    expect,
    launch_runs,
    run_checks,
)

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(900)]

SCRIPT = str(ZOO / "accel_train.py")
LEVELS = ("boundaries", "ops")
PLANT = 1
#: Where rank 1 starts the kernel plant: level -> (module, kind, op).
ORIGIN = {
    "boundaries": ("proj", "module_output", "SplitLinear"),
    "ops": ("proj", "op", "detfp_zoo::split_k_mm.default"),
}
PLANTS = {"a": [], "b": [], "kernel": ["--order", "rev", "--order-rank", "1"], "data": ["--data-rank", "1"]}


@pytest.fixture(scope="module")
def zoo(tmp_path_factory) -> Path:
    pytest.importorskip("accelerate", reason="the zoo needs the development install (requirements-dev.txt)")
    root = tmp_path_factory.mktemp("zoo_accelerate")
    results = str(root / "results")
    runs = {"off": ["--", SCRIPT, results, "off"]}
    for lvl in LEVELS:
        for name, extra in PLANTS.items():
            out = str(root / lvl / name)
            runs[f"{lvl}.{name}"] = ["--out", out, "--level", lvl, "--", SCRIPT, results, f"{lvl}.{name}", *extra]
    launch_runs(root, runs, accelerate=True)
    return root


def _identical(root: Path, lvl: str) -> None:
    check_identical(root / lvl / "a", root / lvl / "b")


def _onoff(root: Path, lvl: str) -> None:
    check_onoff(root, "off", [f"{lvl}.a", f"{lvl}.b"], [0, 1])


def _kernel(root: Path, lvl: str) -> None:
    res = check_one_rank_kernel(root / lvl / "a", root / lvl / "kernel", PLANT, ORIGIN[lvl])
    d = res.diagnosis
    expect(d.headline.startswith("Only rank 1 starts the difference, at "), "kernel: first sentence", res)


def _data(root: Path, lvl: str) -> None:
    check_one_rank_data(root / lvl / "a", root / lvl / "data", PLANT, "TokenNet", "fed to TokenNet", PLANT)


CHECKS: dict[str, Callable[[Path, str], None]] = {
    "identical": _identical,
    "onoff": _onoff,
    "kernel": _kernel,
    "data": _data,
}


@pytest.mark.parametrize("level", LEVELS)
def test_zoo_accelerate(zoo, level):
    """Every scenario at one level; all failures reported together."""
    run_checks(CHECKS, CHECKS, zoo, level)
