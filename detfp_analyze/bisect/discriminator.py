"""The discriminator view of a result: every instance of the origin op, grouped by what tells them apart.

Frozen result types (the ``discriminator`` of ``result.BisectResult``): ``evidence.discriminator``
fills them from the origin ranks' divergent step; their JSON is part of the versioned report.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Discriminator", "DiscriminatorRow"]


@dataclass(frozen=True)
class DiscriminatorRow:
    """Instances of the origin op sharing one (dtype, shape, module, phase)."""

    dtype: str | None
    shape: tuple[int, ...] | None
    module: str
    phase: str
    #: Calls whose records all matched / whose output differed.
    clean: int
    divergent: int

    def to_json_dict(self) -> dict[str, Any]:
        shape = None if self.shape is None else list(self.shape)
        return {"dtype": self.dtype, "shape": shape, "module": self.module, "phase": self.phase,
                "clean": self.clean, "divergent": self.divergent}  # fmt: skip


@dataclass(frozen=True)
class Discriminator:
    """Every instance of the origin op in the divergent step of the origin ranks, grouped."""

    #: The op name.
    op: str
    #: The ranks and steps looked at.
    ranks: tuple[int, ...]
    steps: tuple[int, ...]
    rows: tuple[DiscriminatorRow, ...]

    def to_json_dict(self) -> dict[str, Any]:
        return {
            "op": self.op,
            "ranks": list(self.ranks),
            "steps": list(self.steps),
            "rows": [r.to_json_dict() for r in self.rows],
        }
