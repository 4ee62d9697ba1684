"""``bisect``: where two runs stopped being bitwise identical, rank by rank, and why.

Facade over pure stages (``walk`` and ``evidence`` do the reading):

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

Memory stays bounded by two walk batches of rank-steps; time by the steps up to the first
divergence (steps after every rank's metric divergence are never read when it is found).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from detfp_analyze import rule
from detfp_analyze.bisect import evidence as _evidence
from detfp_analyze.bisect import narrow as _narrow
from detfp_analyze.bisect import resume as _resume
from detfp_analyze.bisect import scope as _scope
from detfp_analyze.bisect import verdict as _verdict
from detfp_analyze.bisect import walk as _walk
from detfp_analyze.bisect.diagnose import diagnose
from detfp_analyze.bisect.diffkind import classify
from detfp_analyze.bisect.result import (
    LEVELS,
    BisectResult,
    Diagnosis,
    Divergence,
    Kernels,
    RankResult,
    ResumeInfo,
    ValueDiff,
    Window,
)
from detfp_analyze.errors import IncomparableError, SelectionError
from detfp_analyze.io import completeness as _completeness
from detfp_analyze.io.envdiff import check_comparable, drop_keys, env_diff
from detfp_analyze.io.reader import as_run
from detfp_analyze.ranks import format_ranks
from detfp_capture.contract import INPUTLESS_KINDS

__all__ = ["BisectResult", "Progress", "bisect"]

#: progress(stage, done, total): called between batches; the CLI draws a bar with it.
Progress = _walk.Progress


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
    verdict, explanation, depends = local.verdict, local.explanation, local.depends_on
    if gtest is not None:
        verdict, explanation = gtest.verdict, gtest.explanation
        if local.verdict in ("reduction", "unobserved_producer") and verdict == "receiver":
            depends = (
                "a cross-rank reduction the capture did not see (a DDP or FSDP gradient reduction, a C++ collective): "
                "capture the wrapper (session.watch on it) or the collective, and see certify"
            )
    deep = LEVELS.index(level)
    shape = row.get("shape_a") if row.get("shape_a") is not None else row.get("shape_b")
    return Divergence(
        step=int(row["step"]),
        microbatch=int(row["microbatch"]),
        phase=row["phase"],
        module=row["module"] if deep >= LEVELS.index("module") else None,  # type: ignore[arg-type]
        kind=row["kind"],
        # A parameter, batch or RNG state is named by its record, not by an op: keep that name at any level.
        op=row["name"] if deep >= LEVELS.index("op") or row["kind"] in INPUTLESS_KINDS else None,  # type: ignore[arg-type]
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
        depends_on=depends,
    )


def bisect(
    run_a: Any,
    run_b: Any,
    *,
    ranks: Iterable[int] | None = None,
    steps: Any = None,
    level: str = "op",
    force: bool = False,
    ignore_env: Sequence[str] = (),
    progress: Progress | None = None,
) -> BisectResult:
    """Find, per rank, the first record where ``run_a`` and ``run_b`` differ, and why.

    ``run_a``/``run_b``: opened runs (``reader.open_run``) or run directories. ``ranks``: ranks to compare
    (default: every rank in both). ``steps``: inclusive (first, last) pair, an int or a range.
    ``level``: step | phase | module | op | kernel (how deep to narrow). ``force``: compare
    even when the manifests say the comparison is meaningless. ``ignore_env``: shell globs of
    manifest keys left out of the environment diff (``host.*``; see ``envdiff.drop_keys``), listed
    in ``notes``. ``progress``: optional callback.
    Raises IncomparableError (blocking manifest difference, no common step) and
    SelectionError (bad ranks/steps/level).
    """
    if level not in LEVELS:
        raise SelectionError(f"level {level!r} is not one of {', '.join(LEVELS)}; pick one of those")
    run_a, run_b = as_run(run_a), as_run(run_b)
    user_steps = _scope.norm_steps(steps)
    if run_a.path == run_b.path:  # trivially identical: almost certainly a mistyped command line
        raise IncomparableError(f"{run_a.label} and {run_b.label} are the same run directory; compare two runs")
    # Only the steps both runs hold completely are compared (runs opened with allow_incomplete).
    run_a, run_b, incomplete = _completeness.restrict_pair(run_a, run_b)
    both, one_sided = _scope.compared_ranks(run_a, run_b, ranks)
    diffs, ignored = drop_keys(env_diff(run_a, run_b, ranks=both or None), ignore_env)
    check_comparable(diffs, label_a=run_a.label, label_b=run_b.label, force=force)
    scope = _scope.plan(run_a, run_b, steps=user_steps, compared=(both, one_sided))
    _scope.check(scope, run_a, run_b)
    compared = list(scope.ranks)
    notes: list[str] = list(incomplete)
    if ignored:
        notes.append(f"environment differences ignored as asked: {', '.join(ignored)}")
    if scope.empty:
        notes.append(f"ranks {format_ranks(scope.empty)} hold no record or metric in either run and were not compared")
    if run_a.missing_ranks or run_b.missing_ranks:
        notes.append(
            f"missing ranks tolerated: A {format_ranks(run_a.missing_ranks) or 'none'}, "
            f"B {format_ranks(run_b.missing_ranks) or 'none'}"
        )
    if one_sided:
        notes.append(f"ranks {format_ranks(one_sided)} exist in one run only and were not compared")
    range_a, range_b, window, rinfo = scope.range_a, scope.range_b, scope.window, scope.resume
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
            _walk.scan(run_a, "metrics", compared, lo, hi), _walk.scan(run_b, "metrics", compared, lo, hi)
        )
        metric = {int(r["rank"]): r for r in m.to_dicts()}
        # The first differing record cannot come after the step where every metric split,
        # unless the capture missed it: scan up to that bound first, the rest only if needed.
        bound = max((r["step"] for r in metric.values()), default=hi)
        bound = min(max(bound, lo), hi)
        errors = [0, 0]
        cands = _walk.rollup_candidates(run_a, run_b, compared, lo, bound, progress, "steps", errors)
        boundary = scope.boundary
        # Every level walks: a candidate step may hold only no-evidence differences (a digest
        # error on one side, records under hazards), which only the walk can tell.
        found = _walk.walk(run_a, run_b, cands, boundary, progress)
        if bound < hi:
            # Ranks without a divergence that changes a value yet (none, or only passed-over steps).
            rest = [r for r in compared if r not in found or (found[r]["next"] is None and found[r]["first"].get("weak"))]
            if rest:
                more = _walk.rollup_candidates(
                    run_a, run_b, rest, bound + 1, hi, progress, "steps (after metrics)", errors
                )
                for r, s in more.items():
                    cands.setdefault(r, []).extend(s)
                more_found = _walk.walk(run_a, run_b, more, boundary, progress, found)
                found.update(more_found)
        if errors[0] or errors[1]:
            notes.append(
                f"records that could not be digested (status error): A {errors[0]}, B {errors[1]}; they are no "
                "evidence either way and were left out of the comparison (see certify)"
            )
        if rinfo.resumed and rinfo.first_common_step is not None and rinfo.first_common_step <= hi:
            s = rinfo.first_common_step
            n, d = _resume.boundary_counts(
                _walk.scan(run_a, "records", compared, s, s), _walk.scan(run_b, "records", compared, s, s), s
            )
            rinfo = ResumeInfo(rinfo.resumed, rinfo.start_a, rinfo.start_b, s, n, d, rinfo.note)
    # Verdicts ---------------------------------------------------------------------------
    # Ranks whose only differences sit under hazards (likely false roots) are identical.
    # Ranks where no value differs (only records under hazards, or calls in another order or
    # number with matching records) are identical; what differed is noted.
    weak = {r: f["first"] for r, f in found.items() if f["next"] is None and f["first"].get("weak")}
    for r, ex in sorted(weak.items()):
        del found[r]
        row = ex["row"]
        where = f"from step {row['step']} {row['name']} ({row['kind']}) in {row['module'] or '<root>'}"
        if ex["weak"] == "hazards":
            notes.append(
                f"rank {r}: differences only under hazards ({', '.join(ex['hazards']) or 'hazard'}), {where}: "
                "likely false roots, and no clean difference follows them"
            )
        else:
            notes.append(
                f"rank {r}: calls in another order or number, {where}, with every record's value equal: a "
                "control-flow difference that changed no value (framework bookkeeping), not a divergence"
            )
    restored = set(scope.boundary)
    entry = restored | {x for x in (range_a and range_a[0], range_b and range_b[0]) if x is not None}
    world = max([int(run_a.manifest(r).get("world_size") or 1) for r in compared] or [1])
    verdicts = _resolve_verdicts(run_a, run_b, found, compared, entry, restored, world)
    record_keys = sorted(
        {
            (r, int(f[w]["row"]["step"]), int(f[w]["row"]["key_hash"]))
            for r, f in found.items()
            for w in ("first", "next")
            if f[w]
        }
    )
    # Record details (moments, rows, errors) were read with the walk's call detail.
    det_a: dict[tuple[int, int, int], dict[str, Any]] = {}
    det_b: dict[tuple[int, int, int], dict[str, Any]] = {}
    for r, f in found.items():
        for w in ("first", "next"):
            if f[w]:
                k = (r, int(f[w]["row"]["step"]), int(f[w]["row"]["key_hash"]))
                da, db = f[w]["details"]
                if da is not None:
                    det_a[k] = da
                if db is not None:
                    det_b[k] = db
    dump_a, dump_b = _evidence.dumps(run_a, record_keys), _evidence.dumps(run_b, record_keys)
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
        kern_a, kern_b = _evidence.kernels(run_a, calls), _evidence.kernels(run_b, calls)
    elif "kernels" in run_a.tables and "kernels" in run_b.tables and found:
        notes.append("kernel identities were captured: rerun with --level kernel to compare them")

    def build(r: int, which: str) -> Divergence | None:
        ex = found[r][which]
        if ex is None:
            return None
        row = ex["row"]
        lv, group, gtest = verdicts[(r, which)]
        key = (r, int(row["step"]), int(row["key_hash"]))
        dumps = (dump_a[key], dump_b[key]) if key in dump_a and key in dump_b else None
        da, db = det_a.get(key), det_b.get(key)
        texts = None
        if da is not None and db is not None and not row["args_same"]:
            ta = _evidence.arg_texts(run_a, [r], [da["args_digest"]] if da.get("args_digest") else [])
            tb = _evidence.arg_texts(run_b, [r], [db["args_digest"]] if db.get("args_digest") else [])
            texts = (
                ta.get(da["args_digest"]) if da.get("args_digest") else "",
                tb.get(db["args_digest"]) if db.get("args_digest") else "",
            )
        diff = classify(
            row["state"], da, db, dumps, texts, tensors_same=bool(row["tensors_same"]), args_same=bool(row["args_same"])
        )
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
        if r in found and level == "step":
            s = int((found[r]["next"] or found[r]["first"])["row"]["step"])
            results[r] = RankResult(r, "diverged", min(s, mkw.get("metric_step", s)), record_step=s, **mkw)
        elif r in found:
            first, nxt = build(r, "first"), build(r, "next")
            if first is None:  # earlier steps differed only under hazards: the clean one is first
                first, nxt = nxt, None
            assert first is not None
            # A likely false root followed by a clean divergence: the rank diverges where the
            # evidence does (the false root stays in the report as ``first``).
            step = nxt.step if first.hazards and nxt is not None else first.step
            results[r] = RankResult(r, "diverged", step, record_step=step, first=first, next_clean=nxt, **mkw)
            if mr is not None and mr["step"] < step:
                notes.append(
                    f"rank {r}: metric {mr['name']} differs at step {mr['step']}, before any record (step {step}): "
                    "widen the capture"
                )
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
    disc = (
        _evidence.discriminator(run_a, run_b, ordered, diag)
        if diag.origin_ranks and level in ("op", "kernel")
        else None
    )
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
        complete=not any(r.completeness is not None and r.completeness.gaps for r in (run_a, run_b)),
    )


def _resolve_verdicts(
    run_a: Any,
    run_b: Any,
    found: Mapping[int, Mapping[str, Any]],
    compared: Sequence[int],
    entry: set[int],
    restored: set[int],
    world: int,
) -> dict[tuple[int, str], tuple[_verdict.LocalVerdict, tuple[str, tuple[int, ...]] | None, _verdict.GroupTest | None]]:
    """(rank, "first"|"next") -> (local verdict, group, group or cross-rank test) for every walked extract.

    Three passes: each rank's own records (``local_verdict``); the group-wide test of
    collectives, from the peers' inputs to the same call; then the cross-rank test of
    differences an uncaptured reduction may have carried, from every rank's first difference.
    """
    every = _evidence.all_groups(run_a)
    ranks_all = sorted(set(run_a.ranks) | set(run_b.ranks))
    local: dict[tuple[int, str], _verdict.LocalVerdict] = {}
    groups: dict[tuple[int, str], tuple[str, tuple[int, ...]]] = {}
    asks: list[tuple[int, int, int, tuple[int, ...]]] = []
    for r, f in found.items():
        for which in ("first", "next"):
            ex = f[which]
            if ex is None:
                continue
            row = ex["row"]
            step = int(row["step"])
            facts = _verdict.StepFacts(ex.get("kinds", frozenset()), step in entry, step in restored, world)
            lv = _verdict.local_verdict(row, ex["call_rows"], ex["upstream"], facts)
            local[(r, which)] = lv
            if lv.verdict == "collective":
                g = _verdict.group_of(row["name"], row["kind"], _evidence.groups_of(run_a, r, every), ranks_all)
                groups[(r, which)] = g
                asks.append((r, int(row["step"]), int(row["call_hash"]), tuple(p for p in g[1] if p != r)))
    peer_states = _evidence.peer_inputs(run_a, run_b, asks) if asks else {}
    tests: dict[tuple[int, str], _verdict.GroupTest | None] = {}
    for (r, which), lv in local.items():
        row = found[r][which]["row"]
        label = f"{row['name']} in {row['module'] or '<root>'}"
        group = groups.get((r, which))
        gtest = None
        if lv.verdict == "collective" and row["kind"] == "p2p":
            # A receive has no peer call with the same key (the peer ran a send): its output
            # differing with matching local inputs means the sender's data differed.
            gtest = _verdict.GroupTest(
                "receiver",
                (),
                (),
                f"{label}: received over p2p{'' if group is None else ' in group ' + group[0]}; the difference "
                "started on the sending rank",
            )
        elif lv.verdict == "collective" and group is not None:
            step, h = int(row["step"]), int(row["call_hash"])
            own_inputs = [c for c in found[r][which]["call_rows"] if c["role"] == "input"]
            states = {}
            for p in group[1]:
                if p == r:
                    continue
                st = peer_states.get((p, step, h))
                if st is None and not own_inputs:
                    st = _fallback_peer(found, p, step, h, compared)
                states[p] = st or rule.UNKNOWN
            gtest = _verdict.group_verdict(r, label, group[0], group[1], states)
        tests[(r, which)] = gtest
    # Every rank's first difference, as the diagnosis will see it (past a likely false root).
    starts: dict[int, tuple[int, str]] = {}
    for r, f in found.items():
        which = "next" if f["next"] is not None and (f["first"] is None or f["first"]["hz"]) else "first"
        gt = tests[(r, which)]
        starts[r] = (int(f[which]["row"]["step"]), gt.verdict if gt is not None else local[(r, which)].verdict)
    for (r, which), lv in local.items():
        if lv.verdict != "reduction" and not (lv.verdict == "unobserved_producer" and world > 1):
            continue
        row = found[r][which]["row"]
        g = _verdict.group_of(row["name"], "reduced_grad", _evidence.groups_of(run_a, r, every), ranks_all)
        label = f"{row['kind']} {row['name']}"
        ct = _verdict.cross_rank(r, int(row["step"]), lv, label, g[0], g[1], starts, compared)
        if ct is not None:
            groups[(r, which)] = g
            tests[(r, which)] = ct
    return {k: (lv, groups.get(k), tests[k]) for k, lv in local.items()}


def _fallback_peer(
    found: Mapping[int, Mapping[str, Any]], peer: int, step: int, h: int, compared: Sequence[int]
) -> str:
    """Peer state for a call without input records (e.g. reduced_grad): from the peer's own first divergence."""
    if peer not in compared:
        return rule.UNKNOWN
    f = found.get(peer)
    if f is None:
        return rule.SAME
    row = f["first"]["row"]
    if int(row["step"]) > step or (int(row["step"]) == step and int(row["call_hash"]) == h):
        return rule.SAME
    return rule.DIFFERS
