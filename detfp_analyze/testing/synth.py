"""Synthetic, contract-valid run pairs with a planted divergence (torch-free, fast).

Used by the scale benchmark, the tests and the notebook. Design:

1. One *template* of a training step (``_template``, in ``_synth_template``): a list of
   calls (module boundaries, forward ops per layer, backward ops with gradient all-reduce
   buckets, optimizer ops, parameters), each call writing its input records before its outputs,
   exactly as the capture does. Keys (``call_hash``/``key_hash``) are hashed once per
   distinct key with ``contract.key_hash`` and broadcast: they do not depend on rank or step.
2. Per (run, rank, step) only the provenance columns and the digests change; digests are
   splitmix64 of a global counter (pyarrow compute, vectorized), salted differently in run B
   for the records the planted divergence reaches.
3. Propagation of a planted origin: on the origin rank every later record differs, except
   records that never depend on the model (``batch``, ``rng_state``); from the first gradient
   all-reduce output after the origin on, every rank differs. A structural plant inserts an
   extra call into run B instead and changes no value.
4. Each (rank, step) is written as one shard per table, rank by rank, so memory stays
   bounded by one rank's rows; shards of B that equal A's are copied, not re-encoded.

``Planted.expected`` is the answer a correct bisect must give, rank by rank.
"""

from __future__ import annotations

import json
import math
import shutil
import struct
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from detfp_analyze.testing.template import _Template, _template
from detfp_capture import contract
from detfp_capture.arrowschema import arrow_schema
from detfp_capture.commitlog import COMMIT_LOG_VERSION, commit_log_relpath, encode

__all__ = ["Expected", "Plant", "Planted", "SynthSpec", "write_pair", "write_run"]

#: Kinds whose records never depend on the model state, so a divergence does not reach them.
_STABLE_KINDS = frozenset({"batch", "rng_state"})
_U64 = pa.uint64()
_MASK64 = (1 << 64) - 1


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
    #: Parquet compression of the shards (the capture writer's default).
    compression: str = "zstd"
    #: "step": one shard per (rank, step, table), as a capture flushing every step writes;
    #: "run": one shard per (rank, table) holding every step (fewer files: large synthetic jobs).
    windows: str = "step"
    #: Parallel layout as ((coordinate, size), ...) from the fastest-varying coordinate out, e.g.
    #: (("tp", 8), ("dp", 19), ("pp", 16)); the product must equal ``ranks``. Default: dp only.
    #: Only the manifests' ``parallel`` coordinates change: every rank stays in the group ``dp``.
    layout: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class Plant:
    """Where and how run B departs from run A."""

    #: Rank of the origin (ignored when ``all_ranks`` is set).
    rank: int = 0
    #: Absolute step of the origin.
    step: int = 0
    #: Record index inside the rank-step template; snapped forward to the first digested
    #: output record at or after it (an origin is an output whose inputs matched).
    index: int = 0
    #: Further ranks with an origin at the same record (a rank subset).
    also_ranks: tuple[int, ...] = ()
    #: Every rank has its origin at the same record: the op itself is nondeterministic.
    all_ranks: bool = False
    #: Instead of changing values, insert an extra call (``aten::clone.default``) into run B
    #: right before the origin call on the origin ranks; values stay equal.
    structural: bool = False


@dataclass(frozen=True)
class Expected:
    """The first divergent record of one rank, as a correct bisect must report it."""

    #: Rank.
    rank: int
    #: Absolute step of the first divergent record.
    step: int
    #: Index of the record in A's rank-step template (for a structural plant: in B's stream).
    index: int
    #: seq of that record in run A (run B for a structural plant: the record exists only there).
    seq: int
    #: key_hash of the record.
    key_hash: int
    #: origin (inputs matched) | receiver (reached through the all-reduce) | structural.
    verdict: str
    #: Phase, module, kind and name of the record's call.
    phase: str
    module: str
    kind: str
    name: str


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
        """Ranks whose first divergence is a local origin (or the structural insertion)."""
        return tuple(e.rank for e in self.expected if e.verdict != "receiver")


# --------------------------------------------------------------------------- digests


