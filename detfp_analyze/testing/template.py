"""Template of one synthetic training step, as Arrow columns (private to ``synth``).

``_template(spec)`` lays out one rank-step's calls: module boundaries, forward ops per
transformer-like layer, backward ops with gradient all-reduce buckets, optimizer ops and
parameters, padded with probe records to exactly ``spec.records`` records. Each call writes
its input records before its outputs, as the capture does. Keys (``call_hash``/``key_hash``)
are hashed once per distinct key with ``contract.key_hash``; they depend on neither rank nor
step, so ``synth`` reuses this one table for every (run, rank, step) and only fills in
provenance and digests. ``_Template`` also carries the indexes the divergence propagation
rules need (digested/output flags, call starts, all-reduce outputs, phase ends).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Protocol

import pyarrow as pa

from detfp_format import contract
from detfp_format.arrowschema import arrow_schema

__all__ = ["TemplateShape", "_Template", "_template"]


class TemplateShape(Protocol):
    """What a template is built from: the fields of ``synth.SynthSpec`` it reads (declared here,
    below synth, which imports this module)."""

    @property
    def records(self) -> int: ...
    @property
    def compact(self) -> bool: ...
    @property
    def bucket_layers(self) -> int: ...


@dataclass(frozen=True)
class _Template:
    """One step's records as Arrow columns plus the indexes the propagation rules need."""

    table: pa.Table  # key columns + dtype/shape/numel/status/... (no provenance, no digests)
    kinds: tuple[str, ...]
    digested: tuple[bool, ...]  # status == ok
    is_output: tuple[bool, ...]
    call_start: tuple[int, ...]  # index of the first record of the record's call
    allreduce_outputs: tuple[int, ...]  # indexes of all_reduce output records, ascending
    forward_end: int  # index after the last forward record (where the loss is known)
    backward_end: int  # index after the last backward record (where grad_norm is known)


def _op(module: str, name: str, inputs: list[str], outputs: list[str], shape: list[int]) -> tuple:
    return (module, "op", name, inputs, outputs, shape)


def _linear(mod: str, width: int, back: bool) -> list[tuple]:
    if back:  # grad input and grad weight
        return [
            _op(mod, "aten::mm.default", ["args[0]", "args[1]"], ["out"], [4096, width]),
            _op(mod, "aten::mm.default", ["args[0]", "args[1]"], ["out"], [width, width]),
        ]
    return [_op(mod, "aten::addmm.default", ["args[0]", "args[1]", "args[2]"], ["out"], [4096, width])]


