"""The GPU check's own parts that run anywhere: the script parses, and its digest-throughput
benchmark runs on the CPU at a small size (the GPU figures come only from a GPU machine)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_script_parses():
    subprocess.run(["bash", "-n", str(ROOT / "scripts" / "gpu_check.sh")], check=True)


def test_digest_bandwidth_runs_on_cpu(tmp_path, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # its folder, as when run as a script (benchlib)
    spec = importlib.util.spec_from_file_location("digest_bandwidth", ROOT / "benchmarks" / "digest_bandwidth.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "bw.json"
    assert mod.main(["--device", "cpu", "--sizes-mib", "1", "--repeats", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["mib"], r["dtype"]) for r in rows] == [(1, "bf16"), (1, "fp32")]
    assert all(r[v]["share"] > 0 for r in rows for v in ("v1", "v2"))
    out = capsys.readouterr().out
    assert "goal >= 50%" in out and "instruction set: " in out.splitlines()[0]
