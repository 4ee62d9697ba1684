"""The ``Slot``: one digest as the buffered records see it, from started to resolved.

A record holds a ``Slot`` (or None: counted, not digested). The slot goes through three states:
waiting for a batch (``pending`` None, see ``batches``), started (``pending``: a
``digest.Pending``, or ``BATCHED`` when it is a row of a batch and the slot itself stands for
the pending; ``COPY`` when its tensor is an exact copy of another slot's, whose digest it
takes; ``COMBINE`` for a tensor subclass's whole, whose digest is combined from its parts'),
and resolved at the flush (``hi``/``lo``: the digest as two unsigned 64-bit integers;
``extra``: a ``digest.Resolved`` when the digest has an error, row digests, moments or a
pointer flag). One slot is shared by every record of the same (tensor, version): it is also
the version cache's entry (``ref``, ``version``, ``opt_rows``, ``opt_moments``).

Also the small helpers every part of the recorder uses: dtype text, the collector pause, the
storages a tensor's bytes live in.
"""

from __future__ import annotations

import contextlib
import gc
import os
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from detfp_capture._digest.batched import BATCHED

__all__ = [
    "COMBINE", "COPY", "DTYPE_STR", "NATIVE", "SHAPES", "Slot", "copy_bytes", "dtype_str", "gc_paused", "held_ref",
    "shape_tuple",
    "storage_ptrs",
]  # fmt: skip

try:  # the record path's native helpers (setup.py; optional)
    from detfp_capture._recorder import _hostpath  # C (its types: _hostpath.pyi)
except ImportError:  # not built: the Python class below and torch's copies, the same trace
    # Typed as the module (the stub) for its uses, each behind NATIVE, which is False here.
    _hostpath = None  # type: ignore[assignment]
#: Whether the native Slot and byte copy are used: built, and not switched off by
#: ``DETFP_NATIVE=0`` (the same switch as the digest's kernel: the pure-Python record path).
NATIVE = _hostpath is not None and os.environ.get("DETFP_NATIVE", "") != "0"
#: ``copy_bytes(dst, src, n)``: memcpy between two addresses (None without the native helpers).
copy_bytes = _hostpath.copy_bytes if NATIVE else None
#: ``weakref.ref`` for the references capture holds until a flush; the native one is not tracked
#: by the cyclic collector (``_hostpath.untracked_ref``: without a callback it cannot be part of
#: a cycle; tracked, a window's hundreds were promoted and brought on full collections).
held_ref: Callable[[Any], weakref.ReferenceType] = (
    getattr(_hostpath, "untracked_ref", weakref.ref) if NATIVE else weakref.ref
)

#: ``Slot.pending`` of a slot whose tensor is an exact copy of another slot's (``Slot.source``).
COPY = object()
#: ``Slot.pending`` of a tensor subclass's whole record: its digest is combined at the flush
#: from the slots of its parts' records (``Slot.source``: a ``subclass.Combo``).
COMBINE = object()

#: dtype -> str(dtype), filled as dtypes are seen (str() of a dtype costs a call per record).
DTYPE_STR: dict[torch.dtype, str] = {}
#: Shape (a torch.Size or tuple) -> one shared tuple of it (``shape_tuple``). A record's shape
#: lives until the flush; one new tuple per record was one more object per record for the
#: cyclic collector to count and look at (a tuple is untracked only at its first collection),
#: so the hot paths look the shape up here instead. Bounded: emptied when full.
SHAPES: dict[tuple, tuple[int, ...]] = {}
_SHAPES_MAX = 1 << 16


def shape_tuple(shape: tuple) -> tuple[int, ...]:
    """The shared tuple of ``shape`` (the hot paths try ``SHAPES.get`` first)."""
    got = SHAPES.get(shape)
    if got is None:
        if len(SHAPES) >= _SHAPES_MAX:
            SHAPES.clear()
        got = tuple(shape)
        SHAPES[got] = got
    return got


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector around a bulk step of the tracer's own work.

    The objects such a step allocates are freed by reference counting when it ends; a
    collection that runs in the middle finds them alive, and a generation-1 one promotes them
    to the oldest generation, whose growth is what triggers full collections (each traverses
    the whole heap). Collection is enabled again right after, if it was enabled before."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def dtype_str(dt: torch.dtype) -> str:
    s = DTYPE_STR.get(dt)
    if s is None:
        s = DTYPE_STR[dt] = str(dt)
    return s


