"""``python -m detfp_capture ... -- train.py``: capture a script that knows nothing about detfp."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import polars as pl

from detfp_capture._launch.cli import main
from tests.fixtures.models import read

SCRIPT = textwrap.dedent(
    """
    import struct, sys
    import torch

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(4, 8)
            self.b = torch.nn.Linear(8, 1)

        def forward(self, x):
            return self.b(input=torch.tanh(self.a(x)))

    def main():
        steps, out = int(sys.argv[1]), sys.argv[2]
        torch.manual_seed(0)
        model = Tiny()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        bits = []
        for _ in range(steps):
            x = torch.randn(3, 4)
            loss = model(x=x).square().mean()  # the batch as keywords, as model(**batch) does
            loss.backward()
            opt.step()
            opt.zero_grad()
            bits.append(struct.unpack("<Q", struct.pack("<d", loss.item()))[0])
        with open(out, "w") as f:
            f.write(" ".join(map(str, bits)))

    if __name__ == "__main__":
        main()
    """
)


def _run_plain(script, out):
    import runpy

    saved = sys.argv
    sys.argv = [str(script), "3", str(out)]
    try:
        runpy.run_path(str(script), run_name="__main__")
    finally:
        sys.argv = saved


def test_launcher_end_to_end_in_process(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    _run_plain(script, tmp_path / "plain.txt")
    saved = sys.argv
    try:
        code = main(
            [
                "--out",
                str(tmp_path / "run"),
                "--level",
                "ops",
                "--start-step",
                "10",
                "--",
                str(script),
                "3",
                str(tmp_path / "cap.txt"),
            ]
        )
    finally:
        sys.argv = saved
    assert code == 0
    # No perturbation: the script's losses are bitwise equal with and without the launcher.
    assert (tmp_path / "cap.txt").read_text() == (tmp_path / "plain.txt").read_text()
    r = read(tmp_path / "run")
    # Steps counted by optimizer.step() from --start-step, each begun by its first forward: the
    # three steps the script ran, no trailing one.
    assert sorted(set(r["step"])) == [10, 11, 12]
    s11 = r.filter(pl.col("step") == 11)
    assert set(s11.filter(pl.col("kind").is_in(["module_input", "module_output"]))["module"]) == {"", "a", "b"}
    # Arguments passed by keyword are recorded, although torch's global hooks never see them.
    assert s11.filter(pl.col("kind") == "batch").select("name", "arg").rows() == [("Tiny", "kwargs.x")]
    b_in = s11.filter((pl.col("kind") == "module_input") & (pl.col("module") == "b") & (pl.col("phase") == "forward"))
    assert b_in["arg"].to_list() == ["kwargs.input"]
    opt = s11.filter(pl.col("phase") == "optimizer")
    assert {"a.weight", "b.bias"} <= set(opt.filter(pl.col("kind") == "param")["name"])
    assert "aten::tanh.default" in set(s11["name"])
    man = (tmp_path / "run/manifest/rank=0/segment-00000.json").read_text()
    assert '"start_step": 10' in man
    # Global hooks and patches are gone after the script: a plain run records nothing more.
    n = len(list((tmp_path / "run/records/rank=0").glob("*.parquet")))
    _run_plain(script, tmp_path / "again.txt")
    assert len(list((tmp_path / "run/records/rank=0").glob("*.parquet"))) == n


def test_launcher_usage_errors(tmp_path):
    # Subprocess: exit codes and one-line messages (fast: argparse fails before torch is imported).
    base = [sys.executable, "-m", "detfp_capture"]
    p = subprocess.run([*base, "--out", str(tmp_path / "x")], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "no training script" in p.stderr
    p = subprocess.run(
        [*base, "--out", str(tmp_path / "x"), "--level", "all", "--", "t.py"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 2 and "invalid choice" in p.stderr


CHECKPOINTED = textwrap.dedent(
    """
    import sys
    import torch
    from torch.utils.checkpoint import checkpoint

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.block = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8))
            self.head = torch.nn.Linear(8, 1)

        def forward(self, x):
            # The recompute stops early (after the block's last saved tensor): an exception that
            # unwinds through the block's submodules while their forward hooks are pending.
            return self.head(checkpoint(self.block, x, use_reentrant=False) * 2)

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(int(sys.argv[1])):
        model(x=torch.randn(3, 4)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    """
)


def test_launcher_keeps_the_module_stack_through_a_checkpoint_early_stop(tmp_path, recwarn):
    # torch calls the global always-call forward hooks without kwargs when a forward raises (the
    # checkpoint's early stop does, in every recompute): the hook must take both forms, or the
    # module stack stays unbalanced and every later step is recorded as one long recompute.
    script = tmp_path / "train.py"
    script.write_text(CHECKPOINTED)
    saved = sys.argv
    try:
        assert main(["--out", str(tmp_path / "run"), "--level", "boundaries", "--", str(script), "3"]) == 0
    finally:
        sys.argv = saved
    assert not [w for w in recwarn if "always_call" in str(w.message)]
    r = read(tmp_path / "run")
    for step in (0, 1, 2):
        s = r.filter(pl.col("step") == step)
        assert s.filter(pl.col("kind") == "batch").select("name", "arg").rows() == [("Net", "kwargs.x")], step
        fwd = s.filter((pl.col("phase") == "forward") & (pl.col("kind") == "module_input"))
        assert set(fwd["module"]) == {"block", "block.0", "block.1", "block.2", "head"}, step
        assert set(s.filter(pl.col("phase") == "recompute")["module"]) <= {"block", "block.0", "block.1", "block.2"}
