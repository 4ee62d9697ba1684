"""The call tuple: what one recorded call (an op, a module boundary, a collective...) shares with
all of its records, and the row types the other buffers hold until the flush.

A call is ``(step, microbatch, phase, module, kind, name, occurrence, args, compiled)``, read by
the field indices below (``call[NAME]``) and made by ``make_call``. It is a plain tuple, not a
NamedTuple, on purpose: there is one per recorded call (thousands per step at level ops), each
alive until the flush, and the cyclic collector untracks only exact tuples of atomic values; a
NamedTuple subclass stays tracked and is traversed by every collection (measured: 20,000 calls
kept to a flush cost 15x the collector time as NamedTuples, and triggered full collections).
The other buffered rows are few per step and are NamedTuples.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

__all__ = [
    "ARGS",
    "COMPILED",
    "KIND",
    "MICROBATCH",
    "MODULE",
    "NAME",
    "OCCURRENCE",
    "PHASE",
    "STEP",
    "Call",
    "DumpRow",
    "EventRow",
    "KernelRow",
    "MetricRow",
    "RecordSpec",
    "TensorArg",
    "make_call",
]

#: A call tuple (see the module docstring for why it is a plain tuple).
Call = tuple
#: Field indices of a call: absolute step; microbatch (-1: none); phase; module path; record
#: kind; name (op overload, module class, collective...); occurrence (calls with the same key
#: before this one on this rank); args (a ``flat_args`` tuple of the non-tensor arguments, or
#: None); compiled (recorded at a compiled region's boundary).
STEP, MICROBATCH, PHASE, MODULE, KIND, NAME, OCCURRENCE, ARGS, COMPILED = range(9)

#: One tensor of a call as the sources hand it to the recorder: (role, arg, tensor). Transient
#: (built and consumed within the call), so a plain tuple.
TensorArg = tuple[str, str, torch.Tensor]


def make_call(
    step: int,
    microbatch: int,
    phase: str,
    module: str,
    kind: str,
    name: str,
    occurrence: int,
    args: tuple | None = None,
    compiled: bool = False,
) -> Call:
    """A call tuple, field by field."""
    return (step, microbatch, phase, module, kind, name, occurrence, args, compiled)


class RecordSpec(NamedTuple):
    """One single-tensor record of a batch (``Recorder.record_many``: step boundaries)."""

    #: The call it belongs to, or None to open a new call (its next occurrence).
    call: Call | None
    kind: str
    name: str
    module: str
    phase: str
    role: str
    arg: str
    tensor: torch.Tensor


class MetricRow(NamedTuple):
    """A ``metric()`` call, until the flush reads its value (a tensor is read there, not now)."""

    step: int
    seq: int
    microbatch: int
    name: str
    occurrence: int
    #: A 1-D one-element tensor (a clone) or a Python number.
    value: Any
    dtype: str


class EventRow(NamedTuple):
    """A row of the events table."""

    step: int
    seq: int
    type: str
    name: str
    module: str
    # The events table's column (a field, shadowing tuple.count: never called on a row).
    count: int | None  # type: ignore[assignment]
    detail: str | None


class KernelRow(NamedTuple):
    """A kernel (or, on CPU, an innermost profiler event) launched under an op's call."""

    call: Call
    # The kernels table's column (a field, shadowing tuple.index: never called on a row).
    index: int  # type: ignore[assignment]
    kernel: str
    device_type: str


class DumpRow(NamedTuple):
    """A record whose tensor is also stored as raw bytes (``dumps=``)."""

    call: Call
    seq: int
    role: str
    arg: str
    tensor: torch.Tensor
