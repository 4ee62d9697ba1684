"""Per (rank, step) folds of the records' rollups and the metrics, from the commit logs alone.

A launch written with ``commitlog.STEP_SUMS_VERSION`` (manifest key ``step_sums``) commits, with
each flush window, per step: its records' rollup (count, digest errors, key XOR, value XOR:
the fold of that window's rollups rows) and its metrics (count, sum of ``commitlog.metric_hash``
mod 2^64). The folds combine across windows and launches, so the bisect tells which (rank, step)s
differ between two runs from the commit logs ``open_run`` has already read, and reads the
rollups and metrics shards of those (rank, step)s only: an identical pair reads neither, and a
diverged rank's metrics are read at its first differing step only.

``from_logs`` keeps, at open, the folds of each (rank, segment) that holds them (``Folds``: one
polars frame of every (rank, segment, step), or the run index's copy of it, ``io.runindex``;
a launch without them, or with a committed window whose line lacks them, is not ``usable``);
``pair`` answers for two runs only when both hold them for every launch of the compared ranks,
with nothing excluded and no completeness gap; anything else is None and the bisect reads the
shards as for older runs (same answer, slower). What the search asks of the folds (which
(rank, step)s differ, and in which fields) is one join of the two runs' frames.
Whether the bisect uses them at all is its caller's choice (``bisect.reads.ReadPaths``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import polars as pl

from detfp_format import commitlog, contract

__all__ = [
    "FOLD_SCHEMA", "HASH_COLUMNS", "RECORD_FOLD_COLUMNS", "Folds", "Sums", "as_dict", "committed", "differing", "fold",
    "from_logs", "hashes", "held", "metric_firsts", "metric_reads", "mismatches", "pair", "record_folds", "record_reads", "rollup_rows",
    "shard_folds", "usable",
]  # fmt: skip

#: One row per (rank, segment, step) of a launch's folds: commitlog.SUM_FIELDS folded over its windows.
FOLD_SCHEMA = {"rank": pl.Int32, "segment": pl.Int32, "step": pl.Int64, "n": pl.Int64, "n_err": pl.Int64,
               "kx": pl.UInt64, "vx": pl.UInt64, "m_n": pl.Int64, "m_h": pl.UInt64}  # fmt: skip
_FIELDS = list(commitlog.SUM_FIELDS)
#: (rank, step) -> commitlog.SUM_FIELDS folded over the step's windows and launches: a frame of
#: the columns rank, step and SUM_FIELDS, sorted by (rank, step).
Sums = pl.DataFrame
_U64 = 1 << 64


@dataclass(frozen=True, eq=False)
class Folds:
    """A run's committed step folds: the frame of every usable launch, and which launches are."""

    #: FOLD_SCHEMA rows of the usable launches, sorted by (rank, segment, step).
    frame: pl.DataFrame
    #: (rank, segment)s whose every committed window states its folds.
    usable: frozenset[tuple[int, int]]

    def get(self, key: tuple[int, int], default: Any = None) -> dict[int, tuple[int, ...]] | None:
        """step -> folds of one launch (None: not usable); for tests and tools, not the search."""
        if key not in self.usable:
            return default
        part = self.frame.filter((pl.col("rank") == key[0]) & (pl.col("segment") == key[1]))
        return {s: tuple(v) for s, *v in part.select("step", *_FIELDS).iter_rows()}

    def __getitem__(self, key: tuple[int, int]) -> dict[int, tuple[int, ...]] | None:
        return self.get(key)


