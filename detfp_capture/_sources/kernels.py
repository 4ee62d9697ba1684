"""Kernel identities for selected steps: which kernels each op record launched.

For a step selected by ``kernels=``, the session runs ``torch.profiler`` and the dispatch mode
wraps every op in ``record_function("detfp#<n>")``, n indexing the op's call. At step end the
profiler's event tree is walked: under each ``detfp#<n>`` range, the device kernels launched by
its descendants (ordered by start) become rows of the ``kernels`` table with the op's call key.
On a machine without a GPU the profiler sees no device kernels; the innermost CPU events under
the op are recorded instead (``device_type`` "cpu"), so the whole path runs in the CPU tests.
The profiler perturbs timing, never values, and only runs for the selected steps. Its library
(kineto) writes ``USDT: ... profiler_start`` / ``profiler_stop`` lines on stderr at every start
and stop whatever its log level below the top one: unless the user chose a level
(``KINETO_LOG_LEVEL``), the first start in a process sets the level above those lines.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch

from detfp_capture._recorder.call import Call, KernelRow

__all__ = ["KernelCapture"]

_PREFIX = "detfp#"
#: kineto's log levels run VERBOSE 0 .. USDT 5: one above the top silences its per-start lines.
_KINETO_QUIET = "6"


@contextlib.contextmanager
def _quiet_kineto() -> Any:
    """kineto reads ``KINETO_LOG_LEVEL`` once, when the profiler first starts in the process: set
    it for that start unless the user set it, and put the environment back right after (the
    level stays with kineto; a profiler started earlier in the process keeps its own)."""
    if os.environ.get("KINETO_LOG_LEVEL"):
        yield
        return
    os.environ["KINETO_LOG_LEVEL"] = _KINETO_QUIET
    try:
        yield
    finally:
        os.environ.pop("KINETO_LOG_LEVEL", None)


class KernelCapture:
    """One profiled step."""

    def __init__(self, rec: Any) -> None:
        self.rec = rec
        self.calls: list[Call] = []
        self.prof: Any = None
        self.cuda = torch.cuda.is_available()

    def start(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU]
        if self.cuda:
            acts.append(ProfilerActivity.CUDA)
        self.prof = profile(activities=acts)
        with _quiet_kineto():
            self.prof.__enter__()

    def range(self, call: Call) -> Any:
        self.calls.append(call)
        return torch.autograd.profiler.record_function(f"{_PREFIX}{len(self.calls) - 1}")

    def stop(self, discard: bool = False) -> None:
        prof, self.prof = self.prof, None
        if prof is None:
            return
        prof.__exit__(None, None, None)
        if discard:
            return
        rows = self.rec.kernels
        for evt in prof.events():
            name = evt.name
            if not name.startswith(_PREFIX):
                continue
            with contextlib.suppress(ValueError, IndexError):
                call = self.calls[int(name[len(_PREFIX) :])]
                for i, (kname, dev) in enumerate(self._kernels_under(evt)):
                    rows.append(KernelRow(call, i, kname, dev))

    def _kernels_under(self, evt: Any) -> list[tuple[str, str]]:
        found: list[tuple[float, str, str]] = []
        leaves: list[tuple[float, str]] = []
        stack = list(evt.cpu_children)
        while stack:
            e = stack.pop()
            for k in getattr(e, "kernels", ()) or ():
                found.append((e.time_range.start, k.name, "cuda"))
            if e.cpu_children:
                stack.extend(e.cpu_children)
            else:
                leaves.append((e.time_range.start, e.name))
        if found or self.cuda:
            found.sort(key=lambda x: x[0])
            return [(n, d) for _, n, d in found]
        leaves.sort(key=lambda x: x[0])
        return [(n, "cpu") for _, n in leaves]
