"""The records buffer of one flush window, kept as one flat list, and the records table built from it.

Why a flat list: a record kept as a tuple is one more container object that lives until the
flush, and Python's cyclic collector pays for every such object (roughly 1.5 us each, amortized
over its full collections) on top of building it. One list of ints, strings and shared call
tuples adds almost nothing the collector has to look at, and a record is appended with one
``extend`` (parallel lists per column took nine ``append`` calls). The remaining per-digest objects
(``Slot``, ``digest.Pending``) are one per distinct tensor value, not one per record.

A record is (call, seq, role, arg, dtype text, shape tuple, numel, Slot or None, hazards); the
call tuple (``call.Call``) is shared by the records of one call. At the flush every Slot holds
its digest as two integers, which become the ``digest_hi``/``digest_lo`` columns as they are.
"""

from __future__ import annotations

from collections.abc import Callable
from operator import itemgetter
from typing import Any

from detfp_capture._recorder.args import ArgsColumn
from detfp_capture._recorder.call import COMPILED, KIND, MICROBATCH, MODULE, NAME, OCCURRENCE, PHASE, STEP, Call
from detfp_capture._recorder.slot import Slot
from detfp_format.indexed import Indexed

__all__ = ["FIELDS", "WIDTH", "RecordBuffer", "by_identity", "record_columns"]


#: Fields per record in ``RecordBuffer.rows``, in this order.
FIELDS = ("call", "seq", "role", "arg", "dtype", "shape", "numel", "slot", "hazards")
WIDTH = len(FIELDS)
SLOT = FIELDS.index("slot")


class RecordBuffer:
    """Buffered records as one flat list, ``WIDTH`` values per record in ``FIELDS`` order.

    The hot paths append a record with one ``rows.extend`` of a tuple (one C call, the tuple
    freed at once) instead of nine ``list.append`` calls; the columns are cut out at the flush
    (``rows[i::WIDTH]``, a C-level slice each)."""

    __slots__ = ("rows",)

    def __init__(self) -> None:
        self.rows: list[Any] = []

    def __len__(self) -> int:
        return len(self.rows) // WIDTH

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
        self.rows.extend((call, seq, role, arg, dtype, shape, numel, slot, hazards))

    def column(self, name: str) -> list[Any]:
        """One field of every record (a new list)."""
        return self.rows[FIELDS.index(name) :: WIDTH]

    # The columns by name (each a new list: read once per flush).
    call = property(lambda self: self.column("call"))
    seq = property(lambda self: self.column("seq"))
    role = property(lambda self: self.column("role"))
    arg = property(lambda self: self.column("arg"))
    dtype = property(lambda self: self.column("dtype"))
    shape = property(lambda self: self.column("shape"))
    numel = property(lambda self: self.column("numel"))
    slot = property(lambda self: self.column("slot"))
    hazards = property(lambda self: self.column("hazards"))

    def last_slot(self) -> Slot | None:
        """The Slot of the record appended last (None: none, or not digested)."""
        rows = self.rows
        return rows[SLOT - WIDTH] if rows else None


def _field(calls: list[Call], i: int) -> list[Any]:
    return list(map(itemgetter(i), calls))


def by_identity(items: list) -> tuple[list, list[int], list[int]]:
    """The record path's ``by_identity`` (this, or ``_hostpath.by_identity``): the distinct objects of ``items`` (by identity, in order of
    first appearance), each item's position among them, and where each first appears."""
    seen: dict[int, int] = {}
    distinct: list = []
    index: list[int] = []
    first: list[int] = []
    for i, x in enumerate(items):
        k = seen.get(id(x))
        if k is None:
            k = seen[id(x)] = len(distinct)
            distinct.append(x)
            first.append(i)
        index.append(k)
    return distinct, index, first


def record_columns(
    buf: RecordBuffer, args: ArgsColumn, distinct: Callable[[list], tuple[list, list[int], list[int]]] = by_identity
) -> tuple[dict[str, Any], dict[str, list] | None]:
    """Columns of the records table from a buffer whose slots are resolved, and the ``args``
    table rows this window adds (None: none). The caller adds the ``hazards`` column (the
    digests may add a hazard). The columns of the call (its key fields, compiled flag and
    argument digest) are ``Indexed`` by call: computed and converted once per call, not per
    record (``detfp_format.indexed``). One comprehension (or one C-level map) per column: this
    runs once per flush over every record. ``distinct``: the record path's ``by_identity``."""
    calls, index, first = distinct(buf.call)
    seqs = buf.seq
    slots = buf.slot

    def by_call(values: list) -> Indexed:
        return Indexed(values, index)

    ads, args_rows = args.build(calls, [seqs[i] for i in first])
    cols: dict[str, Any] = {
        "step": by_call(_field(calls, STEP)),
        "seq": seqs,
        "microbatch": by_call(_field(calls, MICROBATCH)),
        "phase": by_call(_field(calls, PHASE)),
        "module": by_call(_field(calls, MODULE)),
        "kind": by_call(_field(calls, KIND)),
        "name": by_call(_field(calls, NAME)),
        "occurrence": by_call(_field(calls, OCCURRENCE)),
        "role": buf.role,
        "arg": buf.arg,
        "dtype": buf.dtype,
        "shape": buf.shape,  # tuples: pyarrow converts them like lists
        "numel": buf.numel,
        "compiled": by_call([bool(c[COMPILED]) for c in calls]),
        "args_digest": by_call(ads),
    }
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