def from_logs(manifests: Mapping[int, Sequence[Mapping[str, Any]]], logs: Mapping[tuple[int, int], Any]) -> Folds:
    """The folds over each launch's committed windows, of the launches that wrote them for every
    committed window (the manifest says ``step_sums``; older writers did not)."""
    cols: dict[str, list] = {c: [] for c in FOLD_SCHEMA}
    usable = set()
    for rank, ms in sorted(manifests.items()):
        for m in ms:
            seg = m["segment"]
            log = logs.get((rank, seg))
            if not (
                m.get("step_sums") == commitlog.STEP_SUMS_VERSION
                and isinstance(log, commitlog.LogState)
                and set(log.sums) == set(log.windows)
            ):
                continue
            usable.add((rank, seg))
            folded = _fold((log.sums[w] for w in sorted(log.sums)), {})
            steps = sorted(folded)
            cols["rank"] += [rank] * len(steps)
            cols["segment"] += [seg] * len(steps)
            cols["step"] += steps
            for i, c in enumerate(_FIELDS):
                cols[c] += [folded[s][i] for s in steps]
    return Folds(pl.DataFrame(cols, schema=FOLD_SCHEMA), frozenset(usable))


def _fold(parts: Any, into: dict[Any, tuple[int, ...]]) -> dict:
    """Fold step -> SUM_FIELDS mappings into ``into`` (by step): the definition of a fold."""
    for part in parts:
        for step, v in part.items():
            held = into.get(step)
            if held is None:
                into[step] = v
            else:
                n, e, kx, vx, mn, mh = v
                into[step] = (held[0] + n, held[1] + e, held[2] ^ kx, held[3] ^ vx, held[4] + mn, (held[5] + mh) % _U64)
    return into


#: ``_fold`` as a polars aggregation (UInt64 sums wrap: mod 2^64, as the definition).
_AGG = [pl.col("n").sum(), pl.col("n_err").sum(), pl.col("kx").bitwise_xor(), pl.col("vx").bitwise_xor(),
        pl.col("m_n").sum(), pl.col("m_h").sum()]  # fmt: skip


#: Columns of a ``fold`` frame: rank, step and the records' fold (``commitlog.SUM_FIELDS``' first four).
RECORD_FOLD_COLUMNS = ("rank", "step", "n", "n_err", "kx", "vx")
#: What ``hashes`` reads of each record.
HASH_COLUMNS = ("key_hash", "status", "digest_hi", "digest_lo", "args_digest")


def _u64(v: int) -> pl.Expr:
    return pl.lit(v, dtype=pl.UInt64)


