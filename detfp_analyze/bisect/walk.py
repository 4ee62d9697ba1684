"""The exact walk: from candidate steps to each rank's first divergent record (``records.Found``).

Each rank's first candidate step is read on the narrow columns (``align.NARROW_COLUMNS``) for a
batch of ranks (a step sliced by the stored rollups only to its slice's head, the rest where
the head does not settle the pick: ``_unsettled``), aligned with ``detfp_analyze.rule``
(``align``), and its first divergent row
picked (resume boundary state first); steps with records on one side only are re-aligned with
the call-site columns (shifted occurrence counters). The step is then judged as the rule says:
a step that changes no value (only records under hazards, or calls in another order or number
whose records all match: ``rule.VALUE`` and the same-calls test) is passed over for the rank's
next candidate, a step whose first divergence is under a hazard with nothing clean after it is
kept as a likely false root, and the first step that changes a value ends the rank's walk. Only
the calls a verdict needs are then read in full (``enrich``). Both runs' sides of a read are
collected concurrently, and two batches are walked at once, each in its own thread.
Memory: two batches of ``reads.walk_batch`` rank-steps per run (about ``WALK_ROWS`` records each).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import polars as pl

from detfp_analyze import rule
from detfp_analyze.bisect import align as _align
from detfp_analyze.bisect import callfacts as _calls
from detfp_analyze.bisect import enrich as _enrich
from detfp_analyze.bisect.blocks import Slice
from detfp_analyze.bisect.reads import chunks, collect_pair, walk_batch
from detfp_analyze.bisect.records import Aligned, CallKey, Extract, Found, RecordKey
from detfp_analyze.io import binding as _binding
from detfp_analyze.io import integrity as _integrity
from detfp_analyze.io.reader import Run
from detfp_analyze.rule.to_polars import to_polars
from detfp_format.contract import STATUSES

__all__ = ["FIRST_PASS_COLUMNS", "Progress", "walk"]

#: progress(stage, done, total): called between batches; the CLI draws a bar with it.
Progress = Callable[[str, int, int], None]
#: Walk batches in flight at once (each in its own thread; see ``walk``).
_WORKERS = 2
#: An aligned row that is evidence of a value difference (``rule.VALUE``).
_VALUE = to_polars(rule.VALUE)


def _read_columns(columns: Sequence[str]) -> tuple[str, ...]:
    """The records columns read to prepare ``columns`` for the alignment (with the hazard flag's inputs)."""
    return tuple(dict.fromkeys((*columns, *_align.HAZARD_FLAG.meta.root_names())))


#: What the walk's first pass reads of every candidate rank-step (the narrow columns and the
#: hazard flag's inputs): an engine that fetches the rank-steps ahead (``Stages.prefetch``)
#: fetches these; the wider reads (call-site columns, record details) are of a few calls only.
FIRST_PASS_COLUMNS = _read_columns(_align.NARROW_COLUMNS)
#: The columns of the same-calls test (``_same_calls``).
_SAME_CALLS_COLUMNS = tuple(
    dict.fromkeys(
        (
            "rank",
            "step",
            *rule.FAMILY,
            "call_hash",
            *(n for c in rule.SIGNATURE for n in to_polars(c).meta.root_names()),
        )
    )
)


def _pairs_scan(
    run: Run, pairs: Mapping[int, int], columns: Sequence[str], seqs: Mapping[int, tuple[int, int]]
) -> pl.LazyFrame:
    """``pairs``' records; a rank in ``seqs`` only within that inclusive seq range (its slice:
    ``Run.scan_spans``, so the row groups' seq statistics skip the rest of its file)."""
    whole = {r: s for r, s in pairs.items() if r not in seqs}
    parts = [_whole_scan(run, whole, columns)] if whole else []
    if seqs:
        spans = {(r, pairs[r]): span for r, span in seqs.items()}
        parts.append(_prepared(run.scan_spans("records", spans, _read_columns(columns)), columns))
    return parts[0] if len(parts) == 1 else pl.concat(parts)


def _prepared(lf: pl.LazyFrame, columns: Sequence[str]) -> pl.LazyFrame:
    lf = lf.select(*columns, _align.HAZARD_FLAG)
    # Status as an enum: the alignment compares it on every row, integers compare faster.
    return lf.with_columns(pl.col("status").cast(pl.Enum(STATUSES)))


def _whole_scan(run: Run, pairs: Mapping[int, int], columns: Sequence[str]) -> pl.LazyFrame:
    return _prepared(_records(run, pairs, _read_columns(columns)), columns)


def _records(run: Run, pairs: Mapping[int, int], columns: Sequence[str]) -> pl.LazyFrame:
    """``columns`` of the records of the (rank, step) ``pairs`` (one step per rank), by rank, in file order."""
    steps = sorted(set(pairs.values()))
    if len(steps) == 1:  # the scan selects exactly these (rank, step) pairs
        return run.scan("records", ranks=sorted(pairs), steps=steps, columns=columns)
    # One scan per step, of exactly the ranks at that step: a run's reads then name only the
    # (rank, step) pairs walked (an engine that fetched them ahead serves them all; a scan of
    # every rank x every step would ask for pairs nobody walks). A stable sort by rank restores
    # the order of one scan (each rank holds one step): rank, then file, then row.
    parts = [
        run.scan("records", ranks=sorted(r for r in pairs if pairs[r] == s), steps=[s], columns=columns) for s in steps
    ]
    return pl.concat(parts).sort("rank", maintain_order=True)


def _read_pairs(
    run_a: Run,
    run_b: Run,
    pairs: Mapping[int, int],
    columns: Sequence[str],
    slices: Mapping[tuple[int, int], Slice] | None = None,
    head: bool = False,
) -> tuple[pl.DataFrame, pl.DataFrame]:
    """Both runs' records of the (rank, step) ``pairs`` (only its slice where ``slices`` has
    one; with ``head``, only the slice's head: a walk batch's first pass, the rest read where the
    head does not settle the pick, ``_unsettled`` and ``_extracts``), prepared for the alignment
    (after ``integrity.check_stream``: a step with backwards seq or a repeated key is refused)."""
    cut = {r: slices[(r, s)] for r, s in pairs.items() if slices and (r, s) in slices}
    a, b = collect_pair(
        *(
            _pairs_scan(run, pairs, columns, {r: c.span(i, head) for r, c in cut.items()})
            for i, run in enumerate((run_a, run_b))
        )
    )
    _bind(run_a, a, pairs, cut, 0, head)
    _bind(run_b, b, pairs, cut, 1, head)
    _integrity.check_stream(a, run_a.label)
    _integrity.check_stream(b, run_b.label)
    return _align.prepare(a, one_step_per_rank=True), _align.prepare(b, one_step_per_rank=True)


def _bind(
    run: Run, read: pl.DataFrame, pairs: Mapping[int, int], cut: Mapping[int, Slice], side: int, head: bool
) -> None:
    """Refuse records read that are not what their windows committed (``io.binding``): a whole
    step against the step fold its commit lines state, a slice (or its head) against the fold of
    the stored rollups' blocks it covers. No extra I/O: the columns hashed are read anyway."""
    folds = _binding.fold(read)
    whole = [(r, s) for r, s in pairs.items() if r not in cut]
    if whole:
        _binding.check_steps(run, "records", folds.filter(~pl.col("rank").is_in(list(cut))), whole)
    expected = {(r, pairs[r]): f for r, c in cut.items() if (f := c.fold(side, head)) is not None}
    if expected:
        _binding.check_spans(run, folds.filter(pl.col("rank").is_in(list(cut))), expected)


@dataclass(frozen=True)
class _Pick:
    """A divergent row picked from one rank's narrow alignment, before its call is read in full."""

    row: dict[str, Any]
    #: A record of its call carries a hazard.
    hz: bool
    #: call_hash of the call just before it in the rank's order.
    upstream_call: int | None
    kinds: frozenset[str]
    passed: str | None = None

    @property
    def key(self) -> RecordKey:
        return RecordKey(int(self.row["rank"]), int(self.row["step"]), int(self.row["key_hash"]))

    @property
    def call(self) -> CallKey:
        return CallKey(int(self.row["rank"]), int(self.row["step"]), int(self.row["call_hash"]))


def _pick(row: dict[str, Any], call: _calls.CallFacts, rank: _calls.RankFacts) -> _Pick:
    """The divergent row, whether its call has a hazard, the call one hop upstream and the record
    kinds the rank-step holds (what else the capture saw), from the batch's ``callfacts``."""
    return _Pick(row, call.hz, call.upstream, rank.kinds)


def walk(
    run_a: Run,
    run_b: Run,
    cands: Mapping[int, list[int]],
    boundary: Sequence[int],
    progress: Progress | None,
    found: Mapping[int, Found] | None = None,
    *,
    slices: Mapping[tuple[int, int], Slice] | None = None,
    batch_size: int | None = None,
) -> dict[int, Found]:
    """rank -> Found for every rank with a divergence in its candidate steps (``cands``: rank ->
    sorted steps whose rollups differ); ``boundary``: resume boundary steps.

    ``found``: what an earlier walk of the same ranks' earlier steps found (a likely false root,
    a passed-over step); the walk goes on from there and returns the updated mapping. A rank
    whose steps all change no value has a ``Found`` whose ``passed`` is true. ``slices``: the
    candidate steps to read only in part (``blocks.slices``); a pick that needs records outside
    its slice (its call or the one upstream cut, a module output's twin, a hazard) rereads the step.
    ``batch_size``: rank-steps per batch (default ``reads.walk_batch``); the report does not depend on it.
    """
    found = dict(found or {})
    todo = {r: list(s) for r, s in cands.items() if s}
    total = len(todo)
    # Two batches run at once, each read then aligned and enriched in its own thread: the
    # engine releases the GIL, so one batch's reads and joins run while the other's Python
    # does its part (two cores busy where one batch at a time left one mostly idle), and at
    # most two batches are held, as with a read-ahead. A batch only reads and changes the
    # candidate lists and findings of its own ranks, so batches are independent; their results
    # are taken in batch order (the first failing batch raises, as one at a time would) and the
    # mapping is returned sorted by rank, whatever order the threads finished in.
    pool = ThreadPoolExecutor(max_workers=_WORKERS)
    try:
        while todo:
            batches = chunks(sorted(todo), batch_size or walk_batch(run_a, run_b))
            runs = [pool.submit(_run_batch, run_a, run_b, {r: todo[r][0] for r in b}, todo, boundary, found, slices)
                    for b in batches]  # fmt: skip
            for fut in runs:
                fut.result()
                if progress:
                    progress("walk", len(found), total)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return dict(sorted(found.items()))


def _run_batch(
    run_a: Run,
    run_b: Run,
    pairs: Mapping[int, int],
    todo: dict[int, list[int]],
    boundary: Sequence[int],
    found: dict[int, Found],
    slices: Mapping[tuple[int, int], Slice] | None,
) -> None:
    """One walk batch from its first read (``pairs``: rank -> step; the sliced ones only to their
    slice's head) to its findings (``_walk_batch``, in place)."""
    read = _read_pairs(run_a, run_b, pairs, _align.NARROW_COLUMNS, slices, True)
    cut = {r: slices[(r, s)] for r, s in pairs.items() if slices and (r, s) in slices}
    _walk_batch(run_a, run_b, pairs, read, todo, boundary, found, cut)


def _unsettled(
    al: pl.DataFrame, pairs: Mapping[int, int], heads: Collection[int], boundary: Sequence[int]
) -> list[int]:
    """Ranks of ``heads`` (read only to their slice's head) whose walk needs the whole slice.

    The head starts where the slice does, so its records keep their positions; when both sides'
    heads hold the same keys (no record on one side only), every record after the head comes
    after every record in it on both sides, and the head's alignment is the slice's restricted to
    it (states, positions, order keys), under the same 64-bit evidence the slice rests on (the
    step's key sets agree). The head then settles the rank when it holds a value difference
    (the rank-step changes a value: ``_judge``), the step is no resume boundary (whose priority
    records may lie anywhere), provided the picked calls have no record past the head on either
    side: their rows, hazards and upstream calls are then the slice's. The enrich read of the
    picked calls, which reads the rest of the slice for their records anyway, tells
    (``_extracts``); a rank with one past its head is walked again on its whole slice. Anything
    else reads the whole slice here."""
    if not heads:
        return []
    mine = al.filter(pl.col("rank").is_in(list(heads)))
    g = mine.group_by("rank").agg(
        pl.col("state").is_in(rule.ONE_SIDED).any().alias("one_sided"), (_VALUE & ~pl.col("hz")).any().alias("value")
    )
    ok = {int(r) for r, one, v in g.iter_rows() if v and not one and pairs[int(r)] not in boundary}
    return sorted(set(heads) - ok)


def _outside_slice(index: _calls.CallIndex, firsts: pl.DataFrame, cut: Mapping[int, Slice]) -> list[int]:
    """Ranks read in part whose pick needs records outside the slice: its call or the call
    upstream of it may start before the slice, a module output needs its input twin (anywhere in
    the step), a first divergence under a hazard needs the next clean one and its call's hazards."""
    out: list[int] = []
    rows = [row for row in firsts.to_dicts() if int(row["rank"]) in cut]
    if not rows:
        return out
    facts = index.facts([(int(row["rank"]), int(row["call_hash"])) for row in rows])
    for row in rows:
        r = int(row["rank"])
        call = facts[(r, int(row["call_hash"]))]
        if row["kind"] == "module_output" or call.hz:
            out.append(r)
        elif not cut[r].cut:
            continue  # the slice starts at the step's first record: nothing before it
        elif call.upstream is None or call.upstream_at_first:
            out.append(r)  # no call before it in the slice, or the upstream call may begin before the slice
    return sorted(out)


def _judge(values: int, first: _Pick, nxt: _Pick | None, same_calls: Callable[[], bool]) -> str | None:
    """Why the rank-step changes no value ("hazards", "structure"), or None when it does;
    ``values``: the rank-step's rows that are value evidence without a hazard flag."""
    # Framework bookkeeping whose control flow depends on the process (DDP's finalize order,
    # FSDP's buffer alignment) moves records without changing a value: the state after it is equal.
    if values and first.row["state"] in (rule.REORDERED, rule.SHIFTED) and same_calls():
        values = 0  # the same calls, permuted within their families: occurrence keys only moved
    if first.hz and nxt is None:
        return "hazards"
    return None if values else "structure"


def _realign(
    run_a: Run,
    run_b: Run,
    al: pl.DataFrame,
    pairs: Mapping[int, int],
    ranks: Sequence[int] | set[int],
    columns: Sequence[str],
    slices: Mapping[tuple[int, int], Slice] | None = None,
) -> pl.DataFrame:
    """``al`` with the rows of ``ranks`` replaced by a fresh alignment of their rank-steps, read
    with ``columns`` (within ``slices`` where given; else whole), in ``al``'s column order."""
    sub = {r: pairs[r] for r in ranks}
    full = _align.align(*_read_pairs(run_a, run_b, sub, columns, slices)).select(al.columns)
    return pl.concat([al.filter(~pl.col("rank").is_in(list(ranks))), full])


def _walk_batch(
    run_a: Run,
    run_b: Run,
    pairs: Mapping[int, int],
    read: tuple[pl.DataFrame, pl.DataFrame],
    todo: dict[int, list[int]],
    boundary: Sequence[int],
    found: dict[int, Found],
    cut: Mapping[int, Slice],
) -> None:
    """One walk batch: align ``read`` (the batch's prepared sides), pick, judge, enrich; updates
    ``found`` and advances or drops the batch's ranks in ``todo`` (both in place). ``cut``: the
    batch's ranks read only in part (their slices; ``read`` holds only the head of those with one)."""
    before = {r: list(todo[r]) for r in pairs}
    al = _align.align(*read)
    unsettled = _unsettled(al, pairs, {r for r, c in cut.items() if c.head is not None}, boundary)
    if unsettled:  # the rest of their slices: the alignment of the whole slice, as without heads
        sl = {(r, pairs[r]): cut[r] for r in unsettled}
        al = _realign(run_a, run_b, al, pairs, unsettled, _align.NARROW_COLUMNS, sl)
    # Steps with records on one side only: re-align with the call-site columns, so a shifted
    # occurrence counter reads as structural, not as a value mismatch.
    one_sided = al.filter(pl.col("state").is_in(rule.ONE_SIDED))["rank"].unique().to_list()
    if one_sided:
        al = _realign(run_a, run_b, al, pairs, one_sided, _align.ALIGN_COLUMNS)
    firsts = _align.first_divergences(al, priority_kinds=rule.BOUNDARY_KINDS, priority_steps=boundary)
    # The batch's rows indexed once for every call question of this batch (callfacts), not a
    # few small queries per rank: the same answers.
    index = _calls.CallIndex(al)
    reread = _outside_slice(index, firsts, cut)
    if reread:
        al = _realign(run_a, run_b, al, pairs, reread, _align.NARROW_COLUMNS)
        firsts = _align.first_divergences(al, priority_kinds=rule.BOUNDARY_KINDS, priority_steps=boundary)
        cut = {r: c for r, c in cut.items() if r not in reread}
        index = _calls.CallIndex(al)
    by_rank = {int(r["rank"]): r for r in firsts.to_dicts()}
    facts = index.facts([(r, int(row["call_hash"])) for r, row in by_rank.items()])
    per_rank = _calls.rank_facts(al.select("rank", "kind", "hz", _VALUE.alias("value"))) if by_rank else {}
    # The same-calls test of every rank whose judgement needs it (_judge), in one read.
    same = _same_calls(
        run_a,
        run_b,
        {
            r: pairs[r]
            for r in pairs
            if r in by_rank and by_rank[r]["state"] in (rule.REORDERED, rule.SHIFTED) and per_rank[r].values
        },
    )
    picks: dict[int, tuple[_Pick | None, _Pick | None]] = {}
    for r in pairs:
        if r not in by_rank:
            _advance(todo, r)  # only no-evidence differences (skipped records) in that step
            continue
        first = _pick(by_rank[r], facts[(r, int(by_rank[r]["call_hash"]))], per_rank[r])
        if r in cut:
            first = replace(first, kinds=cut[r].kinds)  # the kinds of the whole rank-step
        nxt = None
        if first.hz:
            clean = _align.first_divergences(al.filter(pl.col("rank") == r), exclude_hazard_calls=True)
            if clean.height:
                row = clean.row(0, named=True)
                nxt_facts = index.facts([(r, int(row["call_hash"]))])
                nxt = _pick(row, nxt_facts[(r, int(row["call_hash"]))], per_rank[r])
        passed = _judge(per_rank[r].values, first, nxt, functools.partial(same.__contains__, r))
        held = found.get(r)
        # A false root (a step whose only divergences sit under hazards) stays the rank's first;
        # a step that changes no value otherwise is passed over, kept only for the note on a
        # rank where nothing else differs.
        false_root = held is not None and held.first.passed == "hazards"
        if passed is not None:
            if held is None or (passed == "hazards" and not false_root):
                picks[r] = (replace(first, passed=passed), None)
            _advance(todo, r)  # keep looking for a divergence in the rank's later steps
            continue
        # After a false root, this step's first clean divergence is the next one.
        picks[r] = (None, nxt or first) if false_root else (first, nxt)
        del todo[r]
    heads = {(r, pairs[r]): c for r, c in cut.items() if c.head is not None and r not in unsettled}
    extracts, redo = _extracts(run_a, run_b, al, picks, heads)
    for r, (pf, pn) in picks.items():
        if r in redo:
            continue
        first_ex = extracts[(r, "first")] if pf is not None else found[r].first
        found[r] = Found(first_ex, extracts.get((r, "next")) if pn is not None else None)
    if redo:  # a picked call with records past the head: those ranks again, on their whole slices
        for r in redo:
            todo[r] = before[r]
        sub = {r: pairs[r] for r in redo}
        whole = {r: replace(cut[r], head=None) for r in redo}
        again = _read_pairs(run_a, run_b, sub, _align.NARROW_COLUMNS, {(r, pairs[r]): c for r, c in whole.items()})
        _walk_batch(run_a, run_b, sub, again, todo, boundary, found, whole)


def _extracts(
    run_a: Run,
    run_b: Run,
    al: pl.DataFrame,
    picks: Mapping[int, tuple[_Pick | None, _Pick | None]],
    heads: Mapping[tuple[int, int], Slice],
) -> tuple[dict[tuple[int, str], Extract], set[int]]:
    """(rank, "first"|"next") -> Extract for every pick: its call, upstream call and details read
    in full; and the ranks whose rank-step ``al`` holds only its slice's head (``heads``) with a
    record of those calls past it (no Extract: ``_walk_batch`` walks them again on the slice)."""
    calls: set[CallKey] = set()
    keys: set[RecordKey] = set()
    for pf, pn in picks.values():
        for p in (pf, pn):
            if p is not None:
                calls.add(p.call)
                keys.add(p.key)
                if p.upstream_call is not None:
                    calls.add(CallKey(p.call.rank, p.call.step, p.upstream_call))
    if not calls:
        return {}, set()
    rich, det_a, det_b, past = _enrich.enrich(run_a, run_b, al, calls, keys, heads=heads)
    # Each (rank, call)'s rows once, in the alignment's order: dict lookups, not two queries per pick.
    parts: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for row in rich.to_dicts():
        parts.setdefault((int(row["rank"]), int(row["call_hash"])), []).append(row)
    out: dict[tuple[int, str], Extract] = {}
    for r, (pf, pn) in picks.items():
        if r in past:
            continue
        for which, p in (("first", pf), ("next", pn)):
            if p is None:
                continue
            call = tuple(Aligned.from_row(c) for c in parts.get((r, p.call.call_hash), ()))
            rec = next(c for c in call if c.key_hash == p.key.key_hash and c.dup == int(p.row["dup"]))
            upstream = None
            up = parts.get((r, p.upstream_call)) if p.upstream_call is not None else None
            if up:
                upstream = Aligned.from_row(_first_row(up)).label
            _integrity.check_shapes(
                [{"rank": c.rank, "step": c.step, "shape_a": c.shape_a, "shape_b": c.shape_b} for c in call],
                f"{run_a.label} vs {run_b.label}",
                ("shape_a", "shape_b"),
            )
            details = (det_a.get(p.key), det_b.get(p.key))
            out[(r, which)] = Extract(rec, call, _enrich.hazard_names(call), upstream, details, p.kinds, p.hz, p.passed)
    return _enrich.with_twins(run_a, run_b, al, out), past


def _first_row(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The row of smallest o1 among ``rows`` (one call's rows of the enriched alignment, in its
    row order); of rows tied at it, the first in that order (``min`` keeps the first minimum, as a
    stable sort would), so the name cannot depend on how a sort orders equal keys."""
    return min(rows, key=lambda u: u["o1"])


def _same_calls(run_a: Run, run_b: Run, pairs: Mapping[int, int]) -> set[int]:
    """The ranks of ``pairs`` (rank -> step) where both runs made the same calls in the rank-step,
    up to their order within each call-site family (``rule.SIGNATURE``, ``rule.FAMILY``): per
    family, the multiset of calls is equal. Occurrence numbers key the alignment, so calls in
    another order (DDP copying its buckets back in the order it packed them) read as values that
    differ; this is the exact check, read only for the steps whose first difference is such a
    reordering (all of a batch's in one read)."""
    if not pairs:
        return set()
    sig = pl.concat_str([to_polars(c).cast(pl.String).fill_null("-") for c in rule.SIGNATURE], separator="\x1f")

    def calls(run: Run) -> pl.LazyFrame:
        per_call = (
            _records(run, pairs, _SAME_CALLS_COLUMNS)
            # The state a capture starts from is no call of the step: one run may hold it alone
            # (a resumed run's first step: ``rule.UNSTARTED``).
            .filter(~pl.col("kind").is_in(rule.START_KINDS))
            .select("rank", *rule.FAMILY, "call_hash", sig.alias("sig"))
            .group_by("rank", *rule.FAMILY, "call_hash")
            .agg(pl.col("sig").sort().str.join("\x1e").alias("call"))
        )
        return per_call.group_by("rank", *rule.FAMILY).agg(pl.col("call").sort()).sort("rank", *rule.FAMILY)

    a, b = collect_pair(calls(run_a), calls(run_b))

    def of(frame: pl.DataFrame, r: int) -> pl.DataFrame:
        return frame.filter(pl.col("rank") == r).drop("rank")

    return {r for r in pairs if of(a, r).equals(of(b, r))}


def _advance(todo: dict[int, list[int]], r: int) -> None:
    """Move rank ``r`` on to its next candidate step (dropping it after the last)."""
    todo[r].pop(0)
    if not todo[r]:
        del todo[r]
