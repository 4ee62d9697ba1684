"""Buffers to columns: the metrics, events, kernels and dumps tables of one flush window.

Pure functions over the rows the ``Recorder`` buffers (``call.MetricRow``, ``EventRow``,
``KernelRow``, ``DumpRow``); they run once per flush, off the per-op hot path. The records
table is built in ``records`` (its digests also feed ``flush.DigestFindings``).
"""

from __future__ import annotations

import struct
from collections.abc import Callable

import torch

from detfp_capture._recorder.call import OCCURRENCE, STEP, DumpRow, EventRow, KernelRow, MetricRow
from detfp_format import contract

__all__ = ["dump_columns", "event_columns", "kernel_columns", "metric_columns"]


def metric_columns(metrics: list[MetricRow]) -> dict[str, list]:
    cols: dict[str, list] = {
        n: [] for n in ("step", "seq", "microbatch", "name", "occurrence", "value", "bits", "dtype")
    }
    values = _tensor_values([m.value for m in metrics if isinstance(m.value, torch.Tensor)])
    # In record order: a metric of a collective's result joins the buffer when it completes.
    for m in sorted(metrics, key=lambda m: m.seq):
        v = m.value
        val = values[id(v)] if isinstance(v, torch.Tensor) else float(v)
        cols["step"].append(m.step)
        cols["seq"].append(m.seq)
        cols["microbatch"].append(m.microbatch)
        cols["name"].append(m.name)
        cols["occurrence"].append(m.occurrence)
        cols["value"].append(val)
        cols["bits"].append(struct.unpack("<Q", struct.pack("<d", val))[0])
        cols["dtype"].append(m.dtype)
    return cols


def _tensor_values(tensors: list[torch.Tensor]) -> dict[int, float]:
    """id -> float64 value of one-element 1-D tensors: one concatenation per (device, dtype), one
    conversion per dtype and one device-to-host copy per device, however many metrics."""
    groups: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]] = {}
    for t in tensors:
        groups.setdefault(t.device, {}).setdefault(t.dtype, []).append(t)
    values: dict[int, float] = {}
    for by_dtype in groups.values():
        order: list[torch.Tensor] = []
        parts = []
        for ts in by_dtype.values():
            parts.append(torch.cat(ts).to(torch.float64))  # Recorder.metric keeps them 1-D
            order += ts
        host = (parts[0] if len(parts) == 1 else torch.cat(parts)).cpu().tolist()
        values.update((id(t), v) for t, v in zip(order, host, strict=True))
    return values


def event_columns(events: list[EventRow]) -> dict[str, list]:
    cols: dict[str, list] = {n: [] for n in EventRow._fields}
    for row in sorted(events, key=lambda e: e.seq):
        for k, v in zip(cols, row, strict=True):
            cols[k].append(v)
    return cols


def kernel_columns(kernels: list[KernelRow], next_seq: Callable[[], int]) -> dict[str, list]:
    names = ("step", "seq", *contract.CALL_KEY_COLUMNS, "index", "kernel", "device_type")
    cols: dict[str, list] = {n: [] for n in names}
    for k in kernels:
        step, mb, phase, module, kind, name, occ = k.call[STEP : OCCURRENCE + 1]  # step and the call key
        for col, v in zip(
            names,
            (step, next_seq(), mb, phase, module, kind, name, occ, k.index, k.kernel, k.device_type),
            strict=True,
        ):
            cols[col].append(v)
    return cols


def dump_columns(dumps: list[DumpRow]) -> dict[str, list]:
    names = ("step", "seq", *contract.CALL_KEY_COLUMNS, "role", "arg", "dtype", "shape", "data")
    cols: dict[str, list] = {n: [] for n in names}
    for d in dumps:
        step, mb, phase, module, kind, name, occ = d.call[STEP : OCCURRENCE + 1]  # step and the call key
        t = d.tensor
        c = t.detach().cpu().contiguous().reshape(-1)
        data = bytes(c.view(torch.uint8).numpy()) if c.numel() else b""
        row = (step, d.seq, mb, phase, module, kind, name, occ, d.role, d.arg, str(t.dtype), list(t.shape), data)
        for col, v in zip(names, row, strict=True):
            cols[col].append(v)
    return cols
