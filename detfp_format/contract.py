"""The detfp trace contract, v1: the one place both packages read the format from.

Standard library only, on purpose: ``detfp_analyze`` imports this module and must
never pull in torch, and the capture writer needs nothing heavier than pyarrow.
Everything a compatible producer needs is here or in ``docs/trace-format.md``:

* table names and their columns (name, Arrow type, nullability, meaning);
* the enums (kinds, roles, phases, statuses, hazards, event types);
* the on-disk layout of a run directory (hive partitions by rank);
* the canonical call-site key and its stable 64-bit hash.

Column types are spelled as short strings (``"int64"``, ``"list<string>"``) so
this module stays importable without pyarrow; ``detfp_format.types`` renders each spelling for
pyarrow, polars, DuckDB and Spark, and ``arrowschema`` builds the schemas the writer and the
reader share.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

__all__ = [
    "CALL_KEY_COLUMNS",
    "CAPTURE_LEVELS",
    "COMPONENT_SEP",
    "DATA_PARALLEL_GROUPS",
    "DIGEST_ALGORITHM",
    "DIGEST_VERSION",
    "DIGEST_VERSIONS",
    "EVENT_TYPES",
    "HAZARDS",
    "INPUTLESS_KINDS",
    "KINDS",
    "LOADER_BATCH",
    "MANIFEST_DIR",
    "MANIFEST_KEYS",
    "MANIFEST_OPTIONAL_KEYS",
    "NO_MICROBATCH",
    "PHASES",
    "READ_RULE",
    "ROLES",
    "ROLLUP_BLOCK",
    "ROLLUP_SALTS",
    "ROLLUP_VERSION",
    "SCHEMA_VERSION",
    "SCHEMA_VERSION_KEY",
    "STATUSES",
    "TABLES",
    "Column",
    "call_key",
    "columns",
    "key_hash",
    "kinds_mask",
    "manifest_relpath",
    "record_key",
    "rollup_hashes",
    "shard_name",
    "shard_relpath",
    "split_component",
]

#: Version of the table layout. Bump on any change to a column's name, type or meaning.
SCHEMA_VERSION = 1
#: The shard footer's key-value metadata key holding SCHEMA_VERSION (ASCII decimal).
SCHEMA_VERSION_KEY = "detfp.schema_version"
#: Every version of the tensor digest this release computes and reads (docs/digest.md), with
#: the algorithm's name: 1, the tree of int8 GEMMs (kept to compare runs captured with it); 2,
#: the tree of multilinear hashes designed for memory bandwidth. A new version gets a new
#: number whenever any digest output can change; the analysis refuses to compare digests of
#: different versions (every record would differ).
DIGEST_VERSIONS: dict[int, str] = {1: "detfp-tlh128", 2: "detfp-tlh128"}
#: The version new captures use unless asked for another (``Session(digest_version=...)``,
#: ``python -m detfp_capture --digest-version``, ``DETFP_DIGEST_VERSION``).
DIGEST_VERSION = 2
#: Human-readable name of the digest algorithm, stored in the manifest next to the version.
DIGEST_ALGORITHM = DIGEST_VERSIONS[DIGEST_VERSION]

#: Directory (inside a run directory) that holds the per-rank, per-segment manifests.
MANIFEST_DIR = "manifest"

#: ``microbatch`` value for records captured outside any ``Session.microbatch`` block.
#: A sentinel rather than null because the column is part of the join key, and SQL
#: and polars joins never match null with null.
NO_MICROBATCH = -1


@dataclass(frozen=True)
class Column:
    """One column of a trace table."""

    #: Column name, identical in Parquet, polars and DuckDB.
    name: str
    #: Arrow type as a short string: int32, int64, uint64, float64, bool, string,
    #: large_binary, list<int64>, list<string>.
    type: str
    #: Whether null is allowed. Non-nullable columns are validated by the reader.
    nullable: bool
    #: What the column means (copied into docs/trace-format.md).
    doc: str


def _c(name: str, type_: str, doc: str, nullable: bool = False) -> Column:
    return Column(name, type_, nullable, doc)


# Columns every table shares: where the row came from and its place in that rank's stream.
_PROVENANCE = (
    _c("rank", "int32", "Global rank that wrote the row (equals the rank=N partition)."),
    _c(
        "segment",
        "int32",
        "Process launch that wrote the row: 0 for the first, +1 per resume appended to the same run directory.",
    ),
    _c("step", "int64", "Absolute training step (a resumed run keeps the original numbering)."),
    _c(
        "seq",
        "int64",
        "Per-rank execution sequence number, strictly increasing within (rank, segment); never compared across ranks or runs.",
    ),
)

# The call-site key: how a record in run A is matched to its twin in run B.
_CALL_KEY = (
    _c("microbatch", "int32", "Microbatch index inside the step, or -1 outside any microbatch."),
    _c("phase", "string", "Phase of the step: one of PHASES."),
    _c("module", "string", "Module path (FQN) innermost at the call, '' outside any module."),
    _c("kind", "string", "What was fingerprinted: one of KINDS."),
    _c(
        "name",
        "string",
        "Op overload (aten::mm.default), collective (all_reduce), parameter FQN, probe or metric name.",
    ),
    _c(
        "occurrence",
        "int32",
        "How many calls with the same (step, microbatch, phase, module, kind, name) came before this one on this rank.",
    ),
)

#: Names of the call-site key columns, in key order (``call_key`` takes them in this order).
CALL_KEY_COLUMNS: tuple[str, ...] = tuple(c.name for c in _CALL_KEY)

_RECORDS = (
    *_PROVENANCE,
    *_CALL_KEY,
    _c(
        "role",
        "string",
        "input | output | value | dest: which side of the call the tensor is on (dest: a write-only argument, recorded before the call without a digest).",
    ),
    _c(
        "arg",
        "string",
        "Argument path inside the call: args[0], kwargs.weight, out[1], args[2][0]; '<arg>::<component>' for a part of a tensor subclass (recorded before the whole '<arg>': §2, Tensor subclasses).",
    ),
    _c("call_hash", "uint64", "key_hash of call_key(...): equal for all records of one call, the join key for calls."),
    _c("key_hash", "uint64", "key_hash of record_key(...): the join key for records."),
    _c("dtype", "string", "torch dtype as str(), e.g. torch.bfloat16."),
    _c("shape", "list<int64>", "Logical shape."),
    _c("numel", "int64", "Number of elements."),
    _c(
        "status",
        "string",
        "ok | skipped | error: whether digest_hi/lo hold a digest (skipped: not digested by policy, e.g. a view).",
    ),
    _c("digest_hi", "uint64", "High 64 bits of the 128-bit content digest (null unless status = ok).", True),
    _c("digest_lo", "uint64", "Low 64 bits of the 128-bit content digest (null unless status = ok).", True),
    _c("error", "string", "Why digesting failed (status = error); two errors never compare equal.", True),
    _c("rows", "list<string>", "Ordered row (dim 0) or chunk digests as 32-hex strings, when requested.", True),
    _c(
        "m_sum",
        "float64",
        "float64 sum of the values (floating and complex real part only), when moments are on.",
        True,
    ),
    _c("m_absmax", "float64", "float64 max |value|, when moments are on.", True),
    _c("m_nan", "int64", "Number of NaN elements, when moments are on.", True),
    _c("m_inf", "int64", "Number of +-Inf elements, when moments are on.", True),
    _c("hazards", "list<string>", "Hazard flags (HAZARDS) that make this record a likely false root; empty when none."),
    _c(
        "args_digest",
        "string",
        "16-hex digest of the call's non-tensor arguments (same on every record of a call), null when the call has none.",
        True,
    ),
    _c("compiled", "bool", "True when the record is the boundary of a torch.compile region rather than an eager op."),
)

_METRICS = (
    *_PROVENANCE,
    _c("microbatch", "int32", "Microbatch index, or -1."),
    _c("name", "string", "Metric name: loss, lm_loss, load_balancing_loss, mtp_loss, grad_norm, lr, ..."),
    _c("occurrence", "int32", "How many metrics of the same (step, microbatch, name) came before on this rank."),
    _c("value", "float64", "The scalar as float64 (exact for every float type up to float64)."),
    _c("bits", "uint64", "Raw IEEE-754 bits of value: compare these, never printed values."),
    _c("dtype", "string", "dtype of the tensor or Python type the metric came from."),
)

_EVENTS = (
    *_PROVENANCE,
    _c("type", "string", "One of EVENT_TYPES."),
    _c(
        "name",
        "string",
        "What the event is about: a hazard name, a collective, a module, an exception type; '' when none.",
    ),
    _c("module", "string", "Module path at the time of the event, '' when none."),
    _c("count", "int64", "A count the event carries (records in a step, pending collectives, ...).", True),
    _c("detail", "string", "One line of detail for humans; parsed only for setting_changed (EVENT_TYPES).", True),
)

_KERNELS = (
    *_PROVENANCE,
    *_CALL_KEY,
    _c("call_hash", "uint64", "call_hash of the op record the kernel ran under."),
    _c("index", "int32", "Order of the kernel among those launched under that op."),
    _c("kernel", "string", "Kernel (or, without a device, innermost profiler event) name."),
    _c("device_type", "string", "cuda, cpu, ...: where the kernel ran."),
)

_DUMPS = (
    *_PROVENANCE,
    *_CALL_KEY,
    _c("role", "string", "As in records."),
    _c("arg", "string", "As in records."),
    _c("key_hash", "uint64", "key_hash of the record this dump confirms."),
    _c("dtype", "string", "torch dtype as str()."),
    _c("shape", "list<int64>", "Logical shape."),
    _c("data", "large_binary", "Raw bytes of the tensor, contiguous row-major, little-endian (never pickle)."),
)

_ARGS = (
    *_PROVENANCE,
    _c("args_digest", "string", "An args_digest of the records table this text belongs to."),
    _c(
        "text",
        "string",
        "The call's non-tensor arguments by value: name=value pairs joined by '; ' (positional arguments named by their index), each value as process-independent text (numbers, strings, dtypes, tuples; other objects by type name).",
    ),
)

_ROLLUPS = (
    *_PROVENANCE[:3],
    _c("seq", "int64", "seq of the block's first record in this window (the block's rows in records start here)."),
    _c(
        "block",
        "int32",
        "Block index: the records at positions [block * ROLLUP_BLOCK, (block + 1) * ROLLUP_BLOCK) of the rank-step, in seq order.",
    ),
    _c("seq_hi", "int64", "seq of the block's last record in this window."),
    _c("n", "int64", "Number of the block's records in this window."),
    _c("n_err", "int64", "Records with status error among them."),
    _c("kx", "uint64", "XOR over the records of rollup_hashes' key hash (the key set: structure, order-free)."),
    _c(
        "vx",
        "uint64",
        "XOR over the records of rollup_hashes' value hash (key, status, digest, args digest: order-free).",
    ),
    _c(
        "ox",
        "uint64",
        "XOR over the records of rollup_hashes' ordered hash (the value hash and the position: order-sensitive).",
    ),
    _c("kinds", "int64", "Bit i set when a record of kind KINDS[i] is among them (kinds_mask)."),
)

#: Every table of a run, in the order documented. ``records`` and ``metrics`` and
#: ``events`` are always written (possibly empty); ``kernels`` and ``dumps`` only on request;
#: ``args`` holds each distinct argument text once per (rank, segment), in the window where it
#: first appears (step and seq of its first record), when the text is at most 1024 characters.
#: ``rollups`` (ROLLUP_VERSION, manifest key ``rollups``): per (rank, step, block) fingerprints of
#: the records written in the same window, so an analysis reads only the divergent blocks.
TABLES: dict[str, tuple[Column, ...]] = {
    "records": _RECORDS,
    "metrics": _METRICS,
    "events": _EVENTS,
    "kernels": _KERNELS,
    "dumps": _DUMPS,
    "args": _ARGS,
    "rollups": _ROLLUPS,
}

#: Record kinds. ``op``: an ATen op; ``module_input``/``module_output``: a module boundary
#: (forward and backward); ``collective``/``p2p``: torch.distributed calls; ``reduced_grad``:
#: a gradient after its data-parallel reduction (e.g. DDP buckets); ``param``/``grad``/
#: ``optimizer_state``: optimizer boundary; ``rng_state``: a generator state at step start;
#: ``probe``: Session.probe; ``compiled``: a torch.compile region boundary; ``batch``: data
#: fed to the root module (the model input); ``state``: the state a capture starts from
#: (parameters, buffers, optimizer state; ``arg`` says which), recorded at the begin of the first
#: captured step and of the first one after a checkpoint load the capture saw; ``kernel``: a
#: kernel torch.compile generated (its name Inductor's), inside a compiled region.
KINDS = (
    "op",
    "module_input",
    "module_output",
    "collective",
    "p2p",
    "reduced_grad",
    "param",
    "grad",
    "optimizer_state",
    "rng_state",
    "probe",
    "compiled",
    "batch",
    "state",
    "kernel",
)
#: The name of a ``batch`` record of what a ``DataLoader``'s worker processes delivered, as the
#: main process received it (level ops: receiving it is not recorded, its timing is the workers').
LOADER_BATCH = "DataLoader"
#: Kinds whose records have no inputs: a difference there entered from outside the
#: captured region (data pipeline, restore, RNG), the analysis calls it a ``source``.
INPUTLESS_KINDS = ("param", "grad", "optimizer_state", "rng_state", "probe", "batch", "state")
#: ``dest``: a write-only argument of an op (an ``out=`` argument, the destination of a full
#: overwrite such as ``copy_``/``fill_``/``zero_``, or a destination still unwritten since its
#: ``empty*`` allocation). Its prior contents are never read, so it is recorded before the call
#: without a digest (status ``skipped``): never evidence, never an input of the call.
ROLES = ("input", "output", "value", "dest")
#: ``step``: outside forward/backward/optimizer (step-start RNG, step-end parameters).
PHASES = ("forward", "backward", "recompute", "optimizer", "step")
#: Prefixes of the manifest ``groups`` names that say data parallelism (``dp``, ``dp_cp``,
#: ``dp_shard``, ``fsdp``, Megatron-Core's ``edp``...): what a gradient reduction runs over. The
#: capture reports a step that reduced no gradient over such a group; the analysis looks there
#: first for the reduction that carried a difference into what the optimizer reads.
DATA_PARALLEL_GROUPS = ("dp", "fsdp", "hsdp", "ddp", "edp", "data")

#: Capture levels (the manifest's ``capture.level``), cheapest first: each records everything the
#: one before it does. The capture gives each its capabilities; the analysis and its advice name
#: the next rung up from this tuple.
CAPTURE_LEVELS = ("metrics", "boundaries", "ops")
STATUSES = ("ok", "skipped", "error")
#: Hazard flags: records carrying one are likely false roots.
HAZARDS = ("uninitialized", "async_pending", "nonblocking_pending", "pointer_like")
#: ``partial_step``: a step that did not finish: ended at close without an optimizer step (launcher
#: mode: the forwards after the last one), or left by an exception (``Session.step``); ``setting_changed``: a numerics setting changed between steps (the
#: manifest holds the values at the first step): ``name`` the key of ``determinism``, ``detail``
#: ``before step N: KEY: OLD -> NEW`` (``in step N`` for the autocast state of a forward) with
#: OLD and NEW as JSON (runs of earlier releases: one event for several keys, values as Python text); ``reduction_not_captured``: a gradient
#: reduction the capture could not record (an unhookable DDP, or none seen in a multi-rank step).
EVENT_TYPES = (
    "step_begin",
    "step_end",
    "pending_collective",
    "hazard",
    "recompute_mismatch",
    "truncation",
    "capture_error",
    "capture_disabled",
    "partial_step",
    "setting_changed",
    "reduction_not_captured",
)


#: Version of the rollups table and its hashes (``rollup_hashes``); a manifest says it in its
#: ``rollups`` key. Runs without it (older writers) have no rollups: analyses read records instead.
ROLLUP_VERSION = 1
#: Records per rollup block (positions within a rank-step, in seq order).
ROLLUP_BLOCK = 1024

_M64 = (1 << 64) - 1
#: Salts of the three rollup hashes and the stand-in for a null digest or args digest.
ROLLUP_SALTS = (0x6B6579, 0x76616C, 0x6F7264, 0x6E756C6C)


def _mix(x: int) -> int:
    """The splitmix64 finalizer on an unsigned 64-bit integer."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def rollup_hashes(
    key_hash: int, status: str, digest_hi: int | None, digest_lo: int | None, args_digest: str | None, pos: int
) -> tuple[int, int, int]:
    """(key, value, ordered) hashes of one record for the rollups table (the reference
    definition; writers may compute it vectorized, bit-identically).

    key = mix(key_hash ^ K); value = mix(mix(mix(mix(key ^ status index) ^ hi) ^ lo) ^ args), with
    NULL for a null digest or args digest and args as its 16-hex integer; ordered = mix(value ^
    mix(pos ^ O)) where ``pos`` is the record's position in its block. A value match is evidence
    from 64-bit hashes; a mismatch is only a candidate (the exact comparison decides).
    """
    k_salt, _, o_salt, null = ROLLUP_SALTS
    k = _mix(key_hash ^ k_salt)
    v = _mix(k ^ STATUSES.index(status))
    v = _mix(v ^ (null if digest_hi is None else digest_hi))
    v = _mix(v ^ (null if digest_lo is None else digest_lo))
    v = _mix(v ^ (null if args_digest is None else int(args_digest, 16)))
    return k, v, _mix(v ^ _mix(pos ^ o_salt))


