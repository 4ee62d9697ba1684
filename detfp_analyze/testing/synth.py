"""Synthetic, contract-valid run pairs with a planted divergence (torch-free, fast).

Used by the scale benchmark, the tests and the notebook. Design:

1. One *template* of a training step (``template``): a list of calls (module boundaries,
   forward ops per layer, backward ops with gradient all-reduce buckets, optimizer ops,
   parameters), each call writing its input records before its outputs, exactly as the capture
   does. Keys (``call_hash``/``key_hash``) are hashed once per distinct key; they depend on
   neither rank nor step.
2. Per (run, rank, step) only the provenance columns and the digests change; digests are
   splitmix64 of a global counter (pyarrow compute, vectorized), salted differently in run B for
   the records the plant reaches (``plants``: where and how run B departs, and what a correct
   bisect must answer).
3. Shards, manifests and commit logs are written by the capture's own writer
   (``detfp_format.writer.ShardWriter`` and ``write_manifest``), one flush window per step
   (``windows="step"``) or one per rank (``windows="run"``), rank by rank, so memory stays
   bounded by one rank's rows.

``Planted.expected`` is the answer a correct bisect must give, rank by rank.
"""

from __future__ import annotations

import math
import shutil
import struct
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from detfp_analyze.bisect.vocab import Verdict
from detfp_analyze.testing.plants import HOWS, STABLE_KINDS, Expected, Plant, RankPlan, origin_ranks, plan, snap
from detfp_analyze.testing.template import _template
from detfp_format import contract
from detfp_format.commitlog import COMMIT_LOG_VERSION, SHARD_FACTS_VERSION, STEP_SUMS_VERSION
from detfp_format.writer import ShardWriter, write_manifest

__all__ = ["DETERMINISTIC_SETTINGS", "HOWS", "Expected", "Plant", "Planted", "SynthSpec", "write_pair", "write_run"]

_U64 = pa.uint64()
_MASK64 = (1 << 64) - 1
#: Argument digests of the planted call in run A and run B (how="arguments").
_ARGS = ("00000000000000a1", "00000000000000b2")


@dataclass(frozen=True)
class SynthSpec:
    """Shape of a synthetic run."""

    #: World size (ranks 0..ranks-1 are all written).
    ranks: int = 4
    #: Number of captured steps.
    steps: int = 2
    #: Records per rank and step (exact; the template is padded with probe records).
    records: int = 200
    #: Number of the first step (a run may start anywhere; numbering is absolute).
    first_step: int = 0
    #: Seed of the digests: two runs with the same seed and no plant are identical.
    seed: int = 0
    #: Transformer-like layers are added until the template holds ``records`` records;
    #: the gradient all-reduce bucket closes every ``bucket_layers`` layers of the backward.
    bucket_layers: int = 4
    #: Write moments (m_sum, m_absmax, m_nan, m_inf) on every digested record.
    moments: bool = False
    #: One small step (a forward op, the loss, a backward op, the gradient all-reduce, an optimizer
    #: op, a parameter; 18 records, padded with probes) instead of transformer-like layers: a
    #: pair of a few records per rank-step (``records`` >= 18) whose difference still reaches
    #: every rank through the all-reduce (the seed-shaped pairs of ``testing.seedpair``).
    compact: bool = False
    #: Parquet compression of the shards (the capture writer's default).
    compression: str = "zstd"
    #: "step": one flush window (shard per table) per (rank, step), as a capture flushing every
    #: step writes; "run": one window per rank holding every step (fewer files: large jobs).
    windows: str = "step"
    #: Parallel layout as ((coordinate, size), ...) from the fastest-varying coordinate out, e.g.
    #: (("tp", 8), ("dp", 19), ("pp", 16)); the product must equal ``ranks``. Default: dp only.
    #: Only the manifests' ``parallel`` coordinates change: every rank stays in the group ``dp``.
    layout: tuple[tuple[str, int], ...] = ()
    #: Write the rollups table (as this release's capture does); False: a run as older writers wrote it.
    rollups: bool = True
    #: Commit each shard's size, steps and footer checksum (as this release's capture does);
    #: False: a run as older writers wrote it (every footer parsed when it is opened).
    shard_facts: bool = True
    #: Commit each step's rollup and metrics folds (with ``rollups``, as this release's capture
    #: does); False: a run as older writers wrote it (the bisect reads rollups and metrics shards).
    step_sums: bool = True


