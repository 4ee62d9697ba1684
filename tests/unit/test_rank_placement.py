"""Which rank a process writes as (``detfp_capture/_placement.py``) and the processes the launcher
follows or refuses (``detfp_capture/_launch/children.py``), one mechanism at a time; the zoo runs
them end to end (``tests/integration/test_zoo_lightning.py``).

The process group is stood in for by patching ``_placement.group_place`` (what capture reads of
``torch.distributed``): a two-rank group needs two processes, which the zoo has. Each test fails
on the code before issue 28's fix: the manifest kept the world size of the environment at open
(a manifest that disagreed with its own groups), a launcher process opened its trace as rank 0
whatever its process group said, and processes started by ``torch.multiprocessing`` went
uncaptured without a word.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from detfp_capture import Session
from detfp_capture import _placement as placement
from detfp_capture._launch.children import Children
from detfp_capture._launch.cli import build_parser, followed_options
from detfp_capture._launch.cli import main as launcher_main
from detfp_format import commitlog

STEP = """
import torch
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model(torch.randn(2, 4)).sum().backward()
opt.step()
"""


@pytest.fixture
def no_rank_env(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)


def _manifest(run: Path, rank: int) -> dict:
    return json.loads((run / "manifest" / f"rank={rank}" / "segment-00000.json").read_text())


def _launch(tmp_path: Path, *options: str, script: str = STEP) -> int:
    path = tmp_path / "train.py"
    path.write_text(script)
    argv = sys.argv
    try:
        return launcher_main(["--out", str(tmp_path / "run"), "--level", "boundaries", *options, "--", str(path)])
    finally:
        sys.argv = argv


def test_a_session_opened_before_its_process_group_learns_the_world_size(tmp_path, no_rank_env, monkeypatch):
    s = Session(tmp_path / "run", "metrics")
    assert _manifest(tmp_path / "run", 0)["world_size"] == 1  # all the environment said
    monkeypatch.setattr(placement, "group_place", lambda: (0, 2))  # the script creates its group
    with s.step(0):
        pass
    s.close()
    assert (s.rank, s.world_size) == (0, 2)
    assert _manifest(tmp_path / "run", 0)["world_size"] == 2


def test_a_process_group_that_names_another_rank_stops_capture(tmp_path, no_rank_env, monkeypatch):
    s = Session(tmp_path / "run", "metrics")
    monkeypatch.setattr(placement, "group_place", lambda: (1, 2))
    with pytest.warns(RuntimeWarning, match="opened its trace as rank 0 of 1 before its process group"), s.step(0):
        s.metric("loss", 1.0)
    s.close()
    log = commitlog.parse((tmp_path / "run" / commitlog.commit_log_relpath(0, 0)).read_bytes())
    assert log.close is not None and log.close[1] == "incomplete" and "says rank 1 of 2" in log.close[2]
    assert not (tmp_path / "run" / "metrics").exists()  # nothing filed under another rank's part


def test_the_launcher_takes_its_rank_from_the_process_group(tmp_path, no_rank_env, monkeypatch):
    """A launcher process no RANK names opens its part when its first step begins, as the rank
    its process group gives (a framework chose it); the manifest agrees with the group."""
    monkeypatch.setattr(placement, "group_place", lambda: (1, 2))
    assert _launch(tmp_path, "--followed") == 0
    assert not (tmp_path / "run" / "manifest" / "rank=0").exists()
    m = _manifest(tmp_path / "run", 1)
    assert (m["rank"], m["world_size"]) == (1, 2)


def test_a_followed_process_without_a_process_group_captures_nothing(tmp_path, no_rank_env):
    with pytest.warns(RuntimeWarning, match="its rank is unknown"):
        assert _launch(tmp_path, "--followed") == 0  # the script runs on, uncaptured
    assert not (tmp_path / "run" / "manifest").exists()


def test_a_group_the_launcher_started_no_rank_of_is_said_at_capture_time(tmp_path, no_rank_env, monkeypatch):
    monkeypatch.setattr(placement, "group_place", lambda: (0, 2))
    with pytest.warns(RuntimeWarning, match="as rank 0 of 2, and the launcher started no other rank"):
        assert _launch(tmp_path) == 0
    assert _manifest(tmp_path / "run", 0)["world_size"] == 2


def test_a_single_process_launch_is_rank_0_of_1(tmp_path, no_rank_env):
    assert _launch(tmp_path) == 0
    m = _manifest(tmp_path / "run", 0)
    assert (m["rank"], m["world_size"]) == (0, 1)
    assert _launch(tmp_path) == 2  # the directory holds a run now: refused before the script runs


SPAWNS = """
import torch.multiprocessing as mp

