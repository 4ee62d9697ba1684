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
* each row once more without the run index (``--no-index``: the commit logs and manifests
  parsed at open, the path of runs without an index), and the reports compared byte for byte;
* ``--spark``: the seed identical pair and the late row on ``--engine spark`` (the same report);
* ``--first-open``: only the late pair, the first bisect of a pair nobody indexed (each run's
  index removed first; this tree's reader fills it as it parses) against the bisect of the same
  pair indexed, as a ratio (target: at most 1.5x); with ``--baseline TREE`` both trees side by
  side, each with its own first and indexed bisect (the baseline's index built by its own
  ``detfp-analyze index``, timed), ``--reps`` repeats interleaved;
* ``--baseline TREE``: the seed rows (and, unless ``--no-growth``, the growth table's late rows)
  with this tree and with another checkout (``TREE`` first on ``PYTHONPATH``), ``--reps`` repeats
  interleaved (base, this, this, base, ...): the best and the median wall of each, the larger
  peak RSS, this/base ratios, and whether both trees print byte-identical reports.

The planted answer is checked rank by rank. The machine (CPU, instruction set, cores, load) is
printed first. Usage::

    .venv/bin/python benchmarks/seed_scale.py --workdir /tmp/seed            # every row
    .venv/bin/python benchmarks/seed_scale.py --workdir /tmp/seed --no-growth --spark
    .venv/bin/python benchmarks/seed_scale.py --ranks 64 --steps 80 --no-growth   # a smoke run
    git -C . worktree add --detach /tmp/base main
    .venv/bin/python benchmarks/seed_scale.py --workdir /tmp/seed --baseline /tmp/base --reps 3
    .venv/bin/python benchmarks/seed_scale.py --workdir /tmp/seed --ranks 2048 --steps 200 --no-growth \
        --first-open --baseline /tmp/base --reps 3
"""

from __future__ import annotations

import argparse
import shutil
import statistics
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


#: The comparator of Megatron-LM PR 6610 (``--comparator``): where it is read from.
MEGATRON = ("NVIDIA/Megatron-LM", "refs/pull/6610/head", ("tools/determinism/compare_traces.py",
                                                          "tools/determinism/trace_comparison.py"))  # fmt: skip
#: The 2M pair of ``bisect_scale.py --run-sizes 2M``: 128 ranks x 4 steps x 4,000 records.
PAIR_2M = (128, 4, 4000)


def _comparator(mirror: Path, into: Path) -> Path | str:
    """Copy the comparator's two files out of a Git mirror of Megatron-LM into ``into`` (never
    into this repository); its script, or why it is unavailable."""
    _, ref, files = MEGATRON
    for f in files:
        got = subprocess.run(["git", "-C", str(mirror), "show", f"{ref}:{f}"], capture_output=True)
        if got.returncode != 0:
            return f"{ref}:{f} not in {mirror} ({got.stderr.decode(errors='replace').strip()[:80]})"
        (into / Path(f).name).write_bytes(got.stdout)
    return into / Path(files[0]).name


def _jsonl(run: Path, out: Path) -> int:
    """The comparator's rank_<R>.jsonl files of ``run``'s records (one tensor event per record: its
    call-site key as the event key, its 128-bit digest as the evidence); records written."""
    import polars as pl

    out.mkdir(parents=True, exist_ok=True)
    cols = ("rank", "step", "seq", "microbatch", "phase", "module", "kind", "name", "role", "arg", "occurrence",
            "shape", "digest_hi", "digest_lo")  # fmt: skip
    df = pl.scan_parquet(str(run / "records" / "**" / "*.parquet"), hive_partitioning=False).select(cols).collect()
    digit = [pl.col(c).fill_null(0).cast(pl.Utf8).str.zfill(20) for c in ("digest_hi", "digest_lo")]
    mb = pl.when(pl.col("microbatch") < 0).then(pl.lit("null")).otherwise(pl.col("microbatch").cast(pl.Utf8))
    parts = ['{"event":"tensor","iteration":', "step", ',"microbatch":', mb, ',"name":"', "module", "|", "kind", "|",
             "name", "|", "role", "|", "arg", '","occurrence":', "occurrence", ',"phase":"', "phase", '","rank":', "rank",
             ',"schema_version":1,"sequence":', "seq", ',"tensor":{"mode":"sampled","shape":[',
             pl.col("shape").cast(pl.List(pl.Utf8)).list.join(","), '],"sha256":"', *digit, "0" * 24 + '"}}']  # fmt: skip
    named = set(cols)
    line = pl.concat_str([pl.col(x).cast(pl.Utf8) if isinstance(x, str) and x in named else
                          (pl.lit(x) if isinstance(x, str) else x) for x in parts]).alias("line")  # fmt: skip
    for (rank,), part in df.sort("rank", "seq").partition_by("rank", as_dict=True, maintain_order=True).items():
        (out / f"rank_{rank}.jsonl").write_text("\n".join(part.select(line)["line"].to_list()) + "\n")
    return df.height


def comparator_rows(work: Path, mirror: Path | None) -> None:
    """The 2M pair, identical and late, with this bisect and with the comparator of PR 6610."""
    from detfp_analyze.testing.synth import Plant, SynthSpec, write_pair

    ranks, steps, records = PAIR_2M
    print(f"\n2M pair ({ranks} ranks x {steps} steps x {records} records) against Megatron-LM PR 6610's "
          f"comparator ({MEGATRON[1]}:{MEGATRON[2][0]}), whole processes")  # fmt: skip
    spec = SynthSpec(ranks=ranks, steps=steps, records=records)
    a = work / "2M-a"
    if not (a / ".done").exists():
        shutil.rmtree(a, ignore_errors=True)
        shutil.rmtree(work / "2M-late", ignore_errors=True)
        write_pair(a, work / "2M-late", spec, Plant(rank=5, step=steps - 1, index=records * 3 // 4))
        (a / ".done").write_text("")
    b_same = work / "2M-a-copy"
    if not b_same.exists():
        subprocess.run(["cp", "-al", str(a), str(b_same)], check=True)
    with tempfile.TemporaryDirectory(prefix="detfp-megatron-") as tmp:
        script = _comparator(mirror, Path(tmp)) if mirror is not None else "no --megatron-mirror given"
        if isinstance(script, str):
            print(f"  comparator row skipped: {script}")
            return
        jsonl = {}
        for run in (a, work / "2M-late"):
            jsonl[run] = Path(tmp) / run.name
            _jsonl(run, jsonl[run])
        jsonl[b_same] = jsonl[a]
        for case, b in (("identical", b_same), ("late", work / "2M-late")):
            ours = benchlib.bisect_cli(a, b)
            theirs = benchlib.run_measured([sys.executable, str(script), str(jsonl[a]), str(jsonl[b])])
            verdict = "match" if theirs.code == 0 else "diverged" if theirs.code == 1 else f"exit {theirs.code}"
            print(f"  {case:<10} detfp {ours['wall']:7.2f} s {ours['peak_mib']:7.0f} MiB | comparator "
                  f"{theirs.wall:7.2f} s {theirs.peak_mib:7.0f} MiB ({verdict}) | detfp {theirs.wall / ours['wall']:5.1f}x "
                  f"faster, {theirs.peak_mib / ours['peak_mib']:5.1f}x less memory (goal 100x, 40x)")  # fmt: skip


def _du(path: Path) -> str:
    out = subprocess.run(["du", "-sh", "--apparent-size", str(path)], capture_output=True, text=True).stdout
    return out.split()[0] if out else "?"


def build_index(run: Path) -> str:
    """Build ``run``'s index once (``detfp-analyze index``, measured); '' when it was current."""
    exe = str(Path(sys.executable).with_name("detfp-analyze"))
    if benchlib.run_measured([exe, "index", "--check", str(run)]).code == 0:
        return ""
    m = benchlib.run_measured([exe, "index", str(run)])
    if m.code != 0:
        raise SystemExit(f"detfp-analyze index {run} failed (exit {m.code})")
    return f"{m.wall:.1f} s, {m.peak_mib:.0f} MiB"


def _drop_index(run: Path) -> None:
    """Remove ``run``'s index, beside it and in the user cache (``runindex.cache_dir``)."""
    from detfp_analyze.io.runindex import INDEX_DIR, cache_dir

    for d in (run / INDEX_DIR, cache_dir(run)):
        shutil.rmtree(d, ignore_errors=True)


def first_open(a: Path, b: Path, exp: list, baseline: Path | None, reps: int) -> None:
    """The first bisect of a pair nobody indexed against the bisect of the same pair indexed, per
    tree (this one, and ``baseline`` when given), ``reps`` repeats interleaved: each repeat drops
    both runs' indexes, bisects (this tree's reader fills the index as it parses), makes sure both
    indexes are current (``detfp-analyze index`` of that tree where they are not: the baseline's,
    timed), then bisects again. The ratio is first / indexed of the same repeat (median, and the
    ratio of the best walls)."""
    envs = {"this": {}} if baseline is None else {"base": {"PYTHONPATH": str(baseline.resolve())}, "this": {}}
    if baseline is not None:
        benchlib.byte_compile(baseline.resolve())
    exe = str(Path(sys.executable).with_name("detfp-analyze"))
    got: dict[str, dict[str, list]] = {t: {"first": [], "indexed": [], "build": [], "ratio": []} for t in envs}
    reports = set()
    checks = set()
    for i in range(reps):
        for name in list(envs) if i % 2 == 0 else list(envs)[::-1]:
            env = envs[name]
            for run in (a, b):
                _drop_index(run)
            first = benchlib.bisect_cli(a, b, env)
            build = 0.0
            for run in (a, b):
                if benchlib.run_measured([exe, "index", "--check", str(run)], env).code != 0:
                    m = benchlib.run_measured([exe, "index", str(run)], env)
                    if m.code != 0:
                        raise SystemExit(f"detfp-analyze index {run} failed with the {name} tree (exit {m.code})")
                    build += m.wall
            indexed = benchlib.bisect_cli(a, b, env)
            for res in (first, indexed):
                checks.add(benchlib.check_planted(exp, res))
                reports.add(res.get("report"))
            g = got[name]
            g["first"].append(first["wall"])
            g["indexed"].append(indexed["wall"])
            g["build"].append(build)
            g["ratio"].append(first["wall"] / indexed["wall"])
    print(f"\nfirst bisect of a pair nobody indexed vs the same pair indexed (late pair; whole `detfp-analyze "
          f"bisect --json` processes, {reps} interleaved repeat(s); target first/indexed <= 1.5x)")  # fmt: skip
    head = (f"{'tree':<5} | {'first best':>10} {'med':>6} | {'indexed best':>12} {'med':>6} | "
            f"{'index build (both runs)':>23} | {'first/indexed med':>17} {'of best':>7}")  # fmt: skip
    print(head)
    print("-" * len(head))
    for name, g in got.items():
        build = statistics.median(g["build"])
        built = f"{build:>21.2f} s" if build else f"{'(filled by the first)':>23}"
        print(f"{name:<5} | {min(g['first']):>8.2f} s {statistics.median(g['first']):>6.2f} | "
              f"{min(g['indexed']):>10.2f} s {statistics.median(g['indexed']):>6.2f} | {built} | "
              f"{statistics.median(g['ratio']):>16.2f}x {min(g['first']) / min(g['indexed']):>6.2f}x")  # fmt: skip
    same = "the same report from every bisect" if len(reports) == 1 else "REPORTS DIFFER"
    print(f"planted answer: {'/'.join(sorted(checks))}; {same}; load average after: {benchlib.machine().load}")


def measure(a: Path, b: Path, expected: list, index: bool, flags: tuple[str, ...] = ()) -> dict:
    res = benchlib.bisect_cli(a, b, None, (*flags, *(() if index else ("--no-index",))))
    res["check"] = benchlib.check_planted(expected, res)
    return res


def row(label: str, ranks: int, steps: int, res: dict) -> str:
    us = res["wall"] / (ranks * steps) * 1e6
    return (f"{label:<34} {ranks:>6} {steps:>5} {res['wall']:>8.2f} s {res['peak_mib']:>8.0f} MiB "
            f"{us:>7.2f} us/rank-step  {res['check']}")  # fmt: skip


def compare_code(rows: list[tuple[str, int, int, Path, Path, list | None]], baseline: Path, reps: int) -> None:
    """Each row with this tree and with ``baseline`` (another checkout's root, first on
    PYTHONPATH), ``reps`` repeats interleaved so that a change of load hits both alike; ``exp``
    None: the planted answer is not checked (only that both trees print the same report)."""
    benchlib.byte_compile(baseline.resolve())
    envs = {"base": {"PYTHONPATH": str(baseline.resolve())}, "this": {}}
    head = (f"{'row':<22} {'ranks':>6} {'steps':>5} | {'base best':>9} {'med':>6} {'MiB':>6} | "
            f"{'this best':>9} {'med':>6} {'MiB':>6} | {'this/base':>9} {'MiB':>5} | check")  # fmt: skip
    print(f"\nthis tree ({benchlib.ROOT}) against {baseline}: whole `detfp-analyze bisect --json` processes, "
          f"{reps} interleaved repeats each")  # fmt: skip
    print(head)
    print("-" * len(head), flush=True)
    for label, ranks, steps, a, b, exp in rows:
        runs: dict[str, list[dict]] = {"base": [], "this": []}
        for i in range(reps):
            for name in ("base", "this") if i % 2 == 0 else ("this", "base"):
                runs[name].append(benchlib.bisect_cli(a, b, envs[name]))
        best = {k: min(m["wall"] for m in v) for k, v in runs.items()}
        med = {k: statistics.median(m["wall"] for m in v) for k, v in runs.items()}
        mib = {k: max(m["peak_mib"] for m in v) for k, v in runs.items()}
        checks = {benchlib.check_planted(exp, m) if exp is not None else "" for v in runs.values() for m in v} - {""}
        checks.add("same report" if len({m.get("report") for v in runs.values() for m in v}) == 1 else "REPORTS DIFFER")
        print(f"{label:<22} {ranks:>6} {steps:>5} | {best['base']:>7.2f} s {med['base']:>6.2f} {mib['base']:>6.0f} | "
              f"{best['this']:>7.2f} s {med['this']:>6.2f} {mib['this']:>6.0f} | {best['this'] / best['base']:>9.2f} "
              f"{mib['this'] / mib['base']:>5.2f} | {'/'.join(sorted(checks))}", flush=True)  # fmt: skip
    print(f"load average after: {benchlib.machine().load}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", type=Path, default=None, help="where the pairs are written and reused")
    ap.add_argument("--ranks", type=int, default=2432, help="ranks of the seed pair (default 2432)")
    ap.add_argument("--steps", type=int, default=800, help="steps of the seed pair (default 800)")
    ap.add_argument("--records", type=int, default=20, help="records per rank-step (default 20)")
    ap.add_argument("--step-time", type=float, default=0.5, help="the stated step time, seconds (default 0.5)")
    ap.add_argument("--no-growth", action="store_true", help="skip the growth table")
    ap.add_argument("--no-old-path", action="store_true", help="skip the rows without the run index")
    ap.add_argument(
        "--first-open", action="store_true", help="only the late pair: first bisect without an index vs indexed"
    )
    ap.add_argument("--spark", action="store_true", help="also the identical and late rows on --engine spark")
    ap.add_argument("--generate-only", action="store_true", help="write the pairs, measure nothing")
    ap.add_argument(
        "--megatron-mirror",
        type=Path,
        default=None,
        help="a Git mirror of NVIDIA/Megatron-LM holding refs/pull/6610/head: the comparator row",
    )
    ap.add_argument("--comparator-only", action="store_true", help="only the 2M pair against the comparator")
    ap.add_argument(
        "--baseline",
        type=Path,
        default=None,
        help="another checkout's root: only the seed rows (and growth late rows) side by side with it",
    )
    ap.add_argument("--reps", type=int, default=3, help="interleaved repeats per row with --baseline (default 3)")
    args = ap.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="detfp-seed-"))
    work.mkdir(parents=True, exist_ok=True)
    print(benchlib.machine_line())
    benchlib.byte_compile(Path(__file__).resolve().parents[1])
    if args.comparator_only:
        comparator_rows(work, args.megatron_mirror)
        return
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
    if args.first_open:
        first_open(*cases["late"], args.baseline, args.reps)
        return
    for run in sorted({p for c in cases.values() for p in c[:2]} | {p for g in grid for p in g[3:5]}):
        took = build_index(run)
        if took:
            print(f"  detfp-analyze index {run.name}: {took}")
    if args.baseline is not None:
        rows = [(case, args.ranks, args.steps, *cases[case]) for case in ("identical", "late", "early")]
        rows += [(f"growth {case}", r, s, a, b, exp) for r, s, case, a, b, exp in grid if case == "late"]
        if (work / "2M-late" / ".done").exists() or (work / "2M-a" / ".done").exists():
            # The comparator's 2M pair (comparator_rows), when written: its planted answer is not checked here.
            rows += [(f"2M {case}", PAIR_2M[0], PAIR_2M[1], work / "2M-a", work / b, None)
                     for case, b in (("identical", "2M-a-copy"), ("late", "2M-late"))]  # fmt: skip
        compare_code(rows, args.baseline, args.reps)
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
    comparator_rows(work, args.megatron_mirror)


if __name__ == "__main__":
    main()
