"""Golden-trace gates: expected divergences, loaded from a small allowlist and matched against bisect.

Pipeline: ``load_expectations`` (a TOML or JSON file -> validated ``Expectation`` tuple; every
problem is an ExpectationError naming the file, the entry and the fix) -> ``evaluate`` (a
``BisectResult`` and the expectations -> ``GateResult``: which expectations matched which ranks,
and whether any rank diverged in a way none of them expects) -> ``render_gate`` (text).

A rank's divergence is expected when one expectation matches its first divergent record, or,
when that record is a likely false root, the next clean one; a rank whose metrics alone differ
is matched by an expectation's ``metric``. An expectation's ``status`` matches the comparison's
outcome (``result.STATUSES``): ``status = "rng_only"`` alone expects every diverged rank as long
as only an RNG state differs and no value does; ``status = "ended_early"`` alone expects the ranks
of a run that ended before the other (its step is the step it ended in) when nothing both runs
hold differs. A run that ended early is otherwise unexpected: a gate never passes a run that died. Patterns are shell globs (``blocks.*.attn``,
``aten::index_add*``); ``steps`` and ``ranks`` are selectors (``"3-5,9"``, ``"10-"``, an int or a
list). bisect finds each rank's *first* divergence: a difference that starts after an expected
one on the same rank is hidden behind it, so a gate that expects a change at step 3 cannot see
a second, unexpected change from step 3 on; keep expectations narrow and golden traces fresh.
"""

from __future__ import annotations

import fnmatch
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from detfp_analyze.bisect.result import STATUSES, VERDICTS, BisectResult, Divergence, RankResult
from detfp_analyze.bisect.vocab import Status
from detfp_analyze.errors import ExpectationError
from detfp_analyze.ranks import format_ranks
from detfp_format import strictjson
from detfp_format.contract import KINDS, PHASES

__all__ = ["Expectation", "ExpectationMatch", "GateResult", "evaluate", "load_expectations", "render_gate"]

#: Fields matched by shell glob against a divergent record.
RECORD_FIELDS = ("module", "op", "kind", "phase", "verdict")
_FIELDS = frozenset((*RECORD_FIELDS, "metric", "status", "steps", "ranks", "reason"))
_KNOWN = {"kind": KINDS, "phase": PHASES, "verdict": VERDICTS, "status": STATUSES}
_GLOB = re.compile(r"[*?\[]")


@dataclass(frozen=True)
class Expectation:
    """One expected divergence of an allowlist."""

    #: 1-based position in the file (how reports name it).
    index: int
    #: Why this divergence is intended (a PR, a changed kernel, a new seed): shown in every report.
    reason: str
    #: Globs on the divergent record's module path ('' is the root), op (or record name), kind,
    #: phase and verdict; None matches anything.
    module: str | None = None
    op: str | None = None
    kind: str | None = None
    phase: str | None = None
    verdict: str | None = None
    #: Glob on the name of the first differing metric, for ranks whose metrics alone differ.
    metric: str | None = None
    #: Glob on the comparison's status (STATUSES): ``rng_only`` expects a difference of RNG state alone.
    status: str | None = None
    #: Step and rank selectors as written (``"3-5,9"``); None: any.
    steps: str | None = None
    ranks: str | None = None

    def pattern(self) -> dict[str, str]:
        """The fields given, for reports."""
        out = {f: getattr(self, f) for f in (*RECORD_FIELDS, "metric", "status", "steps", "ranks")}
        return {k: v for k, v in out.items() if v is not None}


@dataclass(frozen=True)
class ExpectationMatch:
    """An expectation and the ranks whose divergence it matched."""

    expectation: Expectation
    #: Ranks it matched, sorted (empty: the expected divergence did not happen, or happened later
    #: than another one on every rank).
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class GateResult:
    """The gate's decision over one bisect result."""

    #: "pass" (identical, or every diverged rank expected) or "fail".
    status: str
    #: The expectations file as the user named it.
    source: str
    #: Diverged ranks an expectation matched / that none matched, sorted.
    expected_ranks: tuple[int, ...]
    unexpected_ranks: tuple[int, ...]
    #: Every expectation in file order, with the ranks it matched.
    matches: tuple[ExpectationMatch, ...]
    #: The comparison's status was ``ended_early``: the ranks gated are those of the run that ended.
    ended_early: bool = False

    @property
    def passed(self) -> bool:
        return self.status == "pass"

    def to_json_dict(self) -> dict[str, Any]:
        """The ``gate`` object of ``bisect --expect --json`` (docs/report.md)."""
        return {
            "status": self.status,
            "file": self.source,
            "expected_ranks": list(self.expected_ranks),
            "unexpected_ranks": list(self.unexpected_ranks),
            "expectations": [
                {
                    "index": m.expectation.index,
                    "reason": m.expectation.reason,
                    "pattern": m.expectation.pattern(),
                    "matched": bool(m.ranks),
                    "ranks": list(m.ranks),
                }
                for m in self.matches
            ],
        }