class PySlot:
    """One digest: device-side state until the flush resolves it into ``hi``/``lo``.

    ``pending`` is a ``digest.Pending``, or ``BATCHED`` when the digest is a row of a batch
    (``arena``/``row``, filled by ``_digest.batched.fill``): then the slot itself stands for the
    pending (it has the attributes ``digest.resolve`` reads), one object per digest instead of two.
    Also the version cache's entry for the tensor it digests (weak reference, version, options).
    See ``records`` on why the object count matters.
    """

    __slots__ = (
        "arena",
        "arena_pointer",
        "device",
        "dtype",
        "extra",
        "hi",
        "lo",
        "numel",
        "opt_moments",
        "opt_rows",
        "pending",
        "ref",
        "row",
        "shape",
        "source",
        "version",
    )

    # Set only on a batch's row (``_digest.batched.fill``), never read before.
    arena: Any
    arena_pointer: bool
    row: int
    device: Any
    dtype: torch.dtype
    shape: tuple[int, ...]
    numel: int

    # What digest.resolve reads from a pending and a batched row never has.
    lanes = rows_lanes = moments = pointer = components = error = None
    rows_meta: tuple = ()
    arena_moments = False
    type_name = ""

    def __init__(self, pending: Any) -> None:
        self.pending = pending
        #: The resolved digest's high and low 64 bits (None until resolved, or without a digest).
        self.hi: int | None = None
        self.lo: int | None = None
        #: A ``digest.Resolved`` when there is more than the two words (an error, row digests,
        #: moments, a pointer flag); None for a plain digest.
        self.extra: Any = None
        self.ref: Any = None
        self.version: int | None = None
        self.opt_rows: bool | int = False
        self.opt_moments = False
        #: Where the flush takes this slot's digest from (``flush.resolve_slots``): with
        #: ``pending`` ``COPY``, the Slot of the tensor this one's tensor is an exact copy of; with
        #: ``COMBINE``, the parts of a tensor subclass (``subclass.Combo``) whose digests it combines.
        self.source: Any = None

    @property
    def resolved(self) -> bool:
        return self.hi is not None or self.extra is not None

    def started(self) -> Any:
        """What to hand to ``digest.resolve``."""
        return self if self.pending is BATCHED else self.pending


def _native_slot() -> type:
    """``_hostpath.Slot`` (the same fields, not tracked by the cyclic collector) with what the
    Python class adds on top of its fields: class attributes, ``resolved`` and ``started``."""
    tp = _hostpath.Slot
    for name in ("lanes", "rows_lanes", "moments", "pointer", "components", "error", "rows_meta", "arena_moments",
                 "type_name", "resolved", "started"):  # fmt: skip
        setattr(tp, name, PySlot.__dict__[name])
    tp.__doc__ = PySlot.__doc__
    return tp


#: The Slot class the recorder uses. The Python class is tracked by the cyclic collector: a
#: window's thousands of live Slots survived its young collections and were promoted, which
#: triggered full collections of the whole heap (``_hostpath.c``); the native one is not. Both
#: have the same fields and write the same trace (tests/golden/test_capture_records.py runs both).
if TYPE_CHECKING:  # the checker reads the Python class: the native one has its fields
    Slot = PySlot
else:
    Slot = _native_slot() if NATIVE else PySlot


def storage_ptrs(t: torch.Tensor) -> list[int] | None:
    """Data pointers of the storages that hold ``t``'s bytes: its own, or for a wrapper subclass
    without one (DTensor, ...) its inner tensors' through ``__tensor_flatten__``; None when
    unknown (sparse, an opaque subclass)."""
    try:
        return [t.untyped_storage().data_ptr()]
    except Exception:
        pass
    flatten = getattr(t, "__tensor_flatten__", None)
    if flatten is None:
        return None
    try:
        names, _ = flatten()
    except Exception:
        return None
    out: list[int] = []
    for name in names:
        inner = getattr(t, name, None)
        if not isinstance(inner, torch.Tensor):
            continue  # a non-tensor component (DTensor's device mesh) holds no data
        ptrs = storage_ptrs(inner)
        if ptrs is None:
            return None
        out += ptrs
    return out or None