@dataclass(frozen=True)
class Planted:
    """What was written: the two run directories and the expected first divergence per rank."""

    #: Run A's directory.
    a: Path
    #: Run B's directory.
    b: Path
    #: The spec both runs were written with.
    spec: SynthSpec
    #: The plant, or None for an identical pair.
    plant: Plant | None
    #: Per diverged rank, sorted by rank; ranks absent here are identical in both runs.
    expected: tuple[Expected, ...] = field(default_factory=tuple)

    @property
    def origin_ranks(self) -> tuple[int, ...]:
        """Ranks whose first divergence starts there (not received through the all-reduce)."""
        return tuple(e.rank for e in self.expected if e.verdict != Verdict.RECEIVER)


# --------------------------------------------------------------------------- digests
def _splitmix(x: pa.Array) -> pa.Array:
    """splitmix64 finalizer, element-wise on uint64 (pyarrow's multiply wraps on overflow)."""

    def s(v: int) -> pa.Scalar:
        return pa.scalar(v, _U64)

    z = pc.add(x, s(0x9E3779B97F4A7C15))
    z = pc.multiply(pc.bit_wise_xor(z, pc.shift_right(z, s(30))), s(0xBF58476D1CE4E5B9))
    z = pc.multiply(pc.bit_wise_xor(z, pc.shift_right(z, s(27))), s(0x94D049BB133111EB))
    return pc.bit_wise_xor(z, pc.shift_right(z, s(31)))


def _digests(spec: SynthSpec, salt: int, rank: int, step: int, n: int) -> tuple[list[int], list[int]]:
    base = ((((spec.seed * 0x100000001B3) ^ salt) & _MASK64) * 1_000_003 + rank * 7_919 + step) & _MASK64
    start = (base * 0x2545F4914F6CDD1D) & _MASK64
    ctr = pc.add(pc.multiply(pa.array(range(n), _U64), pa.scalar(2, _U64)), pa.scalar(start, _U64))
    return _splitmix(ctr).to_pylist(), _splitmix(pc.add(ctr, pa.scalar(1, _U64))).to_pylist()


def _bits(v: float) -> int:
    return struct.unpack("<Q", struct.pack("<d", v))[0]


# --------------------------------------------------------------------------- manifests
def _parallel(spec: SynthSpec, rank: int) -> dict:
    """The manifest's ``parallel`` object of ``rank`` (coordinates and sizes, fastest first)."""
    if not spec.layout:
        return {"dp": rank, "dp_size": spec.ranks, "tp": 0, "tp_size": 1, "pp": 0, "pp_size": 1}
    if math.prod(n for _, n in spec.layout) != spec.ranks:
        raise ValueError(
            f"layout {spec.layout}: the sizes multiply to {math.prod(n for _, n in spec.layout)}, not ranks={spec.ranks}"
        )
    out, rest = {}, rank
    for name, size in spec.layout:
        out[name], out[f"{name}_size"] = rest % size, size
        rest //= size
    return out


#: The determinism settings of a fully deterministic run, as a manifest records them.
DETERMINISTIC_SETTINGS = {
    "deterministic_algorithms": True,
    "deterministic_warn_only": False,
    "cudnn_deterministic": True,
    "cudnn_benchmark": False,
    "cuda_matmul_allow_tf32": False,
    "cudnn_allow_tf32": False,
    "float32_matmul_precision": "highest",
    "fill_uninitialized_memory": True,
    "num_threads": 1,
    "num_interop_threads": 1,
}


