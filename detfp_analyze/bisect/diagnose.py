"""Cross-rank diagnosis: what the pattern of per-rank verdicts points to.

Input: per-rank results (each with its effective divergence: past a likely false root
when a clean divergence follows it) and the manifests' parallel coordinates. Output: one
pattern (result.PATTERNS):

* ``identical``: no rank differs.
* ``single_process``: one rank was compared (a single-process job, or ``--ranks`` picked one)
  and the difference started there: one process cannot tell a nondeterministic op from a
  cause local to it, so the report names the op and leaves the question open.
* ``all_ranks_same_op``: every compared rank (two or more) is an origin at the same op: the
  op or its kernel is nondeterministic (float atomics, split-K, tile scheduling).
* ``all_ranks_different_ops``: every rank is an origin, at different ops.
* ``single_rank`` / ``rank_subset``: the difference started on one or some ranks; the
  parallel coordinates those ranks share say where to look (topology, placement, input
  distribution, reduction order).
* ``control_flow``: every diverged rank's first difference is structural (a record on one
  side only, calls in another number or order): the runs made other calls, not other values.
* ``no_origin``: no rank is an origin or a source: only receivers, unobserved producers,
  metric-only divergences (or structural ones beside them), so the origin is outside the
  captured window, ranks or ops.

``origin_ranks`` are ranks whose difference started locally (verdict origin or source),
never ranks that only received it. ``op`` is an op's name only: a source is named by its
record in the explanation, never as an op.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from detfp_analyze.bisect.result import Diagnosis, Divergence, RankResult
from detfp_analyze.bisect.vocab import Pattern, Status, Verdict
from detfp_analyze.ranks import format_ranks

__all__ = ["diagnose", "shared_coordinates"]

_LOCAL = (Verdict.ORIGIN, Verdict.SOURCE)
#: Where to look when a difference enters at a record without inputs, by its kind.
_SOURCE_HINT = {
    "batch": "the data pipeline (sample order, augmentation, loader position, that rank's shard)",
    "rng_state": "the RNG state (seeding, or not restored on resume)",
    "param": "the restored or initialized parameters (checkpoint save/load, init seed)",
    "optimizer_state": "the restored optimizer state (checkpoint save/load of the inner state)",
    "grad": "gradients produced outside the capture",
    "probe": "the code feeding the probe, which the capture did not see",
    "state": "the state the run started from (initialization or checkpoint load of parameters, buffers, optimizer state)",
}
_COORDS = ("tp", "pp", "dp", "cp", "ep")


def _site(d: Divergence) -> str:
    """The op, or below --depth op the module (or phase) of a divergence, for messages and grouping."""
    if d.op is not None:
        return d.op
    return f"module {d.module or '<root>'}" if d.module is not None else f"phase {d.phase}"


def shared_coordinates(
    origin: Sequence[int], compared: Sequence[int], parallel: Mapping[int, Mapping[str, Any]]
) -> dict[str, Any]:
    """Parallel coordinates with one value on every origin rank that not all compared ranks share.

    A coordinate every compared rank shares (e.g. pp=0 when there is no pipeline) explains
    nothing, so it is left out.
    """
    out: dict[str, Any] = {}
    keys = sorted({k for r in origin for k in parallel.get(r, {}) if k in _COORDS or not k.endswith("_size")})
    for k in keys:
        vals = {repr(parallel.get(r, {}).get(k)) for r in origin}
        if len(vals) != 1 or parallel.get(origin[0], {}).get(k) is None:
            continue
        everyone = {repr(parallel.get(r, {}).get(k)) for r in compared}
        if len(everyone) > 1:
            out[k] = parallel[origin[0]][k]
    return out


def diagnose(results: Sequence[RankResult], parallel: Mapping[int, Mapping[str, Any]]) -> Diagnosis:
    """Classify the cross-rank pattern of ``results`` (one per compared rank)."""
    compared = sorted(r.rank for r in results)
    diverged = [r for r in results if r.status == Status.DIVERGED]
    if not diverged:
        return Diagnosis(Pattern.IDENTICAL, (), "every compared record and metric matched bit for bit")
    verdicts: Counter[str] = Counter()
    for r in diverged:
        eff = r.effective
        verdicts[eff.verdict if eff else Verdict.METRIC_ONLY] += 1
    origin = sorted(r.rank for r in diverged if r.effective is not None and r.effective.verdict in _LOCAL)
    counts = dict(verdicts)
    if not origin and set(verdicts) == {Verdict.STRUCTURAL}:
        return Diagnosis(
            Pattern.CONTROL_FLOW,
            (),
            f"every diverged rank's first difference is structural ({verdicts[Verdict.STRUCTURAL]} rank(s)): the runs "
            "made other calls (configuration, data-dependent branches, micro-batching), not other values",
            None,
            {},
            counts,
        )
    if not origin:
        parts = ", ".join(f"{n} {v}" for v, n in sorted(verdicts.items()))
        hint = []
        if verdicts.get(Verdict.UNOBSERVED_PRODUCER):
            hint.append("an uncaptured producer (capture probes around fused/extension ops)")
        if verdicts.get(Verdict.RECEIVER):
            hint.append("an untraced rank or a step before the window")
        if verdicts.get(Verdict.STRUCTURAL):
            hint.append("control flow (config or data)")
        if verdicts.get(Verdict.METRIC_ONLY):
            hint.append("ops outside the capture (widen the capture level)")
        return Diagnosis(
            Pattern.NO_ORIGIN,
            (),
            f"no rank started the difference locally ({parts}); look at " + "; ".join(hint),
            None,
            {},
            counts,
        )
    # Below --depth op a record has no op name: compare and name the deepest site reported.
    ops = {r.rank: (r.effective.kind, _site(r.effective)) for r in diverged if r.rank in origin and r.effective}
    first_op = ops[origin[0]][1]
    source = {r.rank for r in diverged if r.rank in origin and r.effective and r.effective.verdict == Verdict.SOURCE}
    # A source's record (a batch, an RNG state) is not an op: the explanation names it.
    op_name = (
        None if origin[0] in source else next(r.effective.op for r in diverged if r.rank == origin[0] and r.effective)
    )
    first_kind = ops[origin[0]][0]
    if len(compared) == 1:
        r0 = origin[0]
        if r0 in source:
            why = (
                f"the difference enters this process from outside the captured region at {first_kind} {first_op}: "
                f"{_SOURCE_HINT.get(first_kind, 'look at what feeds it')}"
            )
        else:
            why = f"the difference starts in this process at {first_kind} {first_op} with matching inputs"
        return Diagnosis(Pattern.SINGLE_PROCESS, (r0,), why, None if r0 in source else first_op, {}, counts)
    if origin == compared:
        if len(set(ops.values())) == 1:
            if source == set(origin):
                why = (
                    f"every compared rank ({len(compared)}) sees the difference enter from outside the captured "
                    f"region at {first_kind} {first_op}: {_SOURCE_HINT.get(first_kind, 'look at what feeds it')}"
                )
                return Diagnosis(Pattern.ALL_RANKS_SAME_SOURCE, tuple(origin), why, None, {}, counts)
            why = (
                f"every compared rank ({len(compared)}) starts the difference at {first_op} with matching inputs: "
                "the op or its kernel is nondeterministic (float atomics, split-K, tile scheduling)"
            )
            return Diagnosis(
                Pattern.ALL_RANKS_SAME_OP,
                tuple(origin),
                why,
                op_name,
                {},
                counts,
            )
        return Diagnosis(
            Pattern.ALL_RANKS_DIFFERENT_OPS,
            tuple(origin),
            f"every compared rank starts a difference locally, at {len(set(ops.values()))} different ops: "
            "look for a shared setting (environment, versions, thread counts) rather than one op",
            op_name,
            {},
            counts,
        )
    shared = shared_coordinates(origin, compared, parallel)
    coord = ", ".join(f"{k}={v}" for k, v in sorted(shared.items()))
    share = f"; they share {coord}" if coord else ""
    if len(origin) == 1:
        if origin[0] in source:
            why = (
                f"only rank {origin[0]} sees the difference enter from outside the captured region (at {first_kind} "
                f"{first_op}){share}: {_SOURCE_HINT.get(first_kind, 'look at what feeds it')}"
            )
        else:
            why = (
                f"only rank {origin[0]} starts the difference (at {first_op}){share}: look at that rank's input data, "
                "placement, topology or reduction order"
            )
        return Diagnosis(
            Pattern.SINGLE_RANK,
            tuple(origin),
            why,
            op_name,
            shared,
            counts,
        )
    return Diagnosis(
        Pattern.RANK_SUBSET,
        tuple(origin),
        f"{len(origin)} of {len(compared)} ranks ({format_ranks(origin)}) start the difference locally{share}: look at "
        "topology, placement, input distribution or reduction order along that coordinate",
        op_name,
        shared,
        counts,
    )
