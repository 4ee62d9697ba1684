"""The records buffer of one flush window, kept as columns, and the records table built from it.

Why columns: a record kept as a tuple is one more container object that lives until the flush,
and Python's cyclic collector pays for every such object (roughly 1.5 us each, amortized over
its full collections) on top of building it. Parallel lists of ints, strings and shared call
tuples add almost nothing the collector has to look at. The remaining per-digest objects
(``Slot``, ``digest.Pending``) are one per distinct tensor value, not one per record.

A record is (call, seq, role, arg, dtype text, shape tuple, numel, Slot or None, hazards); the
call tuple (``call.Call``) is shared by the records of one call. At the flush every Slot holds
its digest as two integers, which become the ``digest_hi``/``digest_lo`` columns as they are.
"""

from __future__ import annotations

from operator import itemgetter
from typing import Any

from detfp_capture._recorder.args import ArgsColumn
from detfp_capture._recorder.call import COMPILED, KIND, MICROBATCH, MODULE, NAME, OCCURRENCE, PHASE, STEP, Call
from detfp_capture._recorder.slot import Slot

__all__ = ["RecordBuffer", "record_columns"]


class RecordBuffer:
    """Buffered records as parallel lists (append to all of them, or use ``add``)."""

    __slots__ = ("arg", "call", "dtype", "hazards", "numel", "role", "seq", "shape", "slot")

    def __init__(self) -> None:
        self.call: list[Call] = []
        self.seq: list[int] = []
        self.role: list[str] = []
        self.arg: list[str] = []
        self.dtype: list[str] = []
        self.shape: list[tuple[int, ...]] = []
        self.numel: list[int] = []
        self.slot: list[Slot | None] = []
        self.hazards: list[tuple[str, ...]] = []

    def __len__(self) -> int:
        return len(self.seq)

    def add(
        self,
        call: Call,
        seq: int,
        role: str,
        arg: str,
        dtype: str,
        shape: tuple[int, ...],
        numel: int,
        slot: Slot | None,
        hazards: tuple[str, ...],
    ) -> None:
        self.call.append(call)
        self.seq.append(seq)
        self.role.append(role)
        self.arg.append(arg)
        self.dtype.append(dtype)
        self.shape.append(shape)
        self.numel.append(numel)
        self.slot.append(slot)
        self.hazards.append(hazards)


def _field(calls: list[Call], i: int) -> list[Any]:
    return list(map(itemgetter(i), calls))


def record_columns(buf: RecordBuffer, args: ArgsColumn) -> tuple[dict[str, list], dict[str, list] | None]:
    """Columns of the records table from a buffer whose slots are resolved, and the ``args``
    table rows this window adds (None: none). The caller adds the ``hazards`` column (the
    digests may add a hazard). One comprehension (or one C-level map) per column: this runs once
    per flush over every record."""
    calls = buf.call
    cols: dict[str, list] = {
        "step": _field(calls, STEP),
        "seq": buf.seq,
        "microbatch": _field(calls, MICROBATCH),
        "phase": _field(calls, PHASE),
        "module": _field(calls, MODULE),
        "kind": _field(calls, KIND),
        "name": _field(calls, NAME),
        "occurrence": _field(calls, OCCURRENCE),
        "role": buf.role,
        "arg": buf.arg,
        "dtype": buf.dtype,
        "shape": buf.shape,  # tuples: pyarrow converts them like lists
        "numel": buf.numel,
        "compiled": [bool(c[COMPILED]) for c in calls],
    }
    cols["args_digest"], args_rows = args.build(calls, buf.seq)
    slots = buf.slot
    # A slot is resolved: hi/lo set (a digest), or hi None and extra holding the error.
    cols["status"] = ["skipped" if s is None else ("ok" if s.hi is not None else "error") for s in slots]
    cols["digest_hi"] = [None if s is None else s.hi for s in slots]
    cols["digest_lo"] = [None if s is None else s.lo for s in slots]
    extras = [None if s is None else s.extra for s in slots]
    if any(e is not None for e in extras):
        cols["error"] = [None if e is None else e.error for e in extras]
        cols["rows"] = [None if e is None or e.rows is None or e.error is not None else list(e.rows) for e in extras]
        if any(e is not None and e.moments is not None and e.error is None for e in extras):
            ms = [None if e is None or e.error is not None else e.moments for e in extras]
            cols["m_sum"] = [None if m is None else m.sum for m in ms]
            cols["m_absmax"] = [None if m is None else m.absmax for m in ms]
            cols["m_nan"] = [None if m is None else m.nan for m in ms]
            cols["m_inf"] = [None if m is None else m.inf for m in ms]
    else:
        cols["error"] = [None] * len(slots)
        cols["rows"] = [None] * len(slots)
    return cols, args_rows
