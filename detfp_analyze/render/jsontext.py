"""The CLI's indented JSON text: the bytes ``json.dumps(finite(doc), indent=2, sort_keys=True)`` writes, faster.

Strict RFC 8259 JSON (``detfp_format.strictjson``): a non-finite float value is written as the
string ``"NaN"``, ``"Infinity"`` or ``"-Infinity"``, never as a bare word. With
``indent`` set, the standard library encodes in Python, one generator step per value. A bisect
report of N ranks names every rank's group (N members each): about N^2 integers, 17.8 MB of text
at 1,024 ranks. Here a list of scalars is written by one ``str.join`` over C-level encoders (a long
list of integers once per distinct content and depth: the ranks of one group share it), and
everything else as the standard encoder does, so the text is byte-identical
(``tests/property/test_jsontext.py`` holds it to ``json.dumps`` on random documents).
"""

from __future__ import annotations

import math
from json.encoder import encode_basestring_ascii as _text
from typing import Any

__all__ = ["dumps"]

_INF = float("inf")
#: Lists of integers at least this long are written once per distinct content and depth (``_Memo``).
_MEMO_MIN = 32
_PLAIN = frozenset({int, str, float, bool, type(None)})


def _float(o: float) -> str:
    if o != o:
        return "NaN"
    if o == _INF:
        return "Infinity"
    if o == -_INF:
        return "-Infinity"
    return float.__repr__(o)


def _scalar(o: Any) -> str | None:
    """The text of a JSON scalar (the standard encoder's tests, in its order; a non-finite float as
    its ``NONFINITE`` string); None otherwise."""
    if isinstance(o, str):
        return _text(o)
    if o is None:
        return "null"
    if o is True:
        return "true"
    if o is False:
        return "false"
    if isinstance(o, int):
        return int.__repr__(o)
    if isinstance(o, float):  # a non-finite value as its strictjson.NONFINITE string
        return _float(o) if math.isfinite(o) else '"' + _float(o) + '"'
    return None


def _key(k: Any) -> str:
    """A dict key as the standard encoder turns it into text (no ``skipkeys``): a text as it is,
    any other scalar as its value's text (the encoder's key and value tests agree on those; a
    key is a string anyway, so a non-finite float key is its bare word)."""
    if isinstance(k, str):
        return k
    if isinstance(k, float):
        return _float(k)
    text = _scalar(k)
    if text is None:
        raise TypeError(f"keys must be str, int, float, bool or None, not {type(k).__name__}")
    return text


def _items(o: list[Any] | tuple[Any, ...]) -> list[str] | None:
    """Each element's text when every element is a plain scalar (one C-level pass per type)."""
    types = set(map(type, o))
    if types <= {int}:
        return list(map(int.__repr__, o))
    if types <= {str}:
        return list(map(_text, o))
    if _PLAIN.issuperset(types):
        return list(map(_scalar, o))  # type: ignore[arg-type]
    return None


#: (the integers, depth) -> the text of a list of integers only (exact ``int``: a float or bool
#: equal to an integer would be another text, and is never memoized).
_Memo = dict[tuple[tuple[int, ...], int], str]


def _write(o: Any, depth: int, out: list[str], memo: _Memo) -> None:
    text = _scalar(o)
    if text is not None:
        out.append(text)
        return
    pad = "\n" + "  " * (depth + 1)
    end = "\n" + "  " * depth
    if isinstance(o, (list, tuple)):
        if not o:
            out.append("[]")
            return
        if len(o) >= _MEMO_MIN and set(map(type, o)) == {int}:
            key = (tuple(o), depth)
            text = memo.get(key)
            if text is None:
                text = memo[key] = "[" + pad + ("," + pad).join(map(int.__repr__, o)) + end + "]"
            out.append(text)
            return
        items = _items(o)
        if items is not None:
            out.append("[" + pad + ("," + pad).join(items) + end + "]")
            return
        sep = "[" + pad
        for v in o:
            out.append(sep)
            _write(v, depth + 1, out, memo)
            sep = "," + pad
        out.append(end + "]")
        return
    if isinstance(o, dict):
        if not o:
            out.append("{}")
            return
        sep = "{" + pad
        for k, v in sorted(o.items()):
            out.append(sep + _text(_key(k)) + ": ")
            _write(v, depth + 1, out, memo)
            sep = "," + pad
        out.append(end + "}")
        return
    raise TypeError(f"Object of type {type(o).__name__} is not JSON serializable")


def dumps(doc: Any) -> str:
    """``json.dumps(finite(doc), indent=2, sort_keys=True)``, byte for byte (TypeError where it
    raises one): strict JSON, indented."""
    out: list[str] = []
    _write(doc, 0, out, {})
    return "".join(out)
