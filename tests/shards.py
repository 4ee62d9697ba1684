"""Tiny torch-free helper to write inline detfp runs through the real writer (for tests).

Rows are plain dicts holding only the columns a test cares about; every other contract
column gets a default, and shards and manifests are written by ``ShardWriter`` and
``write_manifest`` exactly as capture writes them. Example::

    from tests.shards import hexdigest, write_run

    run = write_run(tmp_path / "a", {
        0: {"records": [dict(step=1, name="aten::mm.default", role="input", arg="args[0]"),
                        dict(step=1, name="aten::mm.default", digest=hexdigest("x"))],
            "metrics": [dict(step=1, name="loss", value=2.5)]},
        1: {"records": [dict(step=1, kind="collective", name="all_reduce")]},
    })

Signature::

    write_run(path, ranks, *, world_size=None, segment=0, start_step=None,
              manifest_overrides=None, windows="step", manifests=True, legacy=False) -> Path

* ``ranks``: rank -> table name -> list of row dicts (a rank with ``{}`` gets a manifest only).
* ``world_size``: defaults to ``max(ranks) + 1``.
* ``segment``/``start_step``: write a later process launch (resume) into the same directory.
* ``manifest_overrides``: dict merged into every rank's manifest, or ``{rank: dict}``.
* ``windows``: ``"step"`` writes one flush window per distinct step, ``"single"`` one window.
* ``manifests``: False to write shards only (for invalid-run tests).
* ``legacy``: True to write no commit log (a run from before the completeness contract).

Defaults (records): microbatch -1, phase "forward", module "", kind "op", name
"aten::mm.default", role "output", arg "out[0]" (or "args[0]" for inputs, "" for values),
dtype "torch.float32", shape [4], numel = product of shape, status "ok", digest derived
from (rank, step, record key) unless given as ``digest="<32 hex>"`` (or an int, or
``digest_hi``/``digest_lo``), hazards [], compiled False, other nullable columns null.
``occurrence`` is counted per call when absent: a record continues the previous call when
it has the same (step, microbatch, phase, module, kind, name), does not repeat a (role, arg)
already seen in that call and is not an input after the call's outputs; otherwise it starts
the next call. ``seq`` increases per rank across all tables when absent. Metrics: name
"loss", value 0.0, bits = the IEEE-754 bits of value, dtype "torch.float32", occurrence
counted per (step, microbatch, name). Events: type "step_end", name/module "". Kernels:
call key as records, index counted per call, kernel "kernel", device_type "cpu". Dumps:
call key as records, role/arg as records, data b"".
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from detfp_capture import contract
from detfp_capture.writer import ShardWriter, write_manifest

__all__ = ["default_manifest", "hexdigest", "split_digest", "write_run"]

_KEY_DEFAULTS = {
    "microbatch": contract.NO_MICROBATCH,
    "phase": "forward",
    "module": "",
    "kind": "op",
    "name": "aten::mm.default",
}


def hexdigest(label: object) -> str:
    """A deterministic 32-hex digest for a label: handy for planting equal or different digests."""
    return hashlib.blake2b(repr(label).encode(), digest_size=16).hexdigest()


def split_digest(digest: str | int) -> tuple[int, int]:
    """(hi, lo) 64-bit halves of a 32-hex string or a 128-bit int."""
    value = int(digest, 16) if isinstance(digest, str) else int(digest)
    return value >> 64, value & ((1 << 64) - 1)


def default_manifest(rank: int, world_size: int, *, segment: int = 0, start_step: int | None = None) -> dict:
    """A minimal valid manifest holding every contract.MANIFEST_KEYS key."""
    return {
        "schema_version": contract.SCHEMA_VERSION,
        "digest_version": contract.DIGEST_VERSION,
        "digest_algorithm": contract.DIGEST_ALGORITHM,
        "rank": rank,
        "world_size": world_size,
        "segment": segment,
        "start_step": start_step,
        "parallel": {},
        "groups": {},
        "versions": {
            "torch": "2.13.0",
            "cuda": None,
            "cudnn": None,
            "nccl": None,
            "python": "3.11.7",
            "os": "Linux",
            "detfp": "0.1.0",
        },
        "host": {"hostname": "testhost", "device_count": 0, "devices": [], "cpu": "testcpu", "local_rank": rank},
        "determinism": {
            "deterministic_algorithms": True,
            "deterministic_warn_only": False,
            "cudnn_deterministic": True,
            "cudnn_benchmark": False,
            "cuda_matmul_allow_tf32": False,
            "cudnn_allow_tf32": False,
            "float32_matmul_precision": "highest",
            "fill_uninitialized_memory": True,
            "num_threads": 1,
            "num_interop_threads": 1,
        },
        "env": {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"},
        "git": {"commit": None, "dirty": None, "root": None},
        "command": ["train.py"],
        "capture": {"level": "ops"},
    }


def _arg_default(role: str) -> str:
    return {"input": "args[0]", "output": "out[0]"}.get(role, "")


class _Filler:
    """Per-rank default filling (occurrence counters, seq counter)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.seq = 0
        self.counts: dict[tuple, int] = {}
        # Current call: (key, occurrence, seen (role, arg) pairs, outputs seen?)
        self.call: tuple[tuple, int, set, bool] | None = None

    def _seq(self, row: dict) -> None:
        if "seq" in row:
            self.seq = max(self.seq, int(row["seq"]) + 1)
        else:
            row["seq"] = self.seq
            self.seq += 1

    def _call_occurrence(self, row: dict, role: str | None, arg: str | None, table: str) -> None:
        key = (table, row["step"], *(row[k] for k in _KEY_DEFAULTS))
        if "occurrence" in row:
            self.call = (key, int(row["occurrence"]), {(role, arg)}, role == "output")
            self.counts[key] = max(self.counts.get(key, 0), int(row["occurrence"]) + 1)
            return
        cur = self.call
        if (
            cur is not None
            and cur[0] == key
            and (role, arg) not in cur[2]
            and not (role == "input" and cur[3])
            and table == "records"
        ):
            row["occurrence"] = cur[1]
            cur[2].add((role, arg))
            self.call = (key, cur[1], cur[2], cur[3] or role == "output")
            return
        occ = self.counts.get(key, 0)
        self.counts[key] = occ + 1
        row["occurrence"] = occ
        self.call = (key, occ, {(role, arg)}, role == "output")

    def record(self, src: Mapping[str, Any]) -> dict:
        row = dict(src)
        row.setdefault("step", 0)
        for k, v in _KEY_DEFAULTS.items():
            row.setdefault(k, v)
        row.setdefault("role", "output")
        row.setdefault("arg", _arg_default(row["role"]))
        self._call_occurrence(row, row["role"], row["arg"], "records")
        self._seq(row)
        row.setdefault("dtype", "torch.float32")
        row.setdefault("shape", [4])
        row.setdefault("numel", math.prod(row["shape"]))
        row.setdefault("status", "ok")
        digest = row.pop("digest", None)
        if digest is not None:
            row["digest_hi"], row["digest_lo"] = split_digest(digest)
        elif row["status"] == "ok" and "digest_hi" not in row:
            ck = contract.call_key(*(row[k] for k in (*_KEY_DEFAULTS, "occurrence")))
            rk = contract.record_key(ck, row["role"], row["arg"])
            row["digest_hi"], row["digest_lo"] = split_digest(hexdigest((self.rank, row["step"], rk)))
        row.setdefault("hazards", [])
        row.setdefault("compiled", False)
        return row

    def metric(self, src: Mapping[str, Any]) -> dict:
        row = dict(src)
        row.setdefault("step", 0)
        row.setdefault("microbatch", contract.NO_MICROBATCH)
        row.setdefault("name", "loss")
        if "occurrence" not in row:
            key = ("metrics", row["step"], row["microbatch"], row["name"])
            row["occurrence"] = self.counts.get(key, 0)
            self.counts[key] = row["occurrence"] + 1
        self._seq(row)
        row.setdefault("value", 0.0)
        row.setdefault("bits", struct.unpack("<Q", struct.pack("<d", float(row["value"])))[0])
        row.setdefault("dtype", "torch.float32")
        return row

    def event(self, src: Mapping[str, Any]) -> dict:
        row = dict(src)
        row.setdefault("step", 0)
        row.setdefault("type", "step_end")
        row.setdefault("name", "")
        row.setdefault("module", "")
        self._seq(row)
        return row

    def kernel(self, src: Mapping[str, Any]) -> dict:
        row = dict(src)
        row.setdefault("step", 0)
        for k, v in _KEY_DEFAULTS.items():
            row.setdefault(k, v)
        row.setdefault("occurrence", 0)
        if "index" not in row:
            key = ("kernels", row["step"], *(row[k] for k in (*_KEY_DEFAULTS, "occurrence")))
            row["index"] = self.counts.get(key, 0)
            self.counts[key] = row["index"] + 1
        self._seq(row)
        row.setdefault("kernel", "kernel")
        row.setdefault("device_type", "cpu")
        return row

    def dump(self, src: Mapping[str, Any]) -> dict:
        row = dict(src)
        row.setdefault("step", 0)
        for k, v in _KEY_DEFAULTS.items():
            row.setdefault(k, v)
        row.setdefault("occurrence", 0)
        row.setdefault("role", "output")
        row.setdefault("arg", _arg_default(row["role"]))
        self._seq(row)
        row.setdefault("dtype", "torch.float32")
        row.setdefault("shape", [4])
        row.setdefault("data", b"")
        return row


