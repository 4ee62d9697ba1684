"""What one rank's own records say about its first divergent record (``local_verdict``).

Pure functions over aligned records (``records.Aligned``): structural, source, a derived record
(parameters, gradients, optimizer state) judged by its uncaptured producer, an input whose
producer was not captured, arguments-only differences, views and copies that cannot create a
difference, and outputs whose inputs all matched. Collectives get ``collective`` here and wait
for the group-wide test; a difference an uncaptured cross-rank reduction may have carried gets
``reduction`` and waits for the cross-rank test (``peers``). The package docstring lists the rules.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from detfp_analyze import rule
from detfp_analyze._strenum import StrEnum
from detfp_analyze.bisect.records import Aligned
from detfp_analyze.bisect.vocab import Verdict

__all__ = [
    "COLLECTIVE_KINDS",
    "COPY_OPS",
    "DERIVED_KINDS",
    "PARAMS_UNCOMPARED",
    "VIEW_OPS",
    "LocalVerdict",
    "Pending",
    "StepFacts",
    "batch_unseen",
    "is_view_op",
    "local_verdict",
]

#: Kinds whose output depends on peers: the verdict needs the group-wide test.
COLLECTIVE_KINDS = ("collective", "p2p", "reduced_grad")
#: Kinds recorded without inputs that are nonetheless computed inside the step (by the
#: optimizer, the backward, a reduction): their verdict depends on which producer is uncaptured.
DERIVED_KINDS = ("param", "grad", "optimizer_state")
#: Kinds fed from outside the captured region: a difference there entered from outside.
_SOURCE_KINDS = ("rng_state", "batch", "probe")
#: View/metadata ops: their output aliases the input's storage, they cannot create a difference.
VIEW_OPS = frozenset(
    {
        "aten::view",
        "aten::_unsafe_view",
        "aten::slice",
        "aten::select",
        "aten::t",
        "aten::transpose",
        "aten::expand",
        "aten::expand_as",
        "aten::as_strided",
        "aten::permute",
        "aten::reshape",
        "aten::alias",
        "aten::squeeze",
        "aten::unsqueeze",
        "aten::flatten",
        "aten::narrow",
        "aten::detach",
        "aten::split",
        "aten::split_with_sizes",
        "aten::chunk",
        "aten::unbind",
        "aten::view_as",
        "aten::unflatten",
        "aten::lift_fresh",
    }
)
#: Pure data movement: deterministic copies, typical first consumers of an unseen producer.
COPY_OPS = frozenset({"aten::cat", "aten::stack", "aten::clone", "aten::contiguous", "aten::copy_", "aten::_to_copy"})


def is_view_op(name: str) -> bool:
    """True for view/metadata or pure copy ops, with or without an overload suffix."""
    base = name.split(".", 1)[0] if name.startswith("aten::") else name
    return base in VIEW_OPS or base in COPY_OPS


class Pending(StrEnum):
    """A local verdict other ranks must decide (never in a report: ``resolve`` replaces it)."""

    #: The group-wide test of a collective decides.
    COLLECTIVE = "collective"
    #: An uncaptured cross-rank reduction may have carried the difference (``cross_rank`` decides).
    REDUCTION = "reduction"


@dataclass(frozen=True, kw_only=True)
class LocalVerdict:
    """What one rank's own records say about its first divergent record."""

    #: The verdict, or what other ranks must decide first (``Pending``).
    verdict: Verdict | Pending
    #: The consuming call for unobserved_producer.
    consumer: str | None
    #: Set when the op cannot have created the difference (view/copy op).
    contradiction: str | None
    explanation: str
    #: One line: what the capture could not see that this record depends on, and what to capture next.
    depends_on: str | None = None


@dataclass(frozen=True)
class StepFacts:
    """What the rank-step of a first divergence holds, beyond the record's own call."""

    #: Record kinds present in the rank-step (either run).
    kinds: frozenset[str] = frozenset()
    #: The step is where a run's capture of this rank begins (its first captured step, or the
    #: first step of a resumed segment): state read there came from outside the capture.
    entry: bool = False
    #: The step is a resume boundary: parameters and optimizer state there were restored from
    #: a checkpoint (a subset of ``entry``).
    restored: bool = False
    #: Ranks in the job (world size).
    world: int = 1


