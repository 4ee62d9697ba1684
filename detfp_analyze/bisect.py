"""``bisect``: where two runs stopped being bitwise identical, rank by rank, and why.

Facade over pure stages; only this module touches ``Run`` objects:

1. comparable? ``envdiff`` (blocking differences raise IncomparableError unless forced);
2. window: common steps of both runs, the resume boundary (``resume``);
3. step: first metric divergence per rank (``narrow.metric_divergence``) bounds the scan,
   then per-(rank, step) rollups over narrow columns, ranks in batches, streaming;
4. walk: each rank's candidate step is read in full (one step per rank) and aligned by
   call-site key in the rank's own order (``align``); a candidate with only no-evidence
   differences (skipped records) moves on to the rank's next candidate step;
5. verdicts (``verdict``; collectives get the group-wide test from peers' inputs),
   kernels (level "kernel"), kind and magnitude (``diffkind``, from moments, rows, dumps);
6. cross-rank diagnosis (``diagnose``) and the discriminator view of the origin op.

Memory stays bounded by one batch of rank-steps; time by the steps up to the first
divergence (steps after every rank's metric divergence are never read when it is found).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import polars as pl

from detfp_analyze import align as _align
from detfp_analyze import narrow as _narrow
from detfp_analyze import resume as _resume
from detfp_analyze import verdict as _verdict
from detfp_analyze.diagnose import diagnose
from detfp_analyze.diffkind import classify
from detfp_analyze.envdiff import check_comparable, env_diff
from detfp_analyze.errors import IncomparableError, SelectionError
from detfp_analyze.result import (
    LEVELS,
    BisectResult,
    Diagnosis,
    Discriminator,
    DiscriminatorRow,
    Divergence,
    Kernels,
    RankResult,
    ResumeInfo,
    ValueDiff,
    Window,
)
from detfp_capture.contract import INPUTLESS_KINDS, call_key, key_hash

__all__ = ["BisectResult", "Progress", "bisect"]

#: progress(stage, done, total): called between batches; the CLI draws a bar with it.
Progress = Callable[[str, int, int], None]

#: Ranks per rollup scan and per exact walk (memory bound: one walk batch holds
#: WALK_BATCH rank-steps of records from each run).
ROLLUP_BATCH = 64
WALK_BATCH = 32
#: Origin ranks the discriminator view looks at.
DISCRIMINATOR_RANKS = 8
_DETAIL_COLUMNS = (
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


def _chunks(xs: Sequence[int], n: int) -> list[list[int]]:
    return [list(xs[i : i + n]) for i in range(0, len(xs), n)]


def _norm_steps(steps: Any) -> tuple[int, int] | None:
    if steps is None:
        return None
    if isinstance(steps, int):
        return steps, steps
    if isinstance(steps, range):
        if len(steps) == 0:
            raise SelectionError(f"step range {steps} is empty; pass e.g. steps=(3, 5)")
        return min(steps), max(steps)
    vals = [int(s) for s in steps]
    if len(vals) != 2 or vals[0] > vals[1]:
        raise SelectionError(f"steps={steps!r} is not an inclusive (first, last) pair; pass e.g. steps=(3, 5)")
    return vals[0], vals[1]


def _compared_ranks(run_a: Any, run_b: Any, ranks: Iterable[int] | None) -> tuple[list[int], list[int]]:
    both = sorted(set(run_a.ranks) & set(run_b.ranks))
    one = sorted(set(run_a.ranks) ^ set(run_b.ranks))
    if ranks is None:
        return both, one
    wanted = sorted({int(r) for r in ranks})
    unknown = [r for r in wanted if r not in run_a.ranks and r not in run_b.ranks]
    if unknown:
        have = _verdict.format_ranks(sorted(set(run_a.ranks) | set(run_b.ranks)))
        raise SelectionError(
            f"{run_a.label} vs {run_b.label}: rank(s) {_verdict.format_ranks(unknown)} are in neither run "
            f"(ranks present: {have}); pick ranks from those"
        )
    return [r for r in wanted if r in both], [r for r in wanted if r in one]


def _scan(run: Any, table: str, ranks: Sequence[int], lo: int, hi: int) -> pl.LazyFrame:
    return run.scan(table, ranks=list(ranks), steps=range(lo, hi + 1))


def _collect(lf: pl.LazyFrame) -> pl.DataFrame:
    return lf.collect(engine="streaming")


# ----------------------------------------------------------------------------- step level
def _rollup_candidates(
    run_a: Any, run_b: Any, ranks: Sequence[int], lo: int, hi: int, progress: Progress | None, stage: str
) -> dict[int, list[int]]:
    """rank -> candidate steps (sorted) whose rollups differ, over [lo, hi]."""
    out: dict[int, list[int]] = {}
    batches = _chunks(ranks, ROLLUP_BATCH)
    for i, batch in enumerate(batches):
        ra = _collect(_narrow.step_rollup(_scan(run_a, "records", batch, lo, hi)))
        rb = _collect(_narrow.step_rollup(_scan(run_b, "records", batch, lo, hi)))
        d = _narrow.divergent_steps(ra, rb)
        for rank, step in zip(d["rank"].to_list(), d["step"].to_list(), strict=False):
            out.setdefault(int(rank), []).append(int(step))
        if progress:
            progress(stage, i + 1, len(batches))
    return out


# ----------------------------------------------------------------------------- the walk
def _read_pairs(run: Any, pairs: Mapping[int, int], columns: Sequence[str]) -> pl.DataFrame:
    steps = sorted(set(pairs.values()))
    key = pl.DataFrame(
        {"rank": list(pairs), "step": [pairs[r] for r in pairs]}, schema={"rank": pl.Int32, "step": pl.Int64}
    )
    lf = run.scan("records", ranks=sorted(pairs), steps=steps).select(list(columns))
    return _collect(lf.join(key.lazy(), on=["rank", "step"], how="semi"))


def _label(row: Mapping[str, Any]) -> str:
    return f"{row['name']} ({row['kind']}) in {row['module'] or '<root>'}"


#: Call-site and tensor columns joined onto the narrow alignment for the calls a verdict needs.
_CALL_DETAIL = ("microbatch", "phase", "module", "name", "occurrence", "role", "arg", "dtype", "shape")


def _pick(al: pl.DataFrame, row: dict[str, Any]) -> dict[str, Any]:
    """From one rank's narrow alignment: the divergent row, its call's hazards, the upstream call."""
    call = al.filter(pl.col("call_hash") == row["call_hash"])
    hazards: set[str] = set()
    for col in ("hazards_a", "hazards_b"):
        for hz in call[col].to_list():
            hazards.update(hz or ())
    start = call["o1"].min()
    prev = al.filter((pl.col("o1") < start) & (pl.col("call_hash") != row["call_hash"]))
    upstream = int(prev.sort("o1")["call_hash"][-1]) if prev.height else None
    return {"row": row, "hazards": tuple(sorted(hazards)), "upstream_call": upstream}


def _enrich(run_a: Any, run_b: Any, al: pl.DataFrame, calls: set[tuple[int, int, int]]) -> pl.DataFrame:
    """Aligned rows of ``calls`` (rank, step, call_hash) with the call-site columns of both sides."""
    key = pl.DataFrame(
        {"rank": [c[0] for c in calls], "step": [c[1] for c in calls], "call_hash": [c[2] for c in calls]},
        schema={"rank": pl.Int32, "step": pl.Int64, "call_hash": pl.UInt64},
    )
    sub = al.join(key, on=["rank", "step", "call_hash"], how="semi")
    ranks, steps = sorted({c[0] for c in calls}), sorted({c[1] for c in calls})
    hashes = key["call_hash"].unique().to_list()
    for run, sfx in ((run_a, "a"), (run_b, "b")):
        lf = run.scan("records", ranks=ranks, steps=steps).filter(pl.col("call_hash").is_in(hashes))
        lf = lf.select("rank", "step", "call_hash", "key_hash", *_CALL_DETAIL)
        det = _collect(lf.join(key.lazy(), on=["rank", "step", "call_hash"], how="semi"))
        det = det.unique(["rank", "step", "key_hash"], keep="first", maintain_order=True).drop("call_hash")
        sub = sub.join(det.rename({c: f"{c}_{sfx}" for c in _CALL_DETAIL}), on=["rank", "step", "key_hash"], how="left")
    shared = [c for c in _CALL_DETAIL if c not in ("dtype", "shape")]
    return sub.with_columns([pl.coalesce(f"{c}_a", f"{c}_b").alias(c) for c in shared])


def _walk(
    run_a: Any,
    run_b: Any,
    cands: Mapping[int, list[int]],
    boundary: Sequence[int],
    progress: Progress | None,
) -> dict[int, dict[str, Any]]:
    """rank -> {"first": extract, "next": extract|None} for ranks with a real divergence.

    Each batch is aligned on the narrow columns first; only the calls a verdict needs (the
    divergent call, the next clean one, the call one hop upstream) are then read in full.
    """
    found: dict[int, dict[str, Any]] = {}
    todo = {r: list(s) for r, s in cands.items() if s}
    total = len(todo)
    while todo:
        for batch in _chunks(sorted(todo), WALK_BATCH):
            pairs = {r: todo[r][0] for r in batch}
            a = _align.prepare(_read_pairs(run_a, pairs, _align.NARROW_COLUMNS), one_step_per_rank=True)
            b = _align.prepare(_read_pairs(run_b, pairs, _align.NARROW_COLUMNS), one_step_per_rank=True)
            al = _align.align(a, b)
            # Steps with records on one side only: re-align with the call-site columns, so a
            # shifted occurrence counter reads as structural, not as a value mismatch.
            one_sided = al.filter(pl.col("state").is_in(["a_only", "b_only"]))["rank"].unique().to_list()
            if one_sided:
                sub = {r: pairs[r] for r in one_sided}
                fa = _align.prepare(_read_pairs(run_a, sub, _align.ALIGN_COLUMNS), one_step_per_rank=True)
                fb = _align.prepare(_read_pairs(run_b, sub, _align.ALIGN_COLUMNS), one_step_per_rank=True)
                full = _align.align(fa, fb).select(al.columns)
                al = pl.concat([al.filter(~pl.col("rank").is_in(one_sided)), full])
            firsts = _align.first_divergences(al, priority_kinds=_resume.BOUNDARY_KINDS, priority_steps=boundary)
            by_rank = {int(r["rank"]): r for r in firsts.to_dicts()}
            parts = {int(k[0]): v for k, v in al.partition_by("rank", as_dict=True).items()} if by_rank else {}
            picks: dict[int, dict[str, Any]] = {}
            for r in batch:
                if r not in by_rank:
                    todo[r].pop(0)  # only no-evidence differences (skipped records) in that step
                    if not todo[r]:
                        del todo[r]
                    continue
                first = _pick(parts[r], by_rank[r])
                nxt = None
                if first["hazards"]:
                    clean = _align.first_divergences(parts[r], exclude_hazard_calls=True)
                    if clean.height:
                        nxt = _pick(parts[r], clean.row(0, named=True))
                picks[r] = {"first": first, "next": nxt}
                del todo[r]
            calls: set[tuple[int, int, int]] = set()
            for r, p in picks.items():
                for ex in (p["first"], p["next"]):
                    if ex is None:
                        continue
                    step = int(ex["row"]["step"])
                    calls.add((r, step, int(ex["row"]["call_hash"])))
                    if ex["upstream_call"] is not None:
                        calls.add((r, step, ex["upstream_call"]))
            rich = _enrich(run_a, run_b, al, calls) if calls else al.clear()
            rparts = {int(k[0]): v for k, v in rich.partition_by("rank", as_dict=True).items()} if calls else {}
            for r, p in picks.items():
                out = {}
                for which in ("first", "next"):
                    ex = p[which]
                    if ex is None:
                        out[which] = None
                        continue
                    rr = rparts[r]
                    h = int(ex["row"]["call_hash"])
                    call_rows = rr.filter(pl.col("call_hash") == h).to_dicts()
                    row = next(
                        c for c in call_rows if c["key_hash"] == ex["row"]["key_hash"] and c["dup"] == ex["row"]["dup"]
                    )
                    upstream = None
                    if ex["upstream_call"] is not None:
                        up = rr.filter(pl.col("call_hash") == ex["upstream_call"])
                        if up.height:
                            upstream = _label(up.sort("o1").row(0, named=True))
                    out[which] = {"row": row, "call_rows": call_rows, "hazards": ex["hazards"], "upstream": upstream}
                found[r] = out
            _attach_module_inputs(run_a, run_b, al, {r: found[r] for r in picks})
            if progress:
                progress("walk", len(found), total)
    return found


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
    rich = _enrich(run_a, run_b, al, set(twins))
    for (r, step, h), exs in twins.items():
        rows = rich.filter((pl.col("rank") == r) & (pl.col("step") == step) & (pl.col("call_hash") == h)).to_dicts()
        for ex in exs:
            ex["call_rows"] = ex["call_rows"] + rows
            hz = set(ex["hazards"])
            for c in rows:
                hz.update(c.get("hazards_a") or ())
                hz.update(c.get("hazards_b") or ())
            ex["hazards"] = tuple(sorted(hz))


# ----------------------------------------------------------------------------- group-wide test
def _all_groups(run: Any) -> dict[str, list[int]]:
    """Every logical group any rank's latest manifest names (first definition wins, by rank)."""
    groups: dict[str, list[int]] = {}
    for r in sorted(run.manifests):
        segs = run.manifests[r]
        if segs:
            for k, v in (segs[-1].get("groups") or {}).items():
                groups.setdefault(k, list(v))
    return groups