def kinds_mask(kinds: object) -> int:
    """Bit i set for each KINDS[i] in ``kinds`` (an iterable of kind names)."""
    out = 0
    for k in set(kinds):  # type: ignore[call-overload]
        out |= 1 << KINDS.index(k)
    return out


def columns(table: str) -> tuple[Column, ...]:
    """Columns of ``table``; KeyError names the known tables."""
    try:
        return TABLES[table]
    except KeyError:
        raise KeyError(f"unknown table {table!r}; known: {', '.join(TABLES)}") from None


#: Separator of a tensor subclass's part in ``arg`` (docs/trace-format.md §2, "Tensor
#: subclasses"): ``args[1]::scale`` is the ``scale`` of the subclass tensor passed as ``args[1]``,
#: nested subclasses chain it (``value::_local_tensor::qdata``). Never part of a plain argument path.
COMPONENT_SEP = "::"


def split_component(arg: str) -> tuple[str, str | None]:
    """(the whole's argument path, the component path) of a record's ``arg``:
    ``"args[1]::_local_tensor::scale"`` -> ``("args[1]", "_local_tensor::scale")``; a record that
    is not a part of a subclass gives ``(arg, None)``."""
    whole, sep, comp = arg.partition(COMPONENT_SEP)
    return (whole, comp) if sep else (arg, None)