def work(i):
    pass

mp.spawn(work, nprocs=2)
"""


def test_ranks_started_by_torch_multiprocessing_are_refused_in_one_line(tmp_path, no_rank_env, capsys):
    assert _launch(tmp_path, script=SPAWNS) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        "detfp_capture: error: the script starts its ranks with torch.multiprocessing"
    )
    assert "torchrun --nproc_per_node N -m detfp_capture" in err[0]
    assert torch.multiprocessing.spawn.__module__ == "torch.multiprocessing.spawn"  # put back
    assert not (tmp_path / "run" / "manifest").exists()


def test_only_a_reexecution_of_the_script_is_followed(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    ns = build_parser().parse_args(["--out", "rel/out", "--level", "ops", "--steps", "1-2", "--overwrite"])
    opts = followed_options(ns)
    c = Children(opts, [str(script), "x"], lambda: None)
    py = sys.executable
    assert c.command([py, str(script), "--lr", "1"]) == [
        py,
        "-m",
        "detfp_capture",
        *opts,
        "--",
        str(script),
        "--lr",
        "1",
    ]
    for other in ([py, str(tmp_path / "other.py")], ["git", str(script)], [py, "-c", "pass"], f"{py} {script}", [py]):
        assert c.command(other) is None, other
    m = Children(opts, ["-m", "pkg.train"], lambda: None)
    assert m.command([py, "-m", "pkg.train", "--x"])[-4:] == ["--", "-m", "pkg.train", "--x"]
    assert m.command([py, "-m", "pkg.other"]) is None


def test_a_followed_process_gets_every_option_of_its_launch():
    parser = build_parser()
    argv = ["--out", "o", "--level", "ops", "--start-step", "3", "--steps", "3-5", "--ranks", "1", "--modules", "fc"]
    argv += [
        "--rows",
        "4",
        "--moments",
        "all",
        "--dumps",
        "fc",
        "--kernels",
        "4",
        "--poison",
        "--append",
        "--overwrite",
    ]
    argv += ["--flush-records", "99", "--flush-steps", "7", "--views", "--digest-version", "1"]
    ns = parser.parse_args(argv)
    back = parser.parse_args(followed_options(ns))
    assert vars(back) == {**vars(ns), "out": os.path.abspath("o"), "followed": True}
    # Every option of the parser is forwarded (a new one must be added to followed_options).
    assert {a.dest for a in parser._actions if a.dest != "help"} <= set(vars(back))
    assert all(getattr(back, a.dest) != a.default for a in parser._actions if a.dest != "help")


CHILD = """
import os, subprocess, sys
if len(sys.argv) > 1:
    with open(sys.argv[1], "w") as f:
        f.write(repr((sys.argv[2:], "detfp_capture" in sys.modules)))
    sys.exit(0)
subprocess.run([sys.executable, os.path.abspath(sys.argv[0]), sys.argv[0] + ".child", "--x"], check=True)
"""


def test_the_launcher_runs_a_reexecuted_script_through_itself(tmp_path, no_rank_env):
    """The script starts itself again (as Lightning's DDP launcher does): that process runs under
    the launcher, followed; neither it (no process group) nor the parent (no step, it only
    started a process) writes a trace part under a guessed rank."""
    script = tmp_path / "train.py"
    script.write_text(CHILD)
    run = subprocess.run(
        [sys.executable, "-m", "detfp_capture", "--out", str(tmp_path / "run"), "--", str(script)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    argv, captured = eval((tmp_path / "train.py.child").read_text())  # our own repr
    assert argv == ["--x"] and captured
    assert not (tmp_path / "run" / "manifest").exists()