#: Kinds that show the capture saw the model run in the step: with one of them and no ``batch``
#: record, the data the step was fed is unseen.
_MODEL_KINDS = frozenset({"module_input", "module_output", "op", "kernel", "compiled", "param"})

#: Kinds only level ops records: a call's own inputs and outputs (an ATen op; a kernel torch.compile
#: generated, inside a compiled region).
_OP_KINDS = frozenset({"op", "kernel"})

#: depends_on of a module's output that differs with matching inputs where the capture begins
#: without a record of the state it starts from: its parameters were never compared.
PARAMS_UNCOMPARED = "the parameters and buffers of"
_UNCOMPARED_WHY = (
    "were not compared before this call (the trace holds no record of the state the run starts from: a capture of "
    "an earlier release, or a model the session did not watch), so another initialization or checkpoint explains "
    "this as well as the module's kernels; recapture with this release and session.watch(model) (the state before "
    "the first step is recorded), or at level ops, where each parameter is an input of an op"
)

#: depends_on when the step's batch was not captured.
_BATCH_UNSEEN = (
    "the step's batch: no batch record holds the data (the root module took no tensor arguments: a custom "
    "batch object, data read from an attribute; or modules= left the root out of the capture); pass the "
    "tensors to the model's forward (positional or keyword), or record them with session.probe('batch', tensor)"
)


def batch_unseen(facts: StepFacts) -> bool:
    """True when the rank-step ran a model the capture saw but holds no ``batch`` record.

    A difference in the data then shows up first inside the model, where it looks exactly like a
    difference made by the uncaptured code around it: no verdict may claim a local start there.
    Unknown kinds (an empty set) say nothing."""
    return bool(facts.kinds & _MODEL_KINDS) and "batch" not in facts.kinds


def _call_label(rec: Aligned) -> str:
    mod = rec.module or "<root>"
    return f"{rec.name} in {mod}"


def _owner(param: str) -> str:
    """Module path owning a parameter FQN (``'transformer.h.0.mlp.c_fc.weight'`` -> ``'transformer.h.0.mlp.c_fc'``)."""
    return param.rsplit(".", 1)[0] if "." in param else "<root>"


def _recapture(step: int, level: str) -> str:
    # No command line here: the report writes it for the way the run was captured (launcher
    # flags or Session arguments, ``advice.recapture``).
    return f"recapture step {step} at level {level}"


