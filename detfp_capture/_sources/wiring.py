"""The record sources a ``Session`` installs for its level's capabilities, wired to one context.

Which sources run follows from ``CaptureContext.caps`` alone: module hooks, the pipeline
stages' shape-inference guard and the data loader's workers (``dataload``) always; the
collective tracer, the functional collectives and DDP's reduction at ``boundaries`` and up
(``caps.collectives``); the dispatch mode and the kernels of compiled code at ``ops``;
the step and optimizer boundaries last, holding the others (they enter the mode at a step's
start and leave it at its end). Kept apart from ``session`` so that the facade validates,
opens and closes, and this module alone says what a level installs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from detfp_capture._recorder.manifest import RunManifest
from detfp_capture._sources import pipelining
from detfp_capture._sources.context import CaptureContext
from detfp_capture._sources.dataload import DataWorkers
from detfp_capture._sources.modules import ModuleHooks
from detfp_capture._sources.steps import StepBoundaries

__all__ = ["Sources", "install_sources"]


@dataclass
class Sources:
    """What ``install_sources`` installed (None: not at this level)."""

    hooks: ModuleHooks
    #: A pipeline stage's shape inference is not recorded (wrapped once the job imports it).
    stage_inference: pipelining.StageInference
    tracer: Any
    ddp: Any
    steps: StepBoundaries


def install_sources(
    ctx: CaptureContext,
    *,
    manifest: RunManifest,
    group_names: Mapping[str, Any],
    on_root: Callable[[torch.nn.Module], None],
    learn_place: Callable[..., None],
) -> Sources:
    """Install the sources ``ctx.caps`` asks for; everything patched is restored with
    ``ctx.patches`` (the tracer and the hooks also have their own ``uninstall``/``remove``)."""
    caps = ctx.caps
    hooks = ModuleHooks(ctx, on_root=on_root, on_forward=manifest.forward_begins)
    stage_inference = pipelining.StageInference(ctx)
    stage_inference.maybe_install()
    DataWorkers(ctx).install()  # restored with ctx.patches
    tracer: Any = None
    ddp: Any = None
    mode: Any = None
    if caps.collectives:
        from detfp_capture._sources.collectives import CollectiveTracer
        from detfp_capture._sources.ddp import DDPReduction
        from detfp_capture._sources.funcol import FunctionalCollectives

        tracer = CollectiveTracer(ctx)
        tracer.install()
        FunctionalCollectives(ctx, tracer).install()  # restored with ctx.patches
        ddp = DDPReduction(ctx, tracer)
        ddp.install(ctx.patches, hooks.is_watched)
        ctx.scope.on_backward_end = ddp.wait_buckets
        manifest.groups = lambda: dict(tracer.groups)
        for name in group_names:
            tracer.name_of(group_names[name])
    if caps.ops:
        from detfp_capture._sources.dispatch import CaptureMode
        from detfp_capture._sources.inductor import CompiledKernels

        mode = CaptureMode(ctx)
        mode.install(ctx.patches)
        CompiledKernels(ctx).install(ctx.patches)  # restored with ctx.patches
    steps = StepBoundaries(
        ctx,
        hooks=hooks,
        manifest=manifest,
        tracer=tracer,
        ddp=ddp,
        mode=mode,
        stage_inference=stage_inference,
        learn_place=learn_place,
    )
    return Sources(hooks=hooks, stage_inference=stage_inference, tracer=tracer, ddp=ddp, steps=steps)
