"""The zoo's scripts with no detfp code under the launcher: a plain loop
(``tests/fixtures/zoo/plain_train.py``) and a Hugging Face ``Trainer`` (``tests/fixtures/zoo/trainer_train.py``).

``python -m detfp_capture --out DIR --level L -- SCRIPT ...``, single process at every level
and as two DDP ranks, with the zoo's scenarios (see ``tests/integration/test_zoo.py``): identical pair,
capture on vs off, a nondeterministic op, a changed sample, a resume without and with the RNG
state. The single-process runs call the launcher's ``main`` in this process (the same code
path as ``python -m detfp_capture``, without a torch import per run); the two-rank runs are
one process per rank with the environment torchrun sets, each running every run of the test
in turn (``tests/fixtures/zoo/launch_many.py``). ``tests/integration/test_launcher.py`` starts
``python -m detfp_capture`` itself as a process. Also: the steps are the optimizer steps the
script ran, step 0's RNG state follows the script's own seeding, and the determinism settings
are those the script set.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import polars as pl
import pytest
import torch
from typer.testing import CliRunner

from detfp_analyze.bisect import bisect
from detfp_analyze.cli import app
from detfp_analyze.io.envdiff import env_diff
from detfp_analyze.io.reader import open_run
from detfp_analyze.single.certify import certify
from detfp_capture._launch.cli import main as launcher_main
from tests.fixtures.zoo.harness import free_ports

ROOT = Path(__file__).resolve().parents[2]
PLAIN = str(ROOT / "tests" / "fixtures" / "zoo" / "plain_train.py")
TRAINER = str(ROOT / "tests" / "fixtures" / "zoo" / "trainer_train.py")
LEVELS = ("metrics", "boundaries", "ops")


def _in_process(out: Path, level: str, res: Path, *script_args: str, start: int = 0, script: str = PLAIN) -> None:
    """One launcher run in this process; the torch state the script changes is put back."""
    saved = (sys.argv, torch.get_num_threads(), torch.are_deterministic_algorithms_enabled(), torch.get_rng_state())
    try:
        code = launcher_main(
            ["--out", str(out), "--level", level, "--start-step", str(start), "--", script, str(res), *script_args]
        )
    finally:
        sys.argv = saved[0]
        torch.set_num_threads(saved[1])
        torch.use_deterministic_algorithms(saved[2])
        torch.set_rng_state(saved[3])
    assert code == 0


def _plain(res: Path, *script_args: str, script: str = PLAIN) -> None:
    saved = (sys.argv, torch.get_rng_state(), torch.get_num_threads())
    import runpy

    # The script's directory first on sys.path, as `python script.py` (and the launcher) put it:
    # trainer_train.py imports plain_train from there. Without it the import only worked when a
    # launcher run earlier in this process had left the directory on sys.path.
    here = os.path.dirname(os.path.abspath(script))
    try:
        sys.argv = [script, str(res), *script_args]
        sys.path.insert(0, here)
        runpy.run_path(script, run_name="__main__")
    finally:
        sys.path.remove(here)
        sys.argv = saved[0]
        torch.set_rng_state(saved[1])
        torch.set_num_threads(saved[2])


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("plain")
    _plain(root / "off.json")
    for lvl in LEVELS:
        d = root / lvl
        ck = str(d / "ckpt")
        _in_process(d / "a", lvl, d / "a.json", "--save", ck)
        _in_process(d / "b", lvl, d / "b.json")
        _in_process(d / "nondet", lvl, d / "nondet.json", "--order", "rev")
        _in_process(d / "data", lvl, d / "data.json", "--data-rank", "0")
        _in_process(d / "resume_norng", lvl, d / "rn.json", "--resume", ck, "--no-rng", start=1)
        _in_process(d / "resume_rng", lvl, d / "rr.json", "--resume", ck, start=1)
    return root


def _runs(d: Path, a: str, b: str) -> Any:
    return bisect(open_run(d / a), open_run(d / b))


@pytest.mark.parametrize("level", LEVELS)
def test_plain_script_under_the_launcher(single, level):
    d = single / level
    off = json.loads((single / "off.json").read_text())
    for run in ("a", "b"):
        assert json.loads((d / f"{run}.json").read_text()) == off, "capture changed the script's numbers"
    res = _runs(d, "a", "b")
    assert res.status == "identical", res
    # The steps are the three optimizer steps the script ran (no trailing step).
    assert open_run(d / "a").scan("records").select(pl.col("step").unique().sort()).collect()["step"].to_list() == [
        0,
        1,
        2,
    ]
    res = _runs(d, "a", "nondet")
    f = res.rank(0).effective
    assert (res.first_step, res.diagnosis.pattern, f.verdict) == (1, "single_process", "origin")
    if level == "ops":
        assert f.op == "plain_zoo::split_k_mm.default" and f.module == ""
    res = _runs(d, "a", "data")
    f = res.rank(0).effective
    assert (f.verdict, f.kind, f.step, res.diagnosis.pattern) == ("source", "batch", 1, "single_process")
    f = _runs(d, "a", "resume_norng").rank(0).effective
    assert (f.verdict, f.kind, f.step) == ("source", "rng_state", 1)
    assert _runs(d, "a", "resume_rng").status == "identical"


@pytest.fixture(scope="module")
def trainer(tmp_path_factory) -> Path:
    """The Hugging Face ``Trainer`` script's runs: per level a (saving a checkpoint per step),
    b, the planted op, the changed batch, and the resumes from a's first checkpoint."""
    pytest.importorskip("transformers", reason="the zoo needs the development install (requirements-dev.txt)")
    root = tmp_path_factory.mktemp("trainer")
    _plain(root / "off.json", script=TRAINER)
    for lvl in LEVELS:
        d = root / lvl
        ck = d / "ckpt"
        for run, extra, start in (
            ("a", ("--save", str(ck)), 0),
            ("b", (), 0),
            ("nondet", ("--order", "rev"), 0),
            ("data", ("--data-step", "1"), 0),
            ("resume_norng", ("--resume", str(ck / "checkpoint-1"), "--no-rng"), 1),
            ("resume_rng", ("--resume", str(ck / "checkpoint-1")), 1),
        ):
            _in_process(d / run, lvl, d / f"{run}.json", *extra, start=start, script=TRAINER)
    return root


