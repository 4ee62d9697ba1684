"""Trace size on disk: bytes per record, per table and capture level (issue 15: <= 40 at levels
boundaries and ops).

Two sources, each printed as one row per (trace, table) plus a total per trace:

* real captures: ``examples/train_tiny.py`` run at each level (``--steps``, 1 thread), or the
  run directories given with ``--runs``;
* synthetic traces: ``detfp_analyze.testing.synth`` (the bisect benchmark's generator, written
  by the capture's own writer), ``--synth-ranks`` x ``--synth-steps`` x ``--synth-records``.

"bytes/record" divides a table's file bytes (footers included) by the rows of the records
table, so the total row is what the whole trace costs per record; "bytes/row" divides by the
table's own rows. Manifests and commit logs are left out (a few KiB per launch).

    .venv/bin/python benchmarks/trace_size.py
    .venv/bin/python benchmarks/trace_size.py --runs RUN_DIR [RUN_DIR ...]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import benchlib
from benchlib import ROOT

LEVELS = ("metrics", "boundaries", "ops")
TARGET = 40.0  # bytes per record at levels boundaries and ops


def table_sizes(run: Path) -> dict[str, tuple[int, int, int]]:
    """table -> (files, rows, bytes) of one run directory's shards."""
    import pyarrow.parquet as pq

    out: dict[str, tuple[int, int, int]] = {}
    for f in sorted(run.rglob("*.parquet")):
        if f.name.startswith("."):
            continue
        table = f.relative_to(run).parts[0]
        files, rows, size = out.get(table, (0, 0, 0))
        out[table] = (files + 1, rows + pq.ParquetFile(f).metadata.num_rows, size + f.stat().st_size)
    return out


def report(label: str, run: Path, gated: bool) -> float:
    """Print one trace's rows; returns its total bytes per record."""
    sizes = table_sizes(run)
    records = sizes.get("records", (0, 0, 0))[1]
    total = sum(b for _, _, b in sizes.values())
    for table, (files, rows, size) in sorted(sizes.items()):
        per_record = size / records if records else float("nan")
        print(f"{label:<24}{table:<10}{files:>6}{rows:>10}{size:>12}{size / max(rows, 1):>11.1f}{per_record:>14.1f}")
    per = total / records if records else float("nan")
    verdict = f"  target <= {TARGET:.0f} {'met' if per <= TARGET else 'MISSED'}" if gated else ""
    print(f"{label:<24}{'(all)':<10}{'':>6}{records:>10}{total:>12}{'':>11}{per:>14.1f}{verdict}")
    return per


def capture_example(out: Path, level: str, steps: int) -> Path:
    run = out / f"train_tiny-{level}"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, str(ROOT / "examples" / "train_tiny.py"), "--steps", str(steps), "--threads", "1"]
    cmd += ["--quiet", "--level", level, "--out", str(run)]
    subprocess.run(cmd, check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
    return run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", nargs="*", help="report these run directories instead of capturing the example")
    p.add_argument("--steps", type=int, default=3, help="steps of each example capture")
    p.add_argument("--levels", default=",".join(LEVELS), help="levels of the example captures")
    p.add_argument("--synth-ranks", type=int, default=4)
    p.add_argument("--synth-steps", type=int, default=4)
    p.add_argument("--synth-records", type=int, default=4000, help="records per rank and step")
    p.add_argument("--no-synth", action="store_true")
    args = p.parse_args(argv)
    print(benchlib.machine_line(), flush=True)
    print(f"{'trace':<24}{'table':<10}{'files':>6}{'rows':>10}{'bytes':>12}{'bytes/row':>11}{'bytes/record':>14}")
    with tempfile.TemporaryDirectory(prefix="detfp-size-") as tmp:
        if args.runs:
            for r in args.runs:
                report(Path(r).name, Path(r), gated=False)
        else:
            for level in [x.strip() for x in args.levels.split(",") if x.strip()]:
                run = capture_example(Path(tmp), level, args.steps)
                report(f"example {level}", run, gated=level != "metrics")
        if not args.no_synth:
            from detfp_analyze.testing.synth import SynthSpec, write_run

            spec = SynthSpec(ranks=args.synth_ranks, steps=args.synth_steps, records=args.synth_records)
            run = write_run(Path(tmp) / "synth", spec)
            label = f"synth {spec.ranks}x{spec.steps}x{spec.records}"
            report(label, run, gated=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
