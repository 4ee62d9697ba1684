"""What the first divergence itself says, in words a user acts on: a headline and next steps per cause.

Used by ``cause.weigh`` once no run-level evidence (an end, an offset, an RNG-only difference,
a setting, a confirmed uninitialized read) explains the divergence better. Pure functions of the
diagnosis, the representative divergence and how the runs were captured:

* ``argument``: a call's non-tensor arguments differ (``lr 0.001 -> 0.002``): a deliberate change;
* ``dtype`` / ``shape`` / ``layout``: the first differing tensor has another dtype, shape or
  layout: another computation (autocast, a cast, a size, a sharding), never a kernel's rounding;
* ``data`` / ``rng`` / ``restore``: a source (the batch, an RNG state, state where a capture
  begins): the data pipeline, the seeding, the checkpoint; never the kernel level;
* ``op``: an origin at an op (every rank, or one process: then the caveat that one process
  cannot tell a nondeterministic kernel from a local cause), with the kernel-level next steps;
* ``collective``: an origin at a collective's output whose group's inputs all matched (an
  origin at a collective's input is the code before it on that rank, never the reduction order:
  ``rank_local`` or ``op``, by the pattern);
* ``rank_local``: an origin on one rank or a subset (with the coordinates they share);
* ``control_flow``: a record on one side only, or (``micro_batches``) the step ran forward another
  number of times (gradient accumulation); ``uncaptured``: nothing captured starts it.

Recapture hints are written for the way the run was captured (``Capture.form``): launcher flags
for ``python -m detfp_capture``, ``Session`` arguments for a script that opens its own session.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from detfp_analyze.bisect.result import Capture, Diagnosis, Divergence
from detfp_analyze.bisect.verdict.local import PARAMS_UNCOMPARED
from detfp_analyze.bisect.vocab import Cause, DiffKind, Pattern, Verdict
from detfp_analyze.ranks import format_ranks
from detfp_format.contract import CAPTURE_LEVELS, LOADER_BATCH

__all__ = ["Advice", "at", "deeper", "from_divergence", "micro_batches", "recapture", "type_change", "who"]


@dataclass(frozen=True)
class Advice:
    """A cause (``result.CAUSES``), its headline and the next steps that fit it."""

    cause: str
    headline: str
    steps: tuple[str, ...] = ()
    #: Secondary facts, said after the headline.
    also: tuple[str, ...] = ()


def who(ranks: Sequence[int], compared: int) -> str:
    """``in this process``, ``on every rank (0-3)``, ``on rank 1``, ``on ranks 2-3``."""
    if compared <= 1:
        return "in this process"
    if len(ranks) == compared:
        return f"on every rank ({format_ranks(ranks)})"
    return f"on rank {ranks[0]}" if len(ranks) == 1 else f"on ranks {format_ranks(ranks)}"


#: Record kinds of calls a module's code launches with tensors it made (their input records).
_LAUNCHED = ("collective", "p2p")


def at(d: Divergence) -> str:
    """A divergence named for a sentence: ``aten::mm.default in l1 (backward, step 1)``, ``the
    optimizer step for fc.weight (step 0)``, ``batch CharGPT (step 0)``, ``the input of
    all_reduce@tp in mlp (forward, step 1)``."""
    if d.kind == "state" and d.op:
        return f"state before step {d.step}: {d.op}"
    if d.phase == "optimizer" and d.kind in ("param", "grad", "optimizer_state") and d.op:
        return f"the optimizer step for {d.op.split('.state[')[0]} (step {d.step})"
    if d.kind in _LAUNCHED and d.op and d.role in ("input", "output"):
        return f"the {d.role} of {d.op} in {d.module or '<root>'} ({d.phase}, step {d.step})"
    if d.kind in ("module_output", "module_input") and d.module is not None:
        side = "output" if d.kind == "module_output" else "input"
        what = f"{d.op}, " if d.op else ""
        return f"the {side} of {d.module or '<root>'} ({what}{d.phase}, step {d.step})"
    if d.kind == "kernel" and d.op:
        fused = f", fusing aten {', '.join(d.fused)}" if d.fused else ""
        mod = f" in {d.module or '<root>'}" if d.module is not None else ""
        return f"kernel {d.op} (torch.compile{fused}){mod} ({d.phase}, step {d.step})"
    if d.kind != "op" and d.op:
        mod = f" in {d.module or '<root>'}" if d.module else ""
        return f"{d.kind} {d.op}{mod} ({d.phase}, step {d.step})"
    name = d.op if d.op is not None else f"an {d.kind}" if d.kind == "op" else f"a {d.kind} record"
    mod = f" in {d.module or '<root>'}" if d.module is not None else ""
    return f"{name}{mod} ({d.phase}, step {d.step})"


def deeper(c: Capture | None) -> str | None:
    """The capture level after ``c``'s (None at ops, the deepest)."""
    if c is None or c.level not in CAPTURE_LEVELS:
        return "ops"
    i = CAPTURE_LEVELS.index(c.level)
    return CAPTURE_LEVELS[i + 1] if i + 1 < len(CAPTURE_LEVELS) else None