def _mixed(frame: Any, name: str, x: pl.Expr) -> Any:
    """``frame`` with column ``name`` = ``contract._mix(x)`` (the splitmix64 finalizer; polars'
    unsigned multiplication wraps, and a floor division by 2^k is the shift). Each round is a
    column of its own: the finalizer reads its operand three times, so one nested expression of
    the five rounds of a value hash would hold thousands of copies of its inputs."""
    c = pl.col(name)
    frame = frame.with_columns(x.alias(name))
    frame = frame.with_columns(((c ^ (c // _u64(1 << 30))) * _u64(0xBF58476D1CE4E5B9)).alias(name))
    frame = frame.with_columns(((c ^ (c // _u64(1 << 27))) * _u64(0x94D049BB133111EB)).alias(name))
    return frame.with_columns((c ^ (c // _u64(1 << 31))).alias(name))


def hashes(records: pl.DataFrame | pl.LazyFrame) -> Any:
    """``records`` (``HASH_COLUMNS``; ``status`` as text or as the ``Enum`` of ``contract.STATUSES``)
    with two UInt64 columns more, ``_kh`` and ``_vh``: the key and value hashes of
    ``contract.rollup_hashes`` (the frame's kind: lazy in, lazy out)."""
    k_salt, _, _, null = contract.ROLLUP_SALTS
    # A status outside the contract hashes as one more index: its fold cannot match the commit.
    codes = list(range(len(contract.STATUSES)))
    status = (
        pl.col("status")
        .cast(pl.String)
        .replace_strict(list(contract.STATUSES), codes, default=len(codes), return_dtype=pl.UInt64)
    )
    args = pl.col("args_digest").str.to_integer(base=16, dtype=pl.UInt64, strict=False).fill_null(_u64(null))
    k, v = pl.col("_kh"), pl.col("_vh")
    out = _mixed(records, "_kh", pl.col("key_hash").cast(pl.UInt64) ^ _u64(k_salt))
    out = _mixed(out, "_vh", k ^ status)
    out = _mixed(out, "_vh", v ^ pl.col("digest_hi").cast(pl.UInt64).fill_null(_u64(null)))
    out = _mixed(out, "_vh", v ^ pl.col("digest_lo").cast(pl.UInt64).fill_null(_u64(null)))
    return _mixed(out, "_vh", v ^ args)


def fold(records: pl.DataFrame | pl.LazyFrame, by: Sequence[str] = ("rank", "step")) -> Any:
    """Per ``by`` group, the fold of ``records`` (``RECORD_FOLD_COLUMNS``; the frame's kind: lazy
    in, lazy out), unsorted; needs ``by`` and ``HASH_COLUMNS``."""
    lazy = isinstance(records, pl.LazyFrame)
    lf = hashes((records if lazy else records.lazy()).select(*by, *HASH_COLUMNS))
    out = lf.group_by(*by).agg(
        pl.len().cast(pl.Int64).alias("n"),
        (pl.col("status").cast(pl.String) == "error").sum().cast(pl.Int64).alias("n_err"),
        pl.col("_kh").bitwise_xor().alias("kx"),
        pl.col("_vh").bitwise_xor().alias("vx"),
    )
    return out if lazy else out.collect()


def _folded(run: Any, ranks: Sequence[int] | None, lo: int | None = None, hi: int | None = None) -> Sums | None:
    """(rank, step) folds of ``ranks`` (None: all) over steps ``lo``..``hi`` (None: all), each
    launch's steps superseded by a later launch left out (as ``Run.scan`` leaves their rows out);
    None when a launch of those ranks holds no folds."""
    folds: Folds = run.step_sums
    wanted = run.ranks if ranks is None else ranks
    if any((r, m["segment"]) not in folds.usable for r in wanted for m in run.manifests.get(r, ())):
        return None
    lf = folds.frame.lazy()
    if ranks is not None and set(ranks) != set(run.ranks):
        lf = lf.filter(pl.col("rank").is_in(sorted(set(ranks))))
    if lo is not None:
        lf = lf.filter(pl.col("step") >= lo)
    if hi is not None:
        lf = lf.filter(pl.col("step") <= hi)
    cut = run.supersession()
    if cut:
        cuts = pl.LazyFrame(list(cut), schema={"rank": pl.Int32, "segment": pl.Int32, "_cut": pl.Int64}, orient="row")
        lf = (
            lf.join(cuts, on=["rank", "segment"], how="left")
            .filter(pl.col("_cut").is_null() | (pl.col("step") < pl.col("_cut")))
            .drop("_cut")
        )
    if any(len(run.manifests.get(r, ())) > 1 for r in wanted):
        lf = lf.group_by("rank", "step").agg(_AGG)
    return _by_rank_step(lf.select("rank", "step", *_FIELDS).collect())


def usable(run: Any, rank: int) -> bool:
    """Whether every launch of ``rank`` in ``run`` committed step folds (what ``committed`` needs)."""
    folds: Folds = run.step_sums
    return rank in run.manifests and all((rank, m["segment"]) in folds.usable for m in run.manifests[rank])


def committed(run: Any, ranks: Sequence[int], lo: int, hi: int) -> Sums:
    """The committed folds of ``ranks`` (each ``usable``) over steps ``lo``..``hi``, superseded steps
    left out: what the rows ``run.scan`` returns of those steps must fold to (``io.binding``)."""
    got = _folded(run, ranks, lo, hi)
    assert got is not None, "committed() of a rank without step folds"
    return got


def _by_rank_step(frame: pl.DataFrame) -> pl.DataFrame:
    """``frame.sort("rank", "step")``. Folds are stored in that order (one launch per rank), and
    a filter keeps it: a frame whose (rank, step) already strictly increase is returned as it is
    (the sort's result, checked in one vectorized pass instead of sorting millions of rows)."""
    if frame.height > 1:
        dr, ds = frame["rank"].diff().slice(1), frame["step"].diff().slice(1)
        if ((dr > 0) | ((dr == 0) & (ds > 0))).all():
            return frame
    return frame.sort("rank", "step")


def _of(run: Any, ranks: Sequence[int], lo: int, hi: int) -> Sums | None:
    comp = run.completeness
    if comp is None or comp.gaps or run.excluded:
        return None
    return _folded(run, ranks, lo, hi)


def pair(run_a: Any, run_b: Any, ranks: Sequence[int], lo: int, hi: int) -> tuple[Sums, Sums] | None:
    """Both runs' folds of ``ranks`` over steps ``lo``..``hi``, or None when either run lacks
    them anywhere there (then the shards are read)."""
    a = _of(run_a, ranks, lo, hi)
    b = _of(run_b, ranks, lo, hi) if a is not None else None
    return None if a is None or b is None else (a, b)


def as_dict(sums: Sums) -> dict[tuple[int, int], tuple[int, ...]]:
    """(rank, step) -> SUM_FIELDS of a folds frame (tests and tools)."""
    return {(r, s): tuple(v) for r, s, *v in sums.select("rank", "step", *_FIELDS).iter_rows()}


def _differ(a: Sums, b: Sums, fields: Sequence[str]) -> pl.DataFrame:
    """(rank, step)s whose ``fields`` differ (a step on one side only: against zeros), sorted."""
    if a.height == b.height and a.select("rank", "step").equals(b.select("rank", "step")):
        # The same (rank, step)s in the same order (runs of one job, the usual case): a row-wise
        # comparison, no join. Both frames are sorted by (rank, step).
        differs = pl.any_horizontal([a[c] != b[c] for c in fields])
        return a.select("rank", "step").filter(differs) if a.height else a.select("rank", "step")
    j = a.select("rank", "step", *fields).join(
        b.select("rank", "step", *fields), on=["rank", "step"], how="full", coalesce=True, suffix="_b"
    )
    zero = [pl.col(c).fill_null(0) != pl.col(f"{c}_b").fill_null(0) for c in fields]
    return j.filter(pl.any_horizontal(zero)).select("rank", "step").sort("rank", "step")


def differing(a: Sums, b: Sums) -> pl.DataFrame:
    """(rank, step)s whose records' rollup folds differ (a step on one side only included)."""
    return _differ(a, b, _FIELDS[:4])


def _reads(pairs: pl.DataFrame) -> tuple[list[int], int, int] | None:
    """The ranks of ``pairs`` and the step range covering them: what a read of those needs."""
    if pairs.height == 0:
        return None
    return pairs["rank"].unique().sort().to_list(), int(pairs["step"].min()), int(pairs["step"].max())  # type: ignore[arg-type]


def record_reads(
    a: Sums, b: Sums, ranks: Sequence[int] | None = None, lo: int | None = None, hi: int | None = None
) -> tuple[list[int], int, int] | None:
    """(ranks, first step, last step) of the (rank, step)s whose records' rollup differs, among
    ``ranks`` and steps ``lo``..``hi`` when given: the only rollups read (the candidate steps are
    among them); None when none differs."""
    pairs = _differ(a, b, _FIELDS[:4])
    if ranks is not None:
        pairs = pairs.filter(pl.col("rank").is_in(sorted(set(ranks))))
    if lo is not None:
        pairs = pairs.filter(pl.col("step") >= lo)
    if hi is not None:
        pairs = pairs.filter(pl.col("step") <= hi)
    return _reads(pairs)


def metric_firsts(a: Sums, b: Sums) -> dict[int, int]:
    """rank -> its first step whose metrics folds differ (the ranks where one does)."""
    firsts = _differ(a, b, _FIELDS[4:]).group_by("rank").agg(pl.col("step").min())
    return {int(r): int(s) for r, s in firsts.iter_rows()}


def metric_reads(a: Sums, b: Sums) -> tuple[list[int], int, int] | None:
    """(ranks, first step, last step) covering each rank's first step whose metrics differ: the
    only metrics read (a rank's first split is its first such step, the folds of the steps before
    it being equal); None when none differs."""
    pairs = _differ(a, b, _FIELDS[4:])
    return _reads(pairs.group_by("rank").agg(pl.col("step").min()))


def rollup_rows(sums: Sums, ranks: Sequence[int], lo: int, hi: int) -> pl.DataFrame:
    """``blocks.step_rollup``'s rows (rank, step, n, kx, vx, n_err) from folds: the same values, as
    the folds are of the same rollups rows (a step with metrics only has no rollup row)."""
    return _by_rank_step(
        sums.filter(pl.col("rank").is_in(sorted(set(ranks))) & pl.col("step").is_between(lo, hi) & (pl.col("n") != 0))
        .select("rank", "step", "n", "kx", "vx", "n_err")
    )


def held(run: Any) -> tuple[list[int], Sums]:
    """The ranks whose every launch holds step folds and has no completeness gap, and their
    folds over every step (superseded steps left out)."""
    gaps = {g.rank for g in run.completeness.gaps} if run.completeness is not None else set()
    ranks = [
        r for r in run.ranks if r not in gaps and all((r, m["segment"]) in run.step_sums.usable for m in run.manifests[r])
    ]
    got = _folded(run, ranks) if ranks else None
    return ranks, got if got is not None else pl.DataFrame(schema={k: v for k, v in FOLD_SCHEMA.items() if k != "segment"})


def shard_folds(run: Any, ranks: Sequence[int]) -> dict[tuple[int, int], tuple[int, ...]]:
    """The same folds computed from the rollups and metrics shards of ``ranks`` (what ``held``
    must equal): one pass over the rollups table, and one hash per metric row."""
    out: dict[tuple[int, int], list[int]] = {}
    roll = (
        run.scan("rollups", ranks=ranks)
        .group_by("rank", "step")
        .agg(pl.col("n").sum(), pl.col("n_err").sum(), pl.col("kx").bitwise_xor(), pl.col("vx").bitwise_xor())
        .collect()
    )
    for r, s, n, e, kx, vx in roll.select("rank", "step", "n", "n_err", "kx", "vx").iter_rows():
        out[(r, s)] = [n, e, kx, vx, 0, 0]
    met = run.scan("metrics", ranks=ranks, columns=("rank", "step", "microbatch", "name", "occurrence", "bits"))
    for r, s, mb, name, occ, bits in met.collect().iter_rows():
        acc = out.setdefault((r, s), [0] * len(commitlog.SUM_FIELDS))
        acc[4] += 1
        acc[5] = (acc[5] + commitlog.metric_hash(mb, name, occ, bits)) % _U64
    return {k: tuple(v) for k, v in out.items()}


def record_folds(run: Any, ranks: Sequence[int]) -> dict[tuple[int, int], tuple[int, ...]]:
    """The records' folds of ``ranks`` computed from the records shards (one streaming pass over
    ``HASH_COLUMNS``): what the committed folds' first four fields must equal."""
    lf = run.scan("records", ranks=ranks, columns=("rank", "step", *HASH_COLUMNS))
    got = fold(lf).collect(engine="streaming")
    return {(r, s): tuple(v) for r, s, *v in got.select(*RECORD_FOLD_COLUMNS).iter_rows()}


def mismatches(run: Any) -> list[tuple[int, int, str]]:
    """(rank, step, table) wherever a rank's committed folds differ from its shards' (``held``
    against ``shard_folds`` and ``record_folds``), sorted: shards rewritten or replaced after their
    commit, or a faulty writer. The bisect trusts the folds and checks what it reads against them
    (``io.binding``); ``certify`` checks every shard with this."""
    ranks, committed_frame = held(run)
    if not ranks:
        return []
    committed = as_dict(committed_frame)
    shards = shard_folds(run, ranks)
    records = record_folds(run, ranks)
    zero = (0,) * len(commitlog.SUM_FIELDS)
    out = []
    for key in sorted(committed.keys() | shards.keys() | records.keys()):
        c, s = committed.get(key, zero), shards.get(key, zero)
        if c[:4] != records.get(key, zero[:4]):
            out.append((*key, "records"))
        if c[:4] != s[:4]:
            out.append((*key, "rollups"))
        if c[4:] != s[4:]:
            out.append((*key, "metrics"))
    return out
