"""The record path's native helpers (``_recorder/_hostpath.c``) against their Python fallbacks:
the Slot type (same fields and behaviour, not tracked by the cyclic collector) and the staging
buffer's byte copy (``Staging.put_one``: the same rows, bytes and columns as ``put_many``)."""

from __future__ import annotations

import gc

import pytest
import torch

from detfp_capture._digest.staging import Staging
from detfp_capture._recorder import slot as slot_mod
from detfp_capture._recorder.slot import PySlot, Slot
from tests import native_half

native = native_half.needs(slot_mod.NATIVE, native_half.RECORD)

FIELDS = PySlot.__slots__


@pytest.mark.skipif(not native_half.can_build(), reason="no C compiler or no Python headers here: the helpers are optional")
def test_the_record_helpers_are_built_where_they_can_be():
    """``scripts/bootstrap.sh`` builds them; a silently missing build would leave the record path in
    Python and its native tests skipped (``DETFP_REQUIRE_NATIVE=1`` fails those too)."""
    assert slot_mod._hostpath is not None, "detfp_capture._recorder._hostpath is not built: rerun scripts/bootstrap.sh"
INIT = ("pending", "hi", "lo", "extra", "ref", "version", "opt_rows", "opt_moments", "source")


def _state(s: object) -> dict:
    out = {}
    for f in FIELDS:
        try:
            out[f] = getattr(s, f)
        except AttributeError:
            out[f] = "<unset>"
    return out


@native
def test_native_slot_behaves_as_the_python_slot():
    marker = object()
    a, b = Slot(marker), PySlot(marker)
    assert type(a) is not PySlot and _state(a) == _state(b)
    assert {f for f, v in _state(a).items() if v != "<unset>"} == set(INIT)
    for name in ("lanes", "rows_lanes", "moments", "pointer", "components", "error", "rows_meta", "arena_moments",
                 "type_name"):  # fmt: skip
        assert getattr(a, name) == getattr(b, name)
        for s in (a, b):
            with pytest.raises(AttributeError):
                setattr(s, name, 1)  # class attributes, read-only on an instance
    for s in (a, b):
        with pytest.raises(AttributeError):
            s.not_a_field = 1
        assert not s.resolved and s.started() is marker
        s.arena, s.row, s.hi = "arena", 3, 7
        assert s.resolved and (s.arena, s.row) == ("arena", 3)
        del s.arena
        with pytest.raises(AttributeError):
            _ = s.arena
    from detfp_capture._digest.batched import BATCHED

    c = Slot(BATCHED)
    assert c.started() is c
    with pytest.raises(TypeError):
        Slot()
    with pytest.raises(TypeError):
        Slot(None, None)


@native
def test_native_slots_are_not_tracked_and_free_what_they_hold():
    s = Slot(None)
    assert not gc.is_tracked(s) and gc.is_tracked(PySlot(None))
    held = torch.zeros(3)
    import weakref

    s.source, s.pending = [held], held
    ref = weakref.ref(held)
    del held
    assert ref() is not None
    del s  # reference counting alone frees it and what it held
    assert ref() is None


def _staged(put_one: bool, tensors: list[torch.Tensor]) -> tuple[bytes, tuple]:
    st = Staging(torch.device("cpu"), cap_bytes=1 << 20, byte_copy=slot_mod.copy_bytes)  # as the recorder makes it
    slots = [PySlot(None) for _ in tensors]
    for t, s in zip(tensors, slots, strict=True):
        assert st.put_one(t, s) if put_one else st.put_many([t], [s])
    used = st.used
    data = bytes(st.buf[: used * 1024].numpy().tobytes())
    order = [slots.index(y) for y in st.items[0]]  # slots by position (each call has its own)
    cols = (order, *st.items[1:])
    return data, (used, cols)


def test_put_one_stages_what_put_many_stages():
    g = torch.Generator().manual_seed(3)
    base = torch.randn(40, 33, generator=g)
    tensors = [
        torch.randn(2, 8, 16, generator=g),
        torch.randn(5, generator=g).to(torch.bfloat16),
        torch.randint(-(2**40), 2**40, (7, 3), generator=g),  # int64: its pointer check reads the snapshot
        base.t(),  # not contiguous: copy_
        base[3:9, 1:30],  # a strided view with an offset
        base[5],  # contiguous with an offset
        torch.ones(300, dtype=torch.bool),  # not a byte-copy dtype
        torch._efficientzerotensor(6),  # no storage to read
        torch.randn(3, 4, generator=g, requires_grad=True) * 2,  # in the graph: not recorded by autograd
        torch.randn(1, generator=g, dtype=torch.float64),
    ]
    assert _staged(True, tensors) == _staged(False, tensors)


def test_put_one_digests_as_digest_start():
    from detfp_capture import digest

    g = torch.Generator().manual_seed(5)
    tensors = [torch.randn(3, 17, generator=g), torch.randn(64, generator=g).half(), torch.arange(12).view(3, 4).t()]
    st = Staging(torch.device("cpu"), byte_copy=slot_mod.copy_bytes)
    slots = [PySlot(None) for _ in tensors]
    for t, s in zip(tensors, slots, strict=True):
        assert st.put_one(t, s)
    st.run_into()
    got = digest.resolve([s.started() for s in slots])
    want = digest.resolve([digest.start(t) for t in tensors])
    assert [(r.hi, r.lo) for r in got] == [(r.hi, r.lo) for r in want]


def test_put_one_refuses_when_full_and_keeps_nothing():
    st = Staging(torch.device("cpu"), cap_bytes=4096)
    assert st.put_one(torch.zeros(1000), PySlot(None))  # 4 rows: full
    assert not st.put_one(torch.zeros(1), PySlot(None))
    assert st.used == 4 and len(st.items[0]) == 1