def _derived(rec: Aligned, facts: StepFacts) -> LocalVerdict:
    """Verdict of a first divergent parameter, gradient or optimizer-state record."""
    kind, phase, role, name, step = rec.kind, rec.phase, rec.role, rec.name, rec.step
    ops = bool(_OP_KINDS & facts.kinds)
    optimizer_seen = bool({"grad", "optimizer_state"} & facts.kinds)
    many = facts.world > 1
    if kind == "param" and phase == "optimizer" and role == "input":
        if facts.entry:
            return LocalVerdict(
                verdict=Verdict.SOURCE,
                consumer=None,
                contradiction=None,
                explanation=f"parameter {name} differs where the capture of this run begins (step {step}), before the optimizer "
                "changed it: the restored or initialized parameters differ",
            )
        return LocalVerdict(
            verdict=Verdict.UNOBSERVED_PRODUCER,
            consumer=f"the optimizer step for {name}",
            contradiction=None,
            explanation=f"parameter {name} differs when the optimizer reads it although its value after the previous step matched: "
            "it was written outside the capture in between",
            depends_on="a write outside the dispatcher or between steps (a callback, .data): capture the step before at level ops",
        )
    if facts.restored and (kind == "optimizer_state" or kind == "param"):
        # The optimizer's restored state is not recorded before the step that reads it, and a
        # step-end parameter is the first parameter record of a resumed run below level
        # boundaries: at a resume boundary both say what the restore brought in.
        return LocalVerdict(
            verdict=Verdict.SOURCE,
            consumer=None,
            contradiction=None,
            explanation=f"{kind} record {name} differs at the resume boundary (step {step}) while the step's captured inputs "
            "matched: the restored optimizer state or parameters differ (checkpoint save/load of the inner state)",
        )
    if (kind == "param" and phase == "optimizer") or kind == "optimizer_state":
        return LocalVerdict(
            verdict=Verdict.ORIGIN,
            consumer=None,
            contradiction=None,
            explanation=f"the optimizer step for {name.split('.state[')[0]} had matching inputs (parameters and gradients) and its "
            f"{'state ' + name if kind == 'optimizer_state' else 'updated parameter'} differs: the optimizer's "
            "hyperparameters or its kernel (foreach, fused) differ",
        )
    if kind == "param":  # the value at step end
        if optimizer_seen:
            return LocalVerdict(
                verdict=Verdict.UNOBSERVED_PRODUCER,
                consumer=f"the end of step {step}",
                contradiction=None,
                explanation=f"parameter {name} changed after the optimizer step, outside the capture (weight clipping, an EMA or "
                "a write through .data)",
                depends_on="a write after optimizer.step(): capture it with session.probe or at level ops",
            )
        if batch_unseen(facts):
            return LocalVerdict(
                verdict=Verdict.UNOBSERVED_PRODUCER,
                consumer=f"the forward of step {step}",
                contradiction=None,
                explanation=f"parameter {name} after step {step} differs while everything captured before it matched, and the "
                "step's batch was not captured: the data fed to the step or its uncaptured computation introduced it",
                depends_on=_BATCH_UNSEEN,
            )
        what = "forward, backward, gradient reduction and optimizer" if many else "forward, backward and optimizer"
        return LocalVerdict(
            verdict=Pending.REDUCTION if many else Verdict.ORIGIN,
            consumer=None,
            contradiction=None,
            explanation=f"parameter {name} after step {step} differs while everything captured before it matched: the step's "
            f"computation ({what}), not captured at this level, introduced it",
            depends_on=f"level metrics records no op or module: {_recapture(step, 'boundaries')}",
        )
    # A gradient read by the optimizer.
    owner = _owner(name)
    if "reduced_grad" in facts.kinds:
        return LocalVerdict(
            verdict=Verdict.UNOBSERVED_PRODUCER,
            consumer=f"the optimizer step for {name}",
            contradiction=None,
            explanation=f"the gradient of {name} changed after its data-parallel reduction, outside the capture (gradient clipping "
            "or scaling)",
            depends_on=f"a write to .grad outside the dispatcher: {_recapture(step, 'ops')}",
        )
    if ops:
        return LocalVerdict(
            verdict=Verdict.UNOBSERVED_PRODUCER,
            consumer=f"the optimizer step for {name}",
            contradiction=None,
            explanation=f"the gradient of {name} differs although every captured op before it matched: it was produced outside "
            "the dispatcher",
            depends_on="a producer outside the dispatcher (an extension kernel, a C++ gradient hook or reducer)",
        )
    region = f"the backward of {owner}"
    if many:
        return LocalVerdict(
            verdict=Pending.REDUCTION,
            consumer=None,
            contradiction=None,
            explanation=f"the gradient of {name} differs while everything captured before it matched: {region} or the "
            "gradient reduction across ranks (neither captured at this level) introduced it",
            depends_on=f"the weight-gradient ops of {region} and the gradient reduction: {_recapture(step, 'ops')}",
        )
    return LocalVerdict(
        verdict=Verdict.ORIGIN,
        consumer=None,
        contradiction=None,
        explanation=f"{region} had matching inputs and produced a different gradient for {name}: an uncaptured op inside "
        "that module's backward introduced it",
        depends_on=f"the weight-gradient ops of {region} are not captured at level boundaries: {_recapture(step, 'ops')}",
    )


