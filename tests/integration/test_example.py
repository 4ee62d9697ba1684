"""The real multi-rank example (examples/train_tiny.py) end to end: capture, traces, bisect.

Launching ranks costs seconds, so one module-scoped fixture runs every job once (2 ranks,
gloo, CPU; one 4-rank job) and the tests assert many things per job:

* valid per-rank traces at every level (ranks, tables, record kinds, recompute phase,
  collectives and DDP gradient reduction, metric bits), with 2 and 4 ranks;
* capture never perturbs: losses and final parameters equal a capture-off job;
* two unplanted jobs are record-for-record identical, one launch on each digest route;
* each planted cause lands where expected, and ``bisect`` names it (step, op, verdict,
  pattern, difference kind). A changed sample on one rank and a resume with and without the
  RNG state are checked on the example's recorded pairs (``test_example_samples.py``) and on
  five third-party stacks live (``test_zoo.py``).

The 4-rank job runs the example script under ``torchrun``; the 2-rank jobs, to save a torch
import per job, run in two launches of plain processes given the same environment torchrun
provides (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), each process running its
launch's jobs in turn (``tests/fixtures/example_many.py``).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import shutil
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pytest

from detfp_analyze.io import stepsums
from detfp_analyze.io.reader import open_run
from detfp_capture._digest import native
from tests import native_half
from tests.fixtures.shards import fold_shards

# The shared fixture launches every job inside the first test's setup: allow it more than
# the suite's default per-test timeout on a busy 2-core machine.
pytestmark = [pytest.mark.multirank, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = str(ROOT / "examples" / "train_tiny.py")
CLI = [sys.executable, "-m", "detfp_analyze"]
TIMEOUT = 240


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    return env


def _torchrun(args: list[str], nproc: int) -> str:
    """Run the example script under torchrun on ``nproc`` ranks; return the combined stdout."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", EXAMPLE, *args]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=TIMEOUT, cwd=ROOT)
    if proc.returncode != 0:
        raise AssertionError(f"torchrun {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc.stdout


def _launch_many(runs: dict[str, list[str]], root: Path, tag: str, nproc: int = 2) -> dict[str, str]:
    """Run the example jobs ``{name: args}`` on ``nproc`` ranks: one plain process per rank with
    the environment torchrun sets, each running every job in turn (``example_many.py``);
    return each job's combined stdout, ranks in order (rank 0 logs the losses)."""
    socks = [socket.socket() for _ in runs]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        ports = [s.getsockname()[1] for s in socks]  # distinct: all held open while picked
    finally:
        for s in socks:
            s.close()
    spec = [
        {"port": port, "argv": args, "stdout": str(root / name)}
        for port, (name, args) in zip(ports, runs.items(), strict=True)
    ]
    (root / f"runs-{tag}.json").write_text(json.dumps(spec))
    procs = []
    for rank in range(nproc):
        env = _env()
        env.update(LAUNCH_ENV.get(tag, {}))
        env.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(nproc),
            LOCAL_WORLD_SIZE=str(nproc),
            MASTER_ADDR="127.0.0.1",
        )
        cmd = [sys.executable, "-m", "tests.fixtures.example_many", str(root / f"runs-{tag}.json")]  # cwd: ROOT
        procs.append(subprocess.Popen(cmd, env=env, cwd=ROOT, text=True, stderr=subprocess.PIPE))
    for rank, p in enumerate(procs):
        try:
            _, err = p.communicate(timeout=TIMEOUT * len(runs))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        if p.returncode != 0:
            for q in procs:
                q.kill()
            raise AssertionError(f"rank {rank} of launch {tag} {list(runs)} failed ({p.returncode}):\n{err[-4000:]}")
    return {name: "".join((root / f"{name}.rank{r}.stdout").read_text() for r in range(nproc)) for name in runs}


