"""The evidence the cause weighing needs beyond the per-rank results, read from the runs.

Each function reads little and returns a typed value of ``cause``; the weighing itself is pure
(``cause.weigh``). What is read, and when:

* ``endings``: where a run ended before the other: ``partial_step`` events at each rank's last
  step (a step that raised, or forwards no optimizer step ended) and the completeness gaps of a
  capture that never closed or closed incomplete (events table, filtered to those steps);
* ``hazard_reads``: for ranks whose first divergence is under ``uninitialized``, the steps at
  which each run flagged that call's read (hazard events of that rank only);
* ``rng_only``: when every diverged rank's first divergence is an ``rng_state`` source and no
  metric split, whether any other record differs in the window (one rollup over the narrow
  columns of those ranks, ``rng_state`` records left out);
* ``step_offset``: when a rank's first divergence is a source at run B's first step, whether
  B's entry records there (RNG states, the batch, parameters) equal run A's at a later step;
* ``forward_calls``: how often each run's models ran forward in the step of the lowest diverged
  rank's first difference (its ``batch`` records) and whether micro-batches are labelled, read
  only where a count can differ (a structural difference, a metric one run records more often);
* ``settings_at``: the settings that differ at the first divergent step, the manifests' with
  the changes a run made during the run applied (``setting_changed`` events, read only of the
  ranks whose manifest says a setting changed: ``settings_changed_at``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import polars as pl

from detfp_analyze.bisect import narrow as _narrow
from detfp_analyze.bisect import settings as _settings
from detfp_analyze.bisect.cause import ForwardCalls, HazardRead, Offset
from detfp_analyze.bisect.reads import collect, scan
from detfp_analyze.bisect.result import Capture, Ending, RankResult, ResumeInfo
from detfp_analyze.bisect.vocab import Status, Verdict
from detfp_analyze.io.envdiff import flatten_manifest
from detfp_analyze.io.reader import Run

__all__ = ["capture_of", "endings", "forward_calls", "hazard_reads", "rng_only", "settings_at", "step_offset", "with_offset"]

#: Kinds whose records at a run's first step say where it starts from (offset matching).
_ENTRY_KINDS = ("rng_state", "batch", "param")
_ENTRY_COLUMNS = ("rank", "step", "kind", "name", "role", "key_hash", "status", "digest_hi", "digest_lo")


def _last_steps(run: Run, ranks: Sequence[int]) -> dict[int, int]:
    """Each rank's last step with records (shard footers; a scan when they carry no statistics)."""
    out: dict[int, int] = {}
    shards = getattr(run, "shards", {}).get("records", ())
    wanted = set(ranks)  # a set: every shard of every rank asks
    for s in shards:
        if s.rank in wanted and s.step_max is not None:
            out[s.rank] = max(out.get(s.rank, s.step_max), s.step_max)
    missing = [r for r in ranks if r not in out]
    if missing:
        got = collect(run.scan("records", ranks=missing).group_by("rank").agg(pl.col("step").max()))
        out.update({int(r): int(s) for r, s in got.iter_rows() if s is not None})
    return out


def _ended_candidates(results: Sequence[RankResult], last: dict[str, dict[int, int]]) -> dict[str, list[int]]:
    """Per run, the ranks where its end can matter, so an identical pair of equal length reads
    nothing: a first divergence that is a record the other run lacks in that run's last step, or
    an identical rank whose runs end at different steps (the shorter one)."""
    out: dict[str, list[int]] = {"A": [], "B": []}
    for rr in results:
        r, f = rr.rank, rr.first
        a, b = last["A"].get(r), last["B"].get(r)
        if f is not None and f.verdict == Verdict.STRUCTURAL:
            side = {"a_only": "B", "b_only": "A"}.get(f.presence)
            if side is not None and f.step == last[side].get(r):
                out[side].append(r)
        elif rr.status == Status.IDENTICAL and a is not None and b is not None and a != b:
            out["A" if a < b else "B"].append(r)
    return out