@pytest.mark.parametrize("level", LEVELS)
def test_trainer_script_under_the_launcher(trainer, level):
    """A high-level loop (``Trainer.train()``: its dataloader, ``model(**batch)``, clipping,
    fused AdamW, schedule and checkpoints), no detfp code."""
    d = trainer / level
    off = json.loads((trainer / "off.json").read_text())
    assert len(off["losses"]) == 3
    for run in ("a", "b"):
        assert json.loads((d / f"{run}.json").read_text()) == off, "capture changed the script's numbers"
    res = _runs(d, "a", "b")
    assert res.status == "identical", res
    res = _runs(d, "a", "nondet")
    f = res.rank(0).effective
    assert (res.first_step, res.diagnosis.pattern, f.verdict) == (1, "single_process", "origin")
    if level == "ops":
        assert (f.op, f.module) == ("plain_zoo::split_k_mm.default", "transformer.h.0.mlp.c_fc")
    if level == "boundaries":
        assert (f.kind, f.module) == ("module_output", "transformer.h.0.mlp.c_fc")
    # The batch goes in as keyword arguments (``model(**batch)``): still the root's batch.
    f = _runs(d, "a", "data").rank(0).effective
    assert (f.verdict, f.kind, f.step, f.op) == ("source", "batch", 1, "GPT2LMHeadModel")
    f = _runs(d, "a", "resume_norng").rank(0).effective
    assert (f.verdict, f.kind, f.step) == ("source", "rng_state", 1)
    assert json.loads((d / "resume_rng.json").read_text())["params"] == off["params"]
    assert _runs(d, "a", "resume_rng").status == "identical"


def test_settings_are_the_scripts_own(tmp_path):
    """The manifest holds the determinism settings the script set (not those at launch)."""
    _in_process(tmp_path / "one", "metrics", tmp_path / "1.json", "--deterministic")
    _in_process(tmp_path / "two", "metrics", tmp_path / "2.json", "--deterministic", "--threads", "2")
    one, two = open_run(tmp_path / "one"), open_run(tmp_path / "two")
    assert one.manifest(0)["determinism"]["deterministic_algorithms"] is True
    keys = {d.key: (d.a, d.b) for d in env_diff(one, two)}
    assert keys["determinism.num_threads"] == (1, 2)
    assert not [p for p in certify(one).problems if p.kind == "determinism" and "algorithms" in p.detail]


