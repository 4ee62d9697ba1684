"""What the analysis reads, bound to what was committed (no extra I/O).

A shard whose size and footer agree with its commit line can still hold other rows than its
window committed: a file from another run of the same size whose footer statistics coincide (a
size-only sync), a shard rewritten in place, a buggy writer. Each window's commit line states,
per step, the fold of its records (count, digest errors, XOR of the key hashes, XOR of the value
hashes: ``contract.rollup_hashes``, ``io.stepsums``), and the rollups table the same per block.
Whatever the bisect reads of the records or the rollups is folded the same way and compared with
those, so a read that is not what was committed is refused in one line naming the file, before
any answer rests on it:

* ``fold(records)`` (``stepsums.fold``): per (rank, step) the fold of the rows of a frame
  (``FOLD_COLUMNS``: the contract's rollup hashes rendered in polars, bit-identical to the
  reference, which a test checks);
* ``check_steps(run, table, folds)``: per-(rank, step) folds computed from whole steps read (the
  records, or the rollups table's blocks) against the run's committed folds, where its launches
  wrote them (``stepsums``; older runs have none: nothing to bind them to);
* ``check_spans(run, folds, expected)``: folds of parts of steps read (a slice of the stored
  rollups' blocks, ``blocks.Slice``) against the folds of those blocks;
* ``check_metrics(run, rows, asked)``: the metrics rows of the steps whose values a report names
  (each rank's first metric split) against the metrics fold of those steps.

A mismatch is ``BindingError`` (a ``ShardError``: exit 2) naming the shard(s) that hold the
(rank, step), the table and what differs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import polars as pl

from detfp_analyze.errors import ShardError
from detfp_analyze.io import stepsums as _stepsums
from detfp_analyze.io.names import shown_name
from detfp_analyze.io.store import name_of
from detfp_format import commitlog

__all__ = [
    "FOLD_COLUMNS",
    "METRIC_COLUMNS",
    "Asked",
    "BindingError",
    "Fold",
    "Span",
    "check_metrics",
    "check_spans",
    "check_steps",
    "fold",
]

#: Columns of a ``fold`` frame: rank, step and the records' fold (``commitlog.SUM_FIELDS``' first four).
FOLD_COLUMNS = _stepsums.RECORD_FOLD_COLUMNS
fold = _stepsums.fold
_FIX = (
    "the shard was replaced or rewritten after its window was committed (a copy from another run, a "
    "size-only sync) or its writer is faulty; delete it or re-run the capture"
)


class BindingError(ShardError):
    """Rows read from a shard are not the rows its window committed."""


class Fold(NamedTuple):
    """The fold of some records: count, digest errors, key XOR, value XOR."""

    n: int
    n_err: int
    kx: int
    vx: int


class Span(NamedTuple):
    """A read of every step of ``ranks`` from ``lo`` to ``hi`` (inclusive)."""

    ranks: Sequence[int]
    lo: int
    hi: int


#: What a whole-step read asked for: (rank, step) pairs, or a ``Span``.
Asked = Sequence[tuple[int, int]] | Span
#: The fold fields of the records (and of the rollups' blocks) and of the metrics.
_RECORD_FIELDS = FOLD_COLUMNS[2:]
_METRIC_FIELDS = ("m_n", "m_h")
#: The metrics columns ``check_metrics`` reads (``commitlog.metric_hash``'s inputs).
METRIC_COLUMNS = ("rank", "step", "microbatch", "name", "occurrence", "bits")


def check_steps(run: Any, table: str, folds: pl.DataFrame, asked: Asked) -> None:
    """Refuse the first (rank, step) whose fold in ``folds`` (``FOLD_COLUMNS``: whole steps read
    from ``table``, the records or the rollups' blocks) is not the one ``run``'s commit lines state
    for it. ``asked``: what the read covered, so a committed step the read did not return is
    refused too (steps the run leaves out, ``Run.excluded``, are not expected). Ranks whose
    launches wrote no step folds (older runs) pass."""
    bad = _mismatch(run, folds, asked, _RECORD_FIELDS)
    if bad is not None:
        rank, step, got, want = bad
        _refuse(run, table, rank, step, Fold(*got), Fold(*want), "the step fold its commit lines state")


def check_metrics(run: Any, rows: pl.DataFrame, asked: Asked) -> None:
    """Refuse the first (rank, step) of ``asked`` whose metrics rows in ``rows`` (``METRIC_COLUMNS``)
    are not the ones ``run``'s commit lines state (count and ``commitlog.metric_hash`` sum)."""
    acc: dict[tuple[int, int], list[int]] = {}
    for r, s, mb, name, occ, bits in rows.select(*METRIC_COLUMNS).iter_rows():
        a = acc.setdefault((int(r), int(s)), [0, 0])
        a[0] += 1
        a[1] = (a[1] + commitlog.metric_hash(mb, name, occ, bits)) % (1 << 64)
    got = pl.DataFrame(
        [(r, s, n, h) for (r, s), (n, h) in acc.items()],
        schema={"rank": pl.Int32, "step": pl.Int64, "m_n": pl.Int64, "m_h": pl.UInt64},
        orient="row",
    )
    bad = _mismatch(run, got, asked, _METRIC_FIELDS)
    if bad is not None:
        rank, step, (n, _), (want, _) = bad
        files = _files(run, "metrics", rank, step)
        raise BindingError(
            f"{files}: its metrics of rank {rank} step {step} are not what its window committed (the metrics "
            f"fold its commit lines state differs: {n} metric row(s) read, {want} committed); {_FIX}"
        )


def _mismatch(
    run: Any, got: pl.DataFrame, asked: Asked, fields: Sequence[str]
) -> tuple[int, int, tuple[int, ...], tuple[int, ...]] | None:
    """The first (rank, step) of ``asked`` whose ``fields`` in ``got`` (rows by rank and step;
    a (rank, step) without a row: zeros) differ from the committed folds: (rank, step, read,
    committed); None when every one agrees or no asked rank has folds."""
    pairs: list[tuple[int, int]] | None = None
    if isinstance(asked, Span):
        ranks, lo, hi = sorted(set(asked.ranks)), asked.lo, asked.hi
    else:
        pairs = sorted(set(asked))
        if not pairs:
            return None
        ranks, lo, hi = sorted({r for r, _ in pairs}), min(s for _, s in pairs), max(s for _, s in pairs)
    usable = [r for r in ranks if _stepsums.usable(run, r)]
    if not usable:
        return None
    committed = _stepsums.committed(run, usable, lo, hi).select("rank", "step", *fields)
    if pairs is not None:
        want = pl.DataFrame(pairs, schema={"rank": pl.Int32, "step": pl.Int64}, orient="row")
        committed = committed.join(want, on=["rank", "step"], how="right").select("rank", "step", *fields)
    for r, first, last in run.exclusions():
        if r in usable:
            gone = pl.col("step") >= first if last is None else pl.col("step").is_between(first, last)
            committed = committed.filter(~((pl.col("rank") == r) & gone))
    mine = got.filter(pl.col("rank").is_in(usable)).select(
        pl.col("rank").cast(pl.Int32), pl.col("step").cast(pl.Int64), *fields
    )
    j = mine.join(committed, on=["rank", "step"], how="full", coalesce=True, suffix="_c")
    differs = pl.any_horizontal([pl.col(c).fill_null(0) != pl.col(f"{c}_c").fill_null(0) for c in fields])
    bad = j.filter(differs).sort("rank", "step")
    if not bad.height:
        return None
    row = bad.row(0, named=True)
    return (
        int(row["rank"]),
        int(row["step"]),
        tuple(int(row[c] or 0) for c in fields),
        tuple(int(row[f"{c}_c"] or 0) for c in fields),
    )


def check_spans(run: Any, folds: pl.DataFrame, expected: Mapping[tuple[int, int], Fold]) -> None:
    """Refuse the first (rank, step) of ``expected`` whose span read from the records folds (in
    ``folds``, ``FOLD_COLUMNS``) to another fold than ``expected[(rank, step)]``: the fold of the
    stored rollups' blocks the span covers (``blocks.Slice``)."""
    if not expected:
        return
    got = {(int(r), int(s)): Fold(*v) for r, s, *v in folds.select(*FOLD_COLUMNS).iter_rows()}
    for key in sorted(expected):
        have = got.get(key, Fold(0, 0, 0, 0))
        if have != expected[key]:
            _refuse(run, "records", *key, have, expected[key], "the fold of its stored rollups' blocks")


def _refuse(run: Any, table: str, rank: int, step: int, got: Fold, want: Fold, what: str) -> None:
    diff = "record counts" if got.n != want.n else "key sets" if got.kx != want.kx else "values"
    raise BindingError(
        f"{_files(run, table, rank, step)}: its {table} of rank {rank} step {step} are not what its window "
        f"committed ({diff} differ from {what}: {got.n} record(s) read, {want.n} committed); {_FIX}"
    )


def _files(run: Any, table: str, rank: int, step: int) -> str:
    """The shard (or shards) of ``table`` that hold ``rank``'s ``step``, as a message names them."""
    files = [_shown(run, s) for s in run.shards.get(table, ()) if s.rank == rank and _holds(s, step)]
    if not files:
        return f"{run.label}/{table}/rank={rank}"
    return files[0] if len(files) == 1 else " or ".join(files[:2]) + (" (or another)" if len(files) > 2 else "")


def _shown(run: Any, s: Any) -> str:
    return s.shown or f"{run.label}/{s.table}/rank={s.rank}/{shown_name(name_of(s.path))}"


def _holds(s: Any, step: int) -> bool:
    return s.step_min is None or s.step_max is None or s.step_min <= step <= s.step_max
