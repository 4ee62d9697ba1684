"""What capture hands torch and the program in place of their own, while a session is open.

* ``Wrapper``: a function or op packet replaced by a recording one, comparing equal to it
  (torch keys tables by op packets) and passing every other attribute through;
* ``Method``: a ProcessGroup method replaced by a recording one, bound to each group as the
  original is (a pybind class keeps an ``instancemethod`` in its dictionary: close puts that back);
* ``Work``: the program's handle on a recorded collective, itself a ``torch.distributed.Work``
  (FSDP2 waits only for ``isinstance(work, Work)``), whose ``wait()`` records what the call wrote;
* ``Waited``: what a synchronous call returns to the c10d function that made it (which only
  waits for it again): that wait runs as the library's work (gloo copies the output again).

Each is released at close (``release``): one the program or torch kept calls the original from
then on and holds nothing of the session.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

__all__ = ["Method", "Waited", "Work", "Wrapper"]


class Wrapper:
    """A wrapper that compares equal to the function it wraps (torch keys tables by op packets)
    and passes every other attribute through (an op packet's ``.default``)."""

    def __init__(self, orig: Callable, fn: Callable) -> None:
        self.__wrapped__ = orig
        self._fn = fn
        self.__name__ = getattr(orig, "__name__", "collective")
        self.__qualname__ = getattr(orig, "__qualname__", self.__name__)
        self.__doc__ = getattr(orig, "__doc__", None)
        self.__module__ = getattr(orig, "__module__", "torch.distributed")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._fn(*args, **kwargs)

    def release(self) -> None:
        """At the session's close (``Patches.restore``): call the original from now on, and drop
        the recording function (and, through its closure, the session)."""
        self._fn = self.__wrapped__

    def __eq__(self, other: object) -> bool:
        return other is self or other is self.__wrapped__

    def __hash__(self) -> int:
        return hash(self.__wrapped__)

    def __getattr__(self, name: str) -> Any:
        if name == "__wrapped__":  # not set yet
            raise AttributeError(name)
        return getattr(self.__wrapped__, name)


class Method:
    """A ProcessGroup method replaced while a session is open: bound to each group as the
    original is. Released at close, it calls the original (a bound method kept meanwhile)."""

    def __init__(self, attr: Any, orig: Callable, fn: Callable) -> None:
        #: The class attribute it replaces (pybind's instancemethod: what close puts back).
        self.attr = attr
        self.orig = orig
        self.fn = fn

    def __get__(self, obj: Any, cls: Any = None) -> Any:
        return self if obj is None else types.MethodType(self.fn, obj)

    def __call__(self, pg: Any, *args: Any, **kwargs: Any) -> Any:  # ProcessGroup.allreduce(pg, ...)
        return self.fn(pg, *args, **kwargs)

    def release(self) -> None:
        self.fn = self.orig


class Work(dist.Work):
    """The program's handle on a recorded call: ``wait()`` also records what the call wrote.
    A ``Work`` itself (FSDP2 waits only for ``isinstance(work, Work)``); everything else is the
    backend's work's."""

    def __init__(self, work: Any, on_wait: Callable[[], None], scope: Any) -> None:
        super().__init__()
        self._work = work
        self._on_wait: Callable[[], None] | None = on_wait
        self._scope = scope

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        scope = self._scope
        scope.bookkeeping += 1  # the backend's own ops finishing the call (gloo's copies out) are not the program's
        try:
            result = self._work.wait(*args, **kwargs)
        finally:
            scope.bookkeeping -= 1
        cb, self._on_wait = self._on_wait, None
        if cb is not None:
            cb()
        return result

    def get_future(self, *a: Any, **k: Any) -> Any:
        return self._work.get_future(*a, **k)

    def get_future_result(self, *a: Any, **k: Any) -> Any:
        return self._work.get_future_result(*a, **k)

    def is_completed(self) -> Any:
        return self._work.is_completed()

    def is_success(self) -> Any:
        return self._work.is_success()

    def exception(self) -> Any:
        return self._work.exception()

    def result(self) -> Any:
        return self._work.result()

    def source_rank(self) -> Any:
        return self._work.source_rank()

    def _source_rank(self) -> Any:
        return self._work._source_rank()

    def synchronize(self) -> Any:
        return self._work.synchronize()

    def block_current_stream(self) -> Any:
        return self._work.block_current_stream()

    def boxed(self) -> Any:
        return self._work.boxed()

    def _get_op_type(self) -> Any:
        return self._work._get_op_type()

    def _get_duration(self) -> Any:
        return self._work._get_duration()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_work"], name)


class Waited:
    """A synchronous call's work, already waited for and recorded: the wait the c10d function
    makes next runs unrecorded (``scope.bookkeeping``; gloo's reduce-scatter copies its output
    again there). A plain object: that function only waits for it and drops it."""

    __slots__ = ("_scope", "_work")

    def __init__(self, work: Any, scope: Any) -> None:
        self._work = work
        self._scope = scope

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        scope = self._scope
        scope.bookkeeping += 1
        try:
            return self._work.wait(*args, **kwargs)
        finally:
            scope.bookkeeping -= 1

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)
