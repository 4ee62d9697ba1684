"""A window column given once per distinct value: ``Indexed(values, index)``.

Most columns of a records window repeat per call, not per record: the step, microbatch,
phase, module, kind, name, occurrence, compiled flag and argument digest are the same for every
tensor of one call (a few per op). The capture hands those columns over as the call's values
and, per record, the index of its call (one ``index`` list shared by all of them), so the
writer converts each value once and its key hash is computed once per call; the rows it writes
are the same (``Indexed.expand``: what a plain list column would have held).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pyarrow as pa

__all__ = ["Indexed", "column_bounds", "to_arrow"]


class Indexed:
    """A column whose row ``i`` is ``values[index[i]]``."""

    __slots__ = ("index", "values")

    def __init__(self, values: list, index: list[int]) -> None:
        self.values = values
        self.index = index

    def __len__(self) -> int:
        return len(self.index)

    def expand(self) -> list:
        """The column as a plain list, row by row."""
        values = self.values
        return [values[i] for i in self.index]

    def __repr__(self) -> str:
        return f"Indexed({len(self.values)} values, {len(self.index)} rows)"


def column_bounds(col: Sequence[Any] | Indexed) -> tuple[Any, Any]:
    """(min, max) of a non-empty column (an ``Indexed`` one: of the values its rows use; every
    value is used by the columns the capture builds, whose values are its calls')."""
    values = col.values if isinstance(col, Indexed) else col
    return min(values), max(values)


def to_arrow(col: Sequence[Any] | Indexed, type_: pa.DataType, indices: dict[int, pa.Array]) -> Any:
    """What ``pa.Table.from_pydict`` takes for ``col``: the list itself, or for an ``Indexed``
    column its values converted once and taken by row (``indices``: the converted index lists
    of this table, by identity, so columns sharing an index convert it once)."""
    if not isinstance(col, Indexed):
        return col
    idx = indices.get(id(col.index))
    if idx is None:
        idx = indices[id(col.index)] = pa.array(col.index, type=pa.int32())
    return pa.array(col.values, type=type_).take(idx)
