"""Scale benchmark: bisect vs the naive full-join baseline on synthetic run pairs.

For each size (``--sizes`` ranks x 4 steps x ``--records`` records per rank-step, one planted
origin) it writes a run pair with ``detfp_analyze.testing.synth``, then measures, each in its own
child process (so peak memory is that child's own ``ru_maxrss``, read with ``os.wait4`` by a small
launcher the child is forked from, so the benchmark's own memory is not counted in it:
``benchlib.run_measured``):

* ``bisect``: ``open_run`` both runs + ``bisect(..., level="op")``, as the CLI does;
* ``naive``: read both runs' records fully into pandas (the columns a first-divergence
  search needs), merge on (rank, step, key_hash), and take the first mismatch per rank in
  A's order: what one does without detfp.

* ``cli``: the whole ``detfp-analyze bisect A B --json`` process (imports included).

``--run-sizes [1M,2M,20M]`` measures fixed run sizes instead: identical, early and late divergence
at 1M (64 ranks x 4 steps x 4,000 records), 2M (128 x 4 x 4,000) and 20M records per run (256 x 4
x 20,000), each with the stored rollups ("after") and on the records path of runs written without
rollups ("before": ``ReadPaths(stored_rollups=False)``, the CLI's ``--no-stored-rollups``), in the
same run, one child per measurement. An identical pair's B is a hard-link copy of A (same bytes,
written once); early and late B are written with the plant. Runs under ``--workdir`` are reused
when their ``planted.json`` is there.

``--run-sizes --baseline DIR`` measures the same rows with this tree and with another checkout
(``DIR``, its root put first on ``PYTHONPATH``: e.g. ``git worktree add /tmp/base main``), both
with the stored rollups, repeats interleaved: the code change side by side on one machine's load.

``--engine spark`` compares the local engine with the Spark engine on Spark ``local[2]`` instead,
on the same pairs (``--sizes``): ``spark`` is the session start + ``open_run`` both +
``bisect(..., engine=...)`` in a child; the driver's peak RSS is the Python process's, the JVM's
is given apart (in local mode it holds the driver and the executors); both reports must be
byte-identical, and the Spark jobs are counted. Then both engines' time and memory are
extrapolated linearly in records per run to 2,432 ranks x 800 steps x 700 records (an
extrapolation from the measured points, labelled as such, not a measurement).

Correctness is checked against the plant (origin ranks and the origin record's key) and printed
next to the timings; the machine (CPU, instruction set, cores, load) is printed first. Usage::

    .venv/bin/python benchmarks/bisect_scale.py                 # 64, 256, 1024 ranks + early/late
    .venv/bin/python benchmarks/bisect_scale.py --sizes 64,256 --no-early-late
    .venv/bin/python benchmarks/bisect_scale.py --run-sizes --workdir /tmp/scale --keep
    .venv/bin/python benchmarks/bisect_scale.py --run-sizes 20M --cases identical,late --no-naive --reps 1
    .venv/bin/python benchmarks/bisect_scale.py --run-sizes --workdir /tmp/scale --keep --baseline /tmp/base
    .venv/bin/python benchmarks/bisect_scale.py --engine spark --sizes 16,64   # 256: 20M records per run
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import benchlib

STEPS = 4
#: Records per rank-step of the ``--sizes`` pairs (``--records``).
RECORDS = 20000
#: Naive baseline memory per record pair, measured (~130 B/record per run in pandas incl. merge);
#: skip it above this many records per run so the machine does not swap.
NAIVE_MAX_RECORDS = 25_000_000


def _spark_child(a: str, b: str) -> dict:
    """bisect on Spark local[2] in this process; the JVM's peak RSS from its rusage once it exited."""
    import resource

    from detfp_analyze.bisect import bisect
    from detfp_analyze.io.reader import open_run
    from detfp_analyze.spark import engine, session

    t0 = time.perf_counter()
    spark = session("local[2]", [("spark.driver.memory", "4g"), ("spark.sql.shuffle.partitions", "2")])
    started = time.perf_counter() - t0
    bound = {}

    def bind(ra, rb):
        bound["st"] = engine(spark)(ra, rb)
        return bound["st"]

    res = bisect(open_run(a), open_run(b), level="op", engine=bind)
    seconds = time.perf_counter() - t0
    st = bound["st"]
    out = {
        "seconds": seconds,
        "start_s": started,
        "jobs": sum(st.jobs.values()) + sum(st.a.jobs.values()),
        "report": json.dumps(res.to_json_dict(), sort_keys=True),
        # The Python driver's own peak (the parent's wait4 figure is the larger of it and the JVM's).
        "driver_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    from pyspark import SparkContext

    gateway = SparkContext._gateway
    spark.stop()
    proc = getattr(gateway, "proc", None)
    if proc is not None:
        gateway.shutdown()
        proc.stdin.close()
        proc.wait(timeout=60)
        out["jvm_mib"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return out


def _child(kind: str, a: str, b: str, records_path: bool = False) -> None:
    """Run one measurement in this process and print one JSON line; ``records_path``: bisect
    without the stored rollups (the path of runs written without them)."""
    t0 = time.perf_counter()
    if kind == "spark":
        print(json.dumps(_spark_child(a, b)))
        return
    if kind == "bisect":
        from detfp_analyze.bisect import ReadPaths, bisect
        from detfp_analyze.io.reader import open_run

        res = bisect(open_run(a), open_run(b), level="op", reads=ReadPaths(stored_rollups=not records_path))
        out = {
            "seconds": time.perf_counter() - t0,
            "origin_ranks": list(res.diagnosis.origin_ranks),
            "pattern": res.diagnosis.pattern,
            "first": {
                str(r.rank): [r.first.step, r.first.seq_a, r.first.verdict] for r in res.ranks if r.first is not None
            },
            "report": json.dumps(res.to_json_dict(), sort_keys=True),
        }
    else:
        import pandas as pd

        cols = ["rank", "step", "seq", "key_hash", "digest_hi", "digest_lo", "name"]
        da = pd.read_parquet(Path(a) / "records", columns=cols, partitioning=None)
        db = pd.read_parquet(Path(b) / "records", columns=cols, partitioning=None)
        m = da.merge(db, on=["rank", "step", "key_hash"], how="outer", suffixes=("_a", "_b"))
        bad = m[
            m["seq_a"].isna()
            | m["seq_b"].isna()
            | (m["digest_hi_a"] != m["digest_hi_b"])
            | (m["digest_lo_a"] != m["digest_lo_b"])
        ]
        # Rows present in both with both digests null (skipped records) compare unequal in pandas: drop them.
        bad = bad[
            ~(bad["digest_hi_a"].isna() & bad["digest_hi_b"].isna() & bad["seq_a"].notna() & bad["seq_b"].notna())
        ]
        first = bad.sort_values(["rank", "step", "seq_a"]).groupby("rank").head(1)
        out = {
            "seconds": time.perf_counter() - t0,
            "first": {str(int(r.rank)): [int(r.step), int(r.seq_a), "?"] for r in first.itertuples()},
        }
    print(json.dumps(out))


def measure(kind: str, a: Path, b: Path, env: dict | None = None, records_path: bool = False) -> dict:
    """Run ``kind`` in a child process (``benchlib.run_measured``); add its wall time, CPU seconds
    and peak RSS (MiB), each the child's own. ``records_path``: bisect without the stored rollups.

    ``kind`` "cli": the ``detfp-analyze bisect --json`` process itself (``benchlib.bisect_cli``)."""
    a, b = Path(a).resolve(), Path(b).resolve()  # the child runs elsewhere (benchlib.run_measured)
    if kind == "cli":
        return benchlib.bisect_cli(a, b, env, ["--no-stored-rollups"] if records_path else [])
    cmd = [sys.executable, os.path.abspath(__file__), "--child", kind, str(a), str(b)]
    child = benchlib.run_measured(cmd + (["--child-records-path"] if records_path else []), env)
    stats = {"wall": child.wall, "peak_mib": child.peak_mib, "cpu": child.cpu}
    if child.code != 0:
        return {"error": f"exit {child.code}", **stats}
    return json.loads(child.stdout.strip().splitlines()[-1]) | stats


def _expected(planted) -> list[tuple[int, int, int]]:
    """(rank, step, seq) of each rank a synthetic plant reaches (``synth.Planted.expected``)."""
    return [(e.rank, e.step, e.seq) for e in planted.expected]


def run_case(work: Path, label: str, ranks: int, records: int, plant, naive: bool, keep: bool) -> dict:
    from detfp_analyze.testing.synth import SynthSpec, write_pair

    spec = SynthSpec(ranks=ranks, steps=STEPS, records=records)
    a, b = work / f"{label}-a", work / f"{label}-b"
    t0 = time.perf_counter()
    planted = write_pair(a, b, spec, plant)
    gen = time.perf_counter() - t0
    row = {"case": label, "ranks": ranks, "records": ranks * STEPS * records, "gen_s": gen}
    bis = measure("bisect", a, b)
    row |= {
        "bisect_s": bis.get("seconds", float("nan")),
        "bisect_cpu": bis.get("cpu", float("nan")),
        "bisect_mib": bis["peak_mib"],
    }
    row["bisect_check"] = benchlib.check_planted(_expected(planted), bis, planted.origin_ranks)
    row["pattern"] = bis.get("pattern", "?")
    if naive and row["records"] <= NAIVE_MAX_RECORDS:
        nv = measure("naive", a, b)
        row |= {
            "naive_s": nv.get("seconds", float("nan")),
            "naive_cpu": nv.get("cpu", float("nan")),
            "naive_mib": nv["peak_mib"],
            "naive_check": benchlib.check_planted(_expected(planted), nv),
        }
    if not keep:
        shutil.rmtree(a, ignore_errors=True)
        shutil.rmtree(b, ignore_errors=True)
    return row


#: ``--run-sizes``: records per run, by label -> (ranks, records per rank-step).
RUN_SIZES = {"1M": (64, 4000), "2M": (128, 4000), "20M": (256, 20000)}
#: The cases of each size.
CASES = ("identical", "early", "late")
#: The whole-CLI measurement is taken for these sizes (import time matters there).
CLI_SIZES = ("1M", "2M")


def _pair(work: Path, size: str, case: str) -> tuple[Path, Path, list]:
    """The run pair of one ``--run-sizes`` row, written (or reused) under ``work``; its expected answer."""
    from detfp_analyze.testing.synth import Plant, SynthSpec, write_pair

    ranks, records = RUN_SIZES[size]
    spec = SynthSpec(ranks=ranks, steps=STEPS, records=records)
    a = work / f"{size}-a"
    b = work / f"{size}-{case}-b"
    meta = work / f"{size}-{case}.planted.json"
    if meta.exists() and a.exists() and b.exists():
        return a, b, json.loads(meta.read_text())
    plants = {
        "early": Plant(rank=5, step=0, index=200),
        "late": Plant(rank=5, step=STEPS - 1, index=records * 3 // 4),
    }
    done = work / f"{size}-a.done"  # A is complete (an interrupted benchmark may leave a partial A)
    if not done.exists():
        shutil.rmtree(a, ignore_errors=True)
    if case == "identical":
        if not a.exists():
            shutil.rmtree(work / f".{size}-scratch", ignore_errors=True)
            write_pair(a, work / f".{size}-scratch", spec)
            shutil.rmtree(work / f".{size}-scratch", ignore_errors=True)
            done.touch()
        shutil.rmtree(b, ignore_errors=True)
        shutil.copytree(a, b, copy_function=os.link)
        expected: list = []
    else:
        # A is the same run for every case of a size (same spec and seed): written once.
        scratch = work / f".{size}-scratch-a"
        shutil.rmtree(scratch, ignore_errors=True)
        shutil.rmtree(b, ignore_errors=True)
        planted = write_pair(scratch if a.exists() else a, b, spec, plants[case])
        shutil.rmtree(scratch, ignore_errors=True)
        done.touch()
        expected = [[e.rank, e.step, e.seq] for e in planted.expected]
    meta.write_text(json.dumps(expected))
    return a, b, expected


def paths_table(work: Path, sizes: list[str], naive: bool, reps: int, cases: tuple[str, ...] = CASES) -> None:
    """Per run size and case, after (stored rollups) / before (the records path), each as bisect
    in a child and as the whole CLI, and the naive baseline; best of ``reps`` for times, peak
    memory of that child."""
    head = (
        f"{'size':<4} {'case':<9} | {'after s':>7} {'cpu':>5} {'MiB':>5} | {'before s':>8} {'cpu':>5} {'MiB':>5} | "
        f"{'cli after':>9} {'MiB':>5} {'cli before':>10} {'MiB':>5} | {'naive s':>7} {'MiB':>5} | check"
    )
    benchlib.byte_compile(benchlib.ROOT)
    print(head)
    print("-" * len(head), flush=True)
    for size in sizes:
        for case in cases:
            a, b, expected = _pair(work, size, case)

            def best(kind: str, records_path: bool, a: Path = a, b: Path = b) -> dict:
                runs = [measure(kind, a, b, records_path=records_path) for _ in range(reps)]
                return min(runs, key=lambda m: m.get("seconds", float("inf")))

            after = best("bisect", False)
            before = best("bisect", True)
            cli = (best("cli", False), best("cli", True)) if size in CLI_SIZES else None
            nv = measure("naive", a, b) if naive else None
            checks = [benchlib.check_planted(expected, r) for r in (after, before, *(cli or ()))]
            nan = float("nan")
            cli_txt = (
                f"{cli[0].get('seconds', nan):9.2f} {cli[0]['peak_mib']:5.0f} "
                f"{cli[1].get('seconds', nan):10.2f} {cli[1]['peak_mib']:5.0f}"
                if cli
                else f"{'-':>9} {'-':>5} {'-':>10} {'-':>5}"
            )
            nv_txt = f"{nv.get('seconds', float('nan')):7.2f} {nv['peak_mib']:5.0f}" if nv else f"{'-':>7} {'-':>5}"
            print(
                f"{size:<4} {case:<9} | {after.get('seconds', float('nan')):7.2f} {after.get('cpu', float('nan')):5.1f} "
                f"{after['peak_mib']:5.0f} | {before.get('seconds', float('nan')):8.2f} "
                f"{before.get('cpu', float('nan')):5.1f} {before['peak_mib']:5.0f} | {cli_txt} | {nv_txt} | "
                f"{'/'.join(checks)}",
                flush=True,
            )
    print(
        "\nafter / before: open_run both + bisect(level='op') in a child, with the stored rollups and without them "
        "(reads=ReadPaths(stored_rollups=False), the CLI's --no-stored-rollups: the records path of runs without "
        "rollups); best of the repeats, wall s; cpu: that child's user+sys CPU s; "
        "MiB: that child's peak RSS.\ncli: the whole `detfp-analyze bisect A B --json` process (wall s; MiB: its peak RSS). "
        "naive: pandas read of 7 record columns of both runs + outer merge + first mismatch per rank."
    )


def compare_code(work: Path, sizes: list[str], reps: int, baseline: Path, cases: tuple[str, ...] = CASES) -> None:
    """This tree against ``baseline`` (another checkout's root, put first on PYTHONPATH) on the
    ``--run-sizes`` rows, stored rollups on: the whole CLI process for the CLI sizes, the bisect child
    for the others; repeats interleaved (base, this, this, base, ...), medians and minima, each
    child's peak memory, and whether both trees print byte-identical JSON reports."""
    benchlib.byte_compile(baseline.resolve(), benchlib.ROOT)
    base_env = {"PYTHONPATH": str(baseline.resolve())}
    this_env: dict[str, str] = {}
    head = (
        f"{'size':<4} {'case':<9} {'kind':<6} | {'base med':>8} {'min':>6} {'cpu':>5} {'MiB':>5} | "
        f"{'this med':>8} {'min':>6} {'cpu':>5} {'MiB':>5} | {'this/base':>9} {'cpu':>5} | check"
    )
    print(head)
    print("-" * len(head), flush=True)
    for size in sizes:
        for case in cases:
            a, b, expected = _pair(work, size, case)
            kind = "cli" if size in CLI_SIZES else "bisect"
            runs: dict[str, list[dict]] = {"base": [], "this": []}
            for i in range(reps):
                order = (("base", base_env), ("this", this_env))
                for name, env in order if i % 2 == 0 else order[::-1]:
                    runs[name].append(measure(kind, a, b, env))
            med = {k: statistics.median(m.get("seconds", float("nan")) for m in v) for k, v in runs.items()}
            low = {k: min(m.get("seconds", float("nan")) for m in v) for k, v in runs.items()}
            mib = {k: max(m["peak_mib"] for m in v) for k, v in runs.items()}
            cpu = {k: statistics.median(m.get("cpu", float("nan")) for m in v) for k, v in runs.items()}
            checks = {benchlib.check_planted(expected, m) for v in runs.values() for m in v}
            if kind == "cli":
                same = len({m.get("report") for v in runs.values() for m in v}) == 1
                checks.add("same report" if same else "REPORTS DIFFER")
            print(
                f"{size:<4} {case:<9} {kind:<6} | {med['base']:8.2f} {low['base']:6.2f} {cpu['base']:5.1f} "
                f"{mib['base']:5.0f} | {med['this']:8.2f} {low['this']:6.2f} {cpu['this']:5.1f} {mib['this']:5.0f} | "
                f"{med['this'] / med['base']:9.2f} {cpu['this'] / cpu['base']:5.2f} | "
                f"{'/'.join(sorted(checks))}",
                flush=True,
            )
    print(
        f"\nbase: {baseline}; this: {benchlib.ROOT}. cli: the whole `detfp-analyze bisect "
        "A B --json` process; bisect: open_run both + bisect(level='op') in a child (20M). Wall seconds over "
        f"{reps} interleaved repeats (median, min); cpu: the median child's user+sys CPU seconds (all threads), "
        "steadier than wall on a shared machine; MiB: the largest peak RSS of those children."
    )


def fmt(rows: list[dict]) -> str:
    head = (
        f"{'case':<10} {'ranks':>5} {'records/run':>12} {'gen s':>6} | {'bisect s':>8} {'cpu s':>6} {'MiB':>6} | "
        f"{'naive s':>7} {'cpu s':>6} {'MiB':>6} | {'time x':>6} {'mem x':>5} | check bisect / naive"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        if "naive_s" in r:
            naive = (
                f"{r['naive_s']:7.1f} {r['naive_cpu']:6.1f} {r['naive_mib']:6.0f} | "
                f"{r['naive_s'] / r['bisect_s']:6.1f} {r['naive_mib'] / r['bisect_mib']:5.1f}"
            )
            nchk = r["naive_check"]
        else:
            naive, nchk = f"{'skipped':>7} {'':>6} {'':>6} | {'':>6} {'':>5}", "-"
        lines.append(
            f"{r['case']:<10} {r['ranks']:>5} {r['records']:>12,} {r['gen_s']:6.1f} | {r['bisect_s']:8.2f} "
            f"{r['bisect_cpu']:6.1f} {r['bisect_mib']:6.0f} | {naive} | {r['bisect_check']} / {nchk}"
        )
    return "\n".join(lines)


#: The target scale: 2,432 ranks x 800 steps x ~700 boundary records per rank-step, per run.
TARGET_RECORDS = 2432 * 800 * 700


def _fit(xs: list[float], ys: list[float], x: float) -> float:
    """Least-squares line through (xs, ys) evaluated at x, never below the largest measured y (a
    noisy negative slope says nothing about growth); one point: proportional to x."""
    if len(xs) == 1:
        return ys[0] * x / xs[0]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((a - mx) ** 2 for a in xs)
    slope = sum((a - mx) * (b - my) for a, b in zip(xs, ys, strict=True)) / var if var else 0.0
    return max(my + slope * (x - mx), max(ys))


def run_engines(work: Path, sizes: list[int], records: int, keep: bool) -> None:
    """Local engine vs Spark local[2] on the same pairs, side by side, plus the extrapolation."""
    from detfp_analyze.testing.synth import Plant, SynthSpec, write_pair

    rows = []
    nan = float("nan")
    for n in sizes:
        a, b = work / f"eng-{n}-a", work / f"eng-{n}-b"
        t0 = time.perf_counter()
        if not (a.is_dir() and b.is_dir()):
            spec = SynthSpec(ranks=n, steps=STEPS, records=records)
            write_pair(a, b, spec, Plant(rank=n // 3, step=1, index=records // 4))
        gen = time.perf_counter() - t0
        loc, spk = measure("bisect", a, b), measure("spark", a, b)
        same = "error" not in loc and "error" not in spk and loc.get("report") == spk.get("report")
        rows.append(
            {"ranks": n, "records": n * STEPS * records, "gen_s": gen, "local": loc, "spark": spk, "same": same}
        )
        print(f"  {n} ranks: local {loc.get('wall', nan):.1f} s, spark {spk.get('wall', nan):.1f} s", flush=True)
        if not keep:
            shutil.rmtree(a, ignore_errors=True)
            shutil.rmtree(b, ignore_errors=True)
    head = (
        f"{'ranks':>5} {'records/run':>12} | {'local s':>7} {'cpu s':>6} {'MiB':>6} | {'spark s':>7} {'(start)':>7} "
        f"{'cpu s':>6} {'jobs':>4} {'driver MiB':>10} {'JVM MiB':>7} | same report"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lo, sp = r["local"], r["spark"]
        lines.append(
            f"{r['ranks']:>5} {r['records']:>12,} | {lo.get('wall', nan):7.1f} {lo.get('cpu', nan):6.1f} "
            f"{lo['peak_mib']:6.0f} | {sp.get('wall', nan):7.1f} {sp.get('start_s', nan):7.1f} {sp.get('cpu', nan):6.1f} "
            f"{sp.get('jobs', -1):>4} {sp.get('driver_mib', nan):10.0f} {sp.get('jvm_mib', nan):7.0f} | "
            f"{'yes' if r['same'] else 'NO ' + sp.get('error', '')}"
        )
    print("\n".join(lines))
    xs = [float(r["records"]) for r in rows]
    est = {
        "local s": _fit(xs, [r["local"].get("wall", nan) for r in rows], TARGET_RECORDS),
        "local MiB": _fit(xs, [r["local"]["peak_mib"] for r in rows], TARGET_RECORDS),
        "spark local[2] s": _fit(xs, [r["spark"].get("wall", nan) for r in rows], TARGET_RECORDS),
        "spark driver MiB": _fit(xs, [r["spark"].get("driver_mib", nan) for r in rows], TARGET_RECORDS),
    }
    print(
        f"\nExtrapolated (not measured): a least-squares line in records per run through the points above, "
        f"evaluated at 2,432 ranks x 800 steps x 700 records = {TARGET_RECORDS:,} records per run:"
    )
    for k, v in est.items():
        print(f"  {k:<18} {v:12,.0f}")
    print(
        "wall s: the child's wall time (spark: including the session start, given apart); cpu s: the child's "
        "user+sys CPU s (the JVM's included for spark); MiB: the child's peak RSS (driver MiB: the Python "
        "driver's; JVM MiB: the local[2] JVM, driver and executors together); jobs: Spark jobs of the bisect."
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="64,256,1024", help="comma-separated rank counts (default 64,256,1024)")
    ap.add_argument(
        "--records", type=int, default=RECORDS, help=f"records per rank-step of those pairs (default {RECORDS:,})"
    )
    ap.add_argument("--no-naive", action="store_true", help="skip the pandas baseline")
    ap.add_argument("--no-early-late", action="store_true", help="skip the early/late divergence pair at 256 ranks")
    ap.add_argument("--workdir", type=Path, default=None, help="where to write runs (default: a temporary directory)")
    ap.add_argument("--keep", action="store_true", help="keep the generated runs")
    ap.add_argument(
        "--run-sizes",
        nargs="?",
        const=",".join(RUN_SIZES),
        default=None,
        metavar="SIZES",
        help=f"measure these records per run instead (subset of {','.join(RUN_SIZES)}; alone: all): stored "
        "rollups vs the records path, identical/early/late, bisect and the whole CLI",
    )
    ap.add_argument("--cases", default=",".join(CASES), help="cases for --run-sizes (default identical,early,late)")
    ap.add_argument("--reps", type=int, default=3, help="repeats per measurement for --run-sizes (best is shown)")
    ap.add_argument(
        "--baseline",
        type=Path,
        default=None,
        help="with --run-sizes: compare this tree with another checkout's root (e.g. a main worktree), interleaved",
    )
    ap.add_argument(
        "--engine",
        choices=("local", "spark"),
        default="local",
        help="spark: the local engine vs Spark local[2] on the same pairs, side by side (see the docstring)",
    )
    ap.add_argument("--child", nargs=3, metavar=("KIND", "A", "B"), help=argparse.SUPPRESS)
    ap.add_argument("--child-records-path", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(*args.child, records_path=args.child_records_path)
        return
    sizes = [s for s in (args.run_sizes or "").split(",") if s]
    if set(sizes) - set(RUN_SIZES):
        ap.error(f"--run-sizes {args.run_sizes}: choose from {','.join(RUN_SIZES)}")
    print(benchlib.machine_line(), flush=True)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="detfp-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    if args.run_sizes is not None:
        print(f"runs under {work}", flush=True)
        cases = tuple(c for c in args.cases.split(",") if c)
        if args.baseline is not None:
            compare_code(work, sizes, args.reps, args.baseline, cases)
        else:
            paths_table(work, sizes, not args.no_naive, args.reps, cases)
        print(f"load average at the end: {benchlib.load_average()}")
        if args.workdir is None and not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        return
    from detfp_analyze.testing.synth import Plant

    records = args.records
    print(f"{STEPS} steps x {records:,} records per rank-step; runs under {work}", flush=True)
    if args.engine == "spark":
        run_engines(work, [int(s) for s in args.sizes.split(",") if s], records, args.keep or args.workdir is not None)
        print(f"\nload average at the end: {benchlib.load_average()}")
        return
    rows = []
    for n in [int(s) for s in args.sizes.split(",") if s]:
        plant = Plant(rank=n // 3, step=1, index=records // 4)
        rows.append(run_case(work, f"mid-{n}", n, records, plant, not args.no_naive, args.keep))
        print(fmt(rows[-1:]).splitlines()[-1], flush=True)
    if not args.no_early_late:
        n = 256
        for label, plant in (
            ("early-256", Plant(rank=5, step=0, index=200)),
            ("late-256", Plant(rank=5, step=STEPS - 1, index=records * 3 // 4)),
        ):
            rows.append(run_case(work, label, n, records, plant, False, args.keep))
            print(fmt(rows[-1:]).splitlines()[-1], flush=True)
    print(f"\nload average at the end: {benchlib.load_average()}")
    print(fmt(rows))
    print(
        "\nbisect s: open_run both + bisect(level='op') inside the child (wall); cpu s: the child's user+sys"
        " CPU time (all threads); MiB: the child's peak RSS (ru_maxrss via os.wait4, in a launcher it is forked from)."
        "\nnaive: pandas read of 7 record columns of both runs + outer merge + first mismatch per rank."
        "\ntime x / mem x: naive / bisect."
    )
    if args.workdir is None and not args.keep:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
