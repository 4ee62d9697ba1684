"""``certify``: check one run's invariants before comparing it with anything.

A run that fails these checks can still be bisected, but its first divergence may be a
false root (a hazard, a pending collective) or may be missing (a truncated step, a
missing rank). Checks, each a pure function over the run's lazy scans and manifests:

* ``missing_rank``: a rank of 0..world_size-1 has no manifest;
* completeness (check ``completeness``): each gap between a launch's commit log and the files
  on disk, under its gap kind (``missing_shard``, ``row_mismatch``, ``uncommitted_window``,
  ``not_closed``, ``closed_incomplete``, ``missing_commit_log``, ``damaged_commit_log``,
  ``no_data``; see ``completeness.GAP_KINDS``);
* ``incomplete_step``: a step some rank captured lacks its step_begin or step_end event
  on another (or the same) rank: the capture was cut short or the rank did not run it;
* ``sequence``: seq not strictly increasing within (rank, segment) in a table's write order;
* ``pending_collective``, ``recompute_mismatch``, ``capture_error``, ``capture_disabled``,
  ``truncation``: the capture's own events of those types;
* ``uninitialized``, ``async_pending``, ``nonblocking_pending``, ``pointer_like``: hazard
  flags on records and hazard events (grouped per rank, step and module);
* ``digest_error``: records whose tensor could not be digested (status error);
* ``replica_split``: data-parallel replicas (ranks that must hold bitwise equal parameters after
  every optimizer step) stopped agreeing: the first step and parameter, and which ranks split
  off (``replicas.py``);
* ``reduction_not_captured``, ``setting_changed``: capture events (a gradient reduction capture
  could not record, a determinism setting changed between steps). A reduction is missing only
  where ranks replicate each other: on a run whose ranks hold different parameters (pipeline
  stages, tensor-parallel shards; ``replicas.replicated``) the event is not a problem, unless it
  names the data-parallel group whose reduction capture did not see (a 2-D mesh: the step's tp
  reductions were seen, its dp reduction was not; the problem's module names the group);
* ``step_sums``: a launch's commit lines state step folds (``io.stepsums``) that differ from
  the fold of its records, rollups or metrics shards (replaced or rewritten after their commit, or
  a faulty writer): the bisect decides which steps differ from those folds, so it could miss a
  difference there (and refuses records it reads that differ from them, ``io.binding``);
* ``partial_step`` (a note, not a problem): a trailing step without an optimizer step;
* ``determinism``: the manifest's determinism settings (deterministic algorithms off or
  warn-only, cuDNN benchmark on, and on CUDA: cuDNN deterministic off, CUBLAS_WORKSPACE_CONFIG
  unset or not :4096:8 / :16:8). A setting equal on every rank is reported once (rank null).

Problems are sorted (kind, rank, step, module, detail), so the JSON is byte-stable. Notes are
facts about the run worth knowing that do not make it fail (``NOTE_KINDS``), sorted the same way.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import polars as pl

from detfp_analyze.io import stepsums as _stepsums
from detfp_analyze.io.reader import Run, open_run
from detfp_analyze.ranks import format_ranks
from detfp_analyze.single.replicas import replica_splits, replicated
from detfp_format import contract

__all__ = ["NOTE_KINDS", "CertifyResult", "Problem", "certify"]

#: Kinds reported as notes: true of healthy runs, so they never make certify fail. A trailing
#: forward without an optimizer step (an evaluation at the end, a Trainer's end-of-training
#: gathers) is how most training scripts end (bisect compares it like any step both runs hold),
#: and a CI gate that failed on it would fail on every such run.
NOTE_KINDS = frozenset({"partial_step"})

#: Event types reported one problem per event, under their own name.
_EVENT_KINDS = (
    "pending_collective",
    "recompute_mismatch",
    "capture_error",
    "capture_disabled",
    "truncation",
    "reduction_not_captured",
    "setting_changed",
    "partial_step",
)
#: What an event of these types means, before its own detail.
_EVENT_PREFIX = {
    "reduction_not_captured": "gradient reduction not captured: ",
    "setting_changed": "a determinism setting changed during the run ",
    "partial_step": "",
}
#: Tables whose seq must be strictly increasing within (rank, segment) in write order. Kernels and
#: dumps are excluded: several kernel rows (or a dump and its record) may share one op's seq.
_SEQ_TABLES = ("records", "metrics", "events")
_CUBLAS_OK = (":4096:8", ":16:8")
#: In-place ops that overwrite every element of args[0] without reading it: a hazard flag on that
#: input (e.g. dropout's empty_like buffer handed to bernoulli_) describes memory nobody reads.
_OVERWRITING = r"^aten::(bernoulli|fill|zero|copy|uniform|normal|random|exponential|geometric|log_normal|cauchy)_\."


@dataclass(frozen=True)
class Problem:
    """One violated invariant."""

    #: What is wrong: a hazard name or one of the check names in the module docstring.
    kind: str
    #: Rank concerned, None when it concerns the whole run.
    rank: int | None
    #: Step concerned, None when not tied to a step.
    step: int | None
    #: Module path concerned, None when not tied to a module.
    module: str | None
    #: One line for humans: what was seen and, where useful, the fix.
    detail: str

    def sort_key(self) -> tuple:
        return (
            self.kind,
            -1 if self.rank is None else self.rank,
            -1 if self.step is None else self.step,
            self.module or "",
            self.detail,
        )

    def to_json_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "rank": self.rank, "step": self.step, "module": self.module, "detail": self.detail}


@dataclass(frozen=True)
class CertifyResult:
    """The outcome of ``certify``."""

    #: The run as the user named it.
    label: str
    #: "ok" or "problems".
    status: str
    #: Every problem found, sorted.
    problems: tuple[Problem, ...]
    #: Ranks and steps that were checked (for the human summary).
    ranks: int
    steps: int
    #: Findings of the kinds in ``NOTE_KINDS``, sorted: reported, never a reason to fail.
    notes: tuple[Problem, ...] = ()

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_json_dict(self) -> dict[str, Any]:
        """The documented ``--json`` object (docs/certify.md)."""
        return {
            "status": self.status,
            "problems": [p.to_json_dict() for p in self.problems],
            "notes": [p.to_json_dict() for p in self.notes],
        }


# ----------------------------------------------------------------------------- checks


def _missing_ranks(run: Run) -> list[Problem]:
    return [
        Problem("missing_rank", r, None, None, f"no manifest for rank {r} of world size {run.world_size}")
        for r in run.missing_ranks
    ]


def _completeness(run: Run) -> list[Problem]:
    comp = run.completeness
    if comp is None:
        return []
    out = []
    for g in comp.gaps:
        where = ", ".join(
            p
            for p in (
                f"segment {g.segment}",
                g.table and f"table {g.table}",
                g.window is not None and f"window {g.window}",
            )
            if p
        )
        steps = g.steps()
        out.append(
            Problem(g.kind, g.rank, g.first_step, None, f"{where}: {g.detail}" + (f" ({steps})" if steps else ""))
        )
    return out


def _step_sums(run: Run) -> list[Problem]:
    return [
        Problem("step_sums", r, s, None, f"the commit lines' step fold of the {table} differs from the {table} "
                "shards (replaced or rewritten after their window was committed?): a bisect that reads them "
                "refuses them; restore the shard or re-run the capture")
        for r, s, table in _stepsums.mismatches(run)
    ]  # fmt: skip


def _steps_seen(run: Run) -> set[tuple[int, int]]:
    """Distinct (rank, step) with any record, metric or event (superseded rows excluded).

    Shards holding one step (the usual one flush window per step) answer from their footer
    statistics; a table with any multi-step or statistics-less shard is scanned instead.
    """
    cut = {(r, seg): first for r, seg, first in run.supersession()}
    seen: set[tuple[int, int]] = set()
    for table in ("records", "metrics", "events"):
        shards = run.shards.get(table, ())
        if all(sh.step_min is not None and sh.step_min == sh.step_max for sh in shards):
            seen.update(
                (sh.rank, sh.step_min)  # type: ignore[misc]
                for sh in shards
                if sh.num_rows and sh.step_min < cut.get((sh.rank, sh.segment), _INF)  # type: ignore[operator]
            )
        else:
            seen.update(run.scan(table).select("rank", "step").unique().collect().iter_rows())
    return seen


_INF = float("inf")


def _incomplete_steps(run: Run, events: pl.DataFrame) -> tuple[list[Problem], int]:
    steps = sorted({step for _, step in _steps_seen(run)})
    be = (
        events.filter(pl.col("type").is_in(["step_begin", "step_end"]))
        .group_by("rank", "step")
        .agg(
            pl.col("type").filter(pl.col("type") == "step_begin").len().alias("begin"),
            pl.col("type").filter(pl.col("type") == "step_end").len().alias("end"),
        )
    )
    have = {(r, s): (b, e) for r, s, b, e in be.select("rank", "step", "begin", "end").iter_rows()}
    out = []
    for rank in run.ranks:
        for step in steps:
            b, e = have.get((rank, step), (0, 0))
            if b and e:
                continue
            if not b and not e:
                detail = "no step_begin/step_end events: this rank did not capture a step other ranks captured"
            elif not e:
                detail = "step_begin without step_end: the capture stopped inside the step (crash, error or kill)"
            else:
                detail = "step_end without step_begin"
            out.append(Problem("incomplete_step", rank, step, None, detail))
    return out, len(steps)


def _sequence(run: Run) -> list[Problem]:
    out = []
    for table in _SEQ_TABLES:
        # Run.scan yields rows in file order (rank, then segment and window, then write order), so
        # each (rank, segment) is one contiguous run of rows: compare every row with the previous.
        same_stream = (pl.col("rank") == pl.col("rank").shift(1)) & (pl.col("segment") == pl.col("segment").shift(1))
        bad = (
            run.scan(table)
            .select("rank", "segment", "step", "seq")
            .with_columns(pl.col("seq").shift(1).alias("prev"), same_stream.alias("same"))
            .filter(pl.col("same") & (pl.col("seq") <= pl.col("prev")))
            .group_by("rank", "segment")
            .agg(pl.len().alias("n"), pl.col("step").first(), pl.col("prev").first(), pl.col("seq").first())
            .collect()
        )
        for r in bad.sort("rank", "segment").iter_rows(named=True):
            out.append(
                Problem(
                    "sequence",
                    r["rank"],
                    r["step"],
                    None,
                    f"{table}: seq {r['seq']} follows {r['prev']} in segment {r['segment']} "
                    f"({r['n']} violation(s)); seq must strictly increase within (rank, segment)",
                )
            )
    return out


def _event_problems(run: Run, events: pl.DataFrame) -> list[Problem]:
    out = []
    rows = events.filter(pl.col("type").is_in(_EVENT_KINDS)).sort("rank", "step", "seq")
    # An event that names no group: whether the job is data parallel at all is decided here.
    unseen = rows.filter((pl.col("type") == "reduction_not_captured") & (pl.col("name").fill_null("") == ""))
    if unseen.height and replicated(run.scan("records"), {r: run.manifest(r) for r in run.ranks}) is False:
        # No rank replicates another (pipeline stages, tensor-parallel shards): there is no data
        # parallelism whose gradient reduction capture could have missed. An event naming a
        # data-parallel group stays: the capture knew that layout (FSDP2 shards its parameters
        # over dp, so no two ranks hold the same ones there either).
        rows = rows.filter(~((pl.col("type") == "reduction_not_captured") & (pl.col("name").fill_null("") == "")))
    for r in rows.iter_rows(named=True):
        what = _EVENT_PREFIX.get(r["type"], "") + (r["detail"] or r["name"] or r["type"])
        if r["type"] == "pending_collective" and r["count"] is not None and not r["detail"]:
            what = f"{r['count']} async collective(s) not waited at step end ({r['name']})"
        out.append(Problem(r["type"], r["rank"], r["step"], r["module"] or None, what))
    return out


def _hazards(run: Run, events: pl.DataFrame) -> list[Problem]:
    flagged = (
        run.scan("records")
        .select("rank", "step", "seq", "module", "kind", "name", "role", "arg", "status", "hazards")
        .filter(pl.col("hazards").list.len() > 0)
        # Only digested records can be compared, hence be a false root; an overwritten input is never read.
        .filter(pl.col("status") == "ok")
        .filter(
            ~((pl.col("role") == "input") & (pl.col("arg") == "args[0]") & pl.col("name").str.contains(_OVERWRITING))
        )
        .explode("hazards")
        .group_by("hazards", "rank", "step", "module")
        .agg(pl.len().alias("n"), pl.all().sort_by("seq").first())
        .collect()
    )
    found: dict[tuple, list[str]] = {}
    for r in flagged.iter_rows(named=True):
        key = (r["hazards"], r["rank"], r["step"], r["module"])
        found.setdefault(key, []).append(
            f"{r['n']} record(s) flagged, first: {r['kind']} {r['name']} {r['arg']} (seq {r['seq']})"
        )
    ev = events.filter(pl.col("type") == "hazard").sort("rank", "step", "seq")
    counted: dict[tuple, list[str]] = {}
    for r in ev.iter_rows(named=True):
        counted.setdefault((r["name"], r["rank"], r["step"], r["module"]), []).append(r["detail"] or "")
    for key, details in counted.items():
        first = next((d for d in details if d), "")
        msg = f"{len(details)} hazard event(s)" + (f", first: {first}" if first else "")
        found.setdefault(key, []).append(msg)
    out = []
    for (hazard, rank, step, module), parts in found.items():
        kind = hazard if hazard in contract.HAZARDS else "hazard"
        detail = "; ".join(parts) + ("" if kind != "hazard" else f" (unknown hazard {hazard!r})")
        out.append(Problem(kind, rank, step, module or None, detail))
    return out


def _digest_errors(run: Run) -> list[Problem]:
    errs = (
        run.scan("records")
        .filter(pl.col("status") == "error")
        .select("rank", "step", "seq", "module", "name", "arg", "error")
        .group_by("rank", "step")
        .agg(pl.len().alias("n"), pl.all().sort_by("seq").first())
        .collect()
    )
    return [
        Problem(
            "digest_error",
            r["rank"],
            r["step"],
            r["module"] or None,
            f"{r['n']} record(s) could not be digested, first: {r['name']} {r['arg']}: {r['error']}",
        )
        for r in errs.iter_rows(named=True)
    ]


def _replicas(run: Run) -> list[Problem]:
    manifests = {r: run.manifest(r) for r in run.ranks}
    out = []
    for sp in replica_splits(run.scan("records"), manifests):
        what = "parameter" if sp.kind == "param" else "reduced gradient"
        out.append(
            Problem(
                "replica_split",
                None,
                sp.step,
                None,
                f"data-parallel replicas (ranks {format_ranks(sp.group)}) split at step {sp.step}: {what} "
                f"{sp.name} differs on ranks {format_ranks(sp.split_ranks)} (equal at step {sp.agreed_step}); "
                f"{sp.differing} record(s) of the group differ at that step",
            )
        )
    return out


def _on_cuda(m: dict) -> bool:
    host = m.get("host") or {}
    versions = m.get("versions") or {}
    return bool(host.get("device_count")) and versions.get("cuda") is not None


def _determinism_one(m: dict) -> list[str]:
    """Determinism problems of one manifest, as detail strings."""
    d = m.get("determinism") or {}
    env = m.get("env") or {}
    out = []
    if d.get("deterministic_algorithms") is False:
        out.append("torch.use_deterministic_algorithms is off; call torch.use_deterministic_algorithms(True)")
    elif d.get("deterministic_algorithms") and d.get("deterministic_warn_only") is True:
        out.append("deterministic algorithms are warn-only: nondeterministic ops still run; pass warn_only=False")
    if d.get("cudnn_benchmark") is True:
        out.append("torch.backends.cudnn.benchmark is on (autotuned algorithm choice); set it to False")
    if _on_cuda(m):
        if d.get("cudnn_deterministic") is False:
            out.append("torch.backends.cudnn.deterministic is off; set it to True")
        ws = env.get("CUBLAS_WORKSPACE_CONFIG")
        if ws is None:
            out.append("CUBLAS_WORKSPACE_CONFIG is unset on CUDA; export CUBLAS_WORKSPACE_CONFIG=:4096:8")
        elif ws not in _CUBLAS_OK:
            out.append(f"CUBLAS_WORKSPACE_CONFIG={ws} is not a deterministic setting; use :4096:8 or :16:8")
    return out


def _determinism(run: Run) -> list[Problem]:
    per_rank = {r: _determinism_one(run.manifest(r)) for r in run.ranks}
    everywhere = set.intersection(*(set(v) for v in per_rank.values())) if per_rank else set()
    # rank None says "every rank"; the text renderers print it (saying it in detail too doubled it).
    out = [Problem("determinism", None, None, None, d) for d in sorted(everywhere)]
    for rank, details in per_rank.items():
        out += [Problem("determinism", rank, None, None, d) for d in details if d not in everywhere]
    return out


# ----------------------------------------------------------------------------- facade


def certify(run: Run | str | os.PathLike[str], *, checks: Iterable[str] | None = None) -> CertifyResult:
    """Check a single run's invariants and return every problem found, sorted.

    ``run``: a Run or a run directory (opened with missing ranks tolerated, since a missing
    rank is one of the problems reported). ``checks``: restrict to some of ``CHECKS`` (default all).
    Raises the reader's typed errors when the directory is not a usable run at all.
    """
    # Missing ranks and incomplete launches are problems this reports, not reasons to refuse.
    r = run if isinstance(run, Run) else open_run(run, allow_missing_ranks=True, allow_incomplete=True)
    r = dataclasses.replace(r, excluded=MappingProxyType({}))  # check every committed row
    wanted = set(CHECKS if checks is None else checks)
    unknown = wanted - set(CHECKS)
    if unknown:
        raise ValueError(f"unknown certify check(s) {sorted(unknown)}; known: {', '.join(CHECKS)}")
    events = r.scan("events").collect()
    problems: list[Problem] = []
    nsteps = 0
    if "missing_rank" in wanted:
        problems += _missing_ranks(r)
    if "completeness" in wanted:
        problems += _completeness(r)
    if "incomplete_step" in wanted:
        found, nsteps = _incomplete_steps(r, events)
        problems += found
    if "sequence" in wanted:
        problems += _sequence(r)
    if "events" in wanted:
        problems += _event_problems(r, events)
    if "hazards" in wanted:
        problems += _hazards(r, events)
    if "digest_error" in wanted:
        problems += _digest_errors(r)
    if "determinism" in wanted:
        problems += _determinism(r)
    if "replicas" in wanted:
        problems += _replicas(r)
    if "step_sums" in wanted:
        problems += _step_sums(r)
    problems.sort(key=Problem.sort_key)
    notes = tuple(p for p in problems if p.kind in NOTE_KINDS)
    problems = [p for p in problems if p.kind not in NOTE_KINDS]
    status = "problems" if problems else "ok"
    return CertifyResult(r.label, status, tuple(problems), len(r.ranks), nsteps, notes)


#: Names accepted by ``certify(checks=...)``.
CHECKS = (
    "missing_rank",
    "completeness",
    "incomplete_step",
    "sequence",
    "events",
    "hazards",
    "digest_error",
    "determinism",
    "replicas",
    "step_sums",
)