def _layer_forward(i: int, h: int) -> list[tuple]:
    p = f"layers.{i}"
    ln_in, ln_out = ["args[0]", "args[2]", "args[3]"], ["out[0]", "out[1]", "out[2]"]
    return [
        (p, "module_input", p, ["args[0]"], [], [4096, h]),
        _op(f"{p}.norm1", "aten::native_layer_norm.default", ln_in, ln_out, [4096, h]),
        *_linear(f"{p}.attn.qkv", 3 * h, False),
        _op(f"{p}.attn", "aten::view.default", ["args[0]"], ["out"], [8, 512, 3 * h]),
        _op(
            f"{p}.attn",
            "aten::_scaled_dot_product_efficient_attention.default",
            ["args[0]", "args[1]", "args[2]"],
            ["out[0]", "out[1]"],
            [8, 16, 512, h // 16],
        ),
        *_linear(f"{p}.attn.proj", h, False),
        _op(p, "aten::add.Tensor", ["args[0]", "args[1]"], ["out"], [4096, h]),
        _op(f"{p}.norm2", "aten::native_layer_norm.default", ln_in, ln_out, [4096, h]),
        *_linear(f"{p}.mlp.fc1", 4 * h, False),
        _op(f"{p}.mlp", "aten::gelu.default", ["args[0]"], ["out"], [4096, 4 * h]),
        *_linear(f"{p}.mlp.fc2", h, False),
        _op(p, "aten::add.Tensor", ["args[0]", "args[1]"], ["out"], [4096, h]),
        (p, "module_output", p, [], ["out"], [4096, h]),
    ]


def _layer_backward(i: int, h: int) -> list[tuple]:
    p = f"layers.{i}"
    lnb_in, lnb_out = ["args[0]", "args[1]", "args[4]"], ["out[0]", "out[1]", "out[2]"]
    return [
        *_linear(f"{p}.mlp.fc2", h, True),
        _op(f"{p}.mlp", "aten::gelu_backward.default", ["args[0]", "args[1]"], ["out"], [4096, 4 * h]),
        *_linear(f"{p}.mlp.fc1", 4 * h, True),
        _op(f"{p}.norm2", "aten::native_layer_norm_backward.default", lnb_in, lnb_out, [4096, h]),
        *_linear(f"{p}.attn.proj", h, True),
        _op(
            f"{p}.attn",
            "aten::_scaled_dot_product_efficient_attention_backward.default",
            ["args[0]", "args[1]", "args[2]", "args[3]"],
            ["out[0]", "out[1]", "out[2]"],
            [8, 16, 512, h // 16],
        ),
        *_linear(f"{p}.attn.qkv", 3 * h, True),
        _op(f"{p}.norm1", "aten::native_layer_norm_backward.default", lnb_in, lnb_out, [4096, h]),
        _op(p, "aten::add.Tensor", ["args[0]", "args[1]"], ["out"], [4096, h]),
    ]


def _layer_optimizer(h: int) -> list[tuple]:
    return [
        _op("", "aten::_foreach_mul_.Scalar", ["args[0][0]"], ["args[0][0]"], [h, h]),
        _op("", "aten::_foreach_addcmul_.Scalar", ["args[0][0]", "args[1][0]"], ["args[0][0]"], [h, h]),
        _op("", "aten::_foreach_addcdiv_.Scalar", ["args[0][0]", "args[1][0]"], ["args[0][0]"], [h, h]),
    ]


def _build_calls(spec: TemplateShape) -> list[tuple]:
    """Calls of one step as (phase, module, kind, name, inputs, outputs, shape), exactly spec.records records."""
    h = 1024

    def count(calls: list[tuple]) -> int:
        return sum(len(c[4]) + len(c[5]) for c in calls)

    per_layer = (
        count([("forward", *c) for c in _layer_forward(0, h)])
        + count([("backward", *c) for c in _layer_backward(0, h)])
        + count([("optimizer", *c) for c in _layer_optimizer(h)])
        + 3
    )
    layers = max(1, (spec.records - 8) // per_layer)
    while not spec.compact:
        calls: list[tuple] = [
            ("step", "", "rng_state", "cpu", [], ["value"], [5056]),
            ("forward", "", "batch", "input_ids", [], ["value"], [8, 512]),
        ]
        for i in range(layers):
            calls += [("forward", *c) for c in _layer_forward(i, h)]
        calls.append(
            ("forward", "", "op", "aten::nll_loss_forward.default", ["args[0]", "args[1]"], ["out[0]", "out[1]"], [])
        )
        for j, i in enumerate(reversed(range(layers))):
            calls += [("backward", *c) for c in _layer_backward(i, h)]
            if (j + 1) % spec.bucket_layers == 0 or i == 0:
                calls.append(("backward", "", "collective", "all_reduce", ["args[0]"], ["out[0]"], [h * h]))
        for _ in range(layers):
            calls += [("optimizer", *c) for c in _layer_optimizer(h)]
        for i in range(layers):
            for pname in ("mlp.fc1.weight", "attn.qkv.weight"):
                calls.append(("step", "", "param", f"layers.{i}.{pname}", [], ["value"], [h, h]))
        n = count(calls)
        if n <= spec.records or layers == 1:
            break
        layers -= 1
    if spec.compact:
        calls = _compact_calls(h)
        n = count(calls)
    # Pad with single-record probes so every rank-step holds exactly spec.records records.
    calls += [("step", "", "probe", f"probe.{k}", [], ["value"], [1]) for k in range(max(0, spec.records - n))]
    return calls


def _compact_calls(h: int) -> list[tuple]:
    """One small step (``SynthSpec.compact``): a forward op, the loss, a backward op, the gradient
    all-reduce, an optimizer op and a parameter (18 records): a rank-step of a few records still
    carries an origin's difference through the all-reduce to every rank."""
    return [
        ("step", "", "rng_state", "cpu", [], ["value"], [5056]),
        ("forward", "", "batch", "input_ids", [], ["value"], [8, 512]),
        ("forward", *_linear("layers.0.mlp.fc1", h, False)[0]),
        ("forward", "", "op", "aten::nll_loss_forward.default", ["args[0]", "args[1]"], ["out[0]", "out[1]"], []),
        ("backward", *_linear("layers.0.mlp.fc1", h, True)[0]),
        ("backward", "", "collective", "all_reduce", ["args[0]"], ["out[0]"], [h * h]),
        ("optimizer", *_layer_optimizer(h)[0]),
        ("step", "", "param", "layers.0.mlp.fc1.weight", [], ["value"], [h, h]),
    ]


def _flat(calls: list[tuple]) -> list[tuple]:
    """Records of calls as (call_no, phase, module, kind, name, role, arg, shape): inputs before outputs."""
    out = []
    for n, (phase, module, kind, name, inputs, outputs, shape) in enumerate(calls):
        out += [(n, phase, module, kind, name, "input", a, shape) for a in inputs]
        out += [
            (n, phase, module, kind, name, "value", "", shape)
            if a == "value"
            else (n, phase, module, kind, name, "output", a, shape)
            for a in outputs
        ]
    return out


def _template(spec: TemplateShape) -> _Template:
    recs = _flat(_build_calls(spec))[: spec.records]
    mb = -1
    occ_count: Counter = Counter()
    call_occ: dict[int, int] = {}
    call_hashes: dict[int, int] = {}
    cols: dict[str, list] = {
        k: []
        for k in (
            "microbatch",
            "phase",
            "module",
            "kind",
            "name",
            "occurrence",
            "role",
            "arg",
            "call_hash",
            "key_hash",
            "dtype",
            "shape",
            "numel",
            "status",
        )
    }
    call_start: list[int] = []
    first_of_call: dict[int, int] = {}
    for i, (n, phase, module, kind, name, role, arg, shape) in enumerate(recs):
        if n not in call_occ:
            ck = (mb, phase, module, kind, name)
            call_occ[n] = occ_count[ck]
            occ_count[ck] += 1
            call_hashes[n] = contract.key_hash(contract.call_key(mb, phase, module, kind, name, call_occ[n]))
            first_of_call[n] = i
        call = contract.call_key(mb, phase, module, kind, name, call_occ[n])
        cols["microbatch"].append(mb)
        cols["phase"].append(phase)
        cols["module"].append(module)
        cols["kind"].append(kind)
        cols["name"].append(name)
        cols["occurrence"].append(call_occ[n])
        cols["role"].append(role)
        cols["arg"].append(arg)
        cols["call_hash"].append(call_hashes[n])
        cols["key_hash"].append(contract.key_hash(contract.record_key(call, role, arg)))
        cols["dtype"].append(
            "torch.int64"
            if kind in ("batch", "rng_state")
            else "torch.float32"
            if phase == "optimizer" or kind == "param"
            else "torch.bfloat16"
        )
        cols["shape"].append(shape)
        cols["numel"].append(math.prod(shape))
        cols["status"].append("skipped" if name == "aten::view.default" and role == "output" else "ok")
        call_start.append(first_of_call[n])
    schema = arrow_schema("records")
    table = pa.table({k: pa.array(v, schema.field(k).type) for k, v in cols.items()})
    phases = cols["phase"]
    fwd_end = max((i + 1 for i, p in enumerate(phases) if p == "forward"), default=0)
    bwd_end = max((i + 1 for i, p in enumerate(phases) if p == "backward"), default=fwd_end)
    return _Template(
        table=table,
        kinds=tuple(cols["kind"]),
        digested=tuple(s == "ok" for s in cols["status"]),
        is_output=tuple(r != "input" for r in cols["role"]),
        call_start=tuple(call_start),
        allreduce_outputs=tuple(
            i
            for i, (k, r) in enumerate(zip(cols["kind"], cols["role"], strict=True))
            if k == "collective" and r == "output"
        ),
        forward_end=fwd_end,
        backward_end=bwd_end,
    )
