"""The most likely cause of a divergence, weighed from every piece of evidence a bisect holds.

Pure functions over typed evidence (``Clues``, read by ``clues.py``) and the per-rank results;
nothing here reads a run. Two decisions per rank come first: ``trim_endings`` (a rank whose only
difference is that a run's records stop in the step it ended in is identical over what both
hold) and ``confirm_hazards`` (an uninitialized read both runs make at the first divergence,
whose difference the next one only carries, is the cause, not a false root). Then ``weigh``
ranks the causes, first match wins:

1. ``ended_early``: a run ended (a step that raised or never finished, an incomplete capture)
   and nothing before that end differs: "run B ended at step N", never a structural difference;
2. ``step_offset``: B's first step holds the state of a later step of A (a resume numbered
   from 0): the alignment is offered;
3. ``rng_state_only``: an RNG state differs and no value or metric does (status ``rng_only``);
4. ``setting``: a numerics-relevant setting differs and the first divergence is of the kind it
   changes (``settings.explains``);
5. ``uninitialized``: a confirmed uninitialized read;
6. ``control_flow`` by micro-batches: the step of the first difference ran the watched models
   forward another number of times (``ForwardCalls``: gradient accumulation 2 vs 4);
7. what the first divergence itself says (``advice.from_divergence``): ``argument``, ``data``,
   ``rng``, ``restore``, ``op``, ``collective``, ``rank_local``, ``control_flow``, ``uncaptured``.

The headline (the diagnosis's first sentence) names the cause; the next steps fit it; settings
that differ without explaining the divergence, and a run's end after it, are said after it.
The cause vocabulary is ``result.CAUSES``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from detfp_analyze.bisect import advice as _advice
from detfp_analyze.bisect.advice import Advice
from detfp_analyze.bisect.result import Capture, Diagnosis, Divergence, Ending, RankResult, check_cause
from detfp_analyze.bisect.settings import SETTING_GROUPS, Setting, explains
from detfp_analyze.bisect.vocab import Cause, DiffKind, Status, Verdict
from detfp_analyze.ranks import format_ranks

__all__ = ["Clues", "ForwardCalls", "HazardRead", "Offset", "confirm_hazards", "trim_endings", "weigh"]


@dataclass(frozen=True)
class Offset:
    """B's steps line up with A's shifted: B's step ``first_b`` holds the state of A's step ``first_b + shift``."""

    shift: int
    first_b: int
    #: The records that matched across the shift ("rng_state cpu", "batch CharGPT", ...).
    matched: tuple[str, ...]


@dataclass(frozen=True)
class HazardRead:
    """An uninitialized read at a rank's first divergent call, as both runs' hazard events say."""

    #: Steps at which run A / run B flagged that call's read (hazard events), sorted.
    steps_a: tuple[int, ...]
    steps_b: tuple[int, ...]
    #: The argument read (from the event, e.g. ``args[0]``), "" when not said.
    arg: str = ""


@dataclass(frozen=True)
class ForwardCalls:
    """How often the watched models ran forward in the step of a structural first divergence."""

    rank: int
    step: int
    #: Forward calls (``batch`` records: one per root forward) in that rank-step of run A / run B.
    a: int
    b: int
    #: Either run labels its micro-batches (``session.microbatch``): records align per micro-batch.
    labelled: bool


@dataclass(frozen=True)
class Clues:
    """Evidence beyond the per-rank results, for the weighing."""

    #: Numerics-relevant settings that differ (``settings.settings``).
    settings: tuple[Setting, ...] = ()
    #: Runs that ended early.
    endings: tuple[Ending, ...] = ()
    #: A step offset between the runs, when B's first step matches a later step of A.
    offset: Offset | None = None
    #: An RNG state differs and no value or metric does.
    rng_only: bool = False
    #: Steps compared (inclusive), None when none.
    window: tuple[int, int] | None = None
    #: How each run was captured.
    capture_a: Capture | None = None
    capture_b: Capture | None = None
    #: The step run B resumed at (the first common step of a resumed pair), None when not resumed.
    resume_step: int | None = None
    #: Forward calls in the step of the representative first difference (None when none diverged).
    calls: ForwardCalls | None = None


# ----------------------------------------------------------------------------- per-rank decisions
def confirm_hazards(ranks: Sequence[RankResult], reads: Mapping[int, HazardRead]) -> tuple[RankResult, ...]:
    """Ranks whose first divergence is an uninitialized read that is the cause, not a false root.

    A rank's hazard is confirmed when its first divergent record carries ``uninitialized``, both
    runs flagged that call's read at that step (``reads``: the program reads garbage there every
    time), and the garbage visibly flows on in that same step: the next clean divergence is an
    ``unobserved_producer`` of that step (a consumer whose input differs although nothing captured
    produced it: the read's output, through views), or there is none and the step's metrics
    differ. Everything else stays a likely false root: a clean origin or source of its own, a
    receiver (a peer started a difference), or a next divergence in a later step (the garbage
    matched again in between: FSDP's all-gather copy-in buffers, an e8m0 scale buffer)."""
    out = []
    for rr in ranks:
        f, read = rr.first, reads.get(rr.rank)
        if f is not None and "uninitialized" in f.hazards and read is not None:
            nxt = rr.next_clean
            both = f.step in read.steps_a and f.step in read.steps_b
            flows = (nxt is not None and nxt.step == f.step and nxt.verdict == Verdict.UNOBSERVED_PRODUCER) or (
                nxt is None and rr.metric_step == f.step
            )
            if both and flows:
                rr = dataclasses.replace(rr, hazard_confirmed=True, step=f.step, record_step=f.step)
        out.append(rr)
    return tuple(out)


def trim_endings(
    ranks: Sequence[RankResult], endings: Sequence[Ending]
) -> tuple[tuple[RankResult, ...], tuple[str, ...]]:
    """Ranks whose first divergence is only where a run ended: a record present in the other run
    alone, in the step that run ended in. Such a rank matched up to the end: it is identical over
    what both hold (a note says so), never a structural difference."""
    ended = {(e.side, r): e for e in endings for r in e.ranks}
    out, notes = [], []
    for rr in ranks:
        f = rr.first
        side = {"a_only": "B", "b_only": "A"}.get(f.presence if f is not None else "")
        e = ended.get((side, rr.rank)) if side else None
        if (
            f is not None
            and e is not None
            and f.verdict == Verdict.STRUCTURAL
            and f.step == e.step
            and rr.metric_step in (None, e.step)
        ):
            notes.append(
                f"rank {rr.rank}: run {e.side}'s records of step {e.step} stop before {f.op or f.kind} in "
                f"{f.module or '<root>'} ({e.reason}); every record before that matched"
            )
            rr = RankResult(rr.rank, Status.IDENTICAL, None)
        out.append(rr)
    return tuple(out), tuple(notes)


# ----------------------------------------------------------------------------- weighing
def _ended(clues: Clues, status: str, window: tuple[int, int] | None) -> Advice | None:
    if not clues.endings:
        return None
    e = min(clues.endings, key=lambda x: (x.step, x.side))
    if status not in (Status.IDENTICAL, Status.ENDED_EARLY):
        return None  # a value differs (a rank ended where the run did was trimmed already): that is the cause
    lo = window[0] if window else None
    held = (
        f"steps {lo}-{e.step - 1}, and step {e.step} up to where it stopped"
        if lo is not None and e.step > lo
        else f"step {e.step} up to where it stopped"
    )
    return Advice(
        Cause.ENDED_EARLY,
        f"Run {e.side} ended at step {e.step}: {e.reason}; what both runs hold before that ({held}) is bitwise identical.",
        (
            f"look at why run {e.side} stopped at step {e.step} (its log: the exception, a kill, a full disk)",
            f"to compare the rest, rerun {e.side} to the end and bisect again",
            *(
                ()
                if status == Status.IDENTICAL
                else (
                    "to accept the steps both runs hold (exit 0 when they match): bisect --allow-incomplete, or in a "
                    'gate an expectation with status = "ended_early" and a reason (docs/guards.md)',
                )
            ),
        ),
    )


def _offset(clues: Clues, d: Divergence | None) -> Advice | None:
    o = clues.offset
    if o is None or d is None or d.step != o.first_b:
        return None
    a0, b0 = o.first_b + o.shift, o.first_b
    launcher = clues.capture_b is not None and clues.capture_b.form == "launcher"
    how = f"--start-step {a0}" if launcher else f"session.step({a0} + i), or Session(..., start_step={a0})"
    return Advice(
        Cause.STEP_OFFSET,
        f"Run B's steps are numbered from {b0} but continue run A's: B's step {b0} starts from A's state at step {a0} "
        f"({', '.join(o.matched)} match), so B was resumed without its step numbering and each of its steps is "
        "compared with the wrong step of A.",
        (
            f"relaunch B numbering its steps from {a0} ({how}), then bisect A B again: the steps both hold are "
            "compared in line, the resume's restored state first",
        ),
    )


def _rng_only(clues: Clues, ranks: Sequence[RankResult], where: str) -> Advice | None:
    if not clues.rng_only:
        return None
    firsts = [r.first for r in ranks if r.status == Status.DIVERGED and r.first is not None]
    names = ", ".join(sorted({f"rng_state {f.op}" for f in firsts if f.op}))
    step = min(f.step for f in firsts)
    span = "" if clues.window is None else f" in steps {clues.window[0]}-{clues.window[1]}"
    return Advice(
        Cause.RNG_STATE_ONLY,
        f"Only the RNG state differs ({names} {where}, from step {step}): no value and no metric differs{span}, "
        "because nothing drew from that generator (dropout 0, no random op).",
        (
            "seed both runs the same way before the loop (the same torch.manual_seed calls, in the same order) if they "
            "should match: the first random op (dropout above 0, a random augmentation) makes them diverge",
            'a gate that accepts this difference says so: an expectation with status = "rng_only" (docs/guards.md)',
        ),
    )


def _setting(clues: Clues, d: Divergence | None, pattern: str, origin: Sequence[int], where: str) -> Advice | None:
    fits = [s for s in clues.settings if explains(s, d, pattern) and (s.rank is None or not origin or s.rank in origin)]
    if not fits:
        return None
    s = fits[0]
    unfit = [x for x in clues.settings if x not in fits]
    first = "" if d is None else f"; the first difference, {d.verdict} at {_advice.at(d)} {where}, is of that kind"
    change = None if d is None else _advice.type_change(d)
    if change:
        first += f" ({change})"
    return Advice(
        Cause.SETTING,
        f"{s.text} and most likely caused this: {SETTING_GROUPS[s.group][0]}{first}.",
        (
            f"rerun B with A's value ({s.key} = {s.text.rsplit('(', 1)[1].split(' -> ')[0]}) and bisect again: identical "
            "confirms the setting",
            "set it explicitly for both runs (in the script or the launch environment)",
        ),
        (
            *(f"also differs: {x.text}" for x in _once(fits[1:])),
            *(f"also differs, without explaining this difference: {x.text}" for x in _once(unfit)),
        ),
    )


def _uninitialized(ranks: Sequence[RankResult], reads: Mapping[int, HazardRead], compared: int) -> Advice | None:
    hit = [r for r in ranks if r.hazard_confirmed and r.first is not None]
    if not hit:
        return None
    d, read = hit[0].first, reads.get(hit[0].rank)
    assert d is not None  # filtered above
    arg = f" {read.arg}" if read is not None and read.arg else ""
    n = min(len(read.steps_a), len(read.steps_b)) if read is not None else 0
    every = f"in both runs, at each of {n} steps" if n > 1 else "in both runs"
    where = _advice.who([r.rank for r in hit], compared)
    return Advice(
        Cause.UNINITIALIZED,
        f"Uninitialized memory is read {where}: {d.op or d.kind} in {d.module or '<root>'} reads its input{arg} before "
        f"anything wrote it (a torch.empty* buffer), {every}, and its output is the first difference (step "
        f"{d.step}): the garbage differs between processes.",
        (
            "allocate that buffer with torch.zeros (or write every element before it is read)",
            "detfp-analyze certify on either run names every such read",
            "capture with poison=True (launcher: --poison) to make every read of fresh memory differ between runs",
        ),
    )


def _micro_batches(clues: Clues, d: Divergence | None, where: str) -> Advice | None:
    c = clues.calls
    if c is None or d is None or c.a == c.b or d.step != c.step or d.diff_kind == DiffKind.ARGUMENTS:
        return None
    return _advice.micro_batches(d, where, c.a, c.b, c.labelled)


def _once(settings: Sequence[Setting]) -> list[Setting]:
    """Each key once: a setting that differs on some ranks only is named with the ranks it differs on."""
    by: dict[str, list[Setting]] = {}
    for x in settings:
        by.setdefault(x.key, []).append(x)
    out = []
    for key, xs in by.items():
        if len(xs) == 1 or any(x.rank is None for x in xs):
            out.append(next((x for x in xs if x.rank is None), xs[0]))
        else:  # one entry per rank: the first one's values, on every rank that differs
            ranks = format_ranks(sorted(x.rank for x in xs if x.rank is not None))
            out.append(dataclasses.replace(xs[0], key=f"{key} [ranks {ranks}]", rank=None))
    return out


def weigh(
    diag: Diagnosis,
    ranks: Sequence[RankResult],
    clues: Clues,
    status: str,
    reads: Mapping[int, HazardRead] | None = None,
) -> Diagnosis:
    """``diag`` (the cross-rank pattern, ``diagnose``) with the most likely cause (the ranking of
    the module doc), its headline as the explanation's first sentence, and next steps fitting it."""
    compared = len(ranks)
    diverged = [r.rank for r in ranks if r.status == Status.DIVERGED]
    origin = list(diag.origin_ranks)
    rep = next((r for r in ranks if r.rank in origin and r.effective is not None), None)
    rep = rep or next((r for r in ranks if r.status == Status.DIVERGED and r.effective is not None), None)
    d = rep.effective if rep is not None else None
    where = _advice.who(origin or diverged, compared)
    if status in (Status.IDENTICAL, Status.ENDED_EARLY) and not clues.endings:
        v = Advice(Cause.NONE, "A and B are bitwise identical: every compared record and metric matched.")
    else:
        v = (
            _ended(clues, status, clues.window)
            or _offset(clues, d)
            or _rng_only(clues, ranks, where)
            or _setting(clues, d, diag.pattern, origin, where)
            or _uninitialized(ranks, reads or {}, compared)
            or _micro_batches(clues, d, where)
            or _advice.from_divergence(diag, d, where, compared, clues.capture_a, clues.resume_step)
        )
    check_cause(v.cause)
    if v.headline.startswith(("the ", "an ", "a ")):  # a sentence, not an op name (aten::...), starts capitalized
        v = dataclasses.replace(v, headline=v.headline[0].upper() + v.headline[1:])
    also = list(v.also)
    if v.cause == Cause.NONE or (v.cause == Cause.ENDED_EARLY and status != Status.DIVERGED):
        also += [f"a setting differs, and every value matched anyway: {s.text}" for s in _once(clues.settings)]
    elif v.cause != Cause.SETTING:
        also += [f"also differs, without explaining this difference: {s.text}" for s in _once(clues.settings)]
    if v.cause != Cause.ENDED_EARLY:
        also += [f"run {e.side} ended at step {e.step} ({e.reason})" for e in clues.endings]
    text = " ".join([v.headline, *(f"{a[:1].upper()}{a[1:]}." for a in also)])
    return dataclasses.replace(diag, cause=v.cause, headline=v.headline, explanation=text, next_steps=v.steps)
