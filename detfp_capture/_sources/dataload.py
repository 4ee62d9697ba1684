"""The data pipeline's worker processes: what they do is never a record of the training step.

A ``DataLoader`` with ``num_workers > 0`` builds batches in processes it forks. Two things follow:

* the main process receives each batch whenever a worker delivers it (``_next_data``: unpickle,
  rebuild the tensors over shared memory with ``empty`` + ``set_``, keep batches that arrived out
  of order), so how many batches it rebuilds while a given step runs depends on the workers'
  timing, not on the program. At level ``ops`` that receiving is the loader's work, not the
  step's: it runs unrecorded (``patches.unrecorded``), and what it returns is recorded as a
  ``batch`` (named ``contract.LOADER_BATCH``), one per batch the program takes, in the order it
  takes them: a data difference is a ``source`` there, before the first op that reads the batch
  (a ``.to(device)``). A pin-memory thread is another thread, which capture never records;
* a forked child (a worker, or any process the job forks) inherits the session, its dispatch
  mode, its hooks and its buffers, but not the writer's thread: it is not a rank and writes
  nothing, so capture turns itself off in it at once (``os.register_at_fork``), before the worker
  runs a single op (nothing recorded there, and no flush that would wait forever on a writer
  that does not exist).
"""

from __future__ import annotations

import functools
import os
import weakref
from typing import Any

import torch
from torch.utils.data import dataloader

from detfp_capture._sources.context import CaptureContext
from detfp_capture._sources.modules import flatten_tensors
from detfp_capture._sources.patches import unrecorded
from detfp_format import contract

__all__ = ["DataWorkers"]


def _off_in_child(ref: weakref.ReferenceType) -> None:
    """``after_in_child`` of a fork: the session's recorder, if it still lives, records nothing here."""
    rec = ref()
    if rec is not None and not rec.closed:
        rec.closed = True
        rec.selected = False


class DataWorkers:
    """Keeps the data loader's workers out of the record stream (see the module docstring)."""

    def __init__(self, ctx: CaptureContext) -> None:
        self.ctx = ctx

    def install(self) -> None:
        # One callback per session; it holds the recorder weakly, so a closed session costs nothing.
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=functools.partial(_off_in_child, weakref.ref(self.ctx.rec)))
        if self.ctx.caps.ops:
            self.ctx.patches.wrap(dataloader._MultiProcessingDataLoaderIter, "_next_data", self._receive)

    def _receive(self, orig: Any) -> Any:
        """``_next_data`` run unrecorded, then what it returns recorded as a ``batch``
        (``contract.LOADER_BATCH``): the step's first record of the data, so a difference in it
        is a source there, not an unseen producer at the first op that reads it."""
        rec, scope = self.ctx.rec, self.ctx.scope
        quiet = unrecorded(rec, scope)(orig)

        pending = self.ctx.pending_step

        def next_data(it: Any) -> Any:
            batch = quiet(it)
            if pending.number is not None and not rec.busy:
                pending.touch()  # launcher mode: the data of the next step begins it
            if rec.live and not rec.busy and not scope.bookkeeping:
                with rec.guard("a DataLoader batch"):
                    tensors: list[tuple[str, torch.Tensor]] = []
                    flatten_tensors(batch, "batch", tensors)
                    if tensors:
                        _, phase = scope.where()
                        rec.record_call(
                            "batch", contract.LOADER_BATCH, "", phase, [("input", a, t) for a, t in tensors]
                        )
            return batch

        next_data.__wrapped__ = orig  # type: ignore[attr-defined]
        return next_data
