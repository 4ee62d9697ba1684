"""Seed-scale benchmark: the whole ``detfp-analyze bisect --json`` process on seed-shaped run pairs.

The seed job: 2,432 ranks (tp 8 x dp 19 x pp 16 in the manifests) x 800 steps, ``--records``
records per rank-step (20 on 2 cores), flush windows as the capture writes them (one per 65,536
records and per 20 s of steps at the stated ``--step-time``: 40 steps per window at 0.5 s, 20
windows per rank). The pairs are written by ``detfp_analyze.testing.seedpair`` (vectorized
windows; windows of equal content hard-linked from run A) under ``--workdir`` and reused when
their ``done`` marker is there; their disk size is printed.

Rows (each one child process, wall and peak RSS its own: ``benchlib.bisect_cli``):

* ``identical``: B a hard-link copy of A (target < 5 s, < 2 GiB);
* ``late``: one origin at step 799 on one rank, reaching every rank in that step through the
  gradient all-reduce (target < 10 s);
* ``early``: one origin at step 10 reaching every rank from then on (target < 15 s);
* the growth table: ranks 256 / 1,024 / 2,432 x steps 100 / 400 / 800, identical and late, with
  microseconds per rank-step (it must not grow faster than linearly);
* each row once more without the run index (``DETFP_INDEX=off``: the commit logs and manifests
  parsed at open, the path of runs without an index), and the reports compared byte for byte;
* ``--spark``: the seed identical pair and the late row on ``--engine spark`` (the same report).

The planted answer is checked rank by rank. The machine (CPU, instruction set, cores, load) is
printed first. Usage::

    .venv/bin/python benchmarks/seed_scale.py --workdir /tmp/seed            # every row
    .venv/bin/python benchmarks/seed_scale.py --workdir /tmp/seed --no-growth --spark
    .venv/bin/python benchmarks/seed_scale.py --ranks 64 --steps 80 --no-growth   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import benchlib

#: The growth table's ranks and steps (the largest cell is the seed pair itself).
GROWTH_RANKS = (256, 1024, 2432)
GROWTH_STEPS = (100, 400, 800)
#: The planted origin: this rank, at the template's forward op output (before the all-reduce).
ORIGIN_INDEX = 5


def _layout(ranks: int) -> tuple[tuple[str, int], ...]:
    """tp 8 x dp x pp 16 for ``ranks`` (tp 8 x dp 19 x pp 16 at 2,432); dp only otherwise."""
    if ranks % 128 == 0 or ranks == 2432:
        return (("tp", 8), ("dp", ranks // 128), ("pp", 16))
    return (("dp", ranks),)


def _spec(ranks: int, steps: int, records: int, step_time: float):
    from detfp_analyze.testing.seedpair import SeedSpec

    return SeedSpec(ranks=ranks, steps=steps, records=records, layout=_layout(ranks), step_time=step_time)


def _plant(case: str, ranks: int, steps: int):
    from detfp_analyze.testing.synth import Plant

    return Plant(rank=ranks // 2 - 1, step=steps - 1 if case == "late" else min(10, steps - 1), index=ORIGIN_INDEX)


def _write(path: Path, spec, plant, link_from: Path | None) -> float:
    """Write one run (unless its ``done`` marker is there); seconds spent."""
    from detfp_analyze.testing.seedpair import write_seed_run

    if (path / ".done").exists():
        return 0.0
    shutil.rmtree(path, ignore_errors=True)
    t0 = time.perf_counter()
    write_seed_run(path, spec, plant, link_from=link_from)
    (path / ".done").write_text("")
    return time.perf_counter() - t0


def pair(work: Path, ranks: int, steps: int, case: str, records: int, step_time: float, seed_a: Path | None):
    """Run A and B of one row (written once per work directory) and the expected answer."""
    from detfp_analyze.testing.seedpair import expected_seqs

    spec = _spec(ranks, steps, records, step_time)
    tag = f"r{ranks}-s{steps}-x{records}-t{step_time:g}"
    a = work / f"{tag}-a"
    spent = _write(a, spec, None, seed_a if seed_a is not None and seed_a != a else None)
    if case == "identical":
        b = work / f"{tag}-a-copy"
        if not (b / ".done").exists():
            shutil.rmtree(b, ignore_errors=True)
            subprocess.run(["cp", "-al", str(a), str(b)], check=True)
        return a, b, [], spent
    plant = _plant(case, ranks, steps)
    b = work / f"{tag}-{case}"
    spent += _write(b, spec, plant, a)
    return a, b, [list(e) for e in expected_seqs(spec, plant)], spent


def _du(path: Path) -> str:
    out = subprocess.run(["du", "-sh", "--apparent-size", str(path)], capture_output=True, text=True).stdout
    return out.split()[0] if out else "?"


def measure(a: Path, b: Path, expected: list, index: bool, flags: tuple[str, ...] = ()) -> dict:
    env = {} if index else {"DETFP_INDEX": "off"}
    res = benchlib.bisect_cli(a, b, env, flags)
    res["check"] = benchlib.check_planted(expected, res)
    return res


def row(label: str, ranks: int, steps: int, res: dict) -> str:
    us = res["wall"] / (ranks * steps) * 1e6
    return (f"{label:<34} {ranks:>6} {steps:>5} {res['wall']:>8.2f} s {res['peak_mib']:>8.0f} MiB "
            f"{us:>7.2f} us/rank-step  {res['check']}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", type=Path, default=None, help="where the pairs are written and reused")
    ap.add_argument("--ranks", type=int, default=2432, help="ranks of the seed pair (default 2432)")
    ap.add_argument("--steps", type=int, default=800, help="steps of the seed pair (default 800)")
    ap.add_argument("--records", type=int, default=20, help="records per rank-step (default 20)")
    ap.add_argument("--step-time", type=float, default=0.5, help="the stated step time, seconds (default 0.5)")
    ap.add_argument("--no-growth", action="store_true", help="skip the growth table")
    ap.add_argument("--no-old-path", action="store_true", help="skip the rows without the run index")
    ap.add_argument("--spark", action="store_true", help="also the identical and late rows on --engine spark")
    ap.add_argument("--generate-only", action="store_true", help="write the pairs, measure nothing")
    args = ap.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="detfp-seed-"))
    work.mkdir(parents=True, exist_ok=True)
    print(benchlib.machine_line())
    benchlib.byte_compile(Path(__file__).resolve().parents[1])
    spec = _spec(args.ranks, args.steps, args.records, args.step_time)
    print(f"seed pair: {args.ranks} ranks ({' x '.join(f'{n} {s}' for n, s in spec.layout)}) x {args.steps} steps x "
          f"{args.records} records per rank-step; step time {args.step_time:g} s: {spec.window_steps()} steps per "
          f"window, {len(spec.windows())} windows per rank ({4 * len(spec.windows()) * args.ranks} shards per run)")  # fmt: skip
    cases = {}
    for case in ("identical", "late", "early"):
        a, b, exp, spent = pair(work, args.ranks, args.steps, case, args.records, args.step_time, None)
        cases[case] = (a, b, exp)
        if spent:
            print(f"  wrote {case} pair in {spent:.0f} s")
    seed_a = cases["identical"][0]
    print(f"  disk: run A {_du(seed_a)} (apparent size; B of late and early hard-link A's unchanged windows)")
    grid = []
    if not args.no_growth:
        for r in GROWTH_RANKS:
            for s in GROWTH_STEPS:
                if r > args.ranks or s > args.steps:
                    continue
                for case in ("identical", "late"):
                    a, b, exp, spent = pair(work, r, s, case, args.records, args.step_time, seed_a)
                    grid.append((r, s, case, a, b, exp))
    if args.generate_only:
        return
    print(f"\n{'row':<34} {'ranks':>6} {'steps':>5} {'wall':>10} {'peak RSS':>12} {'per rank-step':>20}  planted")
    reports = {}
    for case, target in (("identical", "< 5 s, < 2 GiB"), ("late", "< 10 s"), ("early", "< 15 s")):
        a, b, exp = cases[case]
        res = measure(a, b, exp, True)
        reports[case] = res.get("report")
        print(row(f"{case} (target {target})", args.ranks, args.steps, res))
        if not args.no_old_path:
            old = measure(a, b, exp, False)
            same = "same report" if old.get("report") == res.get("report") else "REPORT DIFFERS"
            print(row(f"  {case} without the index", args.ranks, args.steps, old) + f"  {same}")
    if grid:
        print("\ngrowth (whole process; us per rank-step = wall / (ranks x steps))")
        for r, s, case, a, b, exp in grid:
            print(row(f"{case}", r, s, measure(a, b, exp, True)))
    if args.spark:
        print("\nSpark local[2] (--engine spark), whole process")
        for case in ("identical", "late"):
            a, b, exp = cases[case]
            res = measure(a, b, exp, True, ("--engine", "spark"))
            same = "same report as local" if res.get("report") == reports[case] else "REPORT DIFFERS from local"
            print(row(f"spark {case}", args.ranks, args.steps, res) + f"  {same}")
    sys.stdout.flush()
    os.environ.pop("DETFP_INDEX", None)
    _ = json  # reports are compared as the CLI's bytes


if __name__ == "__main__":
    main()