def recapture(c: Capture | None, level: str, step: int, kernels: bool = False) -> str:
    """How to capture ``step`` again at ``level``, in the form the run was captured."""
    if c is not None and c.form == "launcher":
        extra = f" --kernels {step}" if kernels else ""
        return f"python -m detfp_capture --out NEW_DIR --level {level} --steps {step}{extra} -- <the same script>"
    extra = f', kernels="{step}"' if kernels else ""
    return f'Session("NEW_DIR", level="{level}", steps="{step}"{extra}) in the script'


def _deeper_steps(d: Divergence, c: Capture | None) -> tuple[str, ...]:
    """Where an op or module origin goes next: the kernel under an op, else the op under a module;
    a compiled kernel is as deep as capture goes: its code and how it was compiled."""
    if d.kind == "kernel":
        return (
            f"compare how {d.op or 'the kernel'} was compiled in both runs: its generated code (TORCH_LOGS=output_code), "
            "the Inductor settings and autotuning choices, and the thread count it was compiled for",
        )
    if d.kind == "op" and d.op is None:
        return ("rerun bisect with --depth op to name the op",)
    if d.kind == "op":
        return (
            f"compare the kernels under it: bisect --depth kernel --steps {d.step} on runs that captured them "
            f"({recapture(c, 'ops', d.step, kernels=True)})",
        )
    nxt = deeper(c)
    return (f"recapture step {d.step} at level {nxt} to name the op: {recapture(c, nxt, d.step)}",) if nxt else ()


def _source(d: Divergence, where: str, resume_step: int | None) -> Advice:
    resumed = d.step == resume_step
    if d.kind == "batch":
        what = "a DataLoader delivered" if d.op == LOADER_BATCH else f"fed to {d.op}"
        return Advice(
            Cause.DATA,
            f"The data differs: the batch {what} differs at step {d.step} {where}, before any computation "
            "(sample order, loader seed, shuffling, augmentation, or that rank's shard).",
            (
                "compare the data pipelines: sampler and shuffle seeds, worker seeding, augmentation, and the loader "
                "position on resume",
                "probe the batch earlier in the pipeline (session.probe) to find the transform that differs",
            ),
        )
    if d.kind == "rng_state":
        why = (
            f"run B resumed at step {d.step} without restoring it"
            if resumed
            else "the seeding differs, or the state was not restored on resume"
        )
        return Advice(
            Cause.RNG,
            f"The RNG state differs: rng_state {d.op} at step {d.step} {where} ({why}), and what draws from it "
            "differs with it.",
            (
                "check the torch.manual_seed calls and everything that draws before the loop (model init, data "
                "shuffling)",
                "on resume, restore torch.set_rng_state (and each device's state) from the checkpoint",
            ),
        )
    if d.kind == "state":
        what = {"param": "a parameter", "buffer": "a buffer", "optimizer_state": "optimizer state"}.get(d.arg, d.arg)
        return Advice(
            Cause.RESTORE,
            f"The state before step {d.step} differs: {d.op} ({what}) {where}, before any computation: the runs "
            "start from other values (the initialization seed, or a checkpoint load: a key missing under "
            "strict=False, another file, a rank that loaded and broadcast it).",
            (
                f"compare how {d.op} is set before step {d.step} in both runs: the init seed, the checkpoint file and "
                "load_state_dict's missing/unexpected keys (strict=True makes a missing key an error)",
                "under DDP, rank 0's parameters are broadcast when the model is wrapped: check what rank 0 loaded",
            ),
        )
    if d.kind in ("param", "optimizer_state", "grad"):
        why = "the checkpoint save/load" if resumed else "the init seed, or the checkpoint save/load"
        return Advice(
            Cause.RESTORE,
            f"The state where the capture begins differs: {d.kind} {d.op} at step {d.step} {where} ({why}).",
            ("check the init seed and the checkpoint: parameters, the optimizer's inner state, the loss scaler",),
        )
    how = " (the same rows in another order)" if d.diff_kind == DiffKind.PERMUTATION else ""
    return Advice(
        Cause.UNCAPTURED,
        f"A probed value differs{how}: {d.kind} {d.op} at step {d.step} {where}, and the code that feeds it was not "
        "captured.",
        ("capture the code that produces it: a level deeper, or probes further upstream",),
    )


