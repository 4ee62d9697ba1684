"""Result types of ``bisect``: frozen dataclasses and their versioned JSON form.

Everything a report needs is here, computed once by the pipeline; the text renderer
(``report.py``) and ``--json`` both read these objects and nothing else. ``to_json_dict``
returns plain JSON values with a fixed key set (documented in docs/report.md), so two
invocations on the same inputs print the same bytes. Bump ``REPORT_VERSION`` whenever a
field is added, renamed, removed or changes meaning (the vocabularies of ``vocab`` are part of
it; they are also importable from here, where the report names them).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from detfp_analyze import _gcpause
from detfp_analyze.bisect.discriminator import Discriminator
from detfp_analyze.bisect.vocab import (
    CAUSES,
    DIFF_KINDS,
    LEVELS,
    PATTERNS,
    STATUSES,
    VERDICTS,
    Status,
    Verdict,
    check_cause,
    check_diff_kind,
    check_pattern,
    check_status,
    check_verdict,
)
from detfp_analyze.io.envdiff import EnvDiff

__all__ = [
    "CAUSES", "DIFF_KINDS", "LEVELS", "PATTERNS", "REPORT_VERSION", "STATUSES", "VERDICTS", "BisectResult", "Capture",
    "Component", "Diagnosis", "Divergence", "Ending", "Kernels", "RankResult", "ResumeInfo",
    "ValueDiff", "Window", "check_cause", "check_pattern", "check_status", "check_verdict",
]  # fmt: skip

#: Version of the JSON report (``report_version``). 2: ``status`` "rng_only", the diagnosis's
#: ``cause``/``headline``/``next_steps``, a rank's ``hazard_confirmed``, the window's ``capture_*``,
#: the resume's ``step_offset``, the pattern ``all_ranks_same_source``; a divergence names the parts
#: of a tensor subclass (``Divergence.component``/``components``, ``ValueDiff.component``).
#: 3: ``status`` "ended_early" and the report's ``endings``; the difference kinds ``dtype``,
#: ``shape`` and ``layout`` with ``ValueDiff.dtype_a``/``dtype_b``/``shape_a``/``shape_b``; the
#: pattern ``control_flow``; the causes ``dtype``, ``shape`` and ``layout``; the record kind ``state``;
#: a divergence at a kernel torch.compile generated names the ATen ops it fused (``Divergence.fused``).
REPORT_VERSION = 3
#: Types a sequence of which is already plain JSON (a group's members: a report names every rank's).
_SCALARS = frozenset({int, str, float, bool, type(None)})


def _json(x: Any) -> Any:
    """Plain JSON values: nested results as their JSON, tuples as lists, dicts sorted by key."""
    if hasattr(x, "to_json_dict"):
        return x.to_json_dict()
    if isinstance(x, (tuple, list)):
        if _SCALARS.issuperset(map(type, x)):
            return list(x)
        return [_json(v) for v in x]
    if isinstance(x, dict):
        return {k: _json(v) for k, v in sorted(x.items())}
    return x


def _fields_json(obj: Any) -> dict[str, Any]:
    """Every field of a result dataclass as JSON, under its own name."""
    return {f.name: _json(getattr(obj, f.name)) for f in fields(obj)}


@dataclass(frozen=True)
class Kernels:
    """Kernels launched under the divergent op on both sides (kernels table, joined by call_hash)."""

    #: Kernel names in launch order under the call in run A.
    a: tuple[str, ...]
    #: Kernel names in launch order under the call in run B.
    b: tuple[str, ...]

    @property
    def same(self) -> bool:
        """True: same kernels, different result (inside the kernel); False: a different kernel was selected."""
        return self.a == self.b

    def to_json_dict(self) -> dict[str, Any]:
        return {"a": list(self.a), "b": list(self.b), "same": self.same}


@dataclass(frozen=True)
class ValueDiff:
    """What kind of difference one divergent record shows, and how big it is."""

    #: One of DIFF_KINDS.
    kind: str
    #: "bytes" when dumps of both sides were compared byte for byte, else "fingerprint".
    confirmed: str = "fingerprint"
    #: Moments (float64 sum and max |x|) of both sides, when captured.
    sum_a: float | None = None
    sum_b: float | None = None
    #: |sum_a - sum_b|.
    abs_dsum: float | None = None
    absmax_a: float | None = None
    absmax_b: float | None = None
    #: absmax_b - absmax_a.
    d_absmax: float | None = None
    #: From dumps: number of elements, of differing elements, the first differing flat index,
    #: the largest distance in units in the last place, and whether every difference is +-1 ULP
    #: (the signature of float atomics accumulating in a different order).
    numel: int | None = None
    n_differing: int | None = None
    first_index: int | None = None
    max_ulp: int | None = None
    all_one_ulp: bool | None = None
    #: From row digests: number of rows whose digest differs position by position.
    rows_differing: int | None = None
    #: Non-tensor argument digests of the call on both sides (kind "arguments").
    args_a: str | None = None
    args_b: str | None = None
    #: The arguments that differ, by value where the runs recorded their text
    #: (``"weight_decay 0.01 -> 0.02"``); empty when no text was recorded.
    args_changes: tuple[str, ...] = ()
    #: The part of a tensor subclass whose values these are (``"scale"``), None for a whole tensor.
    component: str | None = None
    #: The record's dtype and shape on each side (kinds ``dtype`` and ``shape`` name what changed).
    dtype_a: str | None = None
    dtype_b: str | None = None
    shape_a: tuple[int, ...] | None = None
    shape_b: tuple[int, ...] | None = None
    #: One line for humans.
    detail: str = ""

    def to_json_dict(self) -> dict[str, Any]:
        return _fields_json(self)


@dataclass(frozen=True)
class Component:
    """One part of a tensor subclass, next to a divergent record of that subclass."""

    #: Its path below the whole: ``scale``, ``qdata``; nested subclasses ``_local_tensor::scale``.
    name: str
    #: How its records compare (``rule.STATES``: same, differs, only_a, only_b, unknown, ...).
    state: str

    def to_json_dict(self) -> dict[str, Any]:
        return _fields_json(self)


@dataclass(frozen=True)
class Divergence:
    """One divergent record on one rank, with its verdict."""

    #: Absolute training step.
    step: int
    #: Call-site key of the record.
    microbatch: int
    phase: str
    #: Innermost module path at the call ('' outside any module).
    module: str
    #: Record kind (contract.KINDS): op, collective, param, ...
    kind: str
    #: Op overload / collective / parameter name.
    op: str
    occurrence: int
    role: str
    arg: str
    #: "both", "a_only" or "b_only": on which side the record exists.
    presence: str
    #: One of VERDICTS.
    verdict: str
    #: One of DIFF_KINDS.
    diff_kind: str
    #: Hazard flags on the record or on the inputs of its call (likely false root when non-empty).
    hazards: tuple[str, ...]
    #: The record's seq on each side (that rank's own order; never comparable across ranks or runs).
    seq_a: int | None
    seq_b: int | None
    dtype: str | None = None
    shape: tuple[int, ...] | None = None
    #: For unobserved_producer: the call that consumed the already-different input.
    consumer: str | None = None
    #: Set when the divergence sits on a view/metadata op, which cannot create a difference.
    contradiction: str | None = None
    #: The call just before this one in the rank's order ("one hop upstream").
    upstream: str | None = None
    #: For collectives: the group name, its ranks, and the peers whose inputs differed.
    group: str | None = None
    group_ranks: tuple[int, ...] = ()
    peers_differing: tuple[int, ...] = ()
    #: Kernels under the call on both sides (level "kernel", when captured on both sides).
    kernels: Kernels | None = None
    #: Kind and magnitude of the difference.
    diff: ValueDiff | None = None
    #: One line explaining the verdict.
    explanation: str = ""
    #: One line: what this difference depends on that the capture could not see (an uncaptured
    #: reduction, a write-only argument, a compiled region, ...) and what to capture next.
    depends_on: str | None = None
    #: For a part of a tensor subclass (``arg`` ``<whole>::<component>``, trace-format "Tensor
    #: subclasses"): its component path, ``scale``; None otherwise.
    component: str | None = None
    #: For a part of a tensor subclass, or for the whole when its parts were recorded: every
    #: innermost part of that whole, in record order, with how it compares.
    components: tuple[Component, ...] = ()
    #: For a kernel torch.compile generated (kind ``kernel``): the ATen ops it fused, as its
    #: name lists them (``('add', 'native_layer_norm')``); empty otherwise.
    fused: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check_verdict(self.verdict)
        check_diff_kind(self.diff_kind)

    @property
    def where(self) -> str:
        """``phase module kind:name`` for humans."""
        return f"{self.phase} {self.module or '<root>'} {self.op}"

    def to_json_dict(self) -> dict[str, Any]:
        return _fields_json(self)


@dataclass(frozen=True)
class RankResult:
    """One rank's outcome."""

    rank: int
    #: "identical" or "diverged".
    status: str
    #: First step with any difference on this rank (records or metrics), None when identical.
    step: int | None
    #: First step whose metrics differ bitwise, the metric and both values.
    metric_step: int | None = None
    metric_name: str | None = None
    metric_a: float | None = None
    metric_b: float | None = None
    #: First step with a differing record.
    record_step: int | None = None
    #: The first divergent record (None when only metrics differ or identical).
    first: Divergence | None = None
    #: When ``first`` carries hazards (likely false root): the next divergence free of hazards.
    next_clean: Divergence | None = None
    #: The hazard on ``first`` is the cause, not a false root: an uninitialized read both runs
    #: make there, whose difference the next divergence only carries on (``cause.confirm_hazards``).
    hazard_confirmed: bool = False

    @property
    def verdict(self) -> str | None:
        """The verdict of ``first``, or metric_only, or None when identical."""
        if self.first is not None:
            return self.first.verdict
        # A differing record step without a walked record (level "step") has no verdict yet.
        return Verdict.METRIC_ONLY if self.status == Status.DIVERGED and self.record_step is None else None

    @property
    def effective(self) -> Divergence | None:
        """The divergence the diagnosis uses: past a likely false root when there is a clean one."""
        if self.first is not None and self.first.hazards and self.next_clean is not None and not self.hazard_confirmed:
            return self.next_clean
        return self.first

    def to_json_dict(self) -> dict[str, Any]:
        f = self.first
        return {
            "rank": self.rank,
            "status": self.status,
            "step": self.step,
            "phase": f.phase if f else None,
            "module": f.module if f else None,
            "op": f.op if f else None,
            "verdict": self.verdict,
            "kind": f.kind if f else None,
            "hazards": list(f.hazards) if f else [],
            "likely_false_root": bool(f and f.hazards) and not self.hazard_confirmed,
            "hazard_confirmed": self.hazard_confirmed,
            "seq_a": f.seq_a if f else None,
            "seq_b": f.seq_b if f else None,
            "kernels": f.kernels.to_json_dict() if f and f.kernels else None,
            "metric_step": self.metric_step,
            "metric_name": self.metric_name,
            "metric_a": self.metric_a,
            "metric_b": self.metric_b,
            "record_step": self.record_step,
            "first": f.to_json_dict() if f else None,
            "next_clean": self.next_clean.to_json_dict() if self.next_clean else None,
        }