def _groups(run: Any, rank: int, every: Mapping[str, list[int]]) -> dict[str, list[int]]:
    """Groups as ``rank`` sees them: its own manifest first, then any rank's."""
    groups = dict(every)
    own = run.manifests.get(rank)
    if own:
        groups.update({k: list(v) for k, v in (own[-1].get("groups") or {}).items()})
    return groups


def _peer_inputs(
    run_a: Any, run_b: Any, asks: Sequence[tuple[int, int, int, tuple[int, ...]]]
) -> dict[tuple[int, int, int], str]:
    """(peer, step, call_hash) -> match|differ|unknown for the inputs of that call on the peer."""
    peers = sorted({p for _, _, _, g in asks for p in g})
    steps = sorted({s for _, s, _, _ in asks})
    hashes = sorted({h for _, _, h, _ in asks})
    cols = ["rank", "step", "call_hash", "key_hash", "status", "digest_hi", "digest_lo", "args_digest"]
    have = set(run_a.ranks) & set(run_b.ranks)
    sel = [p for p in peers if p in have]

    def side(run: Any) -> pl.DataFrame:
        if not sel:
            return pl.DataFrame(schema={c: pl.Int64 for c in cols})
        lf = run.scan("records", ranks=sel, steps=steps)
        lf = lf.filter(pl.col("call_hash").is_in(hashes) & (pl.col("role") == "input")).select(cols)
        return _collect(lf)

    a, b = side(run_a), side(run_b)
    out: dict[tuple[int, int, int], str] = {}
    if a.height or b.height:
        j = a.join(b, on=["rank", "step", "call_hash", "key_hash"], how="full", coalesce=True, suffix="_b")
        differs = (
            pl.col("status").is_null()
            | pl.col("status_b").is_null()
            | (pl.col("status") == "error")
            | (pl.col("status_b") == "error")
            | (
                (pl.col("status") == "ok")
                & (pl.col("status_b") == "ok")
                & (
                    (pl.col("digest_hi") != pl.col("digest_hi_b"))
                    | (pl.col("digest_lo") != pl.col("digest_lo_b"))
                    | ~pl.col("args_digest").eq_missing(pl.col("args_digest_b"))
                )
            )
        )
        g = j.group_by("rank", "step", "call_hash").agg(differs.any().alias("d"))
        for rank, step, h, d in g.iter_rows():
            out[(int(rank), int(step), int(h))] = "differ" if d else "match"
    return out