#: Difference kinds that are another computation, not another rounding: the cause each names.
_TYPE_CAUSES: dict[str, str] = {DiffKind.DTYPE: Cause.DTYPE, DiffKind.SHAPE: Cause.SHAPE, DiffKind.LAYOUT: Cause.LAYOUT}


def _short(dtype: str | None) -> str:
    return (dtype or "?").removeprefix("torch.")


def _dims(shape: tuple[int, ...] | None) -> str:
    return "[" + "x".join(map(str, shape)) + "]" if shape is not None else "?"


def type_change(d: Divergence) -> str | None:
    """``its dtype: bfloat16 -> float16``, ``its shape: [8x10] -> [8x12]``, ``its layout``: what a
    first difference of kind dtype, shape or layout changed (None for another kind)."""
    v = d.diff
    if v is None or d.diff_kind not in _TYPE_CAUSES:
        return None
    if d.diff_kind == DiffKind.DTYPE:
        return f"its dtype: {_short(v.dtype_a)} -> {_short(v.dtype_b)}"
    if d.diff_kind == DiffKind.SHAPE:
        return f"its shape: {_dims(v.shape_a)} -> {_dims(v.shape_b)}"
    return "its layout, every part equal"


def _type_change(d: Divergence, cause: str, where: str) -> Advice:
    """A first difference whose dtype, shape or layout differs: what the user changed is named,
    not the kernel (the values of another dtype or shape differ whatever the kernel does)."""
    v = d.diff
    assert v is not None  # checked by the caller
    if cause == Cause.DTYPE:
        return Advice(
            cause,
            f"The dtype of {at(d)} differs {where} ({_short(v.dtype_a)} -> {_short(v.dtype_b)}): an autocast dtype or "
            "a cast changed, not a kernel's rounding.",
            (
                "compare the runs' mixed precision: torch.autocast regions and their dtype, .to()/.half()/.bfloat16() "
                "calls, the framework's precision setting",
                f"recapture step {d.step} at level ops to name the op whose output dtype changes first",
            ),
        )
    if cause == Cause.SHAPE:
        return Advice(
            cause,
            f"The shape of {at(d)} differs {where} ({_dims(v.shape_a)} -> {_dims(v.shape_b)}): a size in the "
            "configuration (batch, width, sequence length) or a reshape changed.",
            ("compare the configurations: batch and micro-batch sizes, model widths, sequence lengths, padding",),
        )
    return Advice(
        cause,
        f"{at(d)} differs {where} with every part equal: its layout changed (a DTensor's placements or device mesh, a "
        "subclass's non-tensor attributes), not its values.",
        ("compare the sharding of both runs: the parallel plan (placements), the device mesh, the FSDP/TP settings",),
    )


