"""Text report of a ``BisectResult``: concise, byte-stable, for a terminal or a CI log.

``render_text`` is a pure function of the result: no timestamps, no colours, runs named
by the labels the user gave, every list sorted. Ranks with the same outcome (same step,
verdict and record) are folded into one line with a rank range, so a 1,024-rank job with
one pattern prints a handful of lines. ``render_env`` prints the manifest diff alone
(``detfp-analyze env``). Sections: header, environment, window/resume, ranks, diagnosis (its
first line the most likely cause, then the cause and pattern, the evidence, the next steps),
difference, discriminator, notes.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from detfp_analyze.bisect import components
from detfp_analyze.bisect.result import BisectResult, Divergence, RankResult
from detfp_analyze.bisect.vocab import Cause, Status, Verdict
from detfp_analyze.io.envdiff import EnvDiff, SettingChange
from detfp_analyze.ranks import format_ranks

__all__ = ["capture_text", "render_env", "render_text", "status_line"]


def _v(x: Any) -> str:
    return json.dumps(x, sort_keys=True, default=str)


def render_env(
    diffs: Sequence[EnvDiff],
    label_a: str,
    label_b: str,
    changes: tuple[Sequence[SettingChange], Sequence[SettingChange]] = ((), ()),
) -> str:
    """The manifest diff as text: one line per differing key (``key [rank R]: a -> b``), then the
    determinism settings each run changed during the run (``run A [rank R] before step S: ...``)."""
    lines = [f"A = {label_a}", f"B = {label_b}"]
    if not diffs:
        lines.append("manifests: no difference")
    else:
        lines.append(f"manifests: {len(diffs)} difference(s)")
        for d in diffs:
            where = "" if d.rank is None else f" [rank {d.rank}]"
            flag = "  (blocks comparison)" if d.blocking else ""
            lines.append(f"  {d.key}{where}: {_v(d.a)} -> {_v(d.b)}{flag}")
    if changes[0] or changes[1]:
        lines.append("settings changed during a run (the manifests hold those of the first step):")
        for side, cs in zip("AB", changes, strict=True):
            lines.extend(f"  run {side} [rank {c.rank}] {c.detail}" for c in cs)
    return "\n".join(lines) + "\n"


def _where(d: Divergence) -> str:
    if d.kind == "state" and d.op:  # the state a run starts from: before the step, not a call in it
        return f"state before step {d.step}: {d.op} ({d.arg})"
    parts = [d.phase]
    if d.module is not None:
        parts.append(d.module or "<root>")
    if d.op is not None:
        parts.append(f"{d.kind}:{d.op}")
    parts.append(f"{d.role} {d.arg}".strip())
    if d.microbatch >= 0:
        parts.append(f"mb {d.microbatch}")
    return " ".join(parts)


def _div_key(d: Divergence | None) -> tuple:
    if d is None:
        return ()
    # The peers a receiver's difference came from are part of what a line says: ranks that
    # received from different peers (a 2-D mesh's dp receivers) get a line each.
    return (
        d.step, d.verdict, d.phase, d.module, d.kind, d.op, d.role, d.arg, d.diff_kind, d.hazards, d.presence,
        d.components, d.peers_differing,
    )  # fmt: skip


def _div_lines(d: Divergence, single: bool, indent: str, confirmed: bool = False) -> list[str]:
    out = []
    if d.explanation:
        out.append(f"{indent}{d.explanation}")
    note = components.note(d)
    if note:
        out.append(f"{indent}components: {note}")
    if single and (d.seq_a is not None or d.seq_b is not None):
        out.append(
            f"{indent}seq A {d.seq_a if d.seq_a is not None else '-'} / B {d.seq_b if d.seq_b is not None else '-'}"
        )
    if d.contradiction:
        out.append(f"{indent}contradiction: {d.contradiction}")
    if d.depends_on:
        out.append(f"{indent}not captured: {d.depends_on}")
    if d.hazards and confirmed:
        out.append(
            f"{indent}hazards: {', '.join(d.hazards)} (the cause, not a false root: both runs read it uninitialized)"
        )
    elif d.hazards:
        out.append(f"{indent}hazards: {', '.join(d.hazards)} (likely false root)")
    if d.fused:
        out.append(f"{indent}compiled kernel: fuses aten {', '.join(d.fused)}")
    if d.kernels is not None:
        k = d.kernels
        if k.same:
            out.append(f"{indent}kernels: same kernels, different result: {', '.join(k.a) or '-'}")
        else:
            out.append(
                f"{indent}kernels: different kernel selected: A {', '.join(k.a) or '-'} | B {', '.join(k.b) or '-'}"
            )
    if d.diff is not None and d.diff.detail:
        out.append(f"{indent}difference: {d.diff.kind} ({d.diff.confirmed}): {d.diff.detail}")
    return out


def _rank_groups(ranks: Sequence[RankResult]) -> list[tuple[list[int], RankResult]]:
    groups: dict[tuple, list[RankResult]] = {}
    for r in ranks:
        key = (r.status, r.step, r.verdict, _div_key(r.first), _div_key(r.next_clean), r.metric_step, r.metric_name,
               r.hazard_confirmed)  # fmt: skip
        groups.setdefault(key, []).append(r)
    out = [([x.rank for x in rs], rs[0]) for rs in groups.values()]
    out.sort(key=lambda g: (g[1].status == Status.IDENTICAL, g[0][0]))
    return out


def metric_text(rr: RankResult) -> str:
    """``loss differs from step 3``; a metric one run records more often (micro-batches):
    ``loss has a value in run B only in step 0 (its values before that match)``."""
    if rr.metric_a is None and rr.metric_b is not None:
        side = "B"
    elif rr.metric_b is None and rr.metric_a is not None:
        side = "A"
    else:
        return f"{rr.metric_name} differs from step {rr.metric_step}"
    return f"{rr.metric_name} has a value in run {side} only in step {rr.metric_step} (its values before that match)"


def status_line(r: BisectResult) -> str:
    """``status: ...``: the outcome, the first step, the pattern and the cause."""
    dg = r.diagnosis
    if r.status == Status.IDENTICAL:
        return "status: identical" + ("" if dg.cause == Cause.NONE else f"; cause {dg.cause}")
    if r.status == Status.ENDED_EARLY:
        ends = "; ".join(f"run {e.side} ended at step {e.step}" for e in r.endings)
        return f"status: ended_early ({ends}; what both runs hold matched); cause {dg.cause}"
    if r.status == Status.RNG_ONLY:
        return f"status: rng_only (an RNG state differs, no value or metric does), from step {r.first_step}; cause {dg.cause}"
    return f"status: diverged, first at step {r.first_step}; pattern {dg.pattern}; cause {dg.cause}"


def capture_text(r: BisectResult) -> str:
    """``captured at level boundaries, bisect depth op``: what was captured, and how deep bisect looked."""
    w = r.window
    a, b = w.capture_a, w.capture_b
    la, lb = (c.level if c is not None else None for c in (a, b))
    if la is None and lb is None:
        return f"bisect depth {w.level}"
    got = f"level {la}" if la == lb else f"levels {la or '-'} (A), {lb or '-'} (B)"
    return f"captured at {got}, bisect depth {w.level}"


def render_text(result: BisectResult) -> str:
    """The whole bisect report as text (ends with a newline)."""
    r = result
    lines = [f"A = {r.label_a}", f"B = {r.label_b}", status_line(r)]
    if r.env_diff:
        lines.append(f"environment: {len(r.env_diff)} difference(s)")
        for e in r.env_diff:
            where = "" if e.rank is None else f" [rank {e.rank}]"
            lines.append(f"  {e.key}{where}: {_v(e.a)} -> {_v(e.b)}{' (blocking, forced)' if e.blocking else ''}")
    else:
        lines.append("environment: no difference")
    w = r.window
    span = lambda s: "-" if s is None else f"{s[0]}-{s[1]}"  # noqa: E731
    lines.append(
        f"window: steps {span(w.steps)} (A {span(w.steps_a)}, B {span(w.steps_b)}), "
        f"ranks {format_ranks(w.ranks) or '-'}; {capture_text(r)}"
    )
    if r.resume.note:
        lines.append(f"resume: {r.resume.note}")
    if r.resume.resumed:
        lines.append(
            f"  boundary state at step {r.resume.first_common_step}: {r.resume.boundary_differing} of "
            f"{r.resume.boundary_compared} param/optimizer_state/rng_state records differ"
        )
    lines.append("ranks:")
    for ranks, rr in _rank_groups(r.ranks):
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {format_ranks(ranks)}"
        if rr.status == Status.IDENTICAL:
            lines.append(f"  {who}: identical")
            continue
        metric = ""
        if rr.metric_step is not None:
            metric = f"; {metric_text(rr)}"
        if rr.first is None:
            step = rr.record_step if rr.record_step is not None else rr.step
            verdict = rr.verdict or "records differ"
            lines.append(f"  {who}: step {step} {verdict}{metric}")
            if rr.verdict == Verdict.METRIC_ONLY:
                lines.append("    metrics differ but no captured record does: widen the capture")
            continue
        d = rr.first
        lines.append(f"  {who}: step {d.step} {d.verdict} at {_where(d)}{metric}")
        lines.extend(_div_lines(d, len(ranks) == 1, "    ", rr.hazard_confirmed))
        if rr.next_clean is not None:
            n = rr.next_clean
            what = "where the difference goes next" if rr.hazard_confirmed else "next divergence without hazards"
            lines.append(f"    {what}: step {n.step} {n.verdict} at {_where(n)}")
            lines.extend(_div_lines(n, len(ranks) == 1, "      "))
    dg = r.diagnosis
    lines.append(f"diagnosis: {dg.headline or dg.explanation}")
    facts = [f"cause {dg.cause}", f"pattern {dg.pattern}"]
    if dg.origin_ranks:
        facts.append(f"origin ranks {format_ranks(dg.origin_ranks)}")
    if dg.shared_coordinates:
        facts.append(
            "shared parallel coordinates " + ", ".join(f"{k}={v}" for k, v in sorted(dg.shared_coordinates.items()))
        )
    lines.append(f"  {'; '.join(facts)}")
    rest = dg.explanation[len(dg.headline) :].strip() if dg.headline and dg.explanation.startswith(dg.headline) else ""
    if rest:
        lines.append(f"  {rest}")
    lines.extend(f"  next: {x}" for x in dg.next_steps)
    if r.diff is not None:
        part = f" in component {r.diff.component}" if r.diff.component else ""
        lines.append(f"difference at rank {r.diff_rank}: {r.diff.kind}{part}, confirmed by {r.diff.confirmed}")
        # The rank's own block said it already (its "difference:" line): each detail once.
        shown = {d.diff.detail for rr in r.ranks for d in (rr.first, rr.next_clean) if d is not None and d.diff}
        if r.diff.detail and r.diff.detail not in shown:
            lines.append(f"  {r.diff.detail}")
    if r.discriminator is not None and r.discriminator.rows:
        ds = r.discriminator
        lines.append(
            f"discriminator: {ds.op} on ranks {format_ranks(ds.ranks)}, step(s) {', '.join(map(str, ds.steps))}"
        )
        for row in ds.rows:
            shape = "x".join(map(str, row.shape)) if row.shape is not None else "-"
            lines.append(
                f"  divergent {row.divergent:>4} clean {row.clean:>4}  {row.phase} {row.module or '<root>'} "
                f"{row.dtype or '-'} [{shape}]"
            )
    if r.notes:
        lines.append("notes:")
        lines.extend(f"  {n}" for n in r.notes)
    return "\n".join(lines) + "\n"