# ----------------------------------------------------------------------------- details
def _details(run: Any, keys: Sequence[tuple[int, int, int]]) -> dict[tuple[int, int, int], dict[str, Any]]:
    if not keys:
        return {}
    key = pl.DataFrame(
        {"rank": [k[0] for k in keys], "step": [k[1] for k in keys], "key_hash": [k[2] for k in keys]},
        schema={"rank": pl.Int32, "step": pl.Int64, "key_hash": pl.UInt64},
    )
    lf = run.scan("records", ranks=sorted({k[0] for k in keys}), steps=sorted({k[1] for k in keys}))
    lf = lf.filter(pl.col("key_hash").is_in(key["key_hash"].unique().to_list())).select(list(_DETAIL_COLUMNS))
    df = _collect(lf.join(key.lazy(), on=["rank", "step", "key_hash"], how="semi"))
    return {(int(r["rank"]), int(r["step"]), int(r["key_hash"])): r for r in df.to_dicts()}


def _dumps(run: Any, keys: Sequence[tuple[int, int, int]]) -> dict[tuple[int, int, int], bytes]:
    if not keys or "dumps" not in run.tables:
        return {}
    key = pl.DataFrame(
        {"rank": [k[0] for k in keys], "step": [k[1] for k in keys], "key_hash": [k[2] for k in keys]},
        schema={"rank": pl.Int32, "step": pl.Int64, "key_hash": pl.UInt64},
    )
    lf = run.scan("dumps", ranks=sorted({k[0] for k in keys}), steps=sorted({k[1] for k in keys}))
    lf = lf.filter(pl.col("key_hash").is_in(key["key_hash"].unique().to_list()))
    df = _collect(
        lf.select("rank", "step", "key_hash", "data").join(key.lazy(), on=["rank", "step", "key_hash"], how="semi")
    )
    return {(int(r), int(s), int(k)): d for r, s, k, d in df.iter_rows()}


