"""The hostile-input corpus, part two: special files, a live writer, and captures killed with SIGKILL.

* Special files in place of a run's files (a named pipe, a link to ``/dev/zero``, a directory, a
  socket, a dangling link, a link loop) and in place of the run itself: the command answers within
  its deadline (a pipe opened for reading would block forever), refused in one line, or, where the
  file is the run index (a cache) or a link to a regular file, with the undamaged answer.
* A capture still running (a child process writing a window per step): ``bisect`` refuses it
  (never closed), ``--allow-incomplete`` answers on the steps it committed and nothing else (the
  reference run's answer: identical; ``window.steps`` within the committed steps), ``certify``
  and ``index`` answer without a traceback, however the reads interleave with the writer.
* SIGKILL at random points of a capture, several seeds: exit 2, or with ``--allow-incomplete``
  the correct answer on the committed steps (identical to the unkilled run), on both read paths.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import socket
import time
from pathlib import Path

import pytest

from detfp_format import commitlog
from tests.fixtures.fault_child import FORKSERVER_PRELOAD, train
from tests.fixtures.hostile import capture_pair, decided, invoke, reset, shard

LONG = 30  # steps of the killed and the live captures (one window per step)
SEEDS = (3, 11, 23, 57)  # the random kills
RECORDS_PATH = ("--no-step-sums", "--no-stored-rollups")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile_live")
    got = capture_pair(root / "runs")
    truth = decided(invoke("bisect", got["a"], got["b"], "--json").doc())
    return got, root / "work", truth


# ------------------------------------------------------------------------------ special files
def _fifo(p: Path) -> None:
    os.mkfifo(p)


def _zero(p: Path) -> None:
    p.symlink_to("/dev/zero")


def _directory(p: Path) -> None:
    p.mkdir()


def _socket(p: Path) -> None:
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(p))
    s.close()


def _dangling(p: Path) -> None:
    p.symlink_to(p.with_name("nowhere"))


def _loop(p: Path) -> None:
    p.symlink_to(p.name)


def _link_to_copy(p: Path) -> None:
    """A link to a regular file with the same bytes elsewhere (links are followed: allowed)."""
    keep = p.parent.parent.parent / f".{p.parent.name}-{p.name}"
    keep.write_bytes(p.read_bytes())
    p.unlink()
    p.symlink_to(keep)


KINDS = {"fifo": _fifo, "zero": _zero, "dir": _directory, "socket": _socket, "dangling": _dangling, "loop": _loop}
TARGETS = {
    "manifest": lambda w: w / "manifest" / "rank=1" / "segment-00000.json",
    "commit_log": lambda w: w / commitlog.commit_log_relpath(1, 0),
    "records_shard": lambda w: shard(w, "records", 1, 0),
    "metrics_shard": lambda w: shard(w, "metrics", 0, 0),
}
SPECIAL = [(t, k) for t in TARGETS for k in KINDS] + [
    ("partition", "fifo"), ("run", "fifo"), ("index.json", "fifo"), ("folds.arrow", "fifo"), ("index.seal", "zero"),
    ("records_shard", "link_to_copy"), ("manifest", "link_to_copy"),
]  # fmt: skip


@pytest.mark.parametrize(("target", "kind"), SPECIAL, ids=[f"{t}-{k}" for t, k in SPECIAL])
def test_special_files_never_block_and_are_refused(runs, target, kind):
    got, work, truth = runs
    reset(got["b"], work)
    run = work
    if target in ("index.json", "folds.arrow", "index.seal"):
        assert invoke("index", work).code == 0
        p = work / "_detfp_index" / target
    elif target == "partition":
        p = work / "records" / "rank=1"
        for f in p.iterdir():
            f.unlink()
        p.rmdir()
    elif target == "run":
        p = work.with_name("run-fifo")
        run = p
        if p.exists() or p.is_symlink():
            p.unlink()
    else:
        p = TARGETS[target](work)
    if p.exists() and not p.is_dir() and target != "run" and kind != "link_to_copy":
        p.unlink()
    (KINDS.get(kind) or _link_to_copy)(p)
    out = invoke("bisect", got["a"], run, "--json", seconds=30)
    if target in ("index.json", "folds.arrow", "index.seal") or kind == "link_to_copy":
        assert out.code == 0 and decided(out.doc()) == truth, out
        return
    assert out.refused, out
    expect = {
        "fifo": ("not a regular file", "not a directory", "not a Parquet file"),
        "zero": ("not a regular file",),
        "dir": ("not a regular file", "unreadable", "not a Parquet file"),
        "socket": ("not a regular file", "no such directory", "not a directory"),
        "dangling": ("dangling", "unreadable", "not a regular file", "missing"),
        "loop": ("link loop", "unreadable", "not a regular file", "missing"),
    }[kind]
    assert any(e in out.err for e in expect), out


# ------------------------------------------------------------------------------ live writer
@pytest.fixture(scope="module")
def children(tmp_path_factory):
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
    return ctx, tmp_path_factory.mktemp("children")


def _start(children, name: str, **kw):
    ctx, root = children
    p = ctx.Process(target=train, args=(str(root / name), str(root / f"{name}.json")), kwargs=kw)
    p.start()
    return p, root / name


def _finish(p, seconds: float = 120) -> None:
    p.join(seconds)
    if p.is_alive():
        p.kill()
        pytest.fail("a capture child hung")


@pytest.fixture(scope="module")
def reference(children):
    """The job the live and killed captures run, captured whole."""
    p, out = _start(children, "reference", steps=LONG, level="boundaries")
    _finish(p)
    assert p.exitcode == 0
    return out


def _lines(run: Path) -> int:
    log = run / commitlog.commit_log_relpath(0, 0)
    return log.read_bytes().count(b"\n") if log.exists() else 0


def _committed_last(run: Path) -> int | None:
    """The last step of the committed windows of a killed or live capture (None: none)."""
    state = commitlog.parse((run / commitlog.commit_log_relpath(0, 0)).read_bytes())
    spans = [span for _, span in state.windows.values() if span is not None]
    return max((hi for _, hi in spans), default=None)


def _on_committed_steps(reference: Path, run: Path, flags: tuple[str, ...] = ()) -> str:
    """``bisect --allow-incomplete`` of a partial capture of the reference's job: refused, or
    identical on steps the commit log committed (the last committed step left out: it may be
    unfinished), never diverged. Returns what happened."""
    last = _committed_last(run) if (run / commitlog.commit_log_relpath(0, 0)).exists() else None
    out = invoke("bisect", reference, run, "--json", "--allow-incomplete", *flags)
    if out.refused:
        return "refused"
    doc = out.doc()
    assert doc["status"] == "identical", out
    lo, hi = doc["window"]["steps"]
    assert last is not None and 0 <= lo <= hi <= last, (doc["window"], last)
    return f"identical on steps {lo}-{hi}"


def test_a_live_capture_is_refused_or_answered_on_committed_steps(children, reference):
    p, live = _start(children, "live", steps=LONG, level="boundaries", step_sleep=0.03)
    rng = random.Random(5)
    seen = []
    try:
        while not live.exists() and p.is_alive():
            time.sleep(0.01)
        for _ in range(8):
            time.sleep(rng.uniform(0, 0.15))
            whole = invoke("bisect", reference, live, "--json")
            finished = not p.is_alive() and p.exitcode == 0
            assert whole.refused or (whole.code == 0 and finished), whole
            seen.append(_on_committed_steps(reference, live))
            cert = invoke("certify", live, "--json")
            assert cert.refused or cert.code in (0, 1), cert
            idx = invoke("index", live)
            assert idx.refused or idx.code == 0, idx
    finally:
        _finish(p)
    assert p.exitcode == 0
    # Once the capture closed, the indexes built while it ran are stale or current, never wrong.
    final = invoke("bisect", reference, live, "--json")
    assert final.code == 0 and final.doc()["status"] == "identical", final
    print(f"\nlive probes: {seen}")


# ------------------------------------------------------------------------------ SIGKILL
@pytest.mark.parametrize("seed", SEEDS)
def test_sigkill_at_a_random_point_is_refused_or_answered_on_committed_steps(children, reference, seed):
    rng = random.Random(seed)
    lines, delay = rng.randint(2, 2 * LONG), rng.uniform(0, 0.05)
    p, killed = _start(children, f"killed{seed}", steps=LONG, level="boundaries")
    try:
        while p.is_alive() and _lines(killed) < lines:
            time.sleep(0.002)
        time.sleep(delay)
        if p.is_alive():
            p.kill()
    finally:
        _finish(p)
    whole = invoke("bisect", reference, killed, "--json")
    if p.exitcode == 0:  # it finished before the kill: a complete run of the same job
        assert whole.code == 0 and whole.doc()["status"] == "identical", whole
        return
    assert whole.refused, whole
    got = [_on_committed_steps(reference, killed, flags) for flags in ((), RECORDS_PATH)]
    cert = invoke("certify", killed, "--json")
    assert cert.refused or any(x["kind"] == "not_closed" for x in cert.doc()["problems"]), cert
    print(f"\nseed {seed}: killed after {lines} lines + {delay:.3f} s: {got}")
    assert json.dumps(got)  # both paths gave an answer or a refusal, checked above