def _manifest(spec: SynthSpec, rank: int, start_step: int) -> dict:
    det = dict(DETERMINISTIC_SETTINGS)
    versions = {"torch": None, "cuda": None, "cudnn": None, "nccl": None, "python": "3", "os": "synthetic"}
    return {
        "commit_log": COMMIT_LOG_VERSION,
        **({"shard_facts": SHARD_FACTS_VERSION} if spec.shard_facts else {}),
        **({"rollups": contract.ROLLUP_VERSION} if spec.rollups else {}),
        **({"step_sums": STEP_SUMS_VERSION} if spec.rollups and spec.step_sums else {}),
        "schema_version": contract.SCHEMA_VERSION,
        "digest_version": contract.DIGEST_VERSION,
        "digest_algorithm": contract.DIGEST_ALGORITHM,
        "rank": rank,
        "world_size": spec.ranks,
        "segment": 0,
        "start_step": start_step,
        "parallel": _parallel(spec, rank),
        "groups": {"dp": list(range(spec.ranks))},
        "versions": {**versions, "detfp": "synthetic"},
        "host": {
            "hostname": f"synth-{rank // 8}",
            "device_count": 0,
            "devices": [],
            "cpu": "synthetic",
            "local_rank": rank % 8,
        },
        "determinism": det,
        "env": {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "OMP_NUM_THREADS": "1"},
        "git": {"commit": None, "dirty": None, "root": None},
        "command": ["synthetic"],
        "capture": {"level": "op", "steps": None, "ranks": None, "synthetic": True},
    }


