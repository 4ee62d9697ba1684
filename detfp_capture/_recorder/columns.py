"""Buffers to columns: the metrics, events, kernels and dumps tables of one flush window.

Pure functions over the tuples the ``Recorder`` buffers (see ``_state.py`` for their layout);
they run once per flush, off the per-op hot path. The records table stays in ``_state.py``
because it also feeds the recompute check and the pointer-like hazard events.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

import torch

from detfp_capture import contract

__all__ = ["dump_columns", "event_columns", "kernel_columns", "metric_columns"]


def metric_columns(metrics: list[tuple]) -> dict[str, list]:
    cols: dict[str, list] = {
        n: [] for n in ("step", "seq", "microbatch", "name", "occurrence", "value", "bits", "dtype")
    }
    values = _tensor_values([m[5] for m in metrics if isinstance(m[5], torch.Tensor)])
    for step, seq, mb, name, occ, v, dt in metrics:
        val = values[id(v)] if isinstance(v, torch.Tensor) else float(v)
        cols["step"].append(step)
        cols["seq"].append(seq)
        cols["microbatch"].append(mb)
        cols["name"].append(name)
        cols["occurrence"].append(occ)
        cols["value"].append(val)
        cols["bits"].append(struct.unpack("<Q", struct.pack("<d", val))[0])
        cols["dtype"].append(dt)
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


def event_columns(events: list[tuple]) -> dict[str, list]:
    cols: dict[str, list] = {n: [] for n in ("step", "seq", "type", "name", "module", "count", "detail")}
    for row in sorted(events, key=lambda e: e[1]):
        for k, v in zip(cols, row, strict=True):
            cols[k].append(v)
    return cols


def kernel_columns(kernels: list[tuple], next_seq: Callable[[], int]) -> dict[str, list]:
    names = ("step", "seq", *contract.CALL_KEY_COLUMNS, "index", "kernel", "device_type")
    cols: dict[str, list] = {n: [] for n in names}
    for call, index, kernel, device_type in kernels:
        step, mb, phase, module, kind, name, occ = call[:7]
        for k, v in zip(
            names,
            (step, next_seq(), mb, phase, module, kind, name, occ, index, kernel, device_type),
            strict=True,
        ):
            cols[k].append(v)
    return cols


def dump_columns(dumps: list[tuple]) -> dict[str, list]:
    names = ("step", "seq", *contract.CALL_KEY_COLUMNS, "role", "arg", "dtype", "shape", "data")
    cols: dict[str, list] = {n: [] for n in names}
    for call, seq, role, arg, t in dumps:
        step, mb, phase, module, kind, name, occ = call[:7]
        c = t.detach().cpu().contiguous().reshape(-1)
        data = bytes(c.view(torch.uint8).numpy()) if c.numel() else b""
        row = (step, seq, mb, phase, module, kind, name, occ, role, arg, str(t.dtype), list(t.shape), data)
        for k, v in zip(names, row, strict=True):
            cols[k].append(v)
    return cols
