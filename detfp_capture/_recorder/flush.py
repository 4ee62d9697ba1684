"""What a flush makes of its records' digests: resolved integers, then what they reveal.

A flush (``Recorder.flush``) first runs every batch still waiting, then ``resolve_slots``
turns each distinct started digest into its two 64-bit words (rows of batches in bulk, the rest
one by one), and ``DigestFindings`` reads the resolved digests for what they say beyond the
values: int64 tables that look like device pointers (the ``pointer_like`` hazard, a flag and an
event) and recomputed module outputs that differ from their original forward (the
``recompute_mismatch`` event). Off the per-record hot path: it runs once per window.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from detfp_capture._digest.batched import BATCHED
from detfp_capture._digest.resolve import resolve_raw, resolve_rows
from detfp_capture._recorder import columns
from detfp_capture._recorder.call import KIND, MICROBATCH, MODULE, NAME, PHASE, STEP, EventRow
from detfp_capture._recorder.records import RecordBuffer, record_columns
from detfp_capture._recorder.slot import COMBINE, COPY, Slot, _hostpath
from detfp_capture._recorder.subclass import resolve_combined

__all__ = ["DigestFindings", "resolve_rows_native", "resolve_rows_py", "resolve_slots", "window_tables"]


def resolve_rows_py(slots: list[Slot]) -> list[Slot]:
    """Resolve the slots that are rows of batches in bulk; the others, returned, are left for
    ``resolve_raw`` (a row whose device failed too). The record path's ``resolve_rows``."""
    rows: list[Slot] = []
    rest: list[Slot] = []
    for s in slots:
        (rows if s.pending is BATCHED and not s.arena_pointer else rest).append(s)
    if rows:
        his, los = resolve_rows(rows)
        for s, hi, lo in zip(rows, his, los, strict=True):
            if hi is None:
                rest.append(s)
            else:
                s.hi = hi
                s.lo = lo
                s.pending = None
    return rest


def resolve_rows_native(slots: list[Slot]) -> list[Slot]:
    """``resolve_rows_py``'s loops in C (``_hostpath``'s ``hostpath_c/resolve.c``)."""
    rows, rest = _hostpath.split_rows(slots, BATCHED)
    if rows:
        his, los = resolve_rows(rows, _hostpath.rows_plan, _hostpath.scatter)
        rest += _hostpath.assign_rows(rows, his, los)
    return rest


def resolve_slots(slots: list[Slot], by_rows: Callable[[list[Slot]], list[Slot]] = resolve_rows_py) -> None:
    """Set every slot's ``hi``/``lo`` (and ``extra`` where there is more). Rows of batches (most
    slots) are resolved in bulk (``by_rows``: the record path's ``resolve_rows``); the rest, and
    any a failed device left, one by one; a copy's slot (``COPY``) from its source's; a
    subclass's whole (``COMBINE``) last, from its parts'."""
    combos = [s for s in slots if s.pending is COMBINE]
    if combos:
        slots = [s for s in slots if s.pending is not COMBINE]
    copies = [s for s in slots if s.pending is COPY]
    if copies:
        listed = {id(s) for s in slots}
        sources = []
        for s in copies:
            r = s.source
            if r.hi is None and r.extra is None and id(r) not in listed:
                listed.add(id(r))
                sources.append(r)
        slots = [s for s in slots if s.pending is not COPY] + sources
    rest = by_rows(slots)
    if rest:
        for s, r in zip(rest, resolve_raw([s.started() for s in rest]), strict=True):
            s.hi = r.hi
            s.lo = r.lo
            if r.error is not None or r.rows is not None or r.moments is not None or r.pointer_like:
                s.extra = r
            s.pending = None
    for s in copies:
        r = s.source
        s.hi, s.lo, s.extra = r.hi, r.lo, r.extra
        s.pending = s.source = None
    if combos:
        resolve_combined(combos)


class DigestFindings:
    """The pointer-like hazard and the recompute check, from a window's resolved digests.

    The recompute check keeps the digests of forward module outputs per (step, microbatch,
    module, arg) across windows (a forward and its recompute may fall in different windows)."""

    def __init__(self) -> None:
        #: (step, microbatch, module, arg) -> digests (hi, lo) of its forward outputs.
        self.forward_outputs: dict[tuple, set[tuple[int, int]]] = {}

    def hazards(
        self, records: RecordBuffer, events: list[EventRow], next_seq: Callable[[], int], step: int
    ) -> list[tuple[str, ...]]:
        """The hazards column of ``records`` (``pointer_like`` added where the digest says so);
        hazard and recompute events are appended to ``events`` (``step``: the current step)."""
        calls, roles, args, slots = records.call, records.role, records.arg, records.slot
        hazards: list = records.hazards
        fwd = self.forward_outputs
        checks = []
        for i, s in enumerate(slots):
            if s is None or s.hi is None:
                continue
            c = calls[i]
            kind = c[KIND]
            if s.extra is not None and s.extra.pointer_like and "pointer_like" not in hazards[i]:
                hazards[i] = (*hazards[i], "pointer_like")
                events.append(
                    EventRow(
                        c[STEP],
                        next_seq(),
                        "hazard",
                        "pointer_like",
                        c[MODULE],
                        None,
                        f"{kind} {c[NAME]} {args[i]}: int64 values look like device pointers",
                    )
                )
            if kind == "module_output" and roles[i] == "output":
                key = (c[STEP], c[MICROBATCH], c[MODULE], args[i])
                if c[PHASE] == "forward":
                    fwd.setdefault(key, set()).add((s.hi, s.lo))
                elif c[PHASE] == "recompute":
                    checks.append((key, c[NAME], (s.hi, s.lo)))
        for key, name, d in checks:
            seen = fwd.get(key)
            if seen is None:
                continue  # forward output not captured (selector, or a different step window)
            if d not in seen:
                step_, mb, module, arg = key
                events.append(
                    EventRow(
                        step_,
                        next_seq(),
                        "recompute_mismatch",
                        name,
                        module,
                        None,
                        f"microbatch {mb} {arg}: recomputed output differs from the original forward output",
                    )
                )
        # Forward outputs of the current step may still be recomputed after the next flush.
        self.forward_outputs = {k: v for k, v in fwd.items() if k[0] >= step}
        return hazards


def window_tables(
    rec: Any, records: RecordBuffer, metrics: list, events: list, kernels: list, dumps: list
) -> dict[str, Any]:
    """The tables of one flushed window (``rec``: the ``Recorder``, its digests resolved): the
    records' columns with their hazards, the argument rows, metrics, kernels, dumps, and the
    window's ``events`` then those the digests add (``rec.events``, emptied)."""
    tables: dict[str, Any] = {}
    cols, args_rows = record_columns(records, rec.args, rec.path.by_identity)
    # The digests can add events (recompute mismatches, pointer-like tables): same window.
    cols["hazards"] = rec.findings.hazards(records, rec.events, rec.next_seq, rec.step)
    tables["records"] = cols
    if args_rows is not None:
        tables["args"] = args_rows
    tables["metrics"] = columns.metric_columns(metrics)
    if kernels:
        tables["kernels"] = columns.kernel_columns(kernels, rec.next_seq)
    tables["events"] = columns.event_columns(events + rec.events)
    rec.events = []
    if dumps:
        tables["dumps"] = columns.dump_columns(dumps)
    return tables