def endings(run_a: Run, run_b: Run, ranks: Sequence[int], results: Sequence[RankResult]) -> tuple[Ending, ...]:
    """Where a run ended before the other on ``ranks``: its last step did not finish
    (``partial_step`` events) while the other run's did or went on, or its capture is incomplete
    (the completeness gaps of a launch that never closed or closed incomplete). Two runs that end
    alike (both with the same trailing evaluation step) did not end early. Events are read only
    for the ranks where an end can matter (``_ended_candidates``)."""
    last = {side: _last_steps(run, ranks) for side, run in (("A", run_a), ("B", run_b))}
    wanted = _ended_candidates(results, last)
    partial: dict[str, dict[int, str]] = {"A": {}, "B": {}}
    for side, run in (("A", run_a), ("B", run_b)):
        mine = {r: last[side][r] for r in wanted[side] if r in last[side]}
        if not mine:
            continue
        lo, hi = min(mine.values()), max(mine.values())
        ev = collect(
            scan(run, "events", sorted(mine), lo, hi, ("rank", "step", "type", "detail")).filter(
                pl.col("type") == "partial_step"
            )
        )
        for rank, step, _, detail in ev.iter_rows():
            if mine.get(int(rank)) == int(step):
                partial[side][int(rank)] = detail or f"step {step} did not finish"
    merged: dict[tuple[str, int, str], set[int]] = {}
    for side, other in (("A", "B"), ("B", "A")):
        for rank, why in partial[side].items():
            step, beyond = last[side][rank], last[other].get(rank)
            if beyond is not None and beyond >= step:
                merged.setdefault((side, step, why), set()).add(rank)
    for side, run in (("A", run_a), ("B", run_b)):
        comp = run.completeness
        for g in comp.gaps if comp is not None else ():
            if g.kind in ("not_closed", "closed_incomplete") and g.first_step is not None and g.rank in ranks:
                merged.setdefault((side, g.first_step, g.detail), set()).add(g.rank)
    return tuple(Ending(side, st, tuple(sorted(rs)), why) for (side, st, why), rs in sorted(merged.items()))


def hazard_reads(run_a: Run, run_b: Run, ranks: Sequence[RankResult]) -> dict[int, HazardRead]:
    """rank -> the steps at which each run flagged its first divergent call's uninitialized read
    (one scan of each run's hazard events, of the ranks whose first divergence is under one)."""
    firsts = {rr.rank: rr.first for rr in ranks if rr.first is not None and "uninitialized" in rr.first.hazards}
    firsts = {r: f for r, f in firsts.items() if f.op is not None}
    if not firsts:
        return {}
    cols = ("rank", "step", "type", "name", "module", "detail")
    hz = (pl.col("type") == "hazard") & (pl.col("name") == "uninitialized")
    found: list[dict[int, list[tuple[int, str]]]] = []
    for run in (run_a, run_b):
        ev = collect(run.scan("events", ranks=sorted(firsts), columns=cols).filter(hz))
        mine: dict[int, list[tuple[int, str]]] = {}
        for rank, step, _, _, module, detail in ev.iter_rows():
            f = firsts[int(rank)]
            if module == (f.module or "") and (detail or "").startswith(f"{f.op} "):
                mine.setdefault(int(rank), []).append((int(step), str(detail)[len(f.op) + 1 :].split(" ", 1)[0]))
        found.append(mine)
    out = {}
    for r in firsts:
        a, b = found[0].get(r, []), found[1].get(r, [])
        arg = (a or b or [(0, "")])[0][1]
        out[r] = HazardRead(tuple(sorted({s for s, _ in a})), tuple(sorted({s for s, _ in b})), arg)
    return out


def rng_only(run_a: Run, run_b: Run, ranks: Sequence[RankResult], window: tuple[int, int] | None) -> bool:
    """True when every diverged rank differs only in RNG states: its first divergence is an
    ``rng_state`` source, no metric split, and no other record differs anywhere in ``window``."""
    diverged = [r for r in ranks if r.status == Status.DIVERGED]
    if not diverged or window is None:
        return False
    for r in diverged:
        f = r.effective
        if r.metric_step is not None or f is None or f.kind != "rng_state" or f.verdict != Verdict.SOURCE:
            return False
    wanted = [r.rank for r in diverged]
    rolls = []
    for run in (run_a, run_b):
        lf = scan(run, "records", wanted, window[0], window[1], (*_narrow.ROLLUP_COLUMNS, "kind"))
        rolls.append(collect(_narrow.step_rollup(lf.filter(pl.col("kind") != "rng_state").drop("kind"))))
    return _narrow.divergent_steps(rolls[0], rolls[1]).is_empty()


def step_offset(run_a: Run, run_b: Run, ranks: Sequence[RankResult], range_a, range_b) -> Offset | None:
    """B's first step against each later step of A on the lowest diverged rank: the shift where
    the most of B's entry records (RNG states, the batch, parameters) match, when more match
    there than at no shift and the rank's first divergence is a source at B's first step."""
    if range_a is None or range_b is None:
        return None
    b0 = range_b[0]
    rr = next((r for r in ranks if r.status == Status.DIVERGED and r.effective is not None), None)
    if rr is None:
        return None
    d = rr.effective
    if d is None or d.verdict != Verdict.SOURCE or d.step != b0 or range_a[1] <= b0:
        return None
    cols = _ENTRY_COLUMNS
    kinds = pl.col("kind").is_in(_ENTRY_KINDS) & (pl.col("status") == "ok")
    eb = collect(scan(run_b, "records", [rr.rank], b0, b0, cols).filter(kinds))
    ea = collect(scan(run_a, "records", [rr.rank], b0, range_a[1], cols).filter(kinds))
    if eb.is_empty() or ea.is_empty():
        return None
    j = ea.join(eb.drop("step"), on=["rank", "key_hash"], suffix="_b")
    j = j.with_columns(
        ((pl.col("digest_hi") == pl.col("digest_hi_b")) & (pl.col("digest_lo") == pl.col("digest_lo_b"))).alias("same")
    )
    score = j.group_by("step").agg(pl.col("same").sum().alias("n")).sort("step")
    counts = dict(score.iter_rows())
    best = max((s for s in counts if s > b0), key=lambda s: (counts[s], -s), default=None)
    if best is None or counts[best] <= counts.get(b0, 0):
        return None
    hit = j.filter((pl.col("step") == best) & pl.col("same"))
    pairs = sorted(
        set(zip(hit["kind"].to_list(), hit["name"].to_list(), strict=True)),
        key=lambda kn: (_ENTRY_KINDS.index(kn[0]), kn[1]),
    )
    named = [f"{k} {n}" for k, n in pairs if k != "param"]
    params = len({n for k, n in pairs if k == "param"})
    return Offset(best - b0, b0, (*named, *([f"{params} parameter(s)"] if params else [])))