def _kernels(run: Any, calls: Sequence[tuple[int, int, int]]) -> dict[tuple[int, int, int], tuple[str, ...]]:
    if not calls:
        return {}
    key = pl.DataFrame(
        {"rank": [k[0] for k in calls], "step": [k[1] for k in calls], "call_hash": [k[2] for k in calls]},
        schema={"rank": pl.Int32, "step": pl.Int64, "call_hash": pl.UInt64},
    )
    lf = run.scan("kernels", ranks=sorted({k[0] for k in calls}), steps=sorted({k[1] for k in calls}))
    lf = lf.filter(pl.col("call_hash").is_in(key["call_hash"].unique().to_list()))
    df = _collect(
        lf.select("rank", "step", "call_hash", "index", "kernel").join(
            key.lazy(), on=["rank", "step", "call_hash"], how="semi"
        )
    ).sort("rank", "step", "call_hash", "index")
    out: dict[tuple[int, int, int], list[str]] = {}
    for r, s, h, _, k in df.iter_rows():
        out.setdefault((int(r), int(s), int(h)), []).append(k)
    return {k: tuple(v) for k, v in out.items()}


# ----------------------------------------------------------------------------- assembly
def _divergence(
    ex: Mapping[str, Any],
    local: _verdict.LocalVerdict,
    level: str,
    group: tuple[str, tuple[int, ...]] | None,
    gtest: _verdict.GroupTest | None,
    kernels: Kernels | None,
    diff: ValueDiff,
) -> Divergence:
    row = ex["row"]
    verdict, explanation = local.verdict, local.explanation
    if gtest is not None:
        verdict, explanation = gtest.verdict, gtest.explanation
    deep = LEVELS.index(level)
    shape = row.get("shape_a") if row.get("shape_a") is not None else row.get("shape_b")
    return Divergence(
        step=int(row["step"]),
        microbatch=int(row["microbatch"]),
        phase=row["phase"],
        module=row["module"] if deep >= LEVELS.index("module") else None,  # type: ignore[arg-type]
        kind=row["kind"],
        op=row["name"] if deep >= LEVELS.index("op") else None,  # type: ignore[arg-type]
        occurrence=int(row["occurrence"]),
        role=row["role"],
        arg=row["arg"],
        presence="a_only" if row.get("pos_b") is None else ("b_only" if row.get("pos_a") is None else "both"),
        verdict=verdict,
        diff_kind=diff.kind,
        hazards=ex["hazards"],
        seq_a=None if row.get("seq_a") is None else int(row["seq_a"]),
        seq_b=None if row.get("seq_b") is None else int(row["seq_b"]),
        dtype=row.get("dtype_a") or row.get("dtype_b"),
        shape=None if shape is None else tuple(int(x) for x in shape),
        consumer=local.consumer,
        contradiction=local.contradiction,
        upstream=ex["upstream"],
        group=group[0] if group else None,
        group_ranks=group[1] if group else (),
        peers_differing=gtest.peers_differing if gtest else (),
        kernels=kernels,
        diff=diff,
        explanation=explanation,
    )