def _ranks(root: Path, runs: dict[str, tuple[str, tuple]], level: str = "boundaries", world: int = 2) -> None:
    """Launcher runs ``{name: (script, script args)}`` on ``world`` ranks: one process per rank
    with the environment torchrun sets, each process running every run in turn
    (``tests/fixtures/zoo/launch_many.py``), so the imports are paid once per rank."""
    ports = free_ports(len(runs))
    spec = [
        {
            "port": port,
            "argv": ["--out", str(root / name), "--level", level, "--", script, str(root / f"{name}.json"), *extra],
        }
        for port, (name, (script, extra)) in zip(ports, runs.items(), strict=True)
    ]
    (root / "runs.json").write_text(json.dumps(spec))
    procs = []
    for rank in range(world):
        env = dict(os.environ, OMP_NUM_THREADS="1", RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
        env.update(LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1")
        cmd = [sys.executable, "-m", "tests.fixtures.zoo.launch_many", str(root / "runs.json")]  # cwd: ROOT
        procs.append(subprocess.Popen(cmd, env=env, cwd=ROOT, stderr=subprocess.PIPE, text=True))
    for p in procs:
        _, err = p.communicate(timeout=240)
        assert p.returncode == 0, err[-3000:]


@pytest.fixture(scope="module")
def ddp(tmp_path_factory) -> Path:
    """The two-rank runs of both scripts in one launch (one process per rank, the imports paid
    once): ``plain/{a,b,data}`` and ``trainer/{a,b,nondet,data}``. The plain script's runs come
    first: each destroys the process group it created, so the trainer's first run finds none,
    as in a fresh process (accelerate's group outlives a ``Trainer`` run)."""
    pytest.importorskip("transformers", reason="the zoo needs the development install (requirements-dev.txt)")
    root = tmp_path_factory.mktemp("ddp")
    (root / "plain").mkdir()
    (root / "trainer").mkdir()
    runs = {
        "plain/a": (PLAIN, ()),
        "plain/b": (PLAIN, ()),
        "plain/data": (PLAIN, ("--data-rank", "1")),
        "trainer/a": (TRAINER, ()),
        "trainer/b": (TRAINER, ()),
        "trainer/nondet": (TRAINER, ("--order", "rev")),
        "trainer/data": (TRAINER, ("--data-step", "1", "--data-rank", "1")),
    }
    _ranks(root, runs)
    return root


@pytest.mark.multirank
def test_plain_ddp_script_under_the_launcher(ddp):
    """Two DDP ranks, no detfp code: an identical pair is identical (the DDP reduction found at
    its first forward), and a changed sample on rank 1 is a source there, received on rank 0."""
    tmp_path = ddp / "plain"
    assert json.loads((tmp_path / "a.json").read_text()) == json.loads((tmp_path / "b.json").read_text())
    run_a = open_run(tmp_path / "a")
    assert run_a.scan("records").filter(pl.col("kind") == "reduced_grad").collect().height > 0
    assert bisect(run_a, open_run(tmp_path / "b")).status == "identical"
    res = bisect(run_a, open_run(tmp_path / "data"))
    assert (res.diagnosis.pattern, res.diagnosis.origin_ranks) == ("single_rank", (1,))
    assert (res.rank(1).effective.verdict, res.rank(1).effective.kind) == ("source", "batch")
    assert res.rank(0).effective.verdict == "receiver"
    # The same pair through the CLI a CI gate calls (in this process: the exit status of a real
    # process is test_example.py's and test_example_samples.py's).
    r = CliRunner().invoke(app, ["bisect", str(tmp_path / "a"), str(tmp_path / "b")])
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    assert r.exit_code == 0, r.stdout


@pytest.mark.multirank
def test_trainer_ddp_under_the_launcher(ddp):
    """``Trainer`` on two ranks (DDP over gloo, set up by accelerate), no detfp code: identical
    pair, the planted op on every rank, a changed batch on rank 1 only."""
    tmp_path = ddp / "trainer"
    assert json.loads((tmp_path / "a.json").read_text()) == json.loads((tmp_path / "b.json").read_text())
    run_a = open_run(tmp_path / "a")
    assert run_a.scan("records").filter(pl.col("kind") == "reduced_grad").collect().height > 0
    assert bisect(run_a, open_run(tmp_path / "b")).status == "identical"
    res = bisect(run_a, open_run(tmp_path / "nondet"))
    assert (res.first_step, res.diagnosis.pattern) == (1, "all_ranks_same_op")
    for r in (0, 1):
        f = res.rank(r).effective
        assert (f.verdict, f.kind, f.module) == ("origin", "module_output", "transformer.h.0.mlp.c_fc")
    res = bisect(run_a, open_run(tmp_path / "data"))
    assert (res.diagnosis.pattern, res.diagnosis.origin_ranks) == ("single_rank", (1,))
    assert (res.rank(1).effective.verdict, res.rank(1).effective.kind) == ("source", "batch")
    assert res.rank(0).effective.verdict == "receiver"
