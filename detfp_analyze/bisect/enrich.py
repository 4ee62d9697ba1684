"""The walk's second read: only the calls a verdict needs, in full, for the records the walk picked.

The walk aligns every candidate rank-step on narrow columns; ``enrich`` then reads the
call-site columns (microbatch, phase, module, name, ...) of a handful of calls per rank (the
divergent call, the next clean one, the call one hop upstream) and the detail columns of the
divergent records (moments, row digests, errors), both runs' sides together. ``with_twins``
adds to a divergent module output the records of its module_input twin: the inputs that decide
origin or receiver for a module boundary.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Iterable, Mapping
from dataclasses import replace
from typing import Any, NamedTuple, TypeVar

import polars as pl

from detfp_analyze.bisect.blocks import Slice
from detfp_analyze.bisect.reads import collect_pair
from detfp_analyze.bisect.records import Aligned, CallKey, Extract, RecordKey
from detfp_analyze.io.reader import Run
from detfp_format.contract import call_key, key_hash

__all__ = ["DETAIL_COLUMNS", "Details", "Enriched", "enrich", "hazard_names", "with_twins"]

#: Call-site and tensor columns joined onto the narrow alignment for the calls a verdict needs.
_CALL_DETAIL = ("microbatch", "phase", "module", "name", "occurrence", "role", "arg", "dtype", "shape", "hazards")
#: Record detail columns (moments, rows, errors, digests) the verdict's difference kind needs.
DETAIL_COLUMNS = (
    "rank",
    "step",
    "key_hash",
    "status",
    "error",
    "digest_hi",
    "digest_lo",
    "args_digest",
    "dtype",
    "rows",
    "m_sum",
    "m_absmax",
)
#: RecordKey -> that record's DETAIL_COLUMNS in one run.
Details = dict[RecordKey, dict[str, Any]]


def _frame(keys: Iterable[tuple[int, int, int]], last: str) -> pl.DataFrame:
    rows = sorted(set(keys))
    return pl.DataFrame(
        [list(k) for k in rows], schema={"rank": pl.Int32, "step": pl.Int64, last: pl.UInt64}, orient="row"
    )


class Enriched(NamedTuple):
    """What ``enrich`` read."""

    #: The aligned rows of the calls with the call-site columns of both sides.
    rich: pl.DataFrame
    #: Each side's DETAIL_COLUMNS of the records asked for.
    det_a: Details
    det_b: Details
    #: Ranks whose rank-step the alignment holds only to a slice's head, with a record of the
    #: calls past that head on either side (those records are left out of the rest).
    past: set[int]


def enrich(
    run_a: Run,
    run_b: Run,
    al: pl.DataFrame,
    calls: Collection[CallKey],
    detail_keys: Collection[RecordKey] = (),
    *,
    heads: Mapping[tuple[int, int], Slice] | None = None,
) -> Enriched:
    """Aligned rows of ``calls`` with the call-site columns of both sides, and each side's
    DETAIL_COLUMNS of the records ``detail_keys``.

    The details come from the same read (a record's call hash is a function of its key, so the
    records of ``detail_keys`` lie in ``calls``): per key the last record in file order, as a
    separate read by key would give. ``heads``: the (rank, step)s ``al`` holds only to their
    slice's head (``blocks.Slice.head``): the read goes on to the slice's end, and a rank with a
    record of the calls there is named in ``past``.
    """
    key = _frame(calls, "call_hash")
    hashes = key["call_hash"].unique().to_list()
    # A hash-set filter on the call first: the (rank, step, call) join then runs on a few rows,
    # not on the whole batch's alignment.
    sub = al.filter(pl.col("call_hash").is_in(hashes)).join(key, on=["rank", "step", "call_hash"], how="semi")
    # The hazards lists are only read when a row of these calls has a hazard flag (hz covers
    # every record of the rank-step on both sides): decoding a list column is the costly part.
    cols: list[Any] = list(_CALL_DETAIL)
    if not sub["hz"].any():
        cols[cols.index("hazards")] = pl.lit(None, dtype=pl.List(pl.String)).alias("hazards")
    extra = [c for c in DETAIL_COLUMNS if c not in ("rank", "step", "key_hash", *_CALL_DETAIL)] if detail_keys else []
    seq = ["seq"] if heads else []
    read = ["rank", "step", "call_hash", "key_hash", *seq, *[c for c in cols if isinstance(c, str)], *extra]
    lfs = []
    for i, (run, sfx) in enumerate(((run_a, "a"), (run_b, "b"))):
        spans = _spans(sub, sfx)
        for k, c in (heads or {}).items():
            if k in spans:  # on to the slice's end: the calls' records past the head
                spans[k] = (spans[k][0], c.span(i)[1])
        lf = run.scan_spans("records", spans, read).filter(pl.col("call_hash").is_in(hashes))
        lf = lf.select("rank", "step", "call_hash", "key_hash", *seq, *cols, *extra)
        lfs.append(lf.join(key.lazy(), on=["rank", "step", "call_hash"], how="semi"))
    dets: list[Details] = []
    past: set[int] = set()
    for i, (det, sfx) in enumerate(zip(collect_pair(*lfs), ("a", "b"), strict=True)):
        if heads:
            ends = pl.DataFrame(
                [(r, s, c.span(i, head=True)[1]) for (r, s), c in heads.items()],
                schema={"rank": pl.Int32, "step": pl.Int64, "_end": pl.Int64},
                orient="row",
            )
            beyond = pl.col("seq") > pl.col("_end").fill_null(pl.col("seq"))
            det = det.join(ends, on=["rank", "step"], how="left", maintain_order="left")
            past |= set(det.filter(beyond)["rank"].to_list())
            det = det.filter(~beyond).drop("seq", "_end")
        if detail_keys:
            d = det.join(
                _frame(detail_keys, "key_hash"), on=["rank", "step", "key_hash"], how="semi", maintain_order="left"
            )
            d = d.unique(["rank", "step", "key_hash"], keep="last", maintain_order=True).select(DETAIL_COLUMNS)
            dets.append({RecordKey(int(r["rank"]), int(r["step"]), int(r["key_hash"])): r for r in d.to_dicts()})
            det = det.drop(extra)
        else:
            dets.append({})
        det = det.unique(["rank", "step", "key_hash"], keep="first", maintain_order=True).drop("call_hash")
        sub = sub.join(det.rename({c: f"{c}_{sfx}" for c in _CALL_DETAIL}), on=["rank", "step", "key_hash"], how="left")
    shared = [c for c in _CALL_DETAIL if c not in ("dtype", "shape", "hazards")]
    return Enriched(
        sub.with_columns([pl.coalesce(f"{c}_a", f"{c}_b").alias(c) for c in shared]), dets[0], dets[1], past
    )


def _spans(sub: pl.DataFrame, side: str) -> dict[tuple[int, int], tuple[int, int]]:
    """(rank, step) -> the seq span of one side's rows of ``sub`` (aligned rows) there: a key
    occurs once per rank-step (``integrity.check_stream``), so the records ``sub`` joins to all
    lie in it, and ``Run.scan_spans`` reads only it. A (rank, step) without a row on this side
    reads nothing."""
    spans = (
        sub.filter(pl.col(f"seq_{side}").is_not_null())
        .group_by("rank", "step")
        .agg(pl.col(f"seq_{side}").min().alias("lo"), pl.col(f"seq_{side}").max().alias("hi"))
    )
    return {(int(r), int(s)): (int(lo), int(hi)) for r, s, lo, hi in spans.iter_rows()}


def hazard_names(rows: Iterable[Aligned]) -> tuple[str, ...]:
    """Every hazard flag on ``rows``, either side, sorted."""
    return tuple(sorted({h for r in rows for h in (*r.hazards_a, *r.hazards_b)}))


#: Whatever the caller keys its extracts by.
_K = TypeVar("_K", bound=Hashable)


def with_twins(run_a: Run, run_b: Run, al: pl.DataFrame, extracts: Mapping[_K, Extract]) -> dict[_K, Extract]:
    """``extracts`` with the records of each divergent module output's module_input twin added.

    A module boundary is two calls: module_input (or batch, at the root) before the module runs,
    module_output after. For a divergent module output without input records, the inputs that
    decide origin vs. receiver are its twin's: same microbatch, phase, module, name and
    occurrence. Extracts needing no twin are returned unchanged.
    """
    twins: dict[CallKey, list[_K]] = {}
    for which, ex in extracts.items():
        rec = ex.record
        if rec.kind != "module_output" or any(c.role == "input" for c in ex.call):
            continue
        for kind in ("module_input", "batch"):
            ck = call_key(rec.microbatch, rec.phase, rec.module, kind, rec.name, rec.occurrence)
            twins.setdefault(CallKey(rec.rank, rec.step, key_hash(ck)), []).append(which)
    out = dict(extracts)
    if not twins:
        return out
    rich = enrich(run_a, run_b, al, list(twins))[0]
    parts = rich.partition_by("rank", "step", "call_hash", as_dict=True)
    for twin, whiches in twins.items():
        part = parts.get((twin.rank, twin.step, twin.call_hash))
        rows = tuple(Aligned.from_row(r) for r in part.to_dicts()) if part is not None else ()
        for which in whiches:
            ex = out[which]
            hazards = tuple(sorted(set(ex.hazards) | set(hazard_names(rows))))
            out[which] = replace(ex, call=ex.call + rows, hazards=hazards)
    return out