def micro_batches(d: Divergence, where: str, a: int, b: int, labelled: bool) -> Advice:
    """The runs ran forward another number of times in the step of the first difference
    (gradient accumulation, micro-batching): that is the cause, whatever its first record is."""
    steps: tuple[str, ...] = (
        "compare how many micro-batches each run accumulates per optimizer step (gradient accumulation, "
        "micro-batch size, the loader's batch size)",
    )
    if not labelled:
        steps += (
            "label each micro-batch in the training loop (with session.microbatch(i): around its forward and "
            "backward): records then align micro-batch by micro-batch, and those both runs hold are compared value "
            "by value",
        )
    first = (
        f"{at(d)} {_structural_what(d)}"
        if d.verdict == Verdict.STRUCTURAL
        else f"the first difference, {d.verdict} at {at(d)}, follows from it (a loss scaled by another count, a "
        "gradient summed over other micro-batches)"
    )
    return Advice(
        Cause.CONTROL_FLOW,
        f"Control flow differs: forward calls per step: A {a}, B {b} (step {d.step}) {where}: the runs accumulate a "
        f"different number of micro-batches per step; {first}.",
        steps,
    )


def _structural_what(d: Divergence) -> str:
    return {"a_only": "is in run A only", "b_only": "is in run B only"}.get(
        d.presence, "is called a different number of times, or in another order, in the two runs"
    )


def _no_record(diag: Diagnosis, where: str, capture: Capture | None) -> Advice:
    """No record differs: bisect stopped at the step level, or only metrics differ."""
    if diag.pattern == Pattern.UNDETERMINED:
        return Advice(
            Cause.UNDETERMINED,
            "bisect stopped at the step level, so no record names a cause yet.",
            ("rerun bisect with --depth op for verdicts, a pattern and a cause",),
        )
    nxt = deeper(capture)
    more = (f"recapture the first differing step at level {nxt}: {recapture(capture, nxt, 0)}",) if nxt else ()
    return Advice(
        Cause.UNCAPTURED,
        f"Metrics differ {where} but no captured record does: the difference starts in code the capture did not "
        "record.",
        (*more, "or probe the suspect tensors with session.probe"),
    )


def _origin(d: Divergence, where: str, compared: int, made: bool, capture: Capture | None) -> Advice:
    """An origin on every compared rank (or in one process): the op, the code before a
    collective, or a state the capture did not compare."""
    if compared <= 1:
        return Advice(
            Cause.OP,
            f"{at(d)} is the first call whose output differs although its inputs matched: a nondeterministic kernel "
            "(float atomics, split-K, thread scheduling) or something else local to this process; one process cannot "
            "tell which.",
            ("run the same pair again: the same op named again points at its kernel", *_deeper_steps(d, capture)),
        )
    if d.depends_on and d.depends_on.startswith(PARAMS_UNCOMPARED):
        return Advice(
            Cause.OP,
            f"{at(d)} is the first difference {where}, with matching inputs everywhere, but its parameters were not "
            "compared before the call: another initial state (init seed, checkpoint) explains it as well as a "
            "nondeterministic kernel.",
            (
                f"recapture with this release ({recapture(capture, (capture.level if capture else None) or 'ops', 0)}"
                "): the state before the first step is compared first",
                *_deeper_steps(d, capture),
            ),
        )
    if d.kind == "kernel":
        return Advice(
            Cause.OP,
            f"{at(d)} is the first difference {where}, with matching inputs everywhere: the compiled kernel is "
            "nondeterministic (float atomics, split reductions, autotuned tiles) or was compiled differently.",
            _deeper_steps(d, capture),
        )
    if made:
        return Advice(
            Cause.OP,
            f"{at(d)} is the first difference {where}, made on each rank by the code before it (not captured at this "
            "level) from matching inputs: that code or its kernels are nondeterministic (float atomics, split-K, tile "
            "scheduling).",
            _deeper_steps(d, capture),
        )
    return Advice(
        Cause.OP,
        f"{at(d)} is the first difference {where}, with matching inputs everywhere: the op or its kernel is "
        "nondeterministic (float atomics, split-K, tile scheduling).",
        _deeper_steps(d, capture),
    )