def _splitmix(x: pa.Array) -> pa.Array:
    """splitmix64 finalizer, element-wise on uint64 (pyarrow's multiply wraps on overflow)."""

    def s(v: int) -> pa.Scalar:
        return pa.scalar(v, _U64)

    z = pc.add(x, s(0x9E3779B97F4A7C15))
    z = pc.multiply(pc.bit_wise_xor(z, pc.shift_right(z, s(30))), s(0xBF58476D1CE4E5B9))
    z = pc.multiply(pc.bit_wise_xor(z, pc.shift_right(z, s(27))), s(0x94D049BB133111EB))
    return pc.bit_wise_xor(z, pc.shift_right(z, s(31)))


def _digests(spec: SynthSpec, salt: int, rank: int, step: int, idx: pa.Array) -> tuple[pa.Array, pa.Array]:
    base = ((((spec.seed * 0x100000001B3) ^ salt) & _MASK64) * 1_000_003 + rank * 7_919 + step) & _MASK64
    start = (base * 0x2545F4914F6CDD1D) & _MASK64
    ctr = pc.add(pc.multiply(idx, pa.scalar(2, _U64)), pa.scalar(start, _U64))
    return _splitmix(ctr), _splitmix(pc.add(ctr, pa.scalar(1, _U64)))


# --------------------------------------------------------------------------- writing


