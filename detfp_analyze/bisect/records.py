"""The typed values the bisect stages hand each other: keys, aligned records, what the walk found.

* ``RecordKey`` / ``CallKey``: (rank, step, key_hash) and (rank, step, call_hash), the keys every
  evidence read and verdict lookup uses (a record's key is unique within its rank-step);
* ``Aligned``: one aligned pair of records (a row of ``align.align``), the columns the verdicts,
  the difference kind and the report read;
* ``Extract``: one divergent record the walk picked, with what its verdict needs (its call, the
  call one hop upstream, both sides' details);
* ``Found``: a rank's first divergence and, past a likely false root, the next clean one.

All are frozen: a stage that adds to a value (the walk attaching a module output's input twin)
makes a new one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, NamedTuple

__all__ = ["Aligned", "CallKey", "Extract", "Found", "RecordKey"]


class RecordKey(NamedTuple):
    """A record of one rank-step: its key is unique there."""

    rank: int
    step: int
    key_hash: int


class CallKey(NamedTuple):
    """A call of one rank-step: every record of the call shares the call hash."""

    rank: int
    step: int
    call_hash: int


@dataclass(frozen=True)
class Aligned:
    """One aligned pair of records: the call-site key, both sides' order and tensor facts, the state."""

    rank: int
    step: int
    key_hash: int
    call_hash: int
    #: Repeated-key number (0 unless a capture bug repeated a key).
    dup: int
    microbatch: int
    phase: str
    module: str
    kind: str
    name: str
    occurrence: int
    role: str
    arg: str
    #: ``rule.STATES``.
    state: str
    #: Position in the rank-step on each side (None on the side that lacks the record).
    pos_a: int | None
    pos_b: int | None
    seq_a: int | None
    seq_b: int | None
    dtype_a: str | None
    dtype_b: str | None
    shape_a: tuple[int, ...] | None
    shape_b: tuple[int, ...] | None
    hazards_a: tuple[str, ...]
    hazards_b: tuple[str, ...]
    #: ``rule.TENSORS_EQUAL`` / ``rule.ARGS_EQUAL`` of the pair.
    tensors_same: bool
    args_same: bool

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> Aligned:
        """From a row of ``align.align`` enriched with the call-site columns (``walk``)."""
        shape = lambda s: None if s is None else tuple(int(x) for x in s)  # noqa: E731
        names = {f.name for f in fields(cls)}
        vals: dict[str, Any] = {k: row.get(k) for k in names}  # a row's values, typed by the frame
        vals.update(
            rank=int(row["rank"]),
            step=int(row["step"]),
            key_hash=int(row["key_hash"]),
            call_hash=int(row["call_hash"]),
            dup=int(row.get("dup") or 0),
            microbatch=int(row["microbatch"]),
            occurrence=int(row["occurrence"]),
            shape_a=shape(row.get("shape_a")),
            shape_b=shape(row.get("shape_b")),
            hazards_a=tuple(row.get("hazards_a") or ()),
            hazards_b=tuple(row.get("hazards_b") or ()),
            tensors_same=bool(row.get("tensors_same")),
            args_same=bool(row.get("args_same", True)),
        )
        return cls(**vals)

    @property
    def key(self) -> RecordKey:
        return RecordKey(self.rank, self.step, self.key_hash)

    @property
    def call(self) -> CallKey:
        return CallKey(self.rank, self.step, self.call_hash)

    @property
    def presence(self) -> str:
        """``both``, ``a_only`` or ``b_only`` (the report's spelling)."""
        return "a_only" if self.pos_b is None else ("b_only" if self.pos_a is None else "both")

    @property
    def dtype(self) -> str | None:
        return self.dtype_a or self.dtype_b

    @property
    def shape(self) -> tuple[int, ...] | None:
        return self.shape_a if self.shape_a is not None else self.shape_b

    @property
    def label(self) -> str:
        """``name (kind) in module``: how notes and ``upstream`` name a call."""
        return f"{self.name} ({self.kind}) in {self.module or '<root>'}"


@dataclass(frozen=True)
class Extract:
    """One divergent record the walk picked, with what its verdict needs."""

    #: The divergent record.
    record: Aligned
    #: Every aligned record of its call (and, for a module output, of its module_input twin).
    call: tuple[Aligned, ...]
    #: Hazard flags on the record's call, sorted.
    hazards: tuple[str, ...]
    #: The call just before it in the rank's order (``Aligned.label``), or None.
    upstream: str | None
    #: The record's detail columns (``enrich.DETAIL_COLUMNS``) in run A and in run B (None: absent).
    details: tuple[Mapping[str, Any] | None, Mapping[str, Any] | None]
    #: Record kinds the rank-step holds (either run): what else the capture saw there.
    kinds: frozenset[str]
    #: A record of the call carries a hazard flag (the walk's likely false root).
    hz: bool
    #: Why its step was passed over ("hazards": only differences under hazards; "structure":
    #: calls in another order or number whose values all match), None when the step changes a value.
    passed: str | None = None


@dataclass(frozen=True)
class Found:
    """A rank's first divergence as the walk found it."""

    #: The first divergence (a likely false root when ``hz``), or the step passed over when
    #: nothing changes a value (``passed``).
    first: Extract
    #: The next divergence free of hazards when ``first`` is under one (same or a later step).
    next_clean: Extract | None = None

    @property
    def passed(self) -> bool:
        """No step of the rank changes a value: the rank is identical (``first`` says why, for the notes)."""
        return self.first.passed is not None and self.next_clean is None

    @property
    def start(self) -> Extract:
        """Where the rank's difference starts for the cross-rank tests: past a likely false root."""
        return self.next_clean if self.next_clean is not None and self.first.hz else self.first
