"""Seed-shaped synthetic runs, written window by window with vectorized columns (torch-free).

``synth`` builds each rank-step from Python lists: right for tests, minutes per thousand ranks.
A job of thousands of ranks and hundreds of steps (``SeedSpec``) is written here instead, with
the same content as ``synth`` would write (the same template, digests, metrics, events, seq
numbering and planted values; a test pins the bytes against ``synth``), in the flush windows a
capture writes (a window closes every ``window_records`` records or ``window_seconds`` of steps
at the stated ``step_time``):

1. per window of a rank: the template tiled over the window's steps, digests of every record at
   once (numpy's wrapping uint64 arithmetic, the same splitmix64 as ``synth``), the plant's
   salted digests where ``plants.plan`` says;
2. the window's shards (records, metrics, events, rollups) in the capture writer's Parquet
   encoding, and its commit line (row counts, shard facts, step folds) as ``ShardWriter`` writes
   it; a rank's commit log and manifest once its windows are written;
3. ``link_from``: a window another run holds with the same rank, steps and content (a run of the
   same seed, the plant elsewhere) is hard-linked and its commit line reused: a late plant, a
   smaller world or fewer steps cost only the windows that differ.

Ranks are written by ``workers`` processes (forked), each rank's memory one window's rows.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from detfp_analyze.testing.plants import STABLE_KINDS, Plant, RankPlan, plan
from detfp_analyze.testing.synth import SynthSpec, _bits, _manifest
from detfp_analyze.testing.template import _template
from detfp_format import commitlog, contract
from detfp_format import rollups as _rollups
from detfp_format.arrowschema import arrow_schema, parquet_options
from detfp_format.writer import RECORDS_ROW_GROUP, build_table, write_manifest

__all__ = ["SEED_LAYOUT", "SeedSpec", "expected_seqs", "write_seed_run"]

#: The seed job's parallel layout, fastest coordinate first: tp 8 x dp 19 x pp 16 = 2,432 ranks.
SEED_LAYOUT = (("tp", 8), ("dp", 19), ("pp", 16))
_MASK = (1 << 64) - 1
_SALT_B = 0x5EED_B


@dataclass(frozen=True)
class SeedSpec:
    """Shape of a seed-shaped run: the synthetic content (``synth``) and the capture's windows."""

    #: World size, steps and records per rank-step, the digests' seed and the parallel layout.
    ranks: int = 2432
    steps: int = 800
    records: int = 20
    seed: int = 0
    layout: tuple[tuple[str, int], ...] = SEED_LAYOUT
    #: The stated step time (seconds): with ``window_seconds`` it says how many steps a window holds.
    step_time: float = 0.5
    #: A window closes once it holds this many records, or this many seconds of steps.
    window_records: int = 65536
    window_seconds: float = 20.0

    def synth(self) -> SynthSpec:
        """The ``synth`` spec of the same content (compact steps)."""
        return SynthSpec(ranks=self.ranks, steps=self.steps, records=self.records, seed=self.seed,
                         layout=self.layout, compact=True, windows="run")  # fmt: skip

    def window_steps(self) -> int:
        """Steps per flush window (whole steps: the capture flushes at step ends)."""
        by_time = int(self.window_seconds // self.step_time) if self.step_time > 0 else self.steps
        return max(1, min(self.window_records // max(1, self.records), by_time, self.steps))

    def windows(self) -> list[range]:
        """Every rank's windows, as step ranges."""
        k = self.window_steps()
        return [range(s, min(s + k, self.steps)) for s in range(0, self.steps, k)]


def _splitmix(x):  # numpy uint64, wrapping
    import numpy as np

    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def _starts(seed: int, salt: int, rank: int, steps: Sequence[int]) -> list[int]:
    """``synth._digests``' counter start per step (Python ints: exact mod 2^64)."""
    out = []
    for step in steps:
        base = ((((seed * 0x100000001B3) ^ salt) & _MASK) * 1_000_003 + rank * 7_919 + step) & _MASK
        out.append((base * 0x2545F4914F6CDD1D) & _MASK)
    return out


class _Gen:
    """Writes the windows of one run; one instance per run, shared read-only by the workers."""

    def __init__(self, spec: SeedSpec, plant: Plant | None):
        import numpy as np

        self.spec, self.plant, self.np = spec, plant, np
        self.tpl = _template(spec.synth())
        self.n = self.tpl.table.num_rows
        self.plans: dict[int, RankPlan] = {} if plant is None else plan(plant, self.tpl, spec.ranks, 0, spec.steps - 1)
        self.stable = np.array([k in STABLE_KINDS for k in self.tpl.kinds])
        self.ok = np.array(self.tpl.digested)
        self.stride = self.n + 3 + 2  # records, 3 metrics, step_begin and step_end per step

    def changed(self, rank: int, steps: range) -> bool:
        """Whether this window's content differs from the unplanted run's."""
        rp = self.plans.get(rank)
        return rp is not None and rp.start is not None and steps[-1] >= rp.start[0]

    def digests(self, rank: int, steps: range):
        np, n = self.np, self.n
        lane = np.arange(n, dtype=np.uint64) * np.uint64(2)
        with np.errstate(over="ignore"):
            ctr = lane[None, :] + np.array(_starts(self.spec.seed, 0, rank, steps), np.uint64)[:, None]
        hi, lo = _splitmix(ctr), _splitmix(ctr + np.uint64(1))
        rp = self.plans.get(rank)
        if rp is not None and rp.start is not None:
            ps, pi = rp.start
            with np.errstate(over="ignore"):
                ctr_b = lane[None, :] + np.array(_starts(self.spec.seed, _SALT_B, rank, steps), np.uint64)[:, None]
            pos = np.arange(n)[None, :]
            st = np.array(list(steps))[:, None]
            salted = ((st > ps) | ((st == ps) & (pos >= pi))) & ~self.stable[None, :]
            hi = np.where(salted, _splitmix(ctr_b), hi)
            lo = np.where(salted, _splitmix(ctr_b + np.uint64(1)), lo)
        return hi.ravel(), lo.ravel()

    def records(self, rank: int, steps: range) -> pa.Table:
        np, n, k = self.np, self.n, len(steps)
        schema = arrow_schema("records")
        tiled = self.tpl.table.take(pa.array(np.tile(np.arange(n), k)))
        hi, lo = self.digests(rank, steps)
        ok = np.tile(self.ok, k)
        step = np.repeat(np.array(list(steps), np.int64), n)
        seq = (step * self.stride + 1 + np.tile(np.arange(n), k)).astype(np.int64)
        rows = n * k
        cols = {
            "rank": pa.array(np.full(rows, rank, np.int32)) if schema.field("rank").type == pa.int32() else None,
            "segment": None, "step": pa.array(step), "seq": pa.array(seq),
            "digest_hi": pa.array(hi, mask=~ok), "digest_lo": pa.array(lo, mask=~ok),
            "hazards": pa.array([[]] * rows, schema.field("hazards").type),
            "compiled": pa.array(np.zeros(rows, bool)),
        }  # fmt: skip
        out = []
        for f in schema:
            if f.name in tiled.column_names:
                out.append(tiled.column(f.name).cast(f.type))
            elif cols.get(f.name) is not None:
                out.append(cols[f.name].cast(f.type))
            elif f.name in ("rank", "segment"):
                out.append(pa.array(np.full(rows, rank if f.name == "rank" else 0)).cast(f.type))
            else:
                out.append(pa.nulls(rows, f.type))
        return pa.Table.from_arrays(out, schema=schema)

    def metrics(self, rank: int, steps: range) -> dict[str, list]:
        import math

        rp = self.plans.get(rank, RankPlan())
        cols: dict[str, list] = {c: [] for c in ("microbatch", "name", "occurrence", "value", "bits", "dtype", "step", "seq")}
        for step in steps:
            k = step
            loss = 3.0 / (1.0 + 0.05 * k) + rank * 1e-3 + (self.spec.seed % 97) * 1e-5
            gnorm = 1.5 / (1.0 + 0.1 * k) + rank * 1e-4
            for j, (name, v, at) in enumerate((("loss", loss, self.tpl.forward_end - 1),
                                               ("grad_norm", gnorm, self.tpl.backward_end - 1), ("lr", 1e-3, None))):  # fmt: skip
                if self.plant is not None and at is not None and rp.start is not None and (step, at) >= rp.start:
                    v = math.nextafter(v, math.inf)
                cols["microbatch"].append(contract.NO_MICROBATCH)
                cols["name"].append(name)
                cols["occurrence"].append(0)
                cols["value"].append(v)
                cols["bits"].append(_bits(v))
                cols["dtype"].append("torch.float32")
                cols["step"].append(step)
                cols["seq"].append(step * self.stride + 1 + self.n + j)
        return cols

    def events(self, steps: range) -> dict[str, list]:
        cols: dict[str, list] = {"type": [], "name": [], "module": [], "count": [], "seq": [], "step": []}
        for step in steps:
            base = step * self.stride
            cols["type"] += ["step_begin", "step_end"]
            cols["name"] += ["", ""]
            cols["module"] += ["", ""]
            cols["count"] += [None, self.n]
            cols["seq"] += [base, base + self.stride - 1]
            cols["step"] += [step, step]
        return cols

    def window(self, root: Path, rank: int, w: int, steps: range, positions: _rollups.Positions) -> dict:
        """Write one window's shards; its commit line's record."""
        rec = self.records(rank, steps)
        met = self.metrics(rank, steps)
        roll = _rollups.window_rollups(rec, positions)
        built = [("events", build_table("events", self.events(steps), rank, 0)),
                 ("metrics", build_table("metrics", met, rank, 0)), ("records", rec),
                 ("rollups", build_table("rollups", roll, rank, 0))]  # fmt: skip
        rows, facts = {}, {}
        for table, t in built:
            path = root / contract.shard_relpath(table, rank, 0, w)
            path.parent.mkdir(parents=True, exist_ok=True)
            sink = pa.BufferOutputStream()
            rg = RECORDS_ROW_GROUP if table == "records" else None
            pq.write_table(t, sink, compression="zstd", row_group_size=rg, **parquet_options(table))
            data = sink.getvalue().to_pybytes()
            path.write_bytes(data)
            facts[table] = list(commitlog.shard_fact(data, steps[0], steps[-1]))
            rows[table] = t.num_rows
        mcols = {c: met[c] for c in ("step", "microbatch", "name", "occurrence", "bits")}
        return {"t": "window", "window": w, "rows": rows, "steps": [steps[0], steps[-1]], "shards": facts,
                "sums": commitlog.step_sums(roll, mcols)}  # fmt: skip


def _source_lines(src: Path, rank: int) -> dict[int, tuple[bytes, list[int]]]:
    """window -> (its commit line, its steps) in ``src``'s commit log of ``rank`` (none: empty)."""
    path = src / commitlog.commit_log_relpath(rank, 0)
    if not path.exists():
        return {}
    out = {}
    for line in path.read_bytes().splitlines(keepends=True):
        rec = json.loads(line[9:])
        if rec.get("t") == "window":
            out[rec["window"]] = (line, rec["steps"])
    return out


def _write_rank(gen: _Gen, root: Path, rank: int, link_from: Path | None) -> int:
    """Write (or link) one rank's windows, then its commit log and manifest; windows written."""
    spec, written = gen.spec, 0
    src = _source_lines(link_from, rank) if link_from is not None else {}
    positions = _rollups.Positions()
    lines = [commitlog.encode({"t": "open", "version": commitlog.COMMIT_LOG_VERSION, "rank": rank, "segment": 0})]
    for w, steps in enumerate(spec.windows()):
        got = src.get(w)
        if got is not None and got[1] == [steps[0], steps[-1]] and not gen.changed(rank, steps):
            for table in ("events", "metrics", "records", "rollups"):
                rel = contract.shard_relpath(table, rank, 0, w)
                (root / rel).parent.mkdir(parents=True, exist_ok=True)
                os.link(link_from / rel, root / rel)  # type: ignore[operator]
            lines.append(got[0])
            for s in steps:  # the rollups' positions of a linked window's steps, as if written
                positions.advance(s, gen.n)
            continue
        lines.append(commitlog.encode(gen.window(root, rank, w, steps, positions)))
        written += 1
    n = len(spec.windows())
    lines.append(commitlog.encode({"t": "close", "windows": n, "status": "ok", "reason": None}))
    log = root / commitlog.commit_log_relpath(rank, 0)
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_bytes(b"".join(lines))
    write_manifest(root, _manifest(spec.synth(), rank, 0))
    return written


_JOB: tuple | None = None  # the forked workers' (gen, root, link_from): set before the fork


def _job(rank: int) -> int:
    assert _JOB is not None
    return _write_rank(_JOB[0], _JOB[1], rank, _JOB[2])


def write_seed_run(
    root: str | os.PathLike[str],
    spec: SeedSpec = SeedSpec(),
    plant: Plant | None = None,
    *,
    link_from: str | os.PathLike[str] | None = None,
    workers: int = 2,
) -> int:
    """Write run ``root`` (a fresh directory) of ``spec``: run A of ``synth`` without ``plant``,
    run B with it. ``link_from``: a run of the same seed whose windows of equal content are
    hard-linked (same file system). Returns the number of windows written (not linked)."""
    global _JOB
    out = Path(root)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out}: directory exists and is not empty; pick a new directory")
    out.mkdir(parents=True, exist_ok=True)
    gen = _Gen(spec, plant)
    src = None if link_from is None else Path(link_from)
    ranks = range(spec.ranks)
    if workers <= 1:
        return sum(_write_rank(gen, out, r, src) for r in ranks)
    import multiprocessing

    _JOB = (gen, out, src)
    try:
        with multiprocessing.get_context("fork").Pool(workers) as pool:
            return sum(pool.imap_unordered(_job, ranks, chunksize=8))
    finally:
        _JOB = None


def expected_seqs(spec: SeedSpec, plant: Plant) -> list[tuple[int, int, int]]:
    """(rank, step, seq in run A) of each rank's first divergent record under a values ``plant``."""
    gen = _Gen(spec, plant)
    return sorted((r, rp.start[0], rp.start[0] * gen.stride + 1 + rp.start[1])
                  for r, rp in gen.plans.items() if rp.start is not None)  # fmt: skip

