"""Strict RFC 8259 JSON, written and read the same way by every part of detfp (standard library only).

RFC 8259 has no NaN or infinity. The standard library writes them as the bare words ``NaN``,
``Infinity`` and ``-Infinity`` (which ``jq``, ``JSON.parse`` and Go reject) and reads them back
without a word. Every JSON document detfp writes goes through ``dumps`` (or ``finite`` before an
encoder of its own, ``detfp_analyze.render.jsontext``): a non-finite float value is written as the
string ``"NaN"``, ``"Infinity"`` or ``"-Infinity"`` (``NONFINITE``: the spelling of the protobuf
JSON mapping), and the encoder runs with ``allow_nan=False``, so a value that escaped ``finite``
fails loudly instead of writing invalid JSON. ``loads`` refuses the bare words, as RFC 8259 does:
a manifest or a commit line holding them was not written by detfp.
"""

from __future__ import annotations

import json
import math
from typing import Any

__all__ = ["NONFINITE", "dumps", "finite", "loads"]

#: How a non-finite float value is written (``repr`` of the float -> the JSON string).
NONFINITE = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}


def finite(doc: Any) -> Any:
    """``doc`` with every non-finite float value (in dicts, lists and tuples, at any depth) replaced
    by its ``NONFINITE`` string; keys and everything else unchanged (shared when nothing changed)."""
    if isinstance(doc, float):
        return doc if math.isfinite(doc) else NONFINITE[repr(float(doc))]
    if isinstance(doc, dict):
        items = {k: finite(v) for k, v in doc.items()}
        return doc if all(items[k] is v for k, v in doc.items()) else items
    if isinstance(doc, (list, tuple)):
        values = [finite(v) for v in doc]
        return doc if all(a is b for a, b in zip(values, doc, strict=True)) else values
    return doc


def dumps(doc: Any, **options: Any) -> str:
    """``json.dumps(finite(doc), allow_nan=False, **options)``: strict RFC 8259 text in any layout."""
    return json.dumps(finite(doc), allow_nan=False, **options)


def _refuse_constant(word: str) -> Any:
    raise ValueError(f"{word} is not JSON (RFC 8259 has no NaN or infinity)")


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        name = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise ValueError(f"the name {json.dumps(name)[:40]} occurs twice in one object")
    return out


def loads(text: str | bytes, *, unique: bool = False) -> Any:
    """``json.loads``, strictly: the bare words ``NaN``, ``Infinity`` and ``-Infinity`` (which the
    standard library accepts) are a ValueError, as any other text that is not JSON. ``unique``:
    a name repeated in one object is a ValueError too (RFC 8259 leaves its meaning open; the
    standard library keeps the last): for documents people edit, where a second ``"rank"`` would
    silently win."""
    if unique:
        return json.loads(text, parse_constant=_refuse_constant, object_pairs_hook=_unique)
    return json.loads(text, parse_constant=_refuse_constant)
