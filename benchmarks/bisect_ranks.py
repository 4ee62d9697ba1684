"""Rank-scaling benchmark: how the whole ``detfp-analyze bisect --json`` process grows with the ranks.

Per rank count N it writes (or reuses, under ``--workdir``) a pair of N ranks x 2 steps x
``--records`` records per rank-step (one flush window per rank, as a large job writes), where
rank 5 changes a value early in step 1 and every other rank receives the difference through the
gradient all-reduce: every rank has its own divergent step, its own group-wide test of the same
collective and its own line in the report. What each rank costs should not grow with N; a term
that grows is quadratic in the job's size (a pass over every peer for every rank, every rank's
copy of the group lists), which on thousands of ranks is the whole bill.

With ``--baseline DIR`` (another checkout's root, put first on PYTHONPATH, e.g. ``git worktree
add /tmp/base main``) both trees run on the same pairs, repeats interleaved, and the reports
must be byte-identical. Each measurement is one child process (peak RSS its own,
``benchlib.bisect_cli``); the machine (CPU, instruction set, cores, load) is printed first. Usage::

    .venv/bin/python benchmarks/bisect_ranks.py --ranks 256,1024,2048 --workdir /tmp/ranks --baseline /tmp/base
    .venv/bin/python benchmarks/bisect_ranks.py --ranks 16 --records 50   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
from pathlib import Path

import benchlib

STEPS = 2
#: The planted change: rank 5, step 1, this record (before the backward's all-reduces).
ORIGIN_RANK, ORIGIN_INDEX = 5, 30


def _pair(work: Path, n: int, records: int) -> tuple[Path, Path, list[list[int]]]:
    """The pair of ``n`` ranks (written once per work directory) and its expected [rank, step, seq]s."""
    from detfp_analyze.testing.synth import Plant, SynthSpec, write_pair

    a, b, meta = work / f"r{n}x{records}-a", work / f"r{n}x{records}-b", work / f"r{n}x{records}.json"
    if meta.exists():
        return a, b, json.loads(meta.read_text())
    for d in (a, b):  # an interrupted write leaves directories without the expected answer
        shutil.rmtree(d, ignore_errors=True)
    spec = SynthSpec(ranks=n, steps=STEPS, records=records, windows="run")
    planted = write_pair(a, b, spec, Plant(rank=ORIGIN_RANK, step=STEPS - 1, index=ORIGIN_INDEX))
    expected = [[e.rank, e.step, e.seq] for e in planted.expected]
    meta.write_text(json.dumps(expected))
    return a, b, expected


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", default="256,1024,2048", help="comma-separated rank counts (default 256,1024,2048)")
    ap.add_argument("--records", type=int, default=200, help="records per rank-step (default 200)")
    ap.add_argument("--reps", type=int, default=1, help="repeats per tree and size, interleaved (median shown)")
    ap.add_argument("--workdir", type=Path, default=None, help="where the pairs are written and reused")
    ap.add_argument("--baseline", type=Path, default=None, help="another checkout's root, measured side by side")
    args = ap.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="detfp-ranks-"))
    work.mkdir(parents=True, exist_ok=True)
    trees = (
        {"this": {}} if args.baseline is None else {"base": {"PYTHONPATH": str(args.baseline.resolve())}, "this": {}}
    )
    print(benchlib.machine_line(), flush=True)
    benchlib.byte_compile(benchlib.ROOT, *([args.baseline.resolve()] if args.baseline else []))
    print(f"runs under {work}", flush=True)
    head = f"{'ranks':>5} {'records/run':>11} | " + " | ".join(
        f"{t + ' s':>7} {'cpu':>5} {'MiB':>5} {'ms/rank':>7}" for t in trees
    )
    head += f" | {'this/base':>9} | check" if "base" in trees else " | check"
    print(head)
    print("-" * len(head), flush=True)
    for n in [int(x) for x in args.ranks.split(",") if x]:
        a, b, expected = _pair(work, n, args.records)
        runs: dict[str, list[dict]] = {t: [] for t in trees}
        for i in range(args.reps):
            order = list(trees.items())
            for name, env in order if i % 2 == 0 else order[::-1]:
                runs[name].append(benchlib.bisect_cli(a.resolve(), b.resolve(), env))
        cells, checks = [], {benchlib.check_planted(expected, m) for v in runs.values() for m in v}
        med = {t: statistics.median(m["wall"] for m in v) for t, v in runs.items()}
        for t, v in runs.items():
            cpu = statistics.median(m["cpu"] for m in v)
            mib = max(m["peak_mib"] for m in v)
            cells.append(f"{med[t]:7.2f} {cpu:5.1f} {mib:5.0f} {1000 * med[t] / n:7.2f}")
        line = f"{n:>5} {n * STEPS * args.records:>11,} | " + " | ".join(cells)
        if "base" in trees:
            same = len({m.get("report") for v in runs.values() for m in v}) == 1
            checks.add("same report" if same else "REPORTS DIFFER")
            line += f" | {med['this'] / med['base']:9.2f}"
        print(f"{line} | {'/'.join(sorted(checks))}", flush=True)
    print(
        f"\nload average at the end: {benchlib.load_average()}. Whole `detfp-analyze bisect A B --json` process per cell: wall s "
        f"(median of {args.reps}), cpu: user+sys s, MiB: peak RSS, ms/rank: wall per rank (flat when the cost is "
        "linear in the ranks). check: every rank's first divergent step and seq as planted"
        + ("; reports byte-identical between the trees." if "base" in trees else ".")
    )


if __name__ == "__main__":
    main()