# ----------------------------------------------------------------------------- loading
def _selector(value: Any, what: str) -> str:
    """A step/rank selector as text ("3-5,9", "10-"), checked."""
    if isinstance(value, bool):
        raise ValueError(f"{what}={value!r}")
    if isinstance(value, int):
        value = str(value)
    elif isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        value = ",".join(str(v) for v in value)
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{what}={value!r}")
    for part in value.split(","):
        if not re.fullmatch(r"\s*\d+\s*(-\s*\d*\s*)?", part):
            raise ValueError(f"{what}={value!r}")
    return value.strip()


def _in(selector: str | None, n: int | None) -> bool:
    if selector is None:
        return True
    if n is None:
        return False
    for part in selector.split(","):
        lo, sep, hi = (p.strip() for p in part.partition("-"))
        if (n == int(lo)) if not sep else (int(lo) <= n and (not hi or n <= int(hi))):
            return True
    return False


def _parse(path: Path, text: str) -> Any:
    if path.suffix.lower() == ".json":
        try:
            return strictjson.loads(text)
        except ValueError as exc:  # a JSONDecodeError, or a bare NaN (strict RFC 8259)
            raise ExpectationError(f"{path}: not valid JSON ({exc}); fix the syntax") from None
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        try:
            import tomli as tomllib
        except ImportError:
            raise ExpectationError(
                f"{path}: reading TOML on Python 3.10 needs tomli; install it with: pip install tomli "
                "(or write the file as JSON)"
            ) from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ExpectationError(f"{path}: not valid TOML ({exc}); fix the syntax, or name a .json file") from None