@dataclass(frozen=True)
class Diagnosis:
    """The cross-rank pattern, and the most likely cause weighed from all the evidence."""

    #: One of PATTERNS.
    pattern: str
    #: Ranks where the difference started locally (verdict origin or source), sorted.
    origin_ranks: tuple[int, ...]
    #: One paragraph for humans: the headline first, then what the pattern says.
    explanation: str
    #: The op shared by the origin ranks (all_ranks_same_op), else the lowest origin rank's op.
    op: str | None = None
    #: Parallel coordinates (manifest ``parallel``) all origin ranks share, e.g. {"pp": 3}.
    shared_coordinates: dict[str, Any] = field(default_factory=dict)
    #: verdict -> number of diverged ranks with it (effective divergences).
    verdict_counts: dict[str, int] = field(default_factory=dict)
    #: One of CAUSES: the most likely cause, from every piece of evidence the result holds.
    cause: str = "none"
    #: One sentence naming that cause (the first sentence of ``explanation``).
    headline: str = ""
    #: What to do next, chosen for the cause, most useful first.
    next_steps: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check_pattern(self.pattern)
        check_cause(self.cause)
        for v in self.verdict_counts:
            check_verdict(v)

    def to_json_dict(self) -> dict[str, Any]:
        return _fields_json(self)


