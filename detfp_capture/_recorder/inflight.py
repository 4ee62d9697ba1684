"""Tensors whose producer has not completed: what reads them waits for the completion.

An asynchronous collective writes its output after it returns: a functional collective
(``torch.distributed._functional_collectives``, DTensor's redistributions) until the program's
``wait_tensor``, which an ``AsyncCollectiveTensor`` runs at its first non-view use; a
``torch.distributed`` call with ``async_op=True`` until ``Work.wait()``. A record of such a tensor
made before then (the collective's own output, a module output that is the wrapper, a probe, a
metric, an op's input at level ops) must not read it: the bytes are half written and differ
between identical runs. So:

* the source that launches such a collective registers the buffers it writes (``launch``),
  keyed by their storages, with how capture can complete them itself;
* a digest, dump or metric of a tensor with bytes in such a storage (through a view, or through
  a wrapper's components: an ``AsyncCollectiveTensor``, a DTensor holding one) is taken when
  its producer completes (``after``), not now;
* the program's own wait completes them (``completed``, called by the wait wrappers): nothing here
  waits earlier than the program does;
* at the step end, after the step's work, capture completes what something waits for and the
  program has not waited for yet (``finish``: a wait then changes no value), and a flush inside
  a step is put off while anything waits here (``waiting``).

Only the storages matter, so a tensor's dtype, shape or wrapper never hides its producer. A
wait capture does not see (an op overload called directly, compiled code) leaves the flight to
the step end: a write into the buffer after that wait is what the waiting digests read.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from detfp_capture._digest.awaited import PLAIN, unwaited
from detfp_capture._recorder.slot import storage_ptrs

__all__ = ["InFlight", "Waiter"]

#: Run when the producer completed.
Waiter = Callable[[], None]


class _Flight:
    """One buffer an asynchronous collective is writing."""

    __slots__ = ("buffer", "complete", "ptrs", "step", "waiters")

    def __init__(self, buffer: torch.Tensor, ptrs: list[int], complete: Callable[[], Any], step: int) -> None:
        self.buffer = buffer
        #: The step it was launched in.
        self.step = step
        #: The data pointers of the storages it writes.
        self.ptrs = ptrs
        #: Waits for the collective (capture's own completion, at the step end).
        self.complete = complete
        self.waiters: list[Waiter] = []


def _trigger_wait(t: Any) -> Any:
    """An ``AsyncCollectiveTensor``'s own wait (what its first non-view use runs)."""
    return t.trigger_wait()


class InFlight:
    """Storages an asynchronous collective is writing, and what waits for each to complete."""

    __slots__ = ("by_storage", "tracking")

    def __init__(self) -> None:
        #: Storage data pointer -> the flight writing it (a buffer is held until it completes,
        #: so its address cannot be reused meanwhile).
        self.by_storage: dict[int, _Flight] = {}
        #: Every functional collective launched since the session opened is registered here
        #: (its wrappers are installed): one that is not has completed.
        self.tracking = False

    def __bool__(self) -> bool:
        return bool(self.by_storage)

    @property
    def waiting(self) -> bool:
        """Something waits for a completion (a mid-step flush must be put off)."""
        return any(f.waiters for f in self.by_storage.values())

    def launch(self, buffers: list[torch.Tensor], complete: Callable[[torch.Tensor], Any], step: int) -> None:
        """``buffers`` are being written by a collective launched in ``step`` (call right after
        its launch, so an in-place one's version bump is in); ``complete(buffer)`` waits for it."""
        for b in buffers:
            ptrs = storage_ptrs(b)
            if not ptrs:
                continue
            flight = _Flight(b, ptrs, functools.partial(complete, b), step)
            for p in ptrs:
                self.by_storage[p] = flight

    def after(self, t: torch.Tensor, waiter: Waiter) -> bool:
        """Run ``waiter`` once every collective writing ``t``'s bytes has completed; False (and
        nothing kept) when none is.

        Where the launches are not tracked (level metrics), an ``AsyncCollectiveTensor`` whose
        wait has not run counts as in flight too: its own wait completes it, the program's or
        capture's at the step end."""
        by = self.by_storage
        if not self.tracking and t.__class__ not in PLAIN:
            for a in unwaited(t):
                if not any(p in by for p in storage_ptrs(a) or ()):
                    self.launch([a], _trigger_wait, -1)
        if not by:
            return False
        flights = {id(f): f for p in (storage_ptrs(t) or ()) if (f := by.get(p)) is not None}
        if not flights:
            return False
        if len(flights) == 1:
            next(iter(flights.values())).waiters.append(waiter)
            return True
        left = [len(flights)]

        def one() -> None:
            left[0] -= 1
            if left[0] == 0:
                waiter()

        for f in flights.values():
            f.waiters.append(one)
        return True

    def when_complete(self, t: torch.Tensor, waiter: Waiter) -> None:
        """``waiter()`` now when nothing writes ``t``'s bytes any more, else ``after``."""
        if not ((self.by_storage or t.__class__ not in PLAIN) and self.after(t, waiter)):
            waiter()

    def completed(self, tensors: list[torch.Tensor]) -> None:
        """The program waited for the collective writing ``tensors`` (``wait_tensor``, ``Work.wait``)."""
        by = self.by_storage
        for t in tensors:
            for p in storage_ptrs(t) or ():
                f = by.get(p)
                if f is not None:
                    self._done(f)

    def finish(self, step: int) -> None:
        """At the end of ``step``: complete the collectives that something waits for and that the
        program has not waited for yet (capture waits for them now, after the step's work), in
        launch order, and run what waits. Those nothing waits for stay until the program waits
        for them (a collective launched in a step and waited for in the next), at most until
        the next step ends."""
        for f in list({id(f): f for f in self.by_storage.values()}.values()):
            if f.waiters:
                try:
                    f.complete()
                finally:
                    self._done(f)
            elif f.step != step:
                self._done(f)

    def reset(self) -> None:
        """Forget everything (capture failed: the records that waited are dropped)."""
        self.by_storage = {}

    def _done(self, f: _Flight) -> None:
        by = self.by_storage
        for p in f.ptrs:
            if by.get(p) is f:
                del by[p]
        waiters, f.waiters = f.waiters, []
        for w in waiters:
            w()