def _manifest(spec: SynthSpec, rank: int) -> dict:
    det = {
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
    m = {
        "commit_log": COMMIT_LOG_VERSION,
        "schema_version": contract.SCHEMA_VERSION,
        "digest_version": contract.DIGEST_VERSION,
        "digest_algorithm": contract.DIGEST_ALGORITHM,
        "rank": rank,
        "world_size": spec.ranks,
        "segment": 0,
        "start_step": spec.first_step,
        "parallel": _parallel(spec, rank),
        "groups": {"dp": list(range(spec.ranks))},
        "versions": {
            "torch": None,
            "cuda": None,
            "cudnn": None,
            "nccl": None,
            "python": "3",
            "os": "synthetic",
            "detfp": "synthetic",
        },
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
    assert set(m) == set(contract.MANIFEST_KEYS) | set(contract.MANIFEST_OPTIONAL_KEYS)  # an invariant, not validation
    return m


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


def _write(table: pa.Table, run: Path, name: str, rank: int, window: int, compression: str) -> Path:
    path = run / contract.shard_relpath(name, rank, 0, window)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name("." + path.name)
    # Same encoding as detfp_capture.writer (zstd, default statistics), so benchmarks read
    # files like the ones a capture writes.
    pq.write_table(table, tmp, compression=compression)
    tmp.replace(path)
    return path


def _write_commit_log(run: Path, rank: int) -> None:
    """The commit log a capture writes next to the manifest (``detfp_capture.commitlog``): the
    windows written, each with its rows per table and step range, then a clean close."""
    windows: dict[int, dict] = {}
    for table in contract.TABLES:
        base = run / table / f"rank={rank}"
        for path in sorted(base.glob("part-s00000-w*.parquet")) if base.is_dir() else ():
            w = int(path.stem.rsplit("-w", 1)[1])
            steps = pq.read_table(path, columns=["step"]).column("step")
            entry = windows.setdefault(w, {"rows": {}, "lo": None, "hi": None})
            entry["rows"][table] = len(steps)
            if len(steps):
                lo, hi = pc.min(steps).as_py(), pc.max(steps).as_py()
                entry["lo"] = lo if entry["lo"] is None else min(entry["lo"], lo)
                entry["hi"] = hi if entry["hi"] is None else max(entry["hi"], hi)
    lines = [encode({"t": "open", "version": COMMIT_LOG_VERSION, "rank": rank, "segment": 0})]
    for w in sorted(windows):
        e = windows[w]
        steps = None if e["lo"] is None else [e["lo"], e["hi"]]
        lines.append(encode({"t": "window", "window": w, "rows": e["rows"], "steps": steps}))
    lines.append(encode({"t": "close", "windows": len(windows), "status": "ok", "reason": None}))
    (run / commit_log_relpath(rank, 0)).write_bytes(b"".join(lines))


def _mkparent(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def _write_manifest(run: Path, m: dict) -> None:
    path = run / contract.manifest_relpath(m["rank"], m["segment"])
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name("." + path.name)
    tmp.write_text(json.dumps(m, indent=1, sort_keys=True) + "\n")
    tmp.replace(path)


def _bits(v: float) -> int:
    return struct.unpack("<Q", struct.pack("<d", v))[0]


@dataclass(frozen=True)
class _RankPlan:
    """Where run B first differs on one rank: (step, index) or None, and a structural insertion."""

    start: tuple[int, int] | None
    insert_at: tuple[int, int] | None


def _base_table(spec: SynthSpec, tpl_table: pa.Table, digested: Sequence[bool]) -> pa.Table:
    """A records table with every column but rank/step/seq/digests/moments filled (built once per template)."""
    n = tpl_table.num_rows
    schema = arrow_schema("records")
    zero = pa.repeat(pa.scalar(0, pa.int64()), n)
    cols = {
        "rank": pa.repeat(pa.scalar(0, pa.int32()), n),
        "segment": pa.repeat(pa.scalar(0, pa.int32()), n),
        "step": zero,
        "seq": zero,
    }
    for c in tpl_table.column_names:
        cols[c] = tpl_table.column(c)
    cols["digest_hi"] = cols["digest_lo"] = pa.nulls(n, _U64)
    cols["error"] = pa.nulls(n, pa.string())
    cols["rows"] = pa.nulls(n, pa.list_(pa.string()))
    for c, t in (("m_sum", pa.float64()), ("m_absmax", pa.float64()), ("m_nan", pa.int64()), ("m_inf", pa.int64())):
        cols[c] = pa.nulls(n, t)
    if spec.moments:
        cols["m_nan"] = cols["m_inf"] = pc.if_else(pa.array(digested, pa.bool_()), zero, pa.nulls(n, pa.int64()))
    cols["hazards"] = pa.array([[]] * n, pa.list_(pa.string()))
    cols["args_digest"] = pa.nulls(n, pa.string())
    cols["compiled"] = pa.repeat(pa.scalar(False), n)
    return pa.table([cols[f.name] for f in schema], schema=schema)


def _records_table(
    spec: SynthSpec, base: pa.Table, ok: pa.Array, rank: int, step: int, seq0: int, hi: pa.Array, lo: pa.Array
) -> pa.Table:
    """``base`` with the provenance and digest columns of one (rank, step) filled in."""
    n = base.num_rows
    null_u64 = pa.nulls(n, _U64)
    new = {
        "rank": pa.repeat(pa.scalar(rank, pa.int32()), n),
        "step": pa.repeat(pa.scalar(step, pa.int64()), n),
        "seq": pc.add(pa.array(range(n), pa.int64()), pa.scalar(seq0, pa.int64())),
        "digest_hi": pc.if_else(ok, hi, null_u64),
        "digest_lo": pc.if_else(ok, lo, null_u64),
    }
    if spec.moments:
        # A magnitude derived from the digest, so differing records differ in m_sum too.
        frac = pc.divide(pc.cast(pc.shift_right(hi, pa.scalar(11, _U64)), pa.float64()), float(1 << 53))
        new["m_sum"] = pc.if_else(ok, pc.subtract(frac, 0.5), pa.nulls(n, pa.float64()))
        new["m_absmax"] = pc.if_else(ok, pc.add(frac, 1.0), pa.nulls(n, pa.float64()))
    t = base
    for name, col in new.items():
        t = t.set_column(t.schema.get_field_index(name), t.schema.field(name), col)
    return t


def _insert_table(spec: SynthSpec, tpl: _Template, at: int) -> tuple[pa.Table, int]:
    """Records of the extra call a structural plant inserts before template index ``at``."""
    mod = tpl.table.column("module")[at].as_py()
    phase = tpl.table.column("phase")[at].as_py()
    mb = tpl.table.column("microbatch")[at].as_py()
    call = contract.call_key(mb, phase, mod, "op", "aten::clone.default", 0)
    rows = [("input", "args[0]"), ("output", "out")]
    t = pa.table(
        {
            "microbatch": pa.array([mb] * 2, pa.int32()),
            "phase": [phase] * 2,
            "module": [mod] * 2,
            "kind": ["op"] * 2,
            "name": ["aten::clone.default"] * 2,
            "occurrence": pa.array([0, 0], pa.int32()),
            "role": [r for r, _ in rows],
            "arg": [a for _, a in rows],
            "call_hash": pa.array([contract.key_hash(call)] * 2, _U64),
            "key_hash": pa.array([contract.key_hash(contract.record_key(call, r, a)) for r, a in rows], _U64),
            "dtype": ["torch.bfloat16"] * 2,
            "shape": pa.array([[4096, 1024]] * 2, pa.list_(pa.int64())),
            "numel": pa.array([4096 * 1024] * 2, pa.int64()),
            "status": ["ok"] * 2,
        }
    )
    return t, 2


class _Writer:
    """Writes one run pair rank by rank."""

    def __init__(self, spec: SynthSpec, plant: Plant | None, a: Path, b: Path):
        self.spec, self.plant, self.a, self.b = spec, plant, a, b
        self.tpl = _template(spec)
        self.n = self.tpl.table.num_rows
        self.idx = pa.array(range(self.n), _U64)
        self.stable = pa.array([k in _STABLE_KINDS for k in self.tpl.kinds], pa.bool_())
        self.origin_index = self._snap(plant.index) if plant is not None else None
        self.plans = self._plans()
        self.extra = 2 if plant is not None and plant.structural else 0
        self.base = _base_table(spec, self.tpl.table, self.tpl.digested)
        self.ok = pa.array(self.tpl.digested, pa.bool_())

    # -- plan
    def _snap(self, index: int) -> int:
        tpl = self.tpl
        for i in range(max(0, min(index, self.n - 1)), self.n):
            if tpl.digested[i] and tpl.is_output[i] and tpl.kinds[i] not in _STABLE_KINDS:
                return i
        raise ValueError(f"plant index {index}: no digested output record at or after it in a step of {self.n}")

    def _origin_ranks(self) -> tuple[int, ...]:
        p = self.plant
        assert p is not None
        if p.all_ranks:
            return tuple(range(self.spec.ranks))
        return tuple(sorted({p.rank, *p.also_ranks}))

    def _plans(self) -> dict[int, _RankPlan]:
        p, spec = self.plant, self.spec
        if p is None:
            return {}
        last = spec.first_step + spec.steps - 1
        if not spec.first_step <= p.step <= last:
            raise ValueError(f"plant step {p.step} outside the run's steps {spec.first_step}..{last}")
        for r in (p.rank, *p.also_ranks):
            if not 0 <= r < spec.ranks:
                raise ValueError(f"plant rank {r} outside 0..{spec.ranks - 1}")
        assert self.origin_index is not None
        origins = self._origin_ranks()
        plans: dict[int, _RankPlan] = {}
        if p.structural:
            at = self.tpl.call_start[self.origin_index]
            return {r: _RankPlan(None, (p.step, at)) for r in origins}
        for r in origins:
            plans[r] = _RankPlan((p.step, self.origin_index), None)
        # The first gradient all-reduce output after the origin carries the difference to every rank.
        ar = self.tpl.allreduce_outputs
        later = [i for i in ar if i > self.origin_index]
        carrier = (p.step, later[0]) if later else ((p.step + 1, ar[0]) if ar and p.step < last else None)
        if carrier is not None:
            for r in range(spec.ranks):
                plans.setdefault(r, _RankPlan(carrier, None))
        return plans

    def expected(self) -> tuple[Expected, ...]:
        out = []
        cols = self.tpl.table
        for r in sorted(self.plans):
            plan = self.plans[r]
            if plan.insert_at is not None:
                step, i = plan.insert_at
                ins, _ = _insert_table(self.spec, self.tpl, i)
                out.append(
                    Expected(
                        r,
                        step,
                        i,
                        self._seq0(r, step, "b") + i,
                        ins.column("key_hash")[0].as_py(),
                        "structural",
                        ins.column("phase")[0].as_py(),
                        ins.column("module")[0].as_py(),
                        "op",
                        "aten::clone.default",
                    )
                )
                continue
            assert plan.start is not None
            step, i = plan.start
            verdict = "origin" if r in self._origin_ranks() else "receiver"
            out.append(
                Expected(
                    r,
                    step,
                    i,
                    self._seq0(r, step, "a") + i,
                    cols.column("key_hash")[i].as_py(),
                    verdict,
                    cols.column("phase")[i].as_py(),
                    cols.column("module")[i].as_py(),
                    cols.column("kind")[i].as_py(),
                    cols.column("name")[i].as_py(),
                )
            )
        return tuple(out)

    # -- layout of seq: step_begin, records, metrics, step_end, per step
    def _stride(self, rank: int, step: int, run: str) -> int:
        plan = self.plans.get(rank)
        extra = self.extra if run == "b" and plan and plan.insert_at and plan.insert_at[0] == step else 0
        return self.n + extra + 3 + 2

    def _seq0(self, rank: int, step: int, run: str) -> int:
        """seq of the first record of (rank, step): after step_begin."""
        s = 0
        for st in range(self.spec.first_step, step):
            s += self._stride(rank, st, run)
        return s + 1

    def _differs(self, rank: int, step: int, i: int) -> bool:
        plan = self.plans.get(rank)
        return bool(plan and plan.start and (step, i) >= plan.start)

    # -- write
    def write_rank(self, rank: int) -> None:
        spec = self.spec
        if spec.windows not in ("step", "run"):
            raise ValueError(f"windows={spec.windows!r}: expected 'step' or 'run'")
        for run in (self.a, self.b):
            _write_manifest(run, _manifest(spec, rank))
        if spec.windows == "run":
            self._write_rank_whole(rank)
        else:
            self._write_rank_steps(rank)
        for run in (self.a, self.b):
            _write_commit_log(run, rank)

    def _write_rank_steps(self, rank: int) -> None:
        spec = self.spec
        plan = self.plans.get(rank)
        for w, step in enumerate(range(spec.first_step, spec.first_step + spec.steps)):
            hi, lo = _digests(spec, 0, rank, step, self.idx)
            seq_a = self._seq0(rank, step, "a")
            rec_a = _records_table(spec, self.base, self.ok, rank, step, seq_a, hi, lo)
            pa_path = _write(rec_a, self.a, "records", rank, w, spec.compression)
            rec_b = self._value_b(rank, step, seq_a, hi, lo)
            if rec_b is None and plan and plan.insert_at and plan.insert_at[0] == step:
                at = plan.insert_at[1]
                ins, k = _insert_table(spec, self.tpl, at)
                hib, lob = _digests(spec, 0x1A5E27, rank, step, pa.array(range(k), _U64))
                ok = [True] * k
                ins_full = _records_table(
                    spec, _base_table(spec, ins, ok), pa.array(ok), rank, step, seq_a + at, hib, lob
                )
                rec_b = pa.concat_tables(
                    [
                        rec_a.slice(0, at),
                        ins_full,
                        rec_a.slice(at).set_column(
                            rec_a.schema.get_field_index("seq"),
                            rec_a.schema.field("seq"),
                            pc.add(rec_a.column("seq").slice(at), pa.scalar(k, pa.int64())),
                        ),
                    ]
                )
            if rec_b is None:
                shutil.copyfile(pa_path, _mkparent(self.b / contract.shard_relpath("records", rank, 0, w)))
            else:
                _write(rec_b, self.b, "records", rank, w, spec.compression)
            small: dict[str, pa.Table] = {}
            for run, tag in ((self.a, "a"), (self.b, "b")):
                seq0 = self._seq0(rank, step, tag)
                nrec = self.n + (rec_b.num_rows - self.n if tag == "b" and rec_b is not None else 0)
                tables = {
                    "metrics": self._metrics(rank, step, seq0 + nrec, tag),
                    "events": self._events(rank, step, seq0 - 1, seq0 + nrec + 3, nrec),
                }
                for name, t in tables.items():
                    if tag == "b" and t.equals(small[name]):  # copying beats re-encoding
                        shutil.copyfile(
                            self.a / contract.shard_relpath(name, rank, 0, w),
                            _mkparent(self.b / contract.shard_relpath(name, rank, 0, w)),
                        )
                    else:
                        _write(t, run, name, rank, w, spec.compression)
                    small[name] = t

    def _value_b(self, rank: int, step: int, seq0: int, hi: pa.Array, lo: pa.Array) -> pa.Table | None:
        """Run B's records of (rank, step) under a value plant (None when they equal A's)."""
        plan, spec = self.plans.get(rank), self.spec
        if not (plan and plan.start and step >= plan.start[0]):
            return None
        hib, lob = _digests(spec, 0x5EED_B, rank, step, self.idx)
        from_i = plan.start[1] if step == plan.start[0] else 0
        mask = pc.and_(pc.greater_equal(self.idx, pa.scalar(from_i, _U64)), pc.invert(self.stable))
        return _records_table(
            spec, self.base, self.ok, rank, step, seq0, pc.if_else(mask, hib, hi), pc.if_else(mask, lob, lo)
        )

    def _write_rank_whole(self, rank: int) -> None:
        """windows="run": every step of a table in one shard per rank (a value plant only)."""
        spec, plan = self.spec, self.plans.get(rank)
        if plan is not None and plan.insert_at is not None:
            raise ValueError('windows="run" supports value plants only; use windows="step" for a structural plant')
        parts: dict[str, dict[str, list[pa.Table]]] = {"a": {}, "b": {}}
        for step in range(spec.first_step, spec.first_step + spec.steps):
            hi, lo = _digests(spec, 0, rank, step, self.idx)
            seq0 = self._seq0(rank, step, "a")
            rec_a = _records_table(spec, self.base, self.ok, rank, step, seq0, hi, lo)
            value_b = self._value_b(rank, step, seq0, hi, lo)
            rec_b = rec_a if value_b is None else value_b
            for tag, rec in (("a", rec_a), ("b", rec_b)):
                parts[tag].setdefault("records", []).append(rec)
                parts[tag].setdefault("metrics", []).append(self._metrics(rank, step, seq0 + self.n, tag))
                parts[tag].setdefault("events", []).append(
                    self._events(rank, step, seq0 - 1, seq0 + self.n + 3, self.n)
                )
        for name in ("records", "metrics", "events"):
            ta, tb = pa.concat_tables(parts["a"][name]), pa.concat_tables(parts["b"][name])
            path = _write(ta, self.a, name, rank, 0, spec.compression)
            if tb.equals(ta):  # copying beats re-encoding
                shutil.copyfile(path, _mkparent(self.b / contract.shard_relpath(name, rank, 0, 0)))
            else:
                _write(tb, self.b, name, rank, 0, spec.compression)

    def _metrics(self, rank: int, step: int, seq0: int, run: str) -> pa.Table:
        k = step - self.spec.first_step
        loss = 3.0 / (1.0 + 0.05 * k) + rank * 1e-3 + (self.spec.seed % 97) * 1e-5
        gnorm = 1.5 / (1.0 + 0.1 * k) + rank * 1e-4
        lr = 1e-3
        rows = []
        for j, (name, v, at) in enumerate(
            (
                ("loss", loss, self.tpl.forward_end - 1),
                ("grad_norm", gnorm, self.tpl.backward_end - 1),
                ("lr", lr, None),
            )
        ):
            if run == "b" and at is not None and self._differs(rank, step, at):
                v = math.nextafter(v, math.inf)  # one ULP: the loss is a checksum of the model state
            rows.append((name, v, j))
        n = len(rows)
        return pa.table(
            {
                "rank": pa.array([rank] * n, pa.int32()),
                "segment": pa.array([0] * n, pa.int32()),
                "step": pa.array([step] * n, pa.int64()),
                "seq": pa.array([seq0 + j for j in range(n)], pa.int64()),
                "microbatch": pa.array([contract.NO_MICROBATCH] * n, pa.int32()),
                "name": [r[0] for r in rows],
                "occurrence": pa.array([0] * n, pa.int32()),
                "value": pa.array([r[1] for r in rows], pa.float64()),
                "bits": pa.array([_bits(r[1]) for r in rows], _U64),
                "dtype": ["torch.float32"] * n,
            },
            schema=arrow_schema("metrics"),
        )

    def _events(self, rank: int, step: int, seq_begin: int, seq_end: int, nrec: int) -> pa.Table:
        return pa.table(
            {
                "rank": pa.array([rank] * 2, pa.int32()),
                "segment": pa.array([0] * 2, pa.int32()),
                "step": pa.array([step] * 2, pa.int64()),
                "seq": pa.array([seq_begin, seq_end], pa.int64()),
                "type": ["step_begin", "step_end"],
                "name": ["", ""],
                "module": ["", ""],
                "count": pa.array([None, nrec], pa.int64()),
                "detail": pa.nulls(2, pa.string()),
            },
            schema=arrow_schema("events"),
        )


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