def load_expectations(path: str | Path) -> tuple[Expectation, ...]:
    """Read an expected-divergences file: TOML (``[[expect]]`` tables) or JSON (``{"expect": [...]}``
    or a bare list). Raises ExpectationError naming the file, the entry and the fix."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ExpectationError(f"{path}: cannot read the expectations file ({exc.strerror}); check the path") from None
    doc = _parse(p, text)
    entries = doc.get("expect") if isinstance(doc, dict) else doc
    if isinstance(doc, dict) and set(doc) - {"expect"}:
        extra = ", ".join(sorted(set(doc) - {"expect"}))
        raise ExpectationError(f"{path}: unknown top-level key(s) {extra}; put every entry under 'expect'")
    if not isinstance(entries, list):
        raise ExpectationError(
            f'{path}: no list of expectations; write [[expect]] tables (TOML) or {{"expect": [...]}}'
        )
    out = []
    for i, entry in enumerate(entries, start=1):
        where = f"{path}: expectation {i}"
        if not isinstance(entry, dict):
            raise ExpectationError(f"{where}: expected a table of fields, got {type(entry).__name__}")
        unknown = sorted(set(entry) - _FIELDS)
        if unknown:
            raise ExpectationError(f"{where}: unknown field(s) {', '.join(unknown)}; use {', '.join(sorted(_FIELDS))}")
        reason = entry.get("reason")
        if not isinstance(reason, str) or not reason.strip():
            raise ExpectationError(f'{where}: no reason; say why this divergence is intended (reason = "...")')
        fields: dict[str, Any] = {}
        for f in (*RECORD_FIELDS, "metric", "status"):
            v = entry.get(f)
            if v is None:
                continue
            if not isinstance(v, str):
                raise ExpectationError(f"{where}: {f} must be a string (a shell glob), got {v!r}")
            known = _KNOWN.get(f)
            if known is not None and not _GLOB.search(v) and v not in known:
                raise ExpectationError(f"{where}: {f}={v!r} is not one of {', '.join(known)}")
            fields[f] = v
        if not fields:
            raise ExpectationError(
                f"{where}: matches nothing in particular; give at least one of {', '.join(RECORD_FIELDS)}, metric, status"
            )
        for f in ("steps", "ranks"):
            if entry.get(f) is not None:
                try:
                    fields[f] = _selector(entry[f], f)
                except ValueError:
                    raise ExpectationError(
                        f'{where}: {f}={entry[f]!r} is not a selector; use e.g. "3-5,9", "10-", 4 or [3, 5]'
                    ) from None
        out.append(Expectation(index=i, reason=reason.strip(), **fields))
    return tuple(out)


# ----------------------------------------------------------------------------- matching
def _glob(value: str | None, pattern: str | None) -> bool:
    if pattern is None:
        return True
    return value is not None and fnmatch.fnmatchcase(value, pattern)


def _matches_record(e: Expectation, d: Divergence, rank: int) -> bool:
    if e.metric is not None and not any(getattr(e, f) is not None for f in RECORD_FIELDS):
        return False  # a metric-only expectation
    return (
        _in(e.steps, d.step) and _in(e.ranks, rank) and all(_glob(getattr(d, f), getattr(e, f)) for f in RECORD_FIELDS)
    )


def _matches_metric(e: Expectation, r: RankResult) -> bool:
    return (
        e.metric is not None and _in(e.steps, r.metric_step) and _in(e.ranks, r.rank) and _glob(r.metric_name, e.metric)
    )


def evaluate(result: BisectResult, expectations: Sequence[Expectation], source: str = "") -> GateResult:
    """Which expectations match which diverged ranks; the gate passes when none is left unmatched."""
    hits: dict[int, list[int]] = {e.index: [] for e in expectations}
    expected: list[int] = []
    unexpected: list[int] = []
    # A run that ended early (and nothing before its end differs): its ranks, at the step it ended in.
    ended = {}
    if result.status == Status.ENDED_EARLY:
        ended = {rank: e.step for e in sorted(result.endings, key=lambda x: -x.step) for rank in e.ranks}
    for r in result.ranks:
        if r.status != Status.DIVERGED and r.rank not in ended:
            continue
        records = [d for d in (r.first, r.next_clean if r.first is not None and r.first.hazards else None) if d]
        matched = False
        for e in expectations:
            if not _glob(result.status, e.status):
                continue
            if e.status is not None and e.metric is None and not any(getattr(e, f) is not None for f in RECORD_FIELDS):
                step = ended.get(r.rank, r.step)  # the status alone: every diverged (or ended) rank
                ok = _in(e.steps, step) and _in(e.ranks, r.rank)
            elif r.rank in ended:
                ok = False  # nothing differs there for a record or metric pattern to match
            else:
                ok = any(_matches_record(e, d, r.rank) for d in records) if records else _matches_metric(e, r)
            if ok:
                hits[e.index].append(r.rank)
                matched = True
        (expected if matched else unexpected).append(r.rank)
    return GateResult(
        status="fail" if unexpected else "pass",
        source=source,
        expected_ranks=tuple(expected),
        unexpected_ranks=tuple(unexpected),
        matches=tuple(ExpectationMatch(e, tuple(hits[e.index])) for e in expectations),
        ended_early=bool(ended),
    )


def render_gate(gate: GateResult) -> str:
    """The gate section of the text report (byte-stable)."""
    if gate.passed and not gate.expected_ranks:
        head = "gate: pass (no divergence)"
    elif gate.passed:
        what = "the early end expected" if gate.ended_early else "every divergence expected"
        head = f"gate: pass ({what}: ranks {format_ranks(list(gate.expected_ranks))})"
    else:
        what = "a run ended early" if gate.ended_early else "unexpected divergence"
        head = f"gate: FAIL ({what} on ranks {format_ranks(list(gate.unexpected_ranks))})"
    lines = [f"{head}; expectations from {gate.source}"]
    for m in gate.matches:
        e = m.expectation
        pat = " ".join(f"{k}={v}" for k, v in e.pattern().items())
        state = f"matched ranks {format_ranks(list(m.ranks))}" if m.ranks else "not matched"
        lines.append(f"  [{e.index}] {state}: {pat} -- {e.reason}")
    return "\n".join(lines) + "\n"
