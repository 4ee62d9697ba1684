"""The exact walk: from candidate steps to each rank's first divergent record.

Pipeline: ``rollup_candidates`` (per-(rank, step) rollups of both runs, ranks in batches,
streaming; ``narrow.py``) -> ``walk``: each rank's first candidate step is read on the
narrow columns (``align.NARROW_COLUMNS``) for a batch of ranks, aligned, and the first
divergent row picked per rank (resume boundary state first); steps with records on one
side only are re-aligned with the call-site columns (shifted occurrence counters); then
only the calls a verdict needs (the divergent call, the next clean one when the first has
hazards, the call one hop upstream, a module output's module_input twin) are read in full
(``enrich``, which also brings the divergent records' details). A candidate whose
differences carry no evidence (skipped records) moves on to the rank's next candidate step.
Both runs' sides of a read are collected concurrently, and the next batch is read while the
current one is processed. Memory: two batches of WALK_BATCH rank-steps per run.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import polars as pl

from detfp_analyze import rule
from detfp_analyze.bisect import align as _align
from detfp_analyze.bisect import narrow as _narrow
from detfp_analyze.bisect import resume as _resume
from detfp_analyze.io import integrity as _integrity
from detfp_analyze.rule.to_polars import to_polars
from detfp_capture.contract import STATUSES, call_key, key_hash

__all__ = [
    "DETAIL_COLUMNS",
    "ROLLUP_BATCH",
    "WALK_BATCH",
    "Progress",
    "chunks",
    "collect",
    "collect_pair",
    "rollup_candidates",
    "walk",
]

#: progress(stage, done, total): called between batches; the CLI draws a bar with it.
Progress = Callable[[str, int, int], None]
#: Ranks per rollup scan and per exact walk batch (memory bound: one walk batch holds
#: WALK_BATCH rank-steps of records from each run).
ROLLUP_BATCH = 64
WALK_BATCH = 32


def chunks(xs: Sequence[int], n: int) -> list[list[int]]:
    """``xs`` in consecutive lists of at most ``n``."""
    return [list(xs[i : i + n]) for i in range(0, len(xs), n)]


def collect(lf: pl.LazyFrame) -> pl.DataFrame:
    """Collect with the streaming engine (bounded memory on large scans)."""
    return lf.collect(engine="streaming")


def collect_pair(lf_a: pl.LazyFrame, lf_b: pl.LazyFrame) -> tuple[pl.DataFrame, pl.DataFrame]:
    """``collect`` of run A's and run B's side of a read, run concurrently (same frames as two
    ``collect`` calls: the engine releases the GIL, so the two scans overlap on two cores)."""
    a, b = pl.collect_all([lf_a, lf_b], engine="streaming")
    return a, b


def scan(run: Any, table: str, ranks: Sequence[int], lo: int, hi: int) -> pl.LazyFrame:
    """``run.scan`` of ``ranks`` over the inclusive step range [lo, hi] (files pruned by the reader)."""
    return run.scan(table, ranks=list(ranks), steps=range(lo, hi + 1))


def rollup_candidates(
    run_a: Any,
    run_b: Any,
    ranks: Sequence[int],
    lo: int,
    hi: int,
    progress: Progress | None,
    stage: str,
    errors: list[int] | None = None,
) -> dict[int, list[int]]:
    """rank -> candidate steps (sorted) whose rollups differ, over [lo, hi]. ``errors``, when
    given, accumulates [A, B] counts of records whose digest failed (no evidence)."""
    out: dict[int, list[int]] = {}
    batches = chunks(ranks, ROLLUP_BATCH)
    for i, batch in enumerate(batches):
        ra, rb = collect_pair(
            _narrow.step_rollup(scan(run_a, "records", batch, lo, hi)),
            _narrow.step_rollup(scan(run_b, "records", batch, lo, hi)),
        )
        if errors is not None:
            errors[0] += int(ra["n_err"].sum() or 0)
            errors[1] += int(rb["n_err"].sum() or 0)
        d = _narrow.divergent_steps(ra, rb)
        for rank, step in zip(d["rank"].to_list(), d["step"].to_list(), strict=False):
            out.setdefault(int(rank), []).append(int(step))
        if progress:
            progress(stage, i + 1, len(batches))
    return out


def _pairs_scan(run: Any, pairs: Mapping[int, int], columns: Sequence[str]) -> pl.LazyFrame:
    steps = sorted(set(pairs.values()))
    key = pl.DataFrame(
        {"rank": list(pairs), "step": [pairs[r] for r in pairs]}, schema={"rank": pl.Int32, "step": pl.Int64}
    )
    lf = run.scan("records", ranks=sorted(pairs), steps=steps).select(*columns, _align.HAZARD_FLAG)
    # Status as an enum: the alignment compares it on every row, integers compare faster.
    lf = lf.with_columns(pl.col("status").cast(pl.Enum(STATUSES)))
    if len(steps) == 1:
        return lf  # the scan already selects exactly these (rank, step) pairs: no join
    return lf.join(key.lazy(), on=["rank", "step"], how="semi")


def _read_pairs(
    run_a: Any, run_b: Any, pairs: Mapping[int, int], columns: Sequence[str]
) -> tuple[pl.DataFrame, pl.DataFrame]:
    """Both runs' records of the (rank, step) ``pairs``, prepared for the alignment (after
    ``integrity.check_stream``: a step with backwards seq or a repeated key is refused)."""
    a, b = collect_pair(_pairs_scan(run_a, pairs, columns), _pairs_scan(run_b, pairs, columns))
    _integrity.check_stream(a, run_a.label)
    _integrity.check_stream(b, run_b.label)
    return _align.prepare(a, one_step_per_rank=True), _align.prepare(b, one_step_per_rank=True)


def _label(row: Mapping[str, Any]) -> str:
    return f"{row['name']} ({row['kind']}) in {row['module'] or '<root>'}"


#: Call-site and tensor columns joined onto the narrow alignment for the calls a verdict needs.
_CALL_DETAIL = ("microbatch", "phase", "module", "name", "occurrence", "role", "arg", "dtype", "shape", "hazards")


def _pick(al: pl.DataFrame, row: dict[str, Any]) -> dict[str, Any]:
    """From one rank's narrow alignment: the divergent row, whether its call has a hazard,
    the call one hop upstream (hazard names come with the call's details) and the record
    kinds the rank-step holds (what else the capture saw there)."""
    call = al.filter(pl.col("call_hash") == row["call_hash"])
    start = call["o1"].min()
    prev = al.filter((pl.col("o1") < start) & (pl.col("call_hash") != row["call_hash"]))
    upstream = int(prev.sort("o1")["call_hash"][-1]) if prev.height else None
    kinds = frozenset(al["kind"].unique().to_list())
    return {"row": row, "hz": bool(call["hz"].any()), "upstream_call": upstream, "kinds": kinds}


def _hazard_names(rows: Sequence[Mapping[str, Any]]) -> tuple[str, ...]:
    names: set[str] = set()
    for c in rows:
        names.update(c.get("hazards_a") or ())
        names.update(c.get("hazards_b") or ())
    return tuple(sorted(names))


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
Details = dict[tuple[int, int, int], dict[str, Any]]


def _enrich(
    run_a: Any,
    run_b: Any,
    al: pl.DataFrame,
    calls: set[tuple[int, int, int]],
    detail_keys: set[tuple[int, int, int]] | None = None,
) -> tuple[pl.DataFrame, Details, Details]:
    """Aligned rows of ``calls`` (rank, step, call_hash) with the call-site columns of both sides,
    and each side's DETAIL_COLUMNS of the records ``detail_keys`` (rank, step, key_hash).

    The details come from the same read (a record's call hash is a function of its key, so
    the records of ``detail_keys`` lie in ``calls``): per key the last record in file order,
    as ``evidence.details`` gives.
    """
    key = pl.DataFrame(
        {"rank": [c[0] for c in calls], "step": [c[1] for c in calls], "call_hash": [c[2] for c in calls]},
        schema={"rank": pl.Int32, "step": pl.Int64, "call_hash": pl.UInt64},
    )
    sub = al.join(key, on=["rank", "step", "call_hash"], how="semi")
    ranks, steps = sorted({c[0] for c in calls}), sorted({c[1] for c in calls})
    hashes = key["call_hash"].unique().to_list()
    # The hazards lists are only read when a row of these calls has a hazard flag (hz covers
    # every record of the rank-step on both sides): decoding a list column is the costly part.
    cols: list[Any] = list(_CALL_DETAIL)
    if not sub["hz"].any():
        cols[cols.index("hazards")] = pl.lit(None, dtype=pl.List(pl.String)).alias("hazards")
    extra = [c for c in DETAIL_COLUMNS if c not in ("rank", "step", "key_hash", *_CALL_DETAIL)] if detail_keys else []
    lfs = []
    for run in (run_a, run_b):
        lf = run.scan("records", ranks=ranks, steps=steps).filter(pl.col("call_hash").is_in(hashes))
        lf = lf.select("rank", "step", "call_hash", "key_hash", *cols, *extra)
        lfs.append(lf.join(key.lazy(), on=["rank", "step", "call_hash"], how="semi"))
    dets: list[Details] = []
    for det, sfx in zip(collect_pair(*lfs), ("a", "b"), strict=True):
        if detail_keys:
            dk = pl.DataFrame(
                [list(k) for k in sorted(detail_keys)],
                schema={"rank": pl.Int32, "step": pl.Int64, "key_hash": pl.UInt64},
                orient="row",
            )
            d = det.join(dk, on=["rank", "step", "key_hash"], how="semi", maintain_order="left")
            d = d.unique(["rank", "step", "key_hash"], keep="last", maintain_order=True).select(DETAIL_COLUMNS)
            dets.append({(int(r["rank"]), int(r["step"]), int(r["key_hash"])): r for r in d.to_dicts()})
            det = det.drop(extra)
        else:
            dets.append({})
        det = det.unique(["rank", "step", "key_hash"], keep="first", maintain_order=True).drop("call_hash")
        sub = sub.join(det.rename({c: f"{c}_{sfx}" for c in _CALL_DETAIL}), on=["rank", "step", "key_hash"], how="left")
    shared = [c for c in _CALL_DETAIL if c not in ("dtype", "shape", "hazards")]
    return sub.with_columns([pl.coalesce(f"{c}_a", f"{c}_b").alias(c) for c in shared]), dets[0], dets[1]


def walk(
    run_a: Any,
    run_b: Any,
    cands: Mapping[int, list[int]],
    boundary: Sequence[int],
    progress: Progress | None,
    found: dict[int, dict[str, Any]] | None = None,
) -> dict[int, dict[str, Any]]:
    """rank -> {"first": extract, "next": extract|None} for ranks with a real divergence.

    ``next`` is the first clean divergence after a ``first`` that carries a hazard (a likely
    false root), from the same step or a later candidate step. When no step of the rank holds
    a value difference (only records under hazards, or only calls in another order or number
    whose records all match), ``next`` is None and ``first["weak"]`` says which.

    Each batch is aligned on the narrow columns first; only the calls a verdict needs (the
    divergent call, the next clean one, the call one hop upstream) are then read in full.
    """
    # ``found`` may hold ranks whose earlier steps differed only under hazards: their walk
    # goes on from there (the dict is updated in place and returned).
    found = {} if found is None else found
    todo = {r: list(s) for r, s in cands.items() if s}
    total = len(todo)
    # The next batch is read in a background thread while this one is aligned and enriched
    # (the engine releases the GIL). Its (rank, step) pairs are fixed before this batch
    # runs: a batch only ever changes the candidate lists of its own ranks.
    pool = ThreadPoolExecutor(max_workers=1)
    try:
        while todo:
            batches = chunks(sorted(todo), WALK_BATCH)
            pending = pool.submit(_read_pairs, run_a, run_b, {r: todo[r][0] for r in batches[0]}, _align.NARROW_COLUMNS)
            for i, batch in enumerate(batches):
                pairs = {r: todo[r][0] for r in batch}
                read = pending.result()
                if i + 1 < len(batches):
                    nxt_pairs = {r: todo[r][0] for r in batches[i + 1]}
                    pending = pool.submit(_read_pairs, run_a, run_b, nxt_pairs, _align.NARROW_COLUMNS)
                _walk_batch(run_a, run_b, batch, pairs, read, todo, boundary, found)
                if progress:
                    progress("walk", len(found), total)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return found


def _walk_batch(
    run_a: Any,
    run_b: Any,
    batch: Sequence[int],
    pairs: Mapping[int, int],
    read: tuple[pl.DataFrame, pl.DataFrame],
    todo: dict[int, list[int]],
    boundary: Sequence[int],
    found: dict[int, dict[str, Any]],
) -> None:
    """One walk batch: align ``read`` (the batch's prepared sides), pick, enrich; fills ``found``
    and advances or drops the batch's ranks in ``todo`` (in place)."""
    al = _align.align(*read)
    # Steps with records on one side only: re-align with the call-site columns, so a
    # shifted occurrence counter reads as structural, not as a value mismatch.
    one_sided = al.filter(pl.col("state").is_in(rule.ONE_SIDED))["rank"].unique().to_list()
    if one_sided:
        sub = {r: pairs[r] for r in one_sided}
        full = _align.align(*_read_pairs(run_a, run_b, sub, _align.ALIGN_COLUMNS)).select(al.columns)
        al = pl.concat([al.filter(~pl.col("rank").is_in(one_sided)), full])
    firsts = _align.first_divergences(al, priority_kinds=_resume.BOUNDARY_KINDS, priority_steps=boundary)
    by_rank = {int(r["rank"]): r for r in firsts.to_dicts()}
    # _pick only needs these columns: partitioning and filtering them per rank is far
    # cheaper than the full aligned frame (same rows, same order, so the same picks).
    slim = al.select("rank", "call_hash", "o1", "hz", "kind", _VALUE.alias("value"))
    parts = {int(k[0]): v for k, v in slim.partition_by("rank", as_dict=True).items()} if by_rank else {}
    picks: dict[int, dict[str, Any]] = {}
    for r in batch:
        if r not in by_rank:
            _advance(todo, r)  # only no-evidence differences (skipped records) in that step
            continue
        part = parts[r]
        first = _pick(part, by_rank[r])
        nxt = None
        if first["hz"]:
            clean = _align.first_divergences(al.filter(pl.col("rank") == r), exclude_hazard_calls=True)
            if clean.height:
                nxt = _pick(part, clean.row(0, named=True))
        # A step is no divergence of the run when what differs is only records under hazards
        # (likely false roots) or only the order or count of calls whose records all match
        # (framework bookkeeping whose control flow depends on the process: DDP's finalize
        # order, FSDP's buffer alignment): no value differs, so the state after it is equal.
        values = part.filter(pl.col("value") & ~pl.col("hz")).height
        if values and by_rank[r]["state"] in ("reordered", "shifted") and _same_calls(run_a, run_b, r, pairs[r]):
            values = 0  # the same calls, permuted within their families: occurrence keys only moved
        weak = None if values else ("hazards" if first["hz"] and nxt is None else "structure")
        if weak is None and first["hz"] and nxt is None:
            weak = "hazards"
        held = found.get(r)
        # A false root (a step whose only divergences sit under hazards) is kept as the rank's
        # first; a step that changes no value otherwise is passed over, kept only for the note
        # on a rank where nothing else differs.
        false_root = held is not None and held["first"] is not None and held["first"].get("weak") == "hazards"
        if weak is not None:
            if held is None or (weak == "hazards" and not false_root):
                first["weak"] = weak
                picks[r] = {"first": first, "next": None}
            _advance(todo, r)  # keep looking for a divergence in the rank's later steps
            continue
        if false_root:
            # The false root stays ``first``: this step's first clean divergence is ``next``.
            picks[r] = {"first": None, "next": nxt or first}
        else:
            picks[r] = {"first": first, "next": nxt}
        del todo[r]
    calls: set[tuple[int, int, int]] = set()
    keys: set[tuple[int, int, int]] = set()
    for r, p in picks.items():
        for ex in (p["first"], p["next"]):
            if ex is None:
                continue
            step = int(ex["row"]["step"])
            calls.add((r, step, int(ex["row"]["call_hash"])))
            keys.add((r, step, int(ex["row"]["key_hash"])))
            if ex["upstream_call"] is not None:
                calls.add((r, step, ex["upstream_call"]))
    rich, det_a, det_b = _enrich(run_a, run_b, al, calls, keys) if calls else (al.clear(), {}, {})
    rparts = {int(k[0]): v for k, v in rich.partition_by("rank", as_dict=True).items()} if calls else {}
    for r, p in picks.items():
        out = found.get(r) or {}
        for which in ("first", "next"):
            ex = p[which]
            if ex is None:
                out.setdefault(which, None)
                continue
            rr = rparts[r]
            h = int(ex["row"]["call_hash"])
            call_rows = rr.filter(pl.col("call_hash") == h).to_dicts()
            row = next(c for c in call_rows if c["key_hash"] == ex["row"]["key_hash"] and c["dup"] == ex["row"]["dup"])
            upstream = None
            if ex["upstream_call"] is not None:
                up = rr.filter(pl.col("call_hash") == ex["upstream_call"])
                if up.height:
                    upstream = _label(up.sort("o1").row(0, named=True))
            hazards = _hazard_names(call_rows)
            _integrity.check_shapes(call_rows, f"{run_a.label} vs {run_b.label}", ("shape_a", "shape_b"))
            k = (r, int(row["step"]), int(row["key_hash"]))
            out[which] = {
                "row": row,
                "call_rows": call_rows,
                "hazards": hazards,
                "upstream": upstream,
                "details": (det_a.get(k), det_b.get(k)),
                "kinds": ex["kinds"],
                "hz": ex["hz"],
                "weak": ex.get("weak"),
            }
        found[r] = out
    # Only the extracts made from this batch (a held first was completed in its own batch).
    fresh = {r: {w: found[r][w] if p[w] is not None else None for w in ("first", "next")} for r, p in picks.items()}
    _attach_module_inputs(run_a, run_b, al, fresh)


#: An aligned row that is evidence of a value difference (``rule.VALUE``).
_VALUE = to_polars(rule.VALUE)


def _same_calls(run_a: Any, run_b: Any, rank: int, step: int) -> bool:
    """Whether both runs made the same calls in the rank-step, up to their order within each
    call-site family: per family, the multiset of calls (each its records' role, arg, status,
    digests) is equal. Occurrence numbers key the alignment, so calls in another order (DDP
    copying its buckets back in the order it packed them) read as values that differ; this is
    the exact check, read only for a step whose first difference is such a reordering."""

    def calls(run: Any) -> pl.DataFrame:
        lf = run.scan("records", ranks=[rank], steps=[step]).filter(pl.col("step") == step)
        sig = pl.concat_str([to_polars(c).cast(pl.String).fill_null("-") for c in rule.SIGNATURE], separator="\x1f")
        per_call = (
            lf.select(*rule.FAMILY, "call_hash", sig.alias("sig"))
            .group_by(*rule.FAMILY, "call_hash")
            .agg(pl.col("sig").sort().str.join("\x1e").alias("call"))
        )
        return collect(per_call.group_by(*rule.FAMILY).agg(pl.col("call").sort()).sort(*rule.FAMILY))

    return calls(run_a).equals(calls(run_b))


def _advance(todo: dict[int, list[int]], r: int) -> None:
    """Move rank ``r`` on to its next candidate step (dropping it after the last)."""
    todo[r].pop(0)
    if not todo[r]:
        del todo[r]


def _attach_module_inputs(run_a: Any, run_b: Any, al: pl.DataFrame, found: Mapping[int, dict[str, Any]]) -> None:
    """A module boundary is two calls: module_input (or batch, at the root) before the module
    runs, module_output after. For a divergent module output, the inputs that decide origin
    vs. receiver are the records of its module_input twin: same microbatch, phase, module,
    name and occurrence. Their rows are appended to the output's call rows (in place)."""
    twins: dict[tuple[int, int, int], list[dict[str, Any]]] = {}
    for r, f in found.items():
        for ex in (f["first"], f["next"]):
            if ex is None or ex["row"]["kind"] != "module_output":
                continue
            if any(c["role"] == "input" for c in ex["call_rows"]):
                continue
            row = ex["row"]
            for kind in ("module_input", "batch"):
                ck = call_key(row["microbatch"], row["phase"], row["module"], kind, row["name"], row["occurrence"])
                twins.setdefault((r, int(row["step"]), key_hash(ck)), []).append(ex)
    if not twins:
        return
    rich = _enrich(run_a, run_b, al, set(twins))[0]
    for (r, step, h), exs in twins.items():
        rows = rich.filter((pl.col("rank") == r) & (pl.col("step") == step) & (pl.col("call_hash") == h)).to_dicts()
        for ex in exs:
            ex["call_rows"] = ex["call_rows"] + rows
            ex["hazards"] = tuple(sorted(set(ex["hazards"]) | set(_hazard_names(rows))))
