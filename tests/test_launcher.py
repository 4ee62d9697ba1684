"""``python -m detfp_capture ... -- train.py``: capture a script that knows nothing about detfp."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import polars as pl

from detfp_capture._sources.launcher import main
from tests.test_capture_models import read

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