#: Calls a module's own code launches with tensors it made: below level ops their input was
#: made by the code of the module that launched them.
_LAUNCHED_KINDS = ("collective", "p2p")


def _start_state(rec: Aligned) -> LocalVerdict:
    """A record of the state the capture starts from (kind ``state``) differs: a source."""
    what = {"param": "parameter", "buffer": "buffer", "optimizer_state": "optimizer state"}.get(rec.arg, rec.arg)
    return LocalVerdict(
        verdict=Verdict.SOURCE,
        consumer=None,
        contradiction=None,
        explanation=f"the state before step {rec.step}, {what} {rec.name}, differs: the run started from another "
        "state (its initialization, or the checkpoint loaded into it), before any computation",
    )


def _own_code(rec: Aligned, label: str, facts: StepFacts, module: str) -> LocalVerdict:
    """Verdict of an input made by ``module``'s own code, which levels below ops do not capture."""
    if batch_unseen(facts):
        return LocalVerdict(
            verdict=Verdict.UNOBSERVED_PRODUCER,
            consumer=label,
            contradiction=None,
            explanation=f"the input of {label} differs while every captured record before it matched, and the step's batch "
            f"was not captured: the data or the code {module} runs between its submodules introduced it",
            depends_on=_BATCH_UNSEEN,
        )
    return LocalVerdict(
        verdict=Pending.REDUCTION if facts.world > 1 else Verdict.ORIGIN,
        consumer=None,
        contradiction=None,
        explanation=f"the input of {label} differs while every captured record before it matched: the code {module} runs "
        "between its submodules, not captured at this level, introduced it",
        depends_on=f"the ops of {module} outside its submodules: {_recapture(rec.step, 'ops')}",
    )


def _origin_depends(rec: Aligned, call_rows: Sequence[Aligned], facts: StepFacts) -> str | None:
    """What an origin's call did not compare that could explain it as well (``depends_on``)."""
    depends = None
    if rec.kind == "compiled" and _OP_KINDS & facts.kinds:
        # At level ops the region's kernels and ATen calls are records of their own, all matched.
        depends = (
            "code inside this torch.compile region that capture could not record (a kernel of another backend "
            "than Inductor, a CUDA graph replayed without its digests): its recorded kernels all matched"
        )
    elif rec.kind == "compiled":
        depends = (
            "the kernels inside a torch.compile region are recorded at level ops: "
            f"{_recapture(rec.step, 'ops')} to name the kernel"
        )
    elif any(r.role == "dest" for r in call_rows):
        depends = (
            "the op writes into a destination that is not compared (write-only or still uninitialized): if it does "
            "not write every element, the rest is uninitialized memory"
        )
    elif rec.kind == "module_output" and "op" not in facts.kinds and facts.entry and "state" not in facts.kinds:
        # Below level ops a module's parameters are no input record of its call: where the capture
        # begins, only the state records (``state``) compare them before the first forward.
        depends = f"{PARAMS_UNCOMPARED} {rec.module or '<root>'} {_UNCOMPARED_WHY}"
    return depends


