"""A bisect as a Chrome/Perfetto trace-event timeline: one track per rank, sequence as time.

``trace(a, b, result, steps=..., ranks=...)`` returns the JSON object of the trace-event format
(``{"traceEvents": [...], "displayTimeUnit": ..., "otherData": ...}``), which the Perfetto UI
(ui.perfetto.dev) and chrome://tracing open:

* one process per rank group (``layout.rank_layout``: the outermost parallel coordinate, e.g.
  ``pp 2``), one thread (track) per rank, sorted by layout position;
* time is each rank's own execution order: one microsecond per record (steps separated by a
  gap), never a wall clock; records of run B only are placed after the record that precedes
  them in B's order;
* nested slices: step > phase (and microbatch) > module path (``layers.0`` > ``layers.0.attn``)
  > call (``aten::mm.default``); a call whose records differ is named ``≠ <op>``, carries
  ``cname`` "terrible" and its records as child slices (``output out: differs``);
* an instant event on each diverged rank at its first divergence (past a likely false root):
  the verdict as the name, the explanation and the location in the args.

Records are read for the selected ranks and steps only, 64 ranks at a time; record equality is
``rule.MATCH`` (``frames.match_expr``, as the ``pairs`` SQL view). ``count_records`` sizes a selection first,
so the caller can refuse a trace too large to open.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Any

import polars as pl

from detfp_analyze import rule
from detfp_analyze.bisect.result import BisectResult, check_verdict
from detfp_analyze.io.reader import Run, as_run
from detfp_analyze.render.frames import match_expr
from detfp_analyze.render.layout import rank_layout
from detfp_format import strictjson

__all__ = ["count_records", "dumps_trace", "trace"]

_BATCH = 64
#: Empty time between two steps of one track (microseconds = records).
_STEP_GAP = 8
_COLS = ["rank", "step", "seq", "microbatch", "phase", "module", "kind", "name", "role", "arg", "call_hash", "key_hash",
         "status", "digest_hi", "digest_lo", "args_digest"]  # fmt: skip
_DIFFERENT = rule.DIVERGENT


def count_records(run: Run | str | os.PathLike[str], ranks: Sequence[int], steps: tuple[int, int]) -> int:
    """Records of ``run`` in the selection (reads the step column only)."""
    r = as_run(run)
    sel = range(steps[0], steps[1] + 1)
    return int(r.scan("records", ranks=list(ranks), steps=sel).select(pl.len()).collect().item())


def _ordered(a: pl.LazyFrame, b: pl.LazyFrame) -> pl.DataFrame:
    """Both runs' records of some ranks joined by key, in each rank's execution order."""
    keep = ["rank", "step", "key_hash", "seq", "status", "digest_hi", "digest_lo", "args_digest"]
    j = a.join(b.select(keep), on=["rank", "step", "key_hash"], how="full", coalesce=True, suffix="_b")
    j = j.with_columns(match_expr().alias("match"))
    b_only = j.filter(pl.col("match") == "only_b").select("rank", "step", "key_hash")
    if b_only.select(pl.len()).collect().item():
        # Call-site columns of B-only records come from B itself.
        extra = b.join(b_only, on=["rank", "step", "key_hash"], how="semi")
        fill = ["microbatch", "phase", "module", "kind", "name", "role", "arg", "call_hash"]
        j = j.join(extra.select("rank", "step", "key_hash", *[pl.col(c).alias(f"{c}__b") for c in fill]),
                   on=["rank", "step", "key_hash"], how="left")  # fmt: skip
        j = j.with_columns([pl.coalesce(c, f"{c}__b").alias(c) for c in fill]).drop([f"{c}__b" for c in fill])
    # A record of B only goes right after the matched record before it in B's order.
    anchor = pl.when(pl.col("seq").is_not_null() & pl.col("seq_b").is_not_null()).then(pl.col("seq")).otherwise(None)
    j = j.sort("rank", "step", "seq_b", nulls_last=True).with_columns(
        anchor.forward_fill().over("rank", "step").alias("anchor")
    )
    key = pl.when(pl.col("seq").is_not_null()).then(pl.col("seq")).otherwise(pl.col("anchor").fill_null(-1))
    return (
        j.with_columns(key.alias("k1"), pl.col("seq").is_null().cast(pl.Int8).alias("k2"))
        .sort("rank", "step", "k1", "k2", "seq_b")
        .collect()
    )


class _Track:
    """Slices of one rank, built in order with a stack of open slices (so nesting is exact)."""

    def __init__(self, pid: int, tid: int):
        self.pid, self.tid = pid, tid
        self.events: list[dict[str, Any]] = []
        self.stack: list[tuple[tuple[str, str], dict[str, Any]]] = []  # ((level, key), event)

    def close_to(self, depth: int, ts: int) -> None:
        while len(self.stack) > depth:
            _, ev = self.stack.pop()
            ev["dur"] = ts - ev["ts"]

    def open(self, level: str, key: str, name: str, ts: int, cat: str, args: dict[str, Any]) -> None:
        ev = {"ph": "X", "name": name, "cat": cat, "pid": self.pid, "tid": self.tid, "ts": ts, "dur": 0, "args": args}
        self.events.append(ev)
        self.stack.append(((level, key), ev))

    def ensure(self, path: list[tuple[str, str, str, str]], ts: int) -> None:
        """Make the open stack equal ``path`` [(level, key, name, cat)], closing and opening as needed."""
        keep = 0
        while keep < len(path) and keep < len(self.stack) and self.stack[keep][0] == path[keep][:2]:
            keep += 1
        self.close_to(keep, ts)
        for level, key, name, cat in path[keep:]:
            self.open(level, key, name, ts, cat, {})


def _module_path(module: str) -> list[str]:
    """'layers.0.attn' -> ['layers', 'layers.0', 'layers.0.attn'] ('' -> [])."""
    if not module:
        return []
    parts = module.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


def _rank_events(rows: pl.DataFrame, pid: int, tid: int, first: dict[str, Any] | None) -> list[dict[str, Any]]:
    t = _Track(pid, tid)
    ts, prev_step, mark_ts = 0, None, None
    run: list[dict[str, Any]] = []  # the records of the call being laid out

    def flush_call(end: int) -> None:
        if not run:
            return
        bad = [r for r in run if r["match"] in _DIFFERENT]
        r0 = run[0]
        name = r0["name"] if not bad else f"≠ {r0['name']}"
        args = {"kind": r0["kind"], "module": r0["module"] or "<root>", "records": len(run), "differing": len(bad)}
        ev = {"ph": "X", "name": name, "cat": "differs" if bad else "same", "pid": pid, "tid": tid,
              "ts": end - len(run), "dur": len(run), "args": args}  # fmt: skip
        if bad:
            ev["cname"] = "terrible"
        t.events.append(ev)
        if bad:  # which tensors of the call differ
            for i, r in enumerate(run):
                t.events.append({"ph": "X", "name": f"{r['role']} {r['arg']}: {r['match']}", "cat": r["match"],
                                 "pid": pid, "tid": tid, "ts": end - len(run) + i, "dur": 1,
                                 "args": {"seq_a": r["seq"], "seq_b": r["seq_b"], "status": r["status"]}})  # fmt: skip
        run.clear()

    for r in rows.iter_rows(named=True):
        if r["step"] != prev_step:
            flush_call(ts)
            if prev_step is not None:
                t.close_to(0, ts)
                ts += _STEP_GAP
            prev_step = r["step"]
        phase = r["phase"] if r["microbatch"] < 0 else f"{r['phase']} mb {r['microbatch']}"
        path = [("step", str(r["step"]), f"step {r['step']}", "step"), ("phase", phase, phase, "phase")]
        path += [("module", m, m, "module") for m in _module_path(r["module"] or "")]
        if run and (run[0]["call_hash"] != r["call_hash"] or run[0]["step"] != r["step"]):
            flush_call(ts)
        if not run:
            t.ensure(path, ts)
        run.append(r)
        if first is not None and mark_ts is None and r["step"] == first["step"] and r["key_hash"] == first["key_hash"]:
            mark_ts = ts
        ts += 1
    flush_call(ts)
    t.close_to(0, ts)
    if first is not None:
        at = mark_ts if mark_ts is not None else 0
        t.events.append({"ph": "i", "s": "t", "name": f"first divergence: {first['verdict']}", "cat": "divergence",
                         "pid": pid, "tid": tid, "ts": at, "args": first["args"]})  # fmt: skip
    return t.events


def _firsts(result: BisectResult) -> dict[int, dict[str, Any]]:
    from detfp_format.contract import call_key, key_hash, record_key

    out = {}
    for r in result.ranks:
        d = r.effective
        if d is None or d.module is None or d.op is None:
            continue
        call = call_key(d.microbatch, d.phase, d.module, d.kind, d.op, d.occurrence)
        out[r.rank] = {
            "step": d.step,
            "key_hash": key_hash(record_key(call, d.role, d.arg)),
            "verdict": check_verdict(d.verdict),
            "args": {
                "verdict": d.verdict,
                "explanation": d.explanation,
                "where": f"step {d.step} {d.phase} {d.module or '<root>'} {d.kind}:{d.op} {d.role} {d.arg}",
                "difference": d.diff_kind,
                "hazards": ", ".join(d.hazards),
            },
        }
    return out


def trace(
    a: Run | str | os.PathLike[str],
    b: Run | str | os.PathLike[str],
    result: BisectResult,
    *,
    steps: tuple[int, int] | None = None,
    ranks: Iterable[int] | None = None,
) -> dict[str, Any]:
    """The trace-event object of ``result`` (a bisect of ``a`` and ``b``) over ``steps`` (inclusive
    range, default the compared window) and ``ranks`` (default the compared ranks)."""
    ra, rb = as_run(a), as_run(b)
    window = steps or result.window.steps
    wanted = sorted(result.window.ranks if ranks is None else {int(x) for x in ranks})
    layout = rank_layout(ra, wanted)
    groups = {g: i + 1 for i, g in enumerate(dict.fromkeys(layout["group"].to_list()))}
    events: list[dict[str, Any]] = []
    for g, pid in groups.items():
        events.append({"ph": "M", "pid": pid, "tid": 0, "name": "process_name", "args": {"name": g or "ranks"}})
        events.append({"ph": "M", "pid": pid, "tid": 0, "name": "process_sort_index", "args": {"sort_index": pid}})
    where = {
        int(r): (groups[g], int(p), lab)
        for r, g, p, lab in layout.select("rank", "group", "position", "label").iter_rows()
    }
    for r in wanted:
        pid, pos, label = where[r]
        events.append({"ph": "M", "pid": pid, "tid": r, "name": "thread_name", "args": {"name": label}})
        events.append({"ph": "M", "pid": pid, "tid": r, "name": "thread_sort_index", "args": {"sort_index": pos}})
    firsts = _firsts(result)
    if window is not None:
        sel = range(window[0], window[1] + 1)
        for i in range(0, len(wanted), _BATCH):
            batch = wanted[i : i + _BATCH]
            la = ra.scan("records", ranks=batch, steps=sel).select(_COLS)
            lb = rb.scan("records", ranks=batch, steps=sel).select(_COLS)
            rows = _ordered(la, lb)
            for (rank,), part in rows.group_by(["rank"], maintain_order=True):
                pid, _, _ = where[int(rank)]
                first = firsts.get(int(rank))
                if first is not None and not window[0] <= first["step"] <= window[1]:
                    first = None
                events.extend(_rank_events(part, pid, int(rank), first))
    return {
        "traceEvents": events,
        "displayTimeUnit": "ns",
        "otherData": {
            "generator": "detfp-analyze export",
            "a": result.label_a,
            "b": result.label_b,
            "time": "1 us = one record in the rank's own execution order (not wall-clock time)",
            "steps": "-" if window is None else f"{window[0]}-{window[1]}",
            "pattern": result.diagnosis.pattern,
        },
    }


def dumps_trace(obj: dict[str, Any]) -> str:
    """The trace as JSON text, one event per line, keys sorted: the same bytes for the same trace."""
    head = {k: v for k, v in obj.items() if k != "traceEvents"}
    opts: dict[str, Any] = {"sort_keys": True, "ensure_ascii": False, "separators": (",", ":")}
    lines = [strictjson.dumps(e, **opts) for e in obj["traceEvents"]]
    body = ",\n".join(lines)
    rest = strictjson.dumps(head, **opts)[1:-1]
    return '{"traceEvents":[\n' + body + "\n]," + rest + "}\n"
