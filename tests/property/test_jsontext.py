"""``render.jsontext.dumps`` writes exactly the bytes of ``json.dumps(finite(doc), indent=2,
sort_keys=True)`` (the CLI's reports are byte-stable, and the fast writer must not be a second
format), and that text is strict RFC 8259 JSON: no bare ``NaN`` or ``Infinity``."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from detfp_analyze.render.jsontext import dumps
from detfp_format.strictjson import NONFINITE, finite, loads
from detfp_format.strictjson import dumps as strict_dumps

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=6),
    st.sampled_from(["", "é", "\u2028", '"', "\\", "\x00", "\U0001f600"]),
)
keys = st.one_of(st.text(max_size=4), st.integers(), st.floats(allow_nan=False), st.booleans(), st.none())
documents = st.recursive(
    scalars,
    lambda c: (
        st.lists(c, max_size=5)
        | st.lists(c, max_size=5).map(tuple)
        | st.lists(st.integers(), max_size=6)
        | st.lists(st.text(max_size=3), max_size=4)
        | st.dictionaries(st.text(max_size=3), c, max_size=4)
        | st.dictionaries(st.integers(), c, max_size=3)
    ),
    max_leaves=30,
)


@settings(max_examples=600, deadline=None, derandomize=True)
@given(documents)
def test_the_text_is_json_dumps_indented_and_sorted(doc):
    text = dumps(doc)
    assert text == json.dumps(finite(doc), indent=2, sort_keys=True, allow_nan=False)
    loads(text)  # strict JSON: parses without the bare words NaN and Infinity


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.dictionaries(keys, scalars, max_size=4))
def test_keys_of_every_kind_and_refusals_agree(doc):
    try:
        want = json.dumps(finite(doc), indent=2, sort_keys=True)
    except TypeError:  # keys of mixed types cannot be sorted
        with pytest.raises(TypeError):
            dumps(doc)
        return
    assert dumps(doc) == want


def test_values_json_cannot_write_are_refused_as_json_refuses_them():
    for doc in ({"a": {1, 2}}, [object()], {(1, 2): 3}):
        with pytest.raises(TypeError):
            json.dumps(doc, indent=2, sort_keys=True)
        with pytest.raises(TypeError):
            dumps(doc)


def test_special_numbers_and_int_subclasses():
    import enum

    class E(enum.IntEnum):
        A = 3

    doc = {"x": [math.nan, math.inf, -math.inf, 0.1, -0.0, 10**30, E.A, True, 1], "y": [E.A, 2], "z": [[], {}, ()]}
    assert dumps(doc) == json.dumps(finite(doc), indent=2, sort_keys=True)


# Long lists of integers are written once per content and depth: the same list at other depths,
# and lists of floats or bools equal to those integers, must still get their own text.
_long = st.lists(st.integers(-3, 3), min_size=32, max_size=40)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(_long, st.integers(0, 3))
def test_repeated_long_integer_lists_keep_their_text_at_every_depth(xs, depth):
    as_float = [float(x) for x in xs]
    as_bool = [bool(x % 2) for x in xs]
    ones = [1] * len(xs)
    doc: object = {"a": xs, "b": [xs, {"c": xs}], "d": as_float, "e": as_bool, "f": [True] * len(xs), "g": ones}
    for _ in range(depth):
        doc = {"x": doc, "y": list(xs)}
    assert dumps(doc) == json.dumps(doc, indent=2, sort_keys=True)


def test_non_finite_values_are_strings_and_the_bare_words_are_refused():
    doc = {"metric_b": float("nan"), "up": float("inf"), "down": [float("-inf"), 1.5], "n": 3}
    want = {"metric_b": "NaN", "up": "Infinity", "down": ["-Infinity", 1.5], "n": 3}
    assert loads(dumps(doc)) == want
    assert loads(strict_dumps(doc, sort_keys=True)) == want
    assert set(NONFINITE.values()) == {"NaN", "Infinity", "-Infinity"}
    for bare in ("NaN", "[Infinity]", '{"a": -Infinity}'):
        with pytest.raises(ValueError, match="is not JSON"):
            loads(bare)
    with pytest.raises(ValueError):  # a value finite() did not see is refused, never written bare
        json.dumps(float("nan"), allow_nan=False)