@dataclass(frozen=True)
class Capture:
    """How one run was captured (its lowest compared rank's manifest)."""

    #: Capture level (``metrics``, ``boundaries``, ``ops``), None when the manifest does not say.
    level: str | None
    #: ``launcher`` (``python -m detfp_capture``) or ``session`` (a script opening its own Session).
    form: str

    def to_json_dict(self) -> dict[str, Any]:
        return _fields_json(self)


@dataclass(frozen=True)
class Window:
    """What was compared."""

    #: Inclusive step range compared, or None when the runs share no step.
    steps: tuple[int, int] | None
    #: Inclusive step ranges present in each run.
    steps_a: tuple[int, int] | None
    steps_b: tuple[int, int] | None
    #: Ranks compared.
    ranks: tuple[int, ...]
    #: Ranks missing in each run (tolerated with allow_missing_ranks).
    missing_ranks_a: tuple[int, ...] = ()
    missing_ranks_b: tuple[int, ...] = ()
    #: Ranks present in only one run (not compared).
    one_sided_ranks: tuple[int, ...] = ()
    #: The narrowing depth (LEVELS): how deep bisect looked, not what was captured.
    level: str = "op"
    #: How each run was captured (None when unknown).
    capture_a: Capture | None = None
    capture_b: Capture | None = None

    def to_json_dict(self) -> dict[str, Any]:
        return _fields_json(self)