def local_verdict(
    rec: Aligned,
    call_rows: Sequence[Aligned],
    upstream: str | None,
    facts: StepFacts | None = None,
) -> LocalVerdict:
    """Verdict from the rank's own records: ``rec`` is the first divergent aligned row,
    ``call_rows`` every aligned row of its call (same rank, step, call_hash), ``facts`` what
    else the rank-step holds."""
    facts = facts or StepFacts()
    state, kind, role = rec.state, rec.kind, rec.role
    label = _call_label(rec)
    if state in rule.STRUCTURAL:
        where = {
            rule.ONLY_A: "only in run A",
            rule.ONLY_B: "only in run B",
            rule.REORDERED: "in a different order",
            rule.SHIFTED: "in a call sequence whose number of calls differs (occurrence counters shifted)",
        }[rule.RecordState(state)]
        return LocalVerdict(
            verdict=Verdict.STRUCTURAL,
            consumer=None,
            contradiction=None,
            explanation=f"{label} ({role} {rec.arg}) is {where}: control flow differed (config or data)",
        )
    if kind == "state":
        return _start_state(rec)
    if kind in _SOURCE_KINDS:
        return LocalVerdict(
            verdict=Verdict.SOURCE,
            consumer=None,
            contradiction=None,
            explanation=f"{kind} record {rec.name} differs and has no inputs: the difference entered from outside the "
            "captured region (data pipeline, checkpoint restore, RNG state)",
        )
    same_tensor, args_differ = bool(rec.tensors_same), not rec.args_same
    if same_tensor and args_differ:
        # Arguments belong to the call: the call site passed different non-tensor values (a
        # config or hyperparameter), a local start whichever of its records comes first.
        if kind in DERIVED_KINDS:
            return LocalVerdict(
                verdict=Verdict.ORIGIN,
                consumer=None,
                contradiction=None,
                explanation=f"the optimizer step for {rec.name} ran with different hyperparameters (its param group's "
                "lr, betas, eps, weight_decay, ...) on matching parameters",
            )
        return LocalVerdict(
            verdict=Verdict.ORIGIN,
            consumer=None,
            contradiction=None,
            explanation=f"{label} was called with different non-tensor arguments on matching tensors",
        )
    if kind in DERIVED_KINDS:
        return _derived(rec, facts)
    if role == "input" and not _OP_KINDS & facts.kinds:
        # Below level ops the code a module runs between its submodules is not captured: a
        # submodule's input that differs first was made there by its parent (every earlier
        # record, the previous submodules' outputs included, matched), and so was a collective's
        # input by the module that launched it (TP's row-parallel partial sums).
        if kind == "module_input":
            return _own_code(rec, label, facts, rec.module.rsplit(".", 1)[0] if "." in rec.module else "<root>")
        if kind in _LAUNCHED_KINDS:
            return _own_code(rec, label, facts, rec.module or "<root>")
    hop = f" look one hop upstream ({upstream})" if upstream else " look one hop upstream"
    inputs = [r for r in call_rows if r.role == "input"]
    differing = [r for r in inputs if r.state in rule.DIVERGENT]
    view = is_view_op(rec.name)
    if role == "input" or differing:
        contradiction = f"{rec.name} only moves data;{hop}" if view else None
        return LocalVerdict(
            verdict=Verdict.UNOBSERVED_PRODUCER,
            consumer=label,
            contradiction=contradiction,
            explanation=f"the input of {label} already differs although no earlier record differs: its producer was not "
            "captured (e.g. a kernel that bypasses the dispatcher, a fused or extension op"
            + (", or the data: the step's batch was not captured)" if batch_unseen(facts) else ")"),
            depends_on=_BATCH_UNSEEN
            if batch_unseen(facts)
            else "this input's producer (an extension or fused kernel, a write outside the dispatcher): probe it "
            "with session.probe, or capture the step at a deeper level",
        )
    if kind in COLLECTIVE_KINDS:
        return LocalVerdict(verdict=Pending.COLLECTIVE, consumer=None, contradiction=None, explanation="")
    if view:
        return LocalVerdict(
            verdict=Verdict.UNOBSERVED_PRODUCER,
            consumer=label,
            contradiction=f"{rec.name} is a view or copy and cannot create a difference;{hop}",
            explanation=f"{label} appears to create the difference, which a view or copy cannot: something wrote its "
            "input's memory after it was fingerprinted",
        )
    if args_differ:
        return LocalVerdict(
            verdict=Verdict.ORIGIN,
            consumer=None,
            contradiction=None,
            explanation=f"{label} was called with different non-tensor arguments and its {role} differs",
        )
    n = len(inputs)
    depends = _origin_depends(rec, call_rows, facts)
    return LocalVerdict(
        verdict=Verdict.ORIGIN,
        consumer=None,
        contradiction=None,
        explanation=f"all {n} input(s) of {label} matched and its {role} {rec.arg} differs: this call introduced the difference",
        depends_on=depends,
    )
