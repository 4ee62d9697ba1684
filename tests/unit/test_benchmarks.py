"""The benchmarks share one helper module (``benchmarks/benchlib.py``) and say what they measure.

* no benchmark edits ``sys.path`` (a script's folder is its ``sys.path[0]``; only ``benchlib``
  puts a baseline tree ahead of the installed packages) or imports another one's private names;
* every benchmark prints the machine it ran on, instruction set included; the instruction set
  is read from the CPU's flags;
* no flag is named after an issue number;
* ``benchlib``: a measured child's peak memory is its own (not the benchmark's), a planted
  answer is checked rank by rank;
* four benchmarks run end to end at their smallest, as scripts: ``bisect_ranks.py`` (the measured
  CLI and the planted answer's check), ``capture_flush.py`` (which had stopped running when
  ``capture_overhead.Runner`` grew a second model), ``capture_gc.py`` and
  ``capture_collectives.py`` (children per tree).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
SCRIPTS = sorted(p for p in BENCH.glob("*.py") if p.name != "benchlib.py")
SIBLINGS = {p.stem for p in BENCH.glob("*.py")}
#: The example model at its smallest (a smoke run: does the benchmark still run).
SMALL = ["--width", "16", "--hidden", "32", "--layers", "1", "--heads", "2", "--seq", "8", "--batch", "2"]


@pytest.fixture
def benchlib(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # as when a benchmark runs from its folder
    import benchlib

    return benchlib


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), str(path))


def _is_script(tree: ast.Module) -> bool:
    return any(isinstance(n, ast.If) and "__main__" in ast.unparse(n.test) for n in tree.body)


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_no_benchmark_edits_the_path_or_takes_a_siblings_private_names(path):
    tree = _tree(path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "path" and ast.unparse(node.value) == "sys":
            pytest.fail(f"{path.name}:{node.lineno}: sys.path: import benchlib (this folder is sys.path[0])")
        if isinstance(node, ast.ImportFrom) and node.module in SIBLINGS:
            private = [a.name for a in node.names if a.name.startswith("_")]
            assert not private, f"{path.name}:{node.lineno}: private names of {node.module}: {private}"


@pytest.mark.parametrize("path", [p for p in SCRIPTS if _is_script(_tree(p))], ids=lambda p: p.name)
def test_every_benchmark_prints_its_machine_and_names_flags_by_what_they_measure(path):
    tree = _tree(path)
    calls = {ast.unparse(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    assert "benchlib.machine_line" in calls, f"{path.name} does not print benchlib.machine_line()"
    flags = [
        a.value
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and ast.unparse(n.func).endswith("add_argument")
        for a in n.args
        if isinstance(a, ast.Constant) and isinstance(a.value, str)
    ]
    assert flags and not [f for f in flags if "issue" in f.lower()], flags


def test_the_instruction_set_comes_from_the_cpu_flags(benchlib):
    assert benchlib.instruction_set(["fpu", "sse2", "avx", "avx2", "fma"]) == ("AVX2",)
    assert benchlib.instruction_set(["avx512_vnni", "avx2", "avx512f"]) == ("AVX2", "AVX-512", "AVX-512 VNNI")
    assert benchlib.instruction_set(["avx2", "avx_vnni"]) == ("AVX2", "AVX-VNNI")
    m = benchlib.Machine(cpu="Test CPU", isa=(), cores=4, usable=2, load="0.1 0.2 0.3")
    line = benchlib.machine_line(m)
    assert line.startswith("CPU Test CPU (") and "instruction set: none of AVX2, AVX-512" in line
    assert line.endswith("; 4 cores (2 usable); load average 0.1 0.2 0.3")
    assert "instruction set: " in benchlib.machine_line()


def test_a_measured_childs_peak_memory_is_its_own(benchlib):
    big = benchlib.run_measured([sys.executable, "-c", "x = bytearray(96 << 20); x[::4096] = b'1' * len(x[::4096])"])
    small = benchlib.run_measured([sys.executable, "-c", "print('hi')"])
    assert (big.code, small.code, small.stdout) == (0, 0, "hi\n")
    assert big.peak_mib >= 96 > small.peak_mib
    assert big.wall > 0 and big.cpu > 0
    assert benchlib.run_measured([sys.executable, "-c", "raise SystemExit(3)"]).code == 3


def test_a_planted_answer_is_checked_rank_by_rank(benchlib):
    expected = [(1, 2, 30), (2, 2, 31)]
    ok = {"first": {"1": [2, 30, "origin"], "2": [2, 31, "receiver"]}, "origin_ranks": [1]}
    assert benchlib.check_planted(expected, ok, origin_ranks=[1]) == "ok"
    assert benchlib.check_planted(expected, ok, origin_ranks=[2]) == "origin ranks [1] != [2]"
    assert benchlib.check_planted(expected, {"first": {"1": [2, 30]}}) == "MISMATCH ranks [2]"
    assert benchlib.check_planted(expected, {"first": {"1": [2, 30], "2": [1, 31]}}) == "MISMATCH ranks [2]"
    assert benchlib.check_planted(expected, {"error": "exit 2"}) == "exit 2"


@pytest.mark.parametrize(
    ("script", "args", "says"),
    [
        ("bisect_ranks.py", ["--ranks", "8", "--records", "50"], "| ok\n"),
        ("capture_flush.py", ["--steps", "1", "--flushes", "1", "--warmup", "0", *SMALL], "per record"),
        ("capture_gc.py", ["--levels", "ops", "--rounds", "1", "--steps", "4", "--window", "2", "--warmup", "1"], "\nops "),
        (
            "capture_collectives.py",
            ["--levels", "boundaries", "--rounds", "1", "--steps", "1", "--calls", "2", "--blocks", "1"],
            "\nboundaries ",
        ),
    ],
)
def test_a_benchmark_runs_at_its_smallest(tmp_path, script, args, says):
    if script == "bisect_ranks.py":
        args = [*args, "--workdir", str(tmp_path)]
    out = subprocess.run([sys.executable, str(BENCH / script), *args], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("CPU ") and "instruction set: " in out.stdout.splitlines()[0]
    assert says in out.stdout, out.stdout
