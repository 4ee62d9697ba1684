"""Fault injection for the reliability tests: named points in the writer where a fault can be planted.

Inert unless the environment variable ``DETFP_FAULT`` is set (one ``os.environ`` lookup per
point; the points sit on per-window and per-file paths, never per record). The value is a
comma-separated list of ``POINT[@N]:ACTION``:

* ``POINT``: a name passed to ``hit`` (``shard-mid-write``, ``commit-before``, ...; the list is
  in docs/reliability.md); ``@N`` restricts it to window N (writer points) or to the N-th
  hit (manifest points, counted from 1); without it every hit fires;
* ``ACTION``: ``kill`` (SIGKILL this process, as the OOM killer or a scheduler would),
  ``enospc`` / ``erofs`` / ``eacces`` / ``eio`` (raise that OSError, as the file system
  would), or ``sleep=SECONDS`` (a slow file system).

Used only by tests (tests/integration/test_faults.py); documented so that anyone can reproduce a fault.
"""

from __future__ import annotations

import errno
import os
import signal
import threading
import time

__all__ = ["ENV", "hit"]

#: The environment variable that plants faults.
ENV = "DETFP_FAULT"
_ERRORS = {"enospc": errno.ENOSPC, "erofs": errno.EROFS, "eacces": errno.EACCES, "eio": errno.EIO}


class _Plan:
    """The parsed value of DETFP_FAULT, with its per-point hit counters."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.rules: list[tuple[str, int | None, str]] = []
        for part in text.split(","):
            part = part.strip()
            if not part:
                continue
            where, _, action = part.partition(":")
            point, _, nth = where.partition("@")
            self.rules.append((point, int(nth) if nth else None, action or "kill"))
        self.counts: dict[str, int] = {}
        self.lock = threading.Lock()


_plan: _Plan | None = None  # parsed once per process (and again if the variable changes)


def hit(point: str, index: int | None = None) -> None:
    """A fault point. ``index``: the window number (writer points); None counts hits instead."""
    text = os.environ.get(ENV)
    if not text:
        return
    global _plan
    if _plan is None or _plan.text != text:
        _plan = _Plan(text)
    plan = _plan
    with plan.lock:
        n = plan.counts.get(point, 0) + 1
        plan.counts[point] = n
    where = n if index is None else index
    for name, nth, action in plan.rules:
        if name != point or (nth is not None and nth != where):
            continue
        if action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(10)  # the signal is delivered asynchronously; never run past the point
        elif action.startswith("sleep="):
            time.sleep(float(action[len("sleep=") :]))
        elif action in _ERRORS:
            code = _ERRORS[action]
            raise OSError(code, f"{os.strerror(code)} (injected at {point})")