def _discriminator(run_a: Any, run_b: Any, results: Sequence[RankResult], diag: Diagnosis) -> Discriminator | None:
    origin = [r for r in results if r.rank in diag.origin_ranks and r.effective is not None]
    if not origin or origin[0].effective is None or origin[0].effective.op is None:
        return None
    eff = origin[0].effective
    op, kind = eff.op, eff.kind
    if kind in INPUTLESS_KINDS:
        return None  # a source (batch, RNG, restored state) is not an op with instances to compare
    chosen = [r for r in origin if r.effective and r.effective.op == op][:DISCRIMINATOR_RANKS]
    pairs = {r.rank: r.effective.step for r in chosen if r.effective}
    cols = list(_align.ALIGN_COLUMNS)

    def side(run: Any) -> pl.DataFrame:
        lf = run.scan("records", ranks=sorted(pairs), steps=sorted(set(pairs.values())))
        key = pl.DataFrame(
            {"rank": list(pairs), "step": list(pairs.values())}, schema={"rank": pl.Int32, "step": pl.Int64}
        )
        lf = lf.filter((pl.col("name") == op) & (pl.col("kind") == kind)).select(cols)
        return _align.prepare(_collect(lf.join(key.lazy(), on=["rank", "step"], how="semi")), one_step_per_rank=True)

    al = _align.align(side(run_a), side(run_b))
    if not al.height:
        return None
    calls = al.group_by("rank", "step", "call_hash").agg(
        pl.col("state").is_in(_align.DIVERGENT_STATES).any().alias("divergent"),
        pl.col("phase").first(),
        pl.col("module").first(),
        pl.coalesce("dtype_a", "dtype_b").sort_by(pl.col("role") != "output").first().alias("dtype"),
        pl.coalesce("shape_a", "shape_b").sort_by(pl.col("role") != "output").first().alias("shape"),
    )
    grouped = (
        calls.with_columns(pl.col("shape").cast(pl.List(pl.Int64)))
        .group_by("dtype", "shape", "module", "phase")
        .agg((~pl.col("divergent")).sum().alias("clean"), pl.col("divergent").sum().alias("divergent"))
    )
    rows = [
        DiscriminatorRow(
            r["dtype"],
            None if r["shape"] is None else tuple(r["shape"]),
            r["module"],
            r["phase"],
            int(r["clean"]),
            int(r["divergent"]),
        )
        for r in grouped.to_dicts()
    ]
    rows.sort(key=lambda x: (-x.divergent, x.phase, x.module, str(x.dtype), x.shape or ()))
    return Discriminator(op, tuple(sorted(pairs)), tuple(sorted(set(pairs.values()))), tuple(rows))