# --------------------------------------------------------------------------- writing
class _Writer:
    """Writes one run pair rank by rank through the capture's ShardWriter."""

    def __init__(self, spec: SynthSpec, plant: Plant | None, a: Path, b: Path):
        if spec.windows not in ("step", "run"):
            raise ValueError(f"windows={spec.windows!r}: expected 'step' or 'run'")
        self.spec, self.plant, self.a, self.b = spec, plant, a, b
        self.tpl = _template(spec)
        self.n = self.tpl.table.num_rows
        self.base = self.tpl.table.to_pydict()
        last = spec.first_step + spec.steps - 1
        self.plans: dict[int, RankPlan] = (
            {} if plant is None else plan(plant, self.tpl, spec.ranks, spec.first_step, last)
        )
        if plant is not None and plant.how == "structural" and spec.windows == "run":
            raise ValueError('windows="run" supports value plants only; use windows="step" for a structural plant')
        #: (run, rank, step) -> seq of the step's first record (for ``expected``).
        self.seq0: dict[tuple[str, int, int], int] = {}

    def steps(self, run: str) -> range:
        first = self.spec.first_step
        if run == "b" and self.plant is not None and self.plant.resume_at is not None:
            first = self.plant.resume_at
        return range(first, self.spec.first_step + self.spec.steps)

    # -- one rank-step
    def records(self, run: str, rank: int, step: int) -> dict[str, list]:
        spec, n, rp = self.spec, self.n, self.plans.get(rank, RankPlan())
        cols = {k: list(v) for k, v in self.base.items()}
        hi, lo = _digests(spec, 0, rank, step, n)
        if run == "b" and rp.start is not None and step >= rp.start[0]:
            hib, lob = _digests(spec, 0x5EED_B, rank, step, n)
            frm = rp.start[1] if step == rp.start[0] else 0
            for i in range(frm, n):
                if self.tpl.kinds[i] not in STABLE_KINDS:
                    hi[i], lo[i] = hib[i], lob[i]
        ok = [s == "ok" for s in cols["status"]]
        cols["digest_hi"] = [h if o else None for h, o in zip(hi, ok, strict=True)]
        cols["digest_lo"] = [x if o else None for x, o in zip(lo, ok, strict=True)]
        cols["hazards"] = [[] for _ in range(n)]
        cols["args_digest"] = [None] * n
        cols["error"] = [None] * n
        if self.plant is not None and rank in origin_ranks(self.plant, spec.ranks) and step == self.plant.step:
            self._edit(cols, run, rp)
        if spec.moments:
            frac = [None if h is None else (h >> 11) / float(1 << 53) for h in cols["digest_hi"]]
            cols["m_sum"] = [None if f is None else f - 0.5 for f in frac]
            cols["m_absmax"] = [None if f is None else f + 1.0 for f in frac]
            cols["m_nan"] = cols["m_inf"] = [None if f is None else 0 for f in frac]
        if run == "b" and rp.insert_at is not None and step == rp.insert_at[0]:
            cols = self._insert(cols, rank, step, rp.insert_at[1])
        if run == "b" and self.plant is not None and self.plant.how == "missing" and rp.edit and step == rp.edit[0]:
            drop = set(rp.edit[1])
            cols = {k: [x for i, x in enumerate(v) if i not in drop] for k, v in cols.items()}
        cols["compiled"] = [False] * len(cols["status"])
        return cols

    def _edit(self, cols: dict[str, list], run: str, rp: RankPlan) -> None:
        """The in-place edits of the plant step on an origin rank (both runs where it says so)."""
        p = self.plant
        assert p is not None
        how, idx = p.how, rp.edit[1] if rp.edit else ()
        if p.hazard:
            start = self.tpl.call_start[snap(self.tpl, p.index)]
            for i in range(len(cols["status"])):
                if self.tpl.call_start[i] == start:
                    cols["hazards"][i] = ["uninitialized"]
        if how == "arguments":
            for i in idx:
                cols["args_digest"][i] = _ARGS[run == "b"]
        elif how == "digest_error" and run == "b":
            for i in idx:
                cols["status"][i], cols["digest_hi"][i], cols["digest_lo"][i] = "error", None, None
                cols["error"][i] = "RuntimeError: synthetic digest failure"
        elif how == "rng" and run == "b":
            for i in idx:
                cols["digest_lo"][i] ^= 0x5EED

    def _insert(self, cols: dict[str, list], rank: int, step: int, at: int) -> dict[str, list]:
        """Run B's extra call (``aten::clone.default``, an input and an output) before record ``at``."""
        mb, phase, mod = cols["microbatch"][at], cols["phase"][at], cols["module"][at]
        call = contract.call_key(mb, phase, mod, "op", "aten::clone.default", 0)
        hi, lo = _digests(self.spec, 0x1A5E27, rank, step, 2)
        extra: dict[str, list] = {k: [None, None] for k in cols}
        for j, (role, arg) in enumerate((("input", "args[0]"), ("output", "out"))):
            row = dict(microbatch=mb, phase=phase, module=mod, kind="op", name="aten::clone.default", occurrence=0,
                       role=role, arg=arg, call_hash=contract.key_hash(call),
                       key_hash=contract.key_hash(contract.record_key(call, role, arg)), dtype="torch.bfloat16",
                       shape=[4096, 1024], numel=4096 * 1024, status="ok", digest_hi=hi[j], digest_lo=lo[j],
                       hazards=[])  # fmt: skip
            for k, v in row.items():
                extra[k][j] = v
        return {k: v[:at] + extra[k] + v[at:] for k, v in cols.items()}

    def metrics(self, run: str, rank: int, step: int) -> dict[str, list]:
        k = step - self.spec.first_step
        loss = 3.0 / (1.0 + 0.05 * k) + rank * 1e-3 + (self.spec.seed % 97) * 1e-5
        gnorm = 1.5 / (1.0 + 0.1 * k) + rank * 1e-4
        rows = []
        for name, v, at in (("loss", loss, self.tpl.forward_end - 1), ("grad_norm", gnorm, self.tpl.backward_end - 1),
                            ("lr", 1e-3, None)):  # fmt: skip
            start = self.plans.get(rank, RankPlan()).start
            if run == "b" and at is not None and start is not None and (step, at) >= start:
                v = math.nextafter(v, math.inf)  # one ULP: the loss is a checksum of the model state
            rows.append((name, v))
        return {"microbatch": [contract.NO_MICROBATCH] * 3, "name": [r[0] for r in rows], "occurrence": [0] * 3,
                "value": [r[1] for r in rows], "bits": [_bits(r[1]) for r in rows], "dtype": ["torch.float32"] * 3}  # fmt: skip

    # -- one rank
    def write_rank(self, rank: int) -> None:
        for run, root in (("a", self.a), ("b", self.b)):
            if run == "b" and self.plant is not None and rank in self.plant.missing_ranks:
                continue
            steps = self.steps(run)
            write_manifest(root, _manifest(self.spec, rank, steps.start))
            windows = [[s] for s in steps] if self.spec.windows == "step" else [list(steps)]
            seq = 0
            with ShardWriter(
                root,
                rank,
                0,
                compression=self.spec.compression,
                rollups=self.spec.rollups,
                shard_facts=self.spec.shard_facts,
                step_sums=self.spec.step_sums,
            ) as writer:
                for window in windows:
                    tables: dict[str, dict[str, list]] = {"records": {}, "metrics": {}, "events": {}}
                    for step in window:
                        rec, met = self.records(run, rank, step), self.metrics(run, rank, step)
                        nrec, nmet = len(rec["status"]), len(met["name"])
                        self.seq0[(run, rank, step)] = seq + 1
                        ev: dict[str, list] = {"type": ["step_begin", "step_end"], "name": ["", ""], "module": ["", ""],
                              "count": [None, nrec], "seq": [seq, seq + nrec + nmet + 1]}  # fmt: skip
                        rec["seq"] = list(range(seq + 1, seq + 1 + nrec))
                        met["seq"] = list(range(seq + 1 + nrec, seq + 1 + nrec + nmet))
                        seq += nrec + nmet + 2
                        for name, cols in (("records", rec), ("metrics", met), ("events", ev)):
                            cols["step"] = [step] * len(cols["seq"])
                            for k, v in cols.items():
                                tables[name].setdefault(k, []).extend(v)
                    writer.write_window(tables)
            if writer.failed:
                raise OSError(writer.error)

    def expected(self) -> tuple[Expected, ...]:
        p, tpl = self.plant, self.tpl
        if p is None or p.how == "digest_error":
            return ()
        col = self.tpl.table.column
        out = []
        for r in sorted(self.plans):
            if r in p.missing_ranks or ("a", r, p.step) not in self.seq0:
                continue  # not written
            rp = self.plans[r]
            if rp.insert_at is not None:
                step, i = rp.insert_at
                ins = self._insert({k: [v[i]] for k, v in self.base.items()} | {"digest_hi": [0], "digest_lo": [0],
                                   "hazards": [[]]}, r, step, 0)  # fmt: skip
                out.append(Expected(r, step, i, self.seq0[("b", r, step)] + i, ins["key_hash"][0], Verdict.STRUCTURAL,
                                    ins["phase"][0], ins["module"][0], "op", "aten::clone.default"))  # fmt: skip
                continue
            if rp.edit is not None:
                step, i = rp.edit[0], rp.edit[1][0]
                verdict = {"arguments": Verdict.ORIGIN, "missing": Verdict.STRUCTURAL, "rng": Verdict.SOURCE}[p.how]
            else:
                assert rp.start is not None
                (step, i), verdict = (
                    rp.start,
                    Verdict.ORIGIN if r in origin_ranks(p, self.spec.ranks) else Verdict.RECEIVER,
                )
            out.append(Expected(r, step, i, self.seq0[("a", r, step)] + i, col("key_hash")[i].as_py(), verdict,
                                col("phase")[i].as_py(), col("module")[i].as_py(), tpl.kinds[i], col("name")[i].as_py()))  # fmt: skip
        return tuple(out)


