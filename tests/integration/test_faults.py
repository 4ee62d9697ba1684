"""Faults injected into real capturing processes: kills, full disks, size limits, slow disks, races.

Every child is a real process (tests/fixtures/fault_child.py, forked from a forkserver that imported
torch once). The guarantees under test (docs/reliability.md):

* SIGKILL at any point (named kill points across the flush phases, and at random times):
  every committed window stays on disk, readable and equal to the same window of an unkilled
  run (0 committed records lost), and the run reads as incomplete, never as complete;
* disk full, a file-size limit, a read-only or removed directory: training finishes with the
  same loss bits as without capture, capture disables itself with one warning, and the trace
  says it is incomplete and why (as far as the file system still lets it say anything);
* a slow disk slows training down instead of growing memory: the writer's backlog stays
  within max_pending_windows + 2 windows, measured;
* a second launch on the same rank and segment is refused with one line; a resumed launch
  appends a segment; a rank that dies or stops early is named, and nothing hangs.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import random
import shutil
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from detfp_analyze.bisect import bisect
from detfp_analyze.errors import IncompleteRunError, MissingRankError
from detfp_analyze.io.reader import open_run
from detfp_analyze.single.certify import certify
from detfp_analyze.single.summary import summarize, summary_dict
from tests.fixtures.fault_child import FORKSERVER_PRELOAD, train

STEPS = 5  # one flush window per step: windows 0-4
LONG = 60  # steps of the runs killed at random times
TABLES = ("records", "metrics", "events")


class Children:
    """Start children from the forkserver, at most two at a time (the suite shares two cores)."""

    def __init__(self, root: Path) -> None:
        self.ctx = mp.get_context("forkserver")
        self.ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
        self.root = root

    def start(self, name: str, out: str | None = None, **kw):
        """Start child ``name`` writing into run directory ``out`` (default: ``name``)."""
        args = (str(self.root / (out or name)), str(self.root / f"{name}.json"))
        p = self.ctx.Process(target=train, args=args, kwargs=kw)
        p.start()
        return p

    def result(self, name: str) -> dict | None:
        path = self.root / f"{name}.json"
        return json.loads(path.read_text()) if path.exists() else None

    def run(self, jobs: dict[str, dict], timeout: float = 120.0) -> dict[str, tuple[int, dict | None]]:
        """Run ``jobs`` (name -> train kwargs, plus an optional ``kill_at``: (commit lines of rank
        1's log to wait for, extra seconds) before a SIGKILL from here, whatever the machine's load)."""
        out: dict[str, tuple[int, dict | None]] = {}
        todo = list(jobs.items())
        while todo:
            batch, todo = todo[:2], todo[2:]
            procs = []
            for name, kw in batch:
                kw = dict(kw)
                kill_at = kw.pop("kill_at", None)
                procs.append((name, self.start(name, **kw), kill_at))
            for name, p, kill_at in procs:
                if kill_at is not None:
                    log = self.root / name / "manifest" / "rank=1" / "segment-00000.commits"
                    while p.is_alive() and (not log.exists() or log.read_bytes().count(b"\n") < kill_at[0]):
                        time.sleep(0.002)
                    time.sleep(kill_at[1])
                    if p.is_alive():
                        p.kill()
                p.join(timeout)
                if p.is_alive():
                    p.kill()
                    pytest.fail(f"child {name} hung (> {timeout} s)")
                out[name] = (p.exitcode, self.result(name))
        return out


@pytest.fixture(scope="module")
def kids(tmp_path_factory):
    return Children(tmp_path_factory.mktemp("faults"))


@pytest.fixture(scope="module")
def reference(kids):
    """A complete 2-rank run of STEPS steps, a LONG-step rank-1 run, and the losses without capture."""
    got = kids.run(
        {
            "ref0": dict(rank=0, world=2, steps=STEPS),
            "ref1": dict(rank=1, world=2, steps=STEPS),
            "long": dict(rank=1, world=2, steps=LONG),
            "nocap": dict(capture=False, steps=STEPS),
        }
    )
    assert all(code == 0 for code, _ in got.values()), got
    ref = kids.root / "ref"
    for name in ("ref0", "ref1"):
        shutil.copytree(kids.root / name, ref, dirs_exist_ok=True)
    return {"run": ref, "long": kids.root / "long", "losses": got["nocap"][1]["losses"]}


def _windows(run: Path, rank: int = 1) -> dict[int, dict[str, Path]]:
    """window -> table -> shard path, from the files on disk."""
    out: dict[int, dict[str, Path]] = {}
    for table in TABLES:
        for p in (run / table / f"rank={rank}").glob("part-s00000-w*.parquet"):
            out.setdefault(int(p.stem.split("-w")[1]), {})[table] = p
    return out


def _with_rank0(killed: Path, ref: Path) -> None:
    """Complete the killed rank 1's directory with rank 0's complete files: a 2-rank run."""
    for part in ref.glob("*/rank=0"):
        shutil.copytree(part, killed / part.parent.name / "rank=0", dirs_exist_ok=True)


def _check_committed(killed: Path, ref: Path, rank: int = 1) -> tuple[int, int]:
    """Every committed window of ``rank`` equals the reference's; returns (windows, rows) checked."""
    r = open_run(killed, allow_incomplete=True, allow_missing_ranks=True)
    (seg,) = [s for s in r.completeness.segments if s.rank == rank]
    want, have = _windows(ref, rank), _windows(killed, rank)
    rows = 0
    for w in range(seg.windows):
        for table, path in want[w].items():
            expected = pq.read_table(path)
            assert table in have.get(w, {}), f"committed window {w} lost its {table} shard"
            got = pq.read_table(have[w][table])
            assert got.equals(expected), f"committed window {w} {table} differs from the unkilled run"
            rows += got.num_rows
    kept = {p for t in TABLES for p in r.files(t, [rank])}
    assert kept == {p.resolve() for w in range(seg.windows) for p in have[w].values()}  # nothing uncommitted read
    return seg.windows, rows


# Kill point -> (fewest, most) windows committed when it fires ("all": every window of the
# unkilled run): writer points at windows 1 and 3 (21 points in all); the manifest written at
# start (1), rewritten at the first step (2) and at close (3: the writer thread may still be
# behind, any prefix of the windows); the close line.
KILLS = {
    "manifest-mid-write@1": None,  # killed while writing its first manifest: the rank is missing
    "manifest-before-rename@1": None,
    "manifest-mid-write@2": (0, 0),
    "manifest-before-rename@2": (0, 0),
    **{f"{p}@1": (1, 1) for p in ("window-start", "shard-mid-write", "shard-before-rename", "shard-after-rename",
                                  "commit-before", "commit-mid-write")},
    **{f"{p}@3": (3, 3) for p in ("shard-mid-write", "shard-after-rename", "commit-before", "commit-mid-write")},
    "commit-after@1": (2, 2),
    "commit-after@3": (4, 4),
    "manifest-mid-write@3": (0, "all"),
    "manifest-before-rename@3": (0, "all"),
    "close-before": ("all", "all"),
    "close-mid-write": ("all", "all"),
    "close-after": "complete",  # killed after its close line: a complete trace
}  # fmt: skip


def test_sigkill_at_every_kill_point_loses_no_committed_record(kids, reference):
    jobs = {f"kill-{k.replace('@', '-')}": dict(rank=1, world=2, steps=STEPS, fault=f"{k}:kill") for k in KILLS}
    got = kids.run(jobs)
    ref_windows = _windows(reference["run"])
    every = max(ref_windows) + 1  # flush_records=1: at least one window per step
    checked_windows = checked_rows = 0
    for (name, (code, _)), (point, expect) in zip(got.items(), KILLS.items(), strict=True):
        killed = kids.root / name
        assert code == -9, f"{point}: exit {code}, the kill point was never reached"
        _with_rank0(killed, reference["run"])
        if expect is None:
            with pytest.raises(MissingRankError, match="missing rank"):
                open_run(killed)
            assert not _windows(killed)
            continue
        if expect == "complete":
            assert open_run(killed).completeness.complete
            continue
        with pytest.raises(IncompleteRunError, match="rank 1 segment 0: the capture never closed"):
            open_run(killed)
        windows, rows = _check_committed(killed, reference["run"])
        lo, hi = (every if e == "all" else e for e in expect)
        assert lo <= windows <= hi, f"{point}: {windows} windows committed, expected {expect}"
        checked_windows += windows
        checked_rows += rows
        r = open_run(killed, allow_incomplete=True)
        kinds = {g.kind for g in r.completeness.gaps}
        assert "not_closed" in kinds and kinds <= {"not_closed", "uncommitted_window"}, (point, kinds)
        # Steps before the last committed one are kept; that one may have been cut by the kill.
        last = max((pq.read_metadata(p).row_group(0).column(2).statistics.max
                    for w in range(windows) for p in ref_windows[w].values()), default=0)  # fmt: skip
        assert r.excluded[1][0] == (last, None), point
        res = bisect(open_run(reference["run"]), r, allow_incomplete=True)
        assert res.status == "identical" and not res.complete, point
        # Not allowed, the comparison says the run ended early: a run that died never passes.
        assert bisect(open_run(reference["run"]), r).status == "ended_early", point
    print(f"\nkill points: {len(KILLS)}; committed windows checked: {checked_windows}, rows: {checked_rows}, lost: 0")


def test_sigkill_at_random_times_loses_no_committed_record(kids, reference):
    rng = random.Random(14)
    # Killed once the log holds a random number of lines, after a random extra delay: anywhere in
    # a window's write, whatever the load of the machine.
    jobs = {
        f"rand-{i}": dict(rank=1, world=2, steps=LONG, kill_at=(rng.randint(2, 2 * LONG), rng.uniform(0, 0.02)))
        for i in range(4)
    }
    got = kids.run(jobs)
    outcomes = []
    for name, (code, _) in got.items():
        killed = kids.root / name
        if not (killed / "manifest" / "rank=1" / "segment-00000.json").exists():
            assert not _windows(killed)  # killed while starting: nothing was flushed yet
            outcomes.append("while starting")
            continue
        if code == 0:
            assert open_run(killed, allow_missing_ranks=True).completeness.complete
            outcomes.append("after close")
            continue
        with pytest.raises((IncompleteRunError, MissingRankError)):
            open_run(killed, allow_missing_ranks=True)
        windows, _ = _check_committed(killed, reference["long"])
        outcomes.append(f"{windows} windows")
    print(f"\nrandom kills: {outcomes}")


def _one_warning(info: dict) -> str:
    assert len(info["warnings"]) == 1, info["warnings"]
    msg = info["warnings"][0]
    # Said when the training thread first learns of it (a step start, or close), naming the rank.
    assert msg.startswith(("detfp capture disabled on rank 0", "detfp: trace writer failed: rank 0")), msg
    return msg


@pytest.mark.parametrize(
    ("scenario", "kw", "why"),
    [
        ("disk_full", dict(tmpfs=1 << 20, at_step={2: "fill"}), "No space left on device"),
        ("file_size_limit", dict(fsize=48 << 10, at_step={2: "big_probe"}), "File too large"),
        ("read_only", dict(at_step={2: "read_only"}), "Permission denied"),
    ],
)
def test_a_failing_file_system_costs_the_trace_never_the_job(kids, reference, scenario, kw, why):
    code, info = kids.run({scenario: dict(steps=STEPS, **kw)})[scenario]
    assert code == 0 and info["losses"] == reference["losses"]  # training unaffected, bit for bit
    assert why in _one_warning(info)
    run = kids.root / scenario
    with pytest.raises(IncompleteRunError) as err:
        open_run(run)
    assert "rank 0 segment 0: the capture closed incomplete" in str(err.value) and why in str(err.value)
    r = open_run(run, allow_incomplete=True)
    assert r.excluded[0][0][0] <= 2 and r.scan("metrics").collect().height >= 1  # steps before the fault are kept
    print(f"\n{scenario}: mode {info['mode'] or 'real'}; trace says: {r.completeness.gaps[0].detail[:120]}")


def test_a_run_directory_removed_mid_run_is_not_recreated(kids, reference):
    code, info = kids.run({"removed": dict(steps=STEPS, at_step={2: "remove"})})["removed"]
    assert code == 0 and info["losses"] == reference["losses"]
    assert "No such file or directory" in _one_warning(info)
    assert not (kids.root / "removed").exists()


def test_a_slow_file_system_bounds_memory_and_never_deadlocks(kids):
    # Every step flushes a window holding a 512-row digest probe (~40 KiB of Python objects);
    # the disk takes 25 ms per shard. Without backpressure 18 steps would hold 18 windows.
    slow, kw = "shard-before-rename:sleep=0.025", dict(level="metrics", measure=True, probe_rows=512)
    jobs = {
        "fast": dict(steps=18, **kw),
        "slow-6": dict(steps=6, fault=slow, **kw),
        "slow-18": dict(steps=18, fault=slow, **kw),
    }
    got = {k: v[1] for k, v in kids.run(jobs).items()}
    for name in jobs:
        assert open_run(kids.root / name).completeness.complete, name  # everything flushed arrived
    fast, s6, s18 = got["fast"], got["slow-6"], got["slow-18"]
    assert 4 <= s18["peak_pending"] <= 4 + 2  # the queue filled (backpressure engaged) and never overflowed
    assert s18["seconds"] > fast["seconds"]  # training waited for the disk instead of buffering
    per_step = (s18["traced_peak"] - s6["traced_peak"]) / 12
    # Three times the steps, about the same peak: far less than one window per extra step.
    assert s18["traced_peak"] < s6["traced_peak"] * 1.25, (s6, s18)
    print(
        f"\nslow FS (25 ms per shard, ~40 KiB windows): peak backlog {s18['peak_pending']} windows; traced peak "
        f"{s6['traced_peak'] >> 10} KiB at 6 steps, {s18['traced_peak'] >> 10} KiB at 18 steps "
        f"({per_step / 1024:+.1f} KiB per extra step), fast disk {fast['traced_peak'] >> 10} KiB; "
        f"{s18['seconds'] / 18 * 1e3:.0f} ms per step vs {fast['seconds'] / 18 * 1e3:.0f} ms"
    )


def test_second_session_on_a_directory_is_refused_and_the_first_completes(kids):
    first = kids.start("first", out="shared", steps=10, step_sleep=0.05)
    manifest = kids.root / "shared" / "manifest" / "rank=0" / "segment-00000.json"
    deadline = time.monotonic() + 60
    while not manifest.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    second = kids.start("second", out="shared", steps=3)  # same directory, same rank: another job's mistake
    second.join(60)
    first.join(60)
    assert first.exitcode == 0 and second.exitcode == 0
    msg = kids.result("second")["refused"]
    assert "\n" not in msg and "already holds a trace for rank 0" in msg
    assert "refused" not in kids.result("first")
    r = open_run(kids.root / "shared")  # the first job's trace is untouched and complete
    assert r.completeness.complete and r.scan("metrics").collect().height == 10


def test_resumed_launches_append_segments(kids):
    got = kids.run({"resumed": dict(steps=5), "crashed": dict(steps=5, at_step={3: "die"})})
    assert got["resumed"][0] == 0 and got["crashed"][0] == -9
    # Resumed from checkpoints: after the clean run from step 3, after the crash (at step 3) from step 2.
    got = kids.run(
        {"resumed": dict(steps=4, first_step=3, append=True), "crashed": dict(steps=5, first_step=2, append=True)}
    )
    for name, cut in (("resumed", 3), ("crashed", 2)):
        r = open_run(kids.root / name)  # the crash's incomplete tail was captured again by the resume
        assert r.completeness.complete and r.segments(0) == (0, 1), name
        steps = r.scan("metrics").select("step", "segment").collect()
        assert steps["step"].to_list() == list(range(7)), name
        assert steps.filter(steps["step"] >= cut)["segment"].unique().to_list() == [1]


@pytest.mark.multirank
def test_a_rank_that_dies_or_stops_early_is_named_and_nothing_hangs(kids):
    pg = kids.root / "pg-died"
    jobs = {
        "died-0": dict(out="died", rank=0, world=2, steps=6, gloo=str(pg), collective_steps=2),
        "died-1": dict(out="died", rank=1, world=2, steps=6, gloo=str(pg), collective_steps=2, at_step={4: "die"}),
    }  # fmt: skip
    got = kids.run(jobs, timeout=60)
    assert got["died-0"][0] == 0 and got["died-1"][0] == -9
    run = kids.root / "died"
    with pytest.raises(IncompleteRunError, match="rank 1 segment 0: the capture never closed"):
        open_run(run)
    res = certify(run)
    assert {(p.kind, p.rank) for p in res.problems if p.kind == "not_closed"} == {("not_closed", 1)}
    assert {p.step for p in res.problems if p.kind == "incomplete_step" and p.rank == 1} == {4, 5}
    summary = summary_dict(summarize(open_run(run, allow_incomplete=True)))["completeness"]
    assert summary["0"] == "complete" and summary["1"].startswith("incomplete: not_closed")
    # Ranks that stop at different steps, both closing cleanly: complete, and certify names the gap.
    pg = kids.root / "pg-early"
    jobs = {
        "early-0": dict(out="early", rank=0, world=2, steps=6, gloo=str(pg), collective_steps=2),
        "early-1": dict(out="early", rank=1, world=2, steps=3, gloo=str(pg), collective_steps=2),
    }
    got = kids.run(jobs, timeout=60)
    assert [c for c, _ in got.values()] == [0, 0]
    run = kids.root / "early"
    assert open_run(run).completeness.complete
    steps = {p.step for p in certify(run).problems if p.kind == "incomplete_step" and p.rank == 1}
    assert steps == {3, 4, 5}