@dataclass(frozen=True)
class ResumeInfo:
    """Alignment of a resumed run with an uninterrupted one."""

    #: True when the runs start at different steps.
    resumed: bool
    #: First captured step of each run.
    start_a: int | None
    start_b: int | None
    #: First step both runs captured (the resume boundary when resumed).
    first_common_step: int | None
    #: Boundary-state records (param, optimizer_state, rng_state) at the first common step:
    #: how many were compared and how many differ, over all compared ranks.
    boundary_compared: int = 0
    boundary_differing: int = 0
    #: One line for humans.
    note: str = ""
    #: When B's steps line up with A's shifted (a resume numbered from 0): B's step s holds the
    #: state of A's step s + step_offset (``clues.step_offset``); None otherwise.
    step_offset: int | None = None

    def to_json_dict(self) -> dict[str, Any]:
        return _fields_json(self)


@dataclass(frozen=True)
class Ending:
    """A run that ended before the other: its last step did not finish, or its capture is incomplete."""

    #: "A" or "B".
    side: str
    #: The step it ended in (its records stop there, or are not held from there on).
    step: int
    #: Ranks it ended on, sorted.
    ranks: tuple[int, ...]
    #: Why, as the capture said it ("step 3 raised RuntimeError: ...", "the capture closed incomplete: ...").
    reason: str

    def to_json_dict(self) -> dict[str, Any]:
        return {"run": self.side, "step": self.step, "ranks": list(self.ranks), "reason": self.reason}


@dataclass(frozen=True)
class BisectResult:
    """Everything ``bisect`` found. ``to_json_dict`` is the documented ``--json`` object."""

    #: The runs as the user named them.
    label_a: str
    label_b: str
    #: One of STATUSES.
    status: str
    #: Manifest differences (EnvDiff), sorted.
    env_diff: tuple[EnvDiff, ...]
    #: Lowest first divergent step over all ranks, None when identical.
    first_step: int | None
    #: One entry per compared rank, sorted by rank.
    ranks: tuple[RankResult, ...]
    diagnosis: Diagnosis
    #: Kind and magnitude of the difference at the representative origin (lowest origin rank,
    #: else the lowest diverged rank), and that rank.
    diff: ValueDiff | None
    diff_rank: int | None
    window: Window
    resume: ResumeInfo
    discriminator: Discriminator | None
    #: Extra facts for humans (tolerated problems, capture hints), sorted.
    notes: tuple[str, ...] = ()
    #: False when a run was opened with allow_incomplete and held less than its commit logs
    #: promise: only the steps both runs hold completely were compared (the rest is in notes).
    complete: bool = True
    #: Runs that ended before the other (a step that raised, a capture that never closed), by
    #: run, step and reason: status ``ended_early`` when nothing both hold differs.
    endings: tuple[Ending, ...] = ()

    def __post_init__(self) -> None:
        check_status(self.status)

    def __repr__(self) -> str:
        # Short on purpose: a result of thousands of ranks would print all of them.
        return (
            f"BisectResult({self.label_a!r} vs {self.label_b!r}: {self.status}, first step {self.first_step}, "
            f"pattern {self.diagnosis.pattern}, {len(self.ranks)} rank(s))"
        )

    @property
    def diverged(self) -> bool:
        """Not a pass: values differ (``diverged``), only an RNG state does (``rng_only``), or a run
        ended before the other (``ended_early``)."""
        return self.status != Status.IDENTICAL

    def rank(self, rank: int) -> RankResult:
        """The result of one rank (KeyError when it was not compared)."""
        for r in self.ranks:
            if r.rank == rank:
                return r
        raise KeyError(rank)

    def to_json_dict(self) -> dict[str, Any]:
        # Thousands of ranks' results as plain values, none in a cycle (_gcpause): at 2,432
        # diverged ranks the collector's passes took 1.0 of 1.1 s.
        with _gcpause.paused():
            return self._json_dict()

    def _json_dict(self) -> dict[str, Any]:
        diff = None
        if self.diff is not None:
            diff = {"rank": self.diff_rank, **self.diff.to_json_dict()}
        return {
            "report_version": REPORT_VERSION,
            "a": self.label_a,
            "b": self.label_b,
            "status": self.status,
            "env_diff": [d.to_json_dict() for d in self.env_diff],
            "first_step": self.first_step,
            "ranks": [r.to_json_dict() for r in self.ranks],
            "diagnosis": self.diagnosis.to_json_dict(),
            "diff": diff,
            "window": self.window.to_json_dict(),
            "resume": self.resume.to_json_dict(),
            "discriminator": None if self.discriminator is None else self.discriminator.to_json_dict(),
            "notes": list(self.notes),
            "complete": self.complete,
            "endings": [e.to_json_dict() for e in self.endings],
        }
