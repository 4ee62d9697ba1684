"""The commands a report prints after a bisect: exact, quoted, and right for how the run was captured."""

from __future__ import annotations

from pathlib import Path

from detfp_analyze.bisect import bisect
from detfp_analyze.io.reader import open_run
from detfp_analyze.render.recipes import recipes

SAMPLES = Path(__file__).parent.parent.parent / "sample_traces"
OPS = (str(SAMPLES / "ops" / "a"), str(SAMPLES / "ops" / "b"))


def _manifests(run, command, level="boundaries"):
    return {r: {**run.manifest(r), "command": command, "capture": {"level": level}} for r in run.ranks}


def test_launcher_runs_get_the_launcher_command_rewritten():
    res = bisect(*OPS)
    run = open_run(OPS[0])
    cmd = ["/x/detfp_capture/__main__.py", "--out", "t a", "--level", "boundaries", "--start-step", "4", "--",
           "train.py", "--lr", "0.1"]  # fmt: skip
    got = {r.title: r for r in recipes(res, _manifests(run, cmd), _manifests(run, cmd))}
    a = got["recapture step 1 of run A at level ops"]
    assert a.command == (
        f"torchrun --standalone --nproc_per_node 2 -m detfp_capture --out {OPS[0]}-step1-ops --level ops --steps 1 "
        "--kernels 1 --start-step 4 -- train.py --lr 0.1"
    )
    assert list(got)[:4] == [
        "reproduce this comparison",
        "narrow step 1 down to the kernel",
        "draw the pictures",
        "open step 1 as a timeline in the Perfetto UI",
    ]
    assert got["narrow step 1 down to the kernel"].command.endswith("--steps 1 --ranks 0-1 --depth kernel")


def test_session_scripts_get_their_command_and_the_session_arguments():
    res = bisect(*OPS)
    run = open_run(OPS[0])
    got = recipes(res, _manifests(run, ["train.py", "--out", "my dir"], level="ops"))
    rec = next(r for r in got if r.title.startswith("recapture step 1 of run A"))
    assert rec.title == "recapture step 1 of run A at level ops with kernel identities"
    assert rec.command == "torchrun --standalone --nproc_per_node 2 train.py --out 'my dir'"
    assert 'Session("' in rec.note and 'level="ops", steps="1", kernels="1"' in rec.note
    assert not any(r.title.endswith("of run B at level ops with kernel identities") for r in got)  # no manifests for B


def test_identical_runs_only_reproduce(tmp_path):
    import shutil

    res = bisect(OPS[0], shutil.copytree(OPS[0], tmp_path / "a"))
    assert [r.title for r in recipes(res)] == ["reproduce this comparison"]