def _columnar(rows: list[dict], table: str) -> dict[str, list]:
    names = [c.name for c in contract.columns(table)]
    present = [n for n in names if any(n in r for r in rows)]
    return {n: [r.get(n) for r in rows] for n in present}


def write_run(
    path: str | Path,
    ranks: Mapping[int, Mapping[str, list[Mapping[str, Any]]]],
    *,
    world_size: int | None = None,
    segment: int = 0,
    start_step: int | None = None,
    manifest_overrides: Mapping[Any, Any] | None = None,
    windows: str = "step",
    manifests: bool = True,
    legacy: bool = False,
) -> Path:
    """Write an inline run (see the module docstring); returns ``Path(path)``."""
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    ws = world_size if world_size is not None else (max(ranks) + 1 if ranks else 1)
    for rank in sorted(ranks):
        filler = _Filler(rank)
        fill = {
            "records": filler.record,
            "metrics": filler.metric,
            "events": filler.event,
            "kernels": filler.kernel,
            "dumps": filler.dump,
        }
        tables: dict[str, list[dict]] = {}
        for table, rows in ranks[rank].items():
            if table not in fill:
                raise KeyError(f"unknown table {table!r}")
            tables[table] = [fill[table](r) for r in rows]
        steps = sorted({r["step"] for rows in tables.values() for r in rows})
        groups = [steps] if windows == "single" else [[s] for s in steps]
        writer = ShardWriter(root, rank, segment, commit_log=not legacy)
        try:
            for group in groups:
                writer.write_window(
                    {t: _columnar([r for r in rows if r["step"] in group], t) for t, rows in tables.items()}
                )
        finally:
            writer.close()
        if writer.failed:
            raise RuntimeError(writer.error)
        if manifests:
            manifest = default_manifest(rank, ws, segment=segment, start_step=start_step)
            if manifest_overrides:
                if all(isinstance(k, int) for k in manifest_overrides):
                    manifest.update(manifest_overrides.get(rank, {}))
                else:
                    manifest.update(manifest_overrides)
            write_manifest(root, manifest)
    return root