NONDET = "nondet_op,uninit,async_early"
V1 = ["--digest-version", "1"]
# name -> (example arguments, ranks, launch). The jobs of one launch share one process per rank
# (``_launch_many``), in this order; "torchrun" runs the example script itself under torchrun.
# The two runs of every compared pair (a/b, nondet_a/nondet_b) are in different launches, so
# in different processes (their own hash seeds, urandom-seeded plants and allocator), and the
# capture-off job is the first of its launch: no capture ran in its process before it.
#: Each launch's digest route on CPU (``DETFP_NATIVE``): the compared pairs (a/b, nondet_a/nondet_b)
#: take different routes where the native kernel is built, and must still be identical (or name
#: the planted cause, nothing else): the route is a speed decision, never a difference.
LAUNCH_ENV = {"p1": {"DETFP_NATIVE": "1"}, "p2": {"DETFP_NATIVE": "0"}}
JOBS = {
    "a": (["--level", "boundaries", "--steps", "3", "--rows"], 2, "p1"),
    "off": (["--steps", "3"], 2, "p2"),
    "b": (["--level", "boundaries", "--steps", "3", "--rows"], 2, "p2"),
    "metrics": (["--level", "metrics", "--steps", "3"], 2, "p2"),
    "four": (["--level", "boundaries", "--steps", "2"], 4, "torchrun"),
    # The ops-level pair also carries the hazard plants: they change no numbers, and the
    # uninitialized read comes before the planted combine, so bisect must look past it.
    # Digest version 1 (the other jobs: version 2, the default): the planted pair must name the
    # same causes on either version, and a run of each version must never be compared.
    "nondet_a": (["--level", "ops", "--steps", "2", "--kernels", "1", "--plant", NONDET, *V1], 2, "p1"),
    "nondet_b": (["--level", "ops", "--steps", "2", "--plant", NONDET, *V1], 2, "p2"),
    "moe_permute": (["--level", "boundaries", "--steps", "3", "--rows", "--plant", "moe_permute"], 2, "p2"),
}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> dict[str, tuple[Path, str]]:
    """Every job run once: name -> (trace directory, stdout)."""
    # DETFP_EXAMPLE_JOBS=DIR keeps the jobs in DIR and reuses those already there (for iterating
    # on the assertions); by default every session starts from scratch.
    keep = os.environ.get("DETFP_EXAMPLE_JOBS")
    root = Path(keep) if keep else tmp_path_factory.mktemp("example")
    root.mkdir(parents=True, exist_ok=True)

    def argv(name: str) -> list[str]:
        args = list(JOBS[name][0])
        return args if name == "off" else [*args, "--out", str(root / name)]

    def run(launch: str) -> dict[str, str]:
        names = [n for n, (_, _, how) in JOBS.items() if how == launch]
        logs = {n: root / f"{n}.stdout" for n in names}
        if keep and all(log.exists() for log in logs.values()):
            return {n: log.read_text() for n, log in logs.items()}
        for n in names:
            shutil.rmtree(root / n, ignore_errors=True)  # a half-written trace of an interrupted session
        t0 = time.perf_counter()
        if launch == "torchrun":
            out = {n: _torchrun(argv(n), JOBS[n][1]) for n in names}
        else:
            out = _launch_many({n: argv(n) for n in names}, root, launch, nproc=JOBS[names[0]][1])
        print(f"launch {launch} {names}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        if keep:
            for n, text in out.items():
                logs[n].write_text(text)
        return out

    # Two launches at a time: one launch's start-up (imports, rendezvous) overlaps another's training.
    launches = sorted({how for _, _, how in JOBS.values()})
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        stdout = {n: text for got in pool.map(run, launches) for n, text in got.items()}
    return {n: (root / n, stdout[n]) for n in JOBS}


def _records(path: Path) -> pl.DataFrame:
    return open_run(path).scan("records").collect()


def _losses(stdout: str) -> dict[int, str]:
    return {int(m[1]): m[2] for m in re.finditer(r"^step (\d+) loss \S+ bits ([0-9a-f]{16})", stdout, re.M)}


def _final(stdout: str) -> set[str]:
    return set(re.findall(r"final params sha256 ([0-9a-f]{64})", stdout))


def _bisect(a: Path, b: Path) -> dict:
    from detfp_analyze.bisect import bisect

    return bisect(open_run(a), open_run(b)).to_json_dict()


# ----------------------------------------------------------------------------- traces


BOUNDARY_KINDS = {
    "batch",
    "module_input",
    "module_output",
    "param",
    "grad",
    "optimizer_state",
    "rng_state",
    "probe",
    "collective",
    "reduced_grad",
}


def test_every_level_writes_valid_two_rank_traces(jobs):
    kinds = {}
    for level, name in (("metrics", "metrics"), ("boundaries", "a"), ("ops", "nondet_a")):
        run = open_run(jobs[name][0])
        assert run.world_size == 2 and run.ranks == (0, 1), level
        assert {"records", "metrics", "events"} <= run.tables
        assert run.manifest(1)["capture"]["level"] == level
        rec = _records(jobs[name][0])
        kinds[level] = set(rec["kind"].unique())
        # seq is each rank's execution order: strictly increasing within the rank.
        for rank in (0, 1):
            seq = rec.filter(pl.col("rank") == rank)["seq"]
            assert seq.n_unique() == seq.len(), (level, rank)
        assert rec.filter(pl.col("status") == "error").height == 0, level
        steps = 2 if level == "ops" else 3
        ev = open_run(jobs[name][0]).scan("events").collect()
        for rank in (0, 1):
            for typ in ("step_begin", "step_end"):
                got = ev.filter((pl.col("rank") == rank) & (pl.col("type") == typ))["step"].sort().to_list()
                assert got == list(range(steps)), (level, rank, typ)
        met = open_run(jobs[name][0]).scan("metrics").collect()
        assert met.group_by("rank", "step").agg(pl.col("name").sort())["name"].to_list() == [
            sorted(["loss", "lm_loss", "load_balancing_loss", "grad_norm", "lr"])
        ] * (2 * steps)
        # bits are the raw IEEE-754 bits of value.
        for value, bits in met.select("value", "bits").iter_rows():
            assert struct.unpack("<Q", struct.pack("<d", value))[0] == bits
        # The commit lines' step folds are those of the shards written (the bisect trusts them).
        held = stepsums.pair(run, run, run.ranks, 0, steps)
        assert held is not None and stepsums.as_dict(held[0]) == fold_shards(jobs[name][0]), level
    assert {"param", "rng_state"} <= kinds["metrics"]
    assert not kinds["metrics"] & {"op", "module_input", "module_output", "collective"}
    assert kinds["boundaries"] >= BOUNDARY_KINDS, BOUNDARY_KINDS - kinds["boundaries"]
    assert "op" not in kinds["boundaries"]
    assert BOUNDARY_KINDS | {"op"} <= kinds["ops"]

    rec = _records(jobs["a"][0])
    assert {"forward", "backward", "recompute", "optimizer", "step"} <= set(rec["phase"].unique())
    # The loss all_reduce is a Python collective; DDP's bucket all-reduce arrives as reduced_grad.
    coll = rec.filter(pl.col("kind") == "collective")
    assert any(n.startswith("all_reduce") for n in coll["name"].unique())
    assert rec.filter(pl.col("kind") == "reduced_grad").height > 0
    # Row digests on the MoE probes (--rows): one per dispatched (token, expert) pair.
    probe = rec.filter((pl.col("kind") == "probe") & (pl.col("name") == "moe.dispatch"))
    assert probe.height > 0 and probe["rows"].list.len().min() == probe["shape"].list.first().min()

    ops = _records(jobs["nondet_a"][0])
    names = set(ops.filter(pl.col("kind") == "op")["name"].unique())
    assert any("index_add" in n for n in names) and any("mm" in n for n in names)
    assert "recompute" in set(ops.filter(pl.col("kind") == "op")["phase"].unique())
    kernels = open_run(jobs["nondet_a"][0]).scan("kernels").collect()
    assert kernels.height > 0 and set(kernels["step"].unique()) == {1}


def test_four_ranks_agree_where_ddp_says_they_must(jobs):
    run = open_run(jobs["four"][0])
    assert run.world_size == 4 and run.ranks == (0, 1, 2, 3)
    rec = _records(jobs["four"][0])
    assert set(rec["kind"].unique()) >= BOUNDARY_KINDS
    # Parameters after each step and the clipped-gradient norm are identical on every rank.
    params = rec.filter((pl.col("kind") == "param") & (pl.col("phase") == "step"))
    per_key = params.group_by("step", "key_hash").agg(pl.struct("digest_hi", "digest_lo").n_unique().alias("n"))
    assert per_key["n"].max() == 1 and params["rank"].n_unique() == 4
    met = run.scan("metrics").collect().filter(pl.col("name") == "grad_norm")
    assert met.group_by("step").agg(pl.col("bits").n_unique())["bits"].max() == 1
    # Losses differ per rank (each rank has its own data), so the metric really is per rank.
    loss = run.scan("metrics").collect().filter(pl.col("name") == "lm_loss")
    assert loss.group_by("step").agg(pl.col("bits").n_unique())["bits"].min() == 4
    # Every rank recorded the loss all_reduce of every step.
    coll = rec.filter((pl.col("kind") == "collective") & pl.col("name").str.starts_with("all_reduce"))
    assert set(coll["rank"].unique()) == {0, 1, 2, 3}


def test_capture_never_perturbs(jobs):
    off = jobs["off"][1]
    assert len(_losses(off)) == 3 and len(_final(off)) == 1
    for name in ("a", "b", "metrics"):
        assert _losses(jobs[name][1]) == _losses(off), name
        assert _final(jobs[name][1]) == _final(off), name
    # ops level: step 0, before the planted nondeterministic combine.
    assert _losses(jobs["nondet_a"][1])[0] == _losses(off)[0]


def test_two_unplanted_runs_are_record_for_record_identical(jobs):
    key = ["rank", "step", "key_hash"]
    a, b = _records(jobs["a"][0]), _records(jobs["b"][0])
    assert a.height == b.height > 0
    joined = a.join(b, on=key, how="full", suffix="_b", coalesce=True)
    assert joined.height == a.height  # no record on one side only
    cols = ["digest_hi", "digest_lo", "rows", "status", "seq"]
    for c in cols:
        assert joined.filter(pl.col(c).ne_missing(pl.col(f"{c}_b"))).height == 0, c
    ma, mb = (open_run(jobs[n][0]).scan("metrics").collect().sort("rank", "seq") for n in ("a", "b"))
    assert ma["bits"].to_list() == mb["bits"].to_list()
    result = _bisect(jobs["a"][0], jobs["b"][0])
    assert result["status"] == "identical" and result["first_step"] is None
    # ... across digest routes: a's launch ran the native kernel where it is built, b's torch's GEMM
    routes = {n: set(re.findall(r"^digest route: (.+)$", jobs[n][1], re.M)) for n in ("a", "b")}
    assert len(routes["a"]) == len(routes["b"]) == 1 and not next(iter(routes["b"])).startswith("native")
    if native_half.present(native._lanes is not None, native_half.DIGEST):  # DETFP_NATIVE=1: a's launch used it
        assert next(iter(routes["a"])).startswith("native kernel")


# ----------------------------------------------------------------------------- planted causes


def _digests(rec: pl.DataFrame, **eq) -> pl.DataFrame:
    cond = pl.lit(True)
    for k, v in eq.items():
        cond &= pl.col(k) == v
    return (
        rec.filter(cond).select("rank", "step", "key_hash", "digest_hi", "digest_lo", "rows").sort("rank", "key_hash")
    )


def test_hazard_plants_land_as_flags_and_events(jobs):
    # Planted from step 1 on: the MoE load table read by max() with a slot never written, and
    # the loss all_reduce's buffer read (mul) before wait(). Step 0 runs the same code unplanted.
    ev = open_run(jobs["nondet_a"][0]).scan("events").collect().filter(pl.col("type") == "hazard")
    uninit = ev.filter(pl.col("name") == "uninitialized")
    assert set(uninit["step"].unique()) == {1} and set(uninit["rank"].unique()) == {0, 1}
    assert set(uninit["module"].unique()) == {"blocks.0.moe", "blocks.1.moe"}
    early = ev.filter(pl.col("name") == "async_pending")
    assert set(early["step"].unique()) == {1} and set(early["rank"].unique()) == {0, 1}
    rec = _records(jobs["nondet_a"][0])
    flagged = rec.filter(pl.col("hazards").list.len() > 0).explode("hazards")
    reads = flagged.filter(
        (pl.col("role") == "input") & (pl.col("hazards") == "uninitialized") & (pl.col("name") == "aten::max.default")
    )
    assert set(reads["step"].unique()) == {1} and reads["module"].str.ends_with("moe").all()
    pending = flagged.filter(pl.col("hazards") == "async_pending")
    assert set(pending["step"].unique()) == {1} and set(pending["name"].unique()) == {"aten::mul.Tensor"}
    # The unplanted pair's boundaries trace carries neither hazard.
    a = _records(jobs["a"][0]).explode("hazards")
    assert not {"uninitialized", "async_pending"} & set(a["hazards"].drop_nulls().unique())


def test_nondet_op_is_an_origin_at_the_combine_on_every_rank(jobs):
    a, b = _records(jobs["nondet_a"][0]), _records(jobs["nondet_b"][0])
    same0 = _digests(a, step=0).equals(_digests(b, step=0))
    assert same0, "step 0 (before the plant) must be identical"
    assert not _digests(a, step=1).equals(_digests(b, step=1))
    r = _bisect(jobs["nondet_a"][0], jobs["nondet_b"][0])
    assert r["status"] == "diverged" and r["first_step"] == 1
    assert r["diagnosis"]["pattern"] == "all_ranks_same_op"
    assert sorted(r["diagnosis"]["origin_ranks"]) == [0, 1]
    for rank in r["ranks"]:
        assert rank["verdict"] == "origin" and rank["step"] == 1 and rank["phase"] == "forward"
        assert "index_add" in rank["op"] and rank["module"].endswith("blocks.0.moe")


def test_moe_permute_is_a_permutation_of_the_dispatch_rows(jobs):
    a, b = _records(jobs["a"][0]), _records(jobs["moe_permute"][0])
    pa = _digests(a, kind="probe", name="moe.dispatch", step=1)
    pb = _digests(b, kind="probe", name="moe.dispatch", step=1)
    assert pa.height == pb.height > 0
    for ra, rb in zip(pa["rows"].to_list(), pb["rows"].to_list(), strict=True):
        assert ra != rb and sorted(ra) == sorted(rb)
    # The combine result is unchanged: every MoE output of step 1's forward matches.
    out = {"kind": "module_output", "phase": "forward", "step": 1}
    moe_a = _digests(a, **out).join(
        a.filter(pl.col("module").str.ends_with("moe")).select("key_hash").unique(), on="key_hash"
    )
    moe_b = _digests(b, **out).join(
        b.filter(pl.col("module").str.ends_with("moe")).select("key_hash").unique(), on="key_hash"
    )
    assert moe_a.height > 0 and moe_a.drop("rows").equals(moe_b.drop("rows"))
    r = _bisect(jobs["a"][0], jobs["moe_permute"][0])
    assert r["first_step"] == 1 and r["diff"]["kind"] == "permutation"
    assert {x["kind"] for x in r["ranks"] if x["step"] == 1} == {"probe"}


# ----------------------------------------------------------------------------- the CLI


def _cli(*args) -> tuple[int, str, str]:
    """The command in this process (its exit code as ``SystemExit`` carries it)."""
    from typer.testing import CliRunner

    from detfp_analyze.cli import app

    r = CliRunner().invoke(app, [str(x) for x in args])
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    return r.exit_code, r.stdout, r.stderr


def test_cli_exit_codes(jobs):
    # One real process, the command a CI gate runs on the live pair: its exit status is the
    # process's. The other exit codes through real processes: test_example_samples.py (0, 1) and
    # test_malformed.py (2); here they run in this process, on the live traces.
    same = subprocess.run([*CLI, "bisect", str(jobs["a"][0]), str(jobs["b"][0])], capture_output=True, text=True)
    assert same.returncode == 0, same.stderr
    code, out, err = _cli("bisect", "--json", jobs["nondet_a"][0], jobs["nondet_b"][0])
    assert code == 1, err
    assert json.loads(out)["diagnosis"]["pattern"] == "all_ranks_same_op"
    code, _, err = _cli("bisect", jobs["a"][0], jobs["a"][0].parent / "nope")
    assert code == 2 and "nope" in err
    # A run of digest version 2 against one of version 1: refused in one line naming both
    # versions and how to recapture, whatever is forced.
    a, v1 = jobs["a"][0], jobs["nondet_a"][0]
    assert [open_run(p).manifest(0)["digest_version"] for p in (a, v1)] == [2, 1]
    code, out, err = _cli("bisect", "--force", a, v1)
    assert code == 2 and not out and err.count("\n") == 1, err
    assert "digest version 2 (detfp-tlh128) vs 1 (detfp-tlh128)" in err and "--digest-version 1" in err, err
    code, _, err = _cli("summary", jobs["a"][0])
    assert code == 0, err
