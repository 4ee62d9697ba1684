"""Where and how run B of a synthetic pair departs from run A, and the answer a correct bisect gives.

``Plant`` says where (rank, step, record index, which ranks) and how (``HOWS``):

* ``values``: the record's digest differs on the origin ranks and every later record of theirs
  differs too (but batch and RNG state, which never depend on the model); from the first gradient
  all-reduce output after it, every rank differs (receivers);
* ``structural``: run B runs an extra call (``aten::clone.default``) right before the origin call;
* ``arguments``: the origin call's non-tensor arguments differ (``args_digest``), tensors equal;
* ``digest_error``: run B's digest of the record failed (status error): no evidence, identical;
* ``missing``: run B lacks every record of the origin call (control flow: one-sided records);
* ``rng``: run B's RNG state record of the step differs (a source).

Modifiers: ``hazard`` (the origin call carries a hazard flag in both runs: a likely false root,
the answer names the next clean divergence too), ``resume_at`` (run B is a resumed run holding
steps from there on) and ``missing_ranks`` (run B lacks these ranks entirely).
``plan`` turns a plant into per-rank edits (``RankPlan``) for ``synth``.
"""

from __future__ import annotations

from dataclasses import dataclass

from detfp_analyze.testing.template import _Template

__all__ = ["HOWS", "STABLE_KINDS", "Expected", "Plant", "RankPlan", "plan"]

#: How run B departs (see the module docstring).
HOWS = ("values", "structural", "arguments", "digest_error", "missing", "rng")
#: Kinds whose records never depend on the model state, so a divergence does not reach them.
STABLE_KINDS = frozenset({"batch", "rng_state"})


@dataclass(frozen=True)
class Plant:
    """Where and how run B departs from run A."""

    #: Rank of the origin (ignored when ``all_ranks`` is set).
    rank: int = 0
    #: Absolute step of the origin.
    step: int = 0
    #: Record index inside the rank-step template; snapped forward to the first digested
    #: output record at or after it (an origin is an output whose inputs matched).
    index: int = 0
    #: Further ranks with an origin at the same record (a rank subset).
    also_ranks: tuple[int, ...] = ()
    #: Every rank has its origin at the same record: the op itself is nondeterministic.
    all_ranks: bool = False
    #: One of HOWS.
    how: str = "values"
    #: The origin call carries a hazard flag (``uninitialized``) in both runs at the plant step.
    hazard: bool = False
    #: Run B is a resumed run: it holds steps from ``resume_at`` on (None: every step).
    resume_at: int | None = None
    #: Ranks run B lacks entirely (no manifest, no shard): open it with ``allow_missing_ranks``.
    missing_ranks: tuple[int, ...] = ()


@dataclass(frozen=True)
class Expected:
    """The first divergent record of one rank, as a correct bisect must report it."""

    #: Rank.
    rank: int
    #: Absolute step of the first divergent record.
    step: int
    #: Index of the record in A's rank-step template (for a structural plant: in B's stream).
    index: int
    #: seq of that record in run A (run B for a structural plant: the record exists only there).
    seq: int
    #: key_hash of the record.
    key_hash: int
    #: origin (inputs matched) | receiver (reached through the all-reduce) | structural | source.
    verdict: str
    #: Phase, module, kind and name of the record's call.
    phase: str
    module: str
    kind: str
    name: str


@dataclass(frozen=True)
class RankPlan:
    """What run B does differently on one rank."""

    #: (step, index) from which B's digests differ (the model-dependent records), or None.
    start: tuple[int, int] | None = None
    #: (step, index) before which B runs an extra call (structural), or None.
    insert_at: tuple[int, int] | None = None
    #: (step, record indexes) edited in place: arguments, digest error, dropped records, RNG state.
    edit: tuple[int, tuple[int, ...]] | None = None


def snap(tpl: _Template, index: int) -> int:
    """The first digested, model-dependent output record at or after ``index``."""
    n = len(tpl.kinds)
    for i in range(max(0, min(index, n - 1)), n):
        if tpl.digested[i] and tpl.is_output[i] and tpl.kinds[i] not in STABLE_KINDS:
            return i
    raise ValueError(f"plant index {index}: no digested output record at or after it in a step of {n}")


def origin_ranks(p: Plant, world: int) -> tuple[int, ...]:
    """The ranks where the plant starts a difference."""
    return tuple(range(world)) if p.all_ranks else tuple(sorted({p.rank, *p.also_ranks}))


def _call(tpl: _Template, i: int) -> tuple[int, ...]:
    start = tpl.call_start[i]
    return tuple(j for j in range(start, len(tpl.kinds)) if tpl.call_start[j] == start)


def plan(p: Plant, tpl: _Template, world: int, first_step: int, last_step: int) -> dict[int, RankPlan]:
    """rank -> RankPlan for ``p`` on a run of ``world`` ranks and steps first_step..last_step."""
    if p.how not in HOWS:
        raise ValueError(f"plant how={p.how!r} is not one of {', '.join(HOWS)}")
    if not first_step <= p.step <= last_step:
        raise ValueError(f"plant step {p.step} outside the run's steps {first_step}..{last_step}")
    if p.resume_at is not None and not first_step < p.resume_at <= p.step:
        raise ValueError(
            f"resume_at={p.resume_at}: a resumed run B starts after step {first_step}, at the plant or before"
        )
    for r in (p.rank, *p.also_ranks, *p.missing_ranks):
        if not 0 <= r < world:
            raise ValueError(f"plant rank {r} outside 0..{world - 1}")
    origin = snap(tpl, p.index)
    ranks = origin_ranks(p, world)
    if p.how == "structural":
        return {r: RankPlan(insert_at=(p.step, tpl.call_start[origin])) for r in ranks}
    if p.how in ("arguments", "missing"):
        return {r: RankPlan(edit=(p.step, _call(tpl, origin))) for r in ranks}
    if p.how == "digest_error":
        return {r: RankPlan(edit=(p.step, (origin,))) for r in ranks}
    if p.how == "rng":
        return {r: RankPlan(edit=(p.step, (tpl.kinds.index("rng_state"),))) for r in ranks}
    plans = {r: RankPlan(start=(p.step, origin)) for r in ranks}
    # The first gradient all-reduce output after the origin carries the difference to every rank.
    ar = tpl.allreduce_outputs
    later = [i for i in ar if i > origin]
    carrier = (p.step, later[0]) if later else ((p.step + 1, ar[0]) if ar and p.step < last_step else None)
    if carrier is not None:
        for r in range(world):
            plans.setdefault(r, RankPlan(start=carrier))
    return plans