def call_key(microbatch: int, phase: str, module: str, kind: str, name: str, occurrence: int) -> str:
    """Canonical text of a call-site key (step and rank excluded: they are columns).

    Fields are joined with U+001F (unit separator), which never occurs in module
    paths, op names or argument paths, so distinct keys cannot render alike.
    """
    return f"{microbatch}\x1f{phase}\x1f{module}\x1f{kind}\x1f{name}\x1f{occurrence}"


def record_key(call: str, role: str, arg: str) -> str:
    """Canonical text of a record key: a call key plus the tensor's place in the call."""
    return f"{call}\x1f{role}\x1f{arg}"


def key_hash(key: str) -> int:
    """Stable unsigned 64-bit hash of a canonical key: first 8 bytes of BLAKE2b, little-endian.

    Never Python's ``hash()``, which is salted per process.
    """
    return int.from_bytes(hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest(), "little")


#: How any engine reads a table directory (``<run>/<table>``), settled here so every engine sees
#: the same rows and types (docs/trace-format.md §6). The ``rank=R`` directories are for pruning
#: only; the ``rank`` column inside every file is the rank (a shard read alone is complete), so
#: partition inference is off, or the engine adds a second ``rank`` from the path (Spark warns
#: ``COLUMN_ALREADY_EXISTS``; DuckDB and polars type it BIGINT). The layout and SCHEMA_VERSION are
#: unchanged by this rule: runs of every version read the same way.
READ_RULE: dict[str, str] = {
    "spark": 'spark.read.option("recursiveFileLookup", "true").parquet("<run>/<table>")',
    "duckdb": "read_parquet('<run>/<table>/*/*.parquet', hive_partitioning = false)",
    "polars": 'pl.scan_parquet("<run>/<table>/*/*.parquet", hive_partitioning=False)',
}


def shard_name(segment: int, window: int) -> str:
    """File name of one flushed shard (inside its ``<table>/rank=R`` partition)."""
    return f"part-s{segment:05d}-w{window:07d}.parquet"


def shard_relpath(table: str, rank: int, segment: int, window: int) -> str:
    """Path of one flushed shard inside a run directory (hive-partitioned by rank)."""
    return f"{table}/rank={rank}/{shard_name(segment, window)}"


def manifest_relpath(rank: int, segment: int) -> str:
    """Path of one rank's manifest for one process launch (segment) inside a run directory."""
    return f"{MANIFEST_DIR}/rank={rank}/segment-{segment:05d}.json"


# The manifest's keys and their meanings live beside the contract (its longest table).
from detfp_format.manifest_keys import MANIFEST_KEYS, MANIFEST_OPTIONAL_KEYS  # noqa: E402
