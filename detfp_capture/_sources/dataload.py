"""The data pipeline's worker processes: what they do is never a record of the training step.

A ``DataLoader`` with ``num_workers > 0`` builds batches in processes it forks. Two things follow:

* the main process receives each batch whenever a worker delivers it (``_next_data``: unpickle,
  rebuild the tensors over shared memory with ``empty`` + ``set_``, keep batches that arrived out
  of order), so how many batches it rebuilds while a given step runs depends on the workers'
  timing, not on the program. At level ``ops`` that receiving is the loader's work, not the
  step's: it runs unrecorded (``patches.unrecorded``), and the batch is recorded where the model
  takes it (the root's ``batch`` record), its values and all. A pin-memory thread is another
  thread, which capture never records;
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

from torch.utils.data import dataloader

from detfp_capture._sources.context import CaptureContext
from detfp_capture._sources.patches import unrecorded

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
            wrap = unrecorded(self.ctx.rec, self.ctx.scope)
            self.ctx.patches.wrap(dataloader._MultiProcessingDataLoaderIter, "_next_data", wrap)
