"""``torch.distributed.pipelining``'s own work: a stage's metadata inference is not training.

A ``PipelineStage`` built without its shapes (the default) infers them at the first step: it runs
its module once on tensors made from metadata (``torch.empty``: garbage that differs between
processes), takes ``torch.autograd.grad`` of that forward for the gradients' metadata, and
throws both away. Recorded, that pass makes every identical pair differ at its first step (at
level boundaries nothing tells that its inputs are garbage). So while a stage infers, capture
records nothing: the module hooks pass and the dispatch mode passes (``Scope.bookkeeping``, as
around DDP's own work); digests waiting for a batch are taken before it and cached ones dropped
after it (it writes buffers unseen). The pass runs as without capture.

Importing ``torch.distributed.pipelining`` costs seconds (it imports dynamo), so capture never
imports it: the stage classes are wrapped once the job has imported them, looked for when the
session opens, when a model is watched and when a step begins (before the first step's schedule
runs; under the launcher the script imports it after the session opened).
"""

from __future__ import annotations

import sys

from detfp_capture._sources.context import CaptureContext
from detfp_capture._sources.patches import unrecorded

__all__ = ["StageInference"]

#: A stage's metadata inference, by torch version: ``_shape_inference`` (torch 2.4-2.10), the
#: forward and backward passes of the inference protocol (later versions).
_INFERENCE = ("_shape_inference", "_forward_metadata_inference", "_backward_metadata_inference")


class StageInference:
    """Wraps the pipeline stages' metadata inference once the job has imported them."""

    def __init__(self, ctx: CaptureContext) -> None:
        self.ctx = ctx
        self.done = False

    def maybe_install(self) -> None:
        """Wrap the stage classes if ``torch.distributed.pipelining`` is imported (once);
        ``ctx.patches`` restores them at close."""
        if self.done:
            return
        stage = sys.modules.get("torch.distributed.pipelining.stage")
        if stage is None:
            return
        self.done = True
        wrap = unrecorded(self.ctx.rec, self.ctx.scope)
        classes = {getattr(stage, n, None) for n in ("PipelineStage", "_PipelineStage", "_PipelineStageBase")}
        for cls in sorted((c for c in classes if isinstance(c, type)), key=lambda c: c.__name__):
            for name in _INFERENCE:
                if name in vars(cls):  # where it is defined: a subclass's override is its own
                    self.ctx.patches.wrap(cls, name, wrap)