def from_divergence(
    diag: Diagnosis,
    d: Divergence | None,
    where: str,
    compared: int,
    capture: Capture | None,
    resume_step: int | None = None,
) -> Advice:
    """The cause the first divergence ``d`` names (``where``: ``who``'s phrase for the ranks;
    ``resume_step``: the step run B resumed at, when it was resumed)."""
    if d is None:
        return _no_record(diag, where, capture)
    if d.diff_kind == DiffKind.ARGUMENTS or (d.diff is not None and d.diff.kind == DiffKind.ARGUMENTS):
        changes = (
            ", ".join(d.diff.args_changes) if d.diff is not None and d.diff.args_changes else "a non-tensor argument"
        )
        return Advice(
            Cause.ARGUMENT,
            f"An argument differs: {changes} at {at(d)} {where}: the code or its configuration passes another value "
            "(a deliberate change, not nondeterminism).",
            (
                "find where that value is set (config, command line, scheduler) and make both runs use one",
                "if the change is intended, expect it in a gate (--expect, with a reason)",
            ),
        )
    kind = _TYPE_CAUSES.get(d.diff_kind)
    if kind is not None and d.diff is not None and d.verdict != Verdict.SOURCE:
        return _type_change(d, kind, where)
    if d.verdict == Verdict.SOURCE:
        return _source(d, where, resume_step)
    if d.verdict == Verdict.STRUCTURAL:
        return Advice(
            Cause.CONTROL_FLOW,
            f"Control flow differs: {at(d)} {_structural_what(d)} {where}: a configuration or data-dependent branch ran "
            "differently.",
            ("compare the configurations, and any branch on data, on the rank or on the step",),
        )
    # A collective's input (below level ops) was made by the code before it on that rank: the
    # difference starts there, on the rank's side of the collective, never in its reduction.
    made = d.kind in (*_LAUNCHED, "module_input") and d.role == "input"
    how = "which the code before it on that rank made" if made else "with matching inputs"
    if d.verdict == Verdict.ORIGIN and d.kind in ("collective", "reduced_grad") and d.role != "input":
        what = at(d) if d.kind == "collective" else f"the gradient reduction of {d.op} ({d.phase}, step {d.step})"
        return Advice(
            Cause.COLLECTIVE,
            f"{what[:1].upper()}{what[1:]} is the first difference, and every rank of its group had matching inputs: "
            "its reduction order or algorithm differs (NCCL_ALGO or NCCL_PROTO, ring or tree, topology).",
            (
                "pin the collective's algorithm and protocol (NCCL_ALGO, NCCL_PROTO) in both runs",
                "compare the process layout and hosts of the two launches",
            ),
        )
    if d.verdict == Verdict.ORIGIN and diag.pattern in (Pattern.SINGLE_RANK, Pattern.RANK_SUBSET):
        share = ", ".join(f"{k}={v}" for k, v in sorted(diag.shared_coordinates.items()))
        one = diag.pattern == Pattern.SINGLE_RANK
        if share:
            share = f" (its coordinates: {share})" if one else f" (they share {share})"
        what = "its input data, placement, topology, reduction order"
        if d.kind == "kernel":
            what += ", or how that kernel was compiled there"
        return Advice(
            Cause.RANK_LOCAL,
            f"Only {where.split(' ', 1)[1]} {'starts' if one else 'start'} the difference, at {at(d)}"
            + (f", {how}" if made else f" {how}")
            + share
            + f": look at what differs there ({what}).",
            (
                "compare what those ranks do differently: their batch, device and host, their place in each reduction",
                *_deeper_steps(d, capture),
            ),
        )
    if d.verdict == Verdict.ORIGIN:
        return _origin(d, where, compared, made, capture)
    # unobserved_producer or receiver everywhere: nothing captured starts the difference.
    nxt = deeper(capture)
    steps = (f"recapture step {d.step} at level {nxt}: {recapture(capture, nxt, d.step)}",) if nxt else ()
    return Advice(
        Cause.UNCAPTURED,
        f"No captured record starts the difference: {d.verdict} at {at(d)} {where}; {diag.explanation}.",
        (*steps, "probe the uncaptured producer (session.probe) one hop upstream of the first differing input"),
    )