def bisect(
    run_a: Any,
    run_b: Any,
    *,
    ranks: Iterable[int] | None = None,
    steps: Any = None,
    level: str = "op",
    force: bool = False,
    progress: Progress | None = None,
) -> BisectResult:
    """Find, per rank, the first record where ``run_a`` and ``run_b`` differ, and why.

    ``run_a``/``run_b``: opened runs (``reader.open_run``). ``ranks``: ranks to compare
    (default: every rank in both). ``steps``: inclusive (first, last) pair, an int or a range.
    ``level``: step | phase | module | op | kernel (how deep to narrow). ``force``: compare
    even when the manifests say the comparison is meaningless. ``progress``: optional callback.
    Raises IncomparableError (blocking manifest difference, no common step) and
    SelectionError (bad ranks/steps/level).
    """
    if level not in LEVELS:
        raise SelectionError(f"level {level!r} is not one of {', '.join(LEVELS)}; pick one of those")
    user_steps = _norm_steps(steps)
    compared, one_sided = _compared_ranks(run_a, run_b, ranks)
    diffs = env_diff(run_a, run_b, ranks=compared or None)
    check_comparable(diffs, label_a=run_a.label, label_b=run_b.label, force=force)
    notes: list[str] = []
    if run_a.missing_ranks or run_b.missing_ranks:
        notes.append(
            f"missing ranks tolerated: A {_verdict.format_ranks(run_a.missing_ranks) or 'none'}, "
            f"B {_verdict.format_ranks(run_b.missing_ranks) or 'none'}"
        )
    if one_sided:
        notes.append(f"ranks {_verdict.format_ranks(one_sided)} exist in one run only and were not compared")
    range_a = _resume.step_range(run_a, compared)
    range_b = _resume.step_range(run_b, compared)
    window, rinfo = _resume.plan_window(range_a, range_b, user_steps)
    if window is None and range_a is not None and range_b is not None:
        raise IncomparableError(
            f"{run_a.label} (steps {range_a[0]}-{range_a[1]}) and {run_b.label} (steps {range_b[0]}-{range_b[1]}) "
            "share no step in the selected window; pick overlapping runs or --steps"
        )
    win = Window(
        window, range_a, range_b, tuple(compared), run_a.missing_ranks, run_b.missing_ranks, tuple(one_sided), level
    )
    results: dict[int, RankResult] = {}
    found: dict[int, dict[str, Any]] = {}
    cands: dict[int, list[int]] = {}
    metric: dict[int, dict[str, Any]] = {}
    if window is not None and compared:
        lo, hi = window
        m = _narrow.metric_divergence(
            _scan(run_a, "metrics", compared, lo, hi), _scan(run_b, "metrics", compared, lo, hi)
        )
        metric = {int(r["rank"]): r for r in m.to_dicts()}
        # The first differing record cannot come after the step where every metric split,
        # unless the capture missed it: scan up to that bound first, the rest only if needed.
        bound = max((r["step"] for r in metric.values()), default=hi)
        bound = min(max(bound, lo), hi)
        cands = _rollup_candidates(run_a, run_b, compared, lo, bound, progress, "steps")
        boundary = _resume.boundary_steps(run_a.manifests, run_b.manifests, rinfo)
        if level != "step":
            found = _walk(run_a, run_b, cands, boundary, progress)
        if bound < hi:
            rest = [r for r in compared if r not in found and (level != "step" or r not in cands)]
            if rest:
                more = _rollup_candidates(run_a, run_b, rest, bound + 1, hi, progress, "steps (after metrics)")
                for r, s in more.items():
                    cands.setdefault(r, []).extend(s)
                if level != "step":
                    found.update(_walk(run_a, run_b, more, boundary, progress))
        if rinfo.resumed and rinfo.first_common_step is not None and rinfo.first_common_step <= hi:
            s = rinfo.first_common_step
            n, d = _resume.boundary_counts(
                _scan(run_a, "records", compared, s, s), _scan(run_b, "records", compared, s, s), s
            )
            rinfo = ResumeInfo(rinfo.resumed, rinfo.start_a, rinfo.start_b, s, n, d, rinfo.note)
    # Verdicts ---------------------------------------------------------------------------
    locals_: dict[tuple[int, str], _verdict.LocalVerdict] = {}
    groups: dict[tuple[int, str], tuple[str, tuple[int, ...]]] = {}
    asks: list[tuple[int, int, int, tuple[int, ...]]] = []
    every = _all_groups(run_a)
    for r, f in found.items():
        for which in ("first", "next"):
            ex = f[which]
            if ex is None:
                continue
            lv = _verdict.local_verdict(ex["row"], ex["call_rows"], ex["upstream"])
            locals_[(r, which)] = lv
            if lv.verdict == "collective":
                row = ex["row"]
                world = sorted(set(run_a.ranks) | set(run_b.ranks))
                g = _verdict.group_of(row["name"], row["kind"], _groups(run_a, r, every), world)
                groups[(r, which)] = g
                asks.append((r, int(row["step"]), int(row["call_hash"]), tuple(p for p in g[1] if p != r)))
    peer_states = _peer_inputs(run_a, run_b, asks) if asks else {}
    record_keys = sorted(
        {
            (r, int(f[w]["row"]["step"]), int(f[w]["row"]["key_hash"]))
            for r, f in found.items()
            for w in ("first", "next")
            if f[w]
        }
    )
    det_a, det_b = _details(run_a, record_keys), _details(run_b, record_keys)
    dump_a, dump_b = _dumps(run_a, record_keys), _dumps(run_b, record_keys)
    kern_a: dict[tuple[int, int, int], tuple[str, ...]] = {}
    kern_b: dict[tuple[int, int, int], tuple[str, ...]] = {}
    kernels_on = level == "kernel" and "kernels" in run_a.tables and "kernels" in run_b.tables
    if kernels_on:
        calls = sorted(
            {
                (k[0], k[1], int(found[k[0]][w]["row"]["call_hash"]))
                for k in record_keys
                for w in ("first", "next")
                if found[k[0]][w] and int(found[k[0]][w]["row"]["key_hash"]) == k[2]
            }
        )
        kern_a, kern_b = _kernels(run_a, calls), _kernels(run_b, calls)
    elif "kernels" in run_a.tables and "kernels" in run_b.tables and found:
        notes.append("kernel identities were captured: rerun with --level kernel to compare them")

    def build(r: int, which: str) -> Divergence | None:
        ex = found[r][which]
        if ex is None:
            return None
        row = ex["row"]
        lv = locals_[(r, which)]
        gtest = None
        group = groups.get((r, which))
        if lv.verdict == "collective" and group is not None:
            step, h = int(row["step"]), int(row["call_hash"])
            own_inputs = [c for c in ex["call_rows"] if c["role"] == "input"]
            states = {}
            for p in group[1]:
                if p == r:
                    continue
                st = peer_states.get((p, step, h))
                if st is None and not own_inputs:
                    st = _fallback_peer(found, p, step, h, compared)
                states[p] = st or "unknown"
            gtest = _verdict.group_verdict(
                r, f"{row['name']} in {row['module'] or '<root>'}", group[0], group[1], states
            )
        key = (r, int(row["step"]), int(row["key_hash"]))
        dumps = (dump_a[key], dump_b[key]) if key in dump_a and key in dump_b else None
        diff = classify(row["state"], det_a.get(key), det_b.get(key), dumps)
        kernels = None
        if kernels_on:
            ck = (r, int(row["step"]), int(row["call_hash"]))
            if ck in kern_a or ck in kern_b:
                kernels = Kernels(kern_a.get(ck, ()), kern_b.get(ck, ()))
        return _divergence(ex, lv, level, group, gtest, kernels, diff)

    for r in compared:
        mr = metric.get(r)
        mkw: dict[str, Any] = {}
        if mr is not None:
            mkw = dict(
                metric_step=int(mr["step"]), metric_name=mr["name"], metric_a=mr["value_a"], metric_b=mr["value_b"]
            )
        if r in found:
            first, nxt = build(r, "first"), build(r, "next")
            assert first is not None
            step = first.step
            results[r] = RankResult(r, "diverged", step, record_step=first.step, first=first, next_clean=nxt, **mkw)
            if mr is not None and mr["step"] < first.step:
                notes.append(
                    f"rank {r}: metric {mr['name']} differs at step {mr['step']}, before any record (step {first.step}): "
                    "widen the capture"
                )
        elif level == "step" and cands.get(r):
            s = cands[r][0]
            results[r] = RankResult(r, "diverged", min(s, mkw.get("metric_step", s)), record_step=s, **mkw)
        elif mr is not None:
            results[r] = RankResult(r, "diverged", int(mr["step"]), **mkw)
        else:
            results[r] = RankResult(r, "identical", None)
    ordered = tuple(results[r] for r in sorted(results))
    parallel = {r: dict(run_a.manifest(r).get("parallel") or {}) for r in compared}
    diag = diagnose(ordered, parallel)
    if level == "step" and diag.pattern != "identical":
        diag = Diagnosis(
            "undetermined",
            (),
            "level step narrows to the step only, without verdicts; rerun with --level op for verdicts and a pattern",
        )
    disc = _discriminator(run_a, run_b, ordered, diag) if diag.origin_ranks and level in ("op", "kernel") else None
    rep = None
    for rr in ordered:
        if rr.rank in diag.origin_ranks:
            rep = rr
            break
    if rep is None:
        rep = next((rr for rr in ordered if rr.effective is not None), None)
    diverged = [rr for rr in ordered if rr.status == "diverged"]
    first_step = min((min(x for x in (rr.step, rr.metric_step) if x is not None) for rr in diverged), default=None)
    return BisectResult(
        label_a=run_a.label,
        label_b=run_b.label,
        status="diverged" if diverged else "identical",
        env_diff=diffs,
        first_step=first_step,
        ranks=ordered,
        diagnosis=diag,
        diff=rep.effective.diff if rep and rep.effective else None,
        diff_rank=rep.rank if rep and rep.effective else None,
        window=win,
        resume=rinfo,
        discriminator=disc,
        notes=tuple(sorted(set(notes))),
    )


def _fallback_peer(
    found: Mapping[int, Mapping[str, Any]], peer: int, step: int, h: int, compared: Sequence[int]
) -> str:
    """Peer state for a call without input records (e.g. reduced_grad): from the peer's own first divergence."""
    if peer not in compared:
        return "unknown"
    f = found.get(peer)
    if f is None:
        return "match"
    row = f["first"]["row"]
    if int(row["step"]) > step or (int(row["step"]) == step and int(row["call_hash"]) == h):
        return "match"
    return "differ"