def capture_of(run: Run, ranks: Sequence[int]) -> Capture | None:
    """How ``run`` was captured: its lowest compared rank's manifest (capture level, and whether
    the command was the launcher, ``python -m detfp_capture``)."""
    have = [r for r in ranks if r in run.manifests] or sorted(run.manifests)
    if not have:
        return None
    m = run.manifest(min(have))
    level = (m.get("capture") or {}).get("level")
    command = [str(x) for x in (m.get("command") or [])]
    launcher = bool(command) and command[0].replace("\\", "/").endswith("detfp_capture/__main__.py")
    return Capture(level if isinstance(level, str) else None, "launcher" if launcher else "session")


def with_offset(info: ResumeInfo, o: Offset) -> ResumeInfo:
    """The resume facts with the step offset found between the runs, said in its note too."""
    b0 = o.first_b
    note = f"run B's step {b0} holds the state of run A's step {b0 + o.shift} (steps numbered {o.shift} apart)"
    return dataclasses.replace(info, step_offset=o.shift, note="; ".join(x for x in (info.note, note) if x))


def settings_at(
    run_a: Run, run_b: Run, ranks: Sequence[int], base: Sequence[_settings.Setting], step: int | None
) -> tuple[_settings.Setting, ...]:
    """The numerics settings that differ at ``step`` (the first divergent step; None: none
    diverged): ``base`` (from the manifests, the first step's values) with the settings changed
    during either run applied up to ``step`` (``settings.changed``)."""
    runs = (("A", run_a), ("B", run_b))
    changing = {side: [r for r in ranks if r in run.manifests and "settings_changed_at" in run.manifest(r)]
                for side, run in runs}  # fmt: skip
    if step is None or not any(changing.values()):
        return tuple(base)
    changes: list[_settings.Change] = []
    for side, run in runs:
        if not changing[side]:
            continue
        cols = ("rank", "step", "type", "name", "detail")
        ev = collect(run.scan("events", ranks=changing[side], columns=cols).filter(pl.col("type") == "setting_changed"))
        for rank, st, _, name, detail in ev.iter_rows():
            c = _settings.parse_change(side, int(rank), int(st), name or "", detail or "")
            if c is not None:
                changes.append(c)
    flat = {side: {r: flatten_manifest(run.manifest(r)) for r in changing[side]} for side, run in runs}

    def start(side: str, rank: int, key: str) -> object:
        got = flat[side].get(rank)
        run = run_a if side == "A" else run_b
        if got is None:
            got = flat[side][rank] = flatten_manifest(run.manifest(rank))
        return got.get(key)

    return _settings.changed(base, changes, start, ranks, step)


def forward_calls(run_a: Run, run_b: Run, ranks: Sequence[RankResult]) -> ForwardCalls | None:
    """Forward calls per step (``batch`` records, one per root forward) in both runs at the lowest
    diverged rank with a located first difference, in its step, when a count can differ there: the
    difference is structural, or a metric of that step is recorded in one run only (a loss per
    micro-batch); else None without reading (one read of that rank-step's records otherwise)."""
    rr = next((r for r in ranks if r.status == Status.DIVERGED and r.effective is not None), None)
    if rr is None or rr.effective is None:
        return None
    one_sided_metric = rr.metric_step == rr.effective.step and (rr.metric_a is None) != (rr.metric_b is None)
    if rr.effective.verdict != Verdict.STRUCTURAL and not one_sided_metric:
        return None
    step = rr.effective.step
    counts, labelled = [], False
    for run in (run_a, run_b):
        cols = ("rank", "step", "kind", "microbatch", "call_hash")
        got = collect(scan(run, "records", [rr.rank], step, step, cols).filter(pl.col("kind") == "batch"))
        counts.append(got["call_hash"].n_unique())
        labelled = labelled or bool((got["microbatch"] >= 0).any())
    return ForwardCalls(rr.rank, step, counts[0], counts[1], labelled)