def _fresh(path: str | Path) -> Path:
    p = Path(path)
    if p.exists() and any(p.iterdir()):
        raise FileExistsError(f"{p}: directory exists and is not empty; pick a new directory")
    p.mkdir(parents=True, exist_ok=True)
    return p


def write_pair(
    a: str | Path,
    b: str | Path,
    spec: SynthSpec = SynthSpec(),
    plant: Plant | None = None,
    *,
    ranks: Sequence[int] | None = None,
    workers: int = 2,
) -> Planted:
    """Write runs A and B (fresh directories) and return where B departs from A.

    ``plant=None`` writes an identical pair. ``ranks`` restricts which ranks are written
    (to build runs with missing ranks); the default writes them all.
    """
    pa_, pb_ = _fresh(a), _fresh(b)
    w = _Writer(spec, plant, pa_, pb_)
    todo = list(ranks if ranks is not None else range(spec.ranks))
    # Two ranks at a time: pyarrow releases the GIL while encoding, and memory stays at two ranks' rows.
    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(todo)))) as pool:
        for _ in pool.map(w.write_rank, todo):
            pass
    return Planted(pa_, pb_, spec, plant, w.expected())


def write_run(path: str | Path, spec: SynthSpec = SynthSpec(), *, ranks: Sequence[int] | None = None) -> Path:
    """Write a single clean run (A of an identical pair) and return its directory."""
    p = _fresh(path)
    scratch = p.parent / f".{p.name}.synth-b"
    try:
        write_pair(p, scratch, spec, None, ranks=ranks)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return p
