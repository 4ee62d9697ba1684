"""The one guard around capture's own work: it never raises into the training step.

Every hook, wrapper and callback of the capture runs its work as

    with rec.guard("forward hook of {!r}", path):
        ...

An exception inside becomes ``Recorder.fail(exc, where)`` (a ``capture_error`` event, one
warning, capture switched off) and is swallowed, so the training step carries on; the text of
``where`` is formatted only then. By default the block runs in the tracer's busy state
(``Recorder.enter``/``leave``: the dispatch mode is off the stack, so the tracer's own tensor
work is never recorded); ``busy=False`` is for work that enters it itself or must not.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Guard"]


class Guard:
    """Context manager: enter/leave the tracer's busy state; an Exception ends in ``fail``."""

    __slots__ = ("_args", "_busy", "_rec", "_where", "failed")

    def __init__(self, rec: Any, where: str, args: tuple, busy: bool) -> None:
        self._rec = rec
        self._where = where
        self._args = args
        self._busy = busy
        #: Whether the block raised (and capture was switched off).
        self.failed = False

    def __enter__(self) -> Guard:
        if self._busy:
            self._rec.enter()
        return self

    def __exit__(self, tp: Any, exc: BaseException | None, tb: Any) -> bool:
        rec = self._rec
        try:
            if exc is None or not isinstance(exc, Exception):
                return False
            if not self._busy and rec.depth == 0:
                rec.busy = False  # set by hand on the dispatch mode's hot path (see CaptureMode)
            self.failed = True
            rec.fail(exc, self._where.format(*self._args) if self._args else self._where)
            return True
        finally:
            if self._busy:
                rec.leave()
