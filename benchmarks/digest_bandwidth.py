"""The digest's throughput on large tensors as a share of the device's copy bandwidth (issues 15
and 31: goal >= 50% on a GPU for digest version 2, 256 MiB and 1 GiB tensors, bfloat16 and float32).

Per (size, dtype): the copy bandwidth (``clone()`` of that tensor: reads and writes every byte,
so bytes read per second is what a digest that reads every byte once could reach at best), the
throughput of each digest version (``fingerprint(version=...)``: start + resolve, one host sync),
all as the best of ``--repeats`` runs timed alternately, and their ratios. The goal (version 2)
is printed, never enforced (a shared machine's noise would make it flaky); ``scripts/gpu_check.sh``
runs this on the GPU.

    .venv/bin/python benchmarks/digest_bandwidth.py --device cuda            # 256 MiB and 1 GiB
    .venv/bin/python benchmarks/digest_bandwidth.py --device cpu --sizes-mib 4  # a CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

import benchlib
from detfp_capture.digest import fingerprint

GOAL = 0.50
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_seconds(fns: dict, repeats: int, device: torch.device) -> dict[str, float]:
    """Best time of each function over ``repeats`` rounds, the functions taking turns."""
    for fn in fns.values():
        fn()  # warm-up: weights, allocator, kernels
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeats):
        for name, fn in fns.items():
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def measure(device: torch.device, mib: int, dtype: torch.dtype, repeats: int, versions: list[int]) -> dict:
    n = mib * 2**20 // torch.empty((), dtype=dtype).element_size()
    x = torch.randn(n, device=device).to(dtype)
    fns = {"clone": lambda: x.clone()}
    for v in versions:
        fns[f"v{v}"] = lambda v=v: fingerprint(x, version=v)
    times = best_seconds(fns, repeats, device)
    nbytes = x.numel() * x.element_size()
    copy = nbytes / times["clone"]
    row = {"mib": mib, "copy_bytes_per_s": copy}
    for v in versions:
        dig = nbytes / times[f"v{v}"]
        row[f"v{v}"] = {"digest_bytes_per_s": dig, "share": dig / copy}
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--sizes-mib", default="256,1024", help="comma-separated tensor sizes in MiB")
    p.add_argument("--dtypes", default="bf16,fp32", help=f"comma-separated subset of {','.join(DTYPES)}")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--versions", default="2,1", help="digest versions to time, comma-separated (goal: version 2)")
    p.add_argument("--json", help="also write the rows to this JSON file")
    args = p.parse_args(argv)
    print(benchlib.machine_line(), flush=True)
    device = torch.device(args.device)
    sizes = [int(s) for s in args.sizes_mib.split(",") if s.strip()]
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    if set(dtypes) - set(DTYPES):
        p.error(f"--dtypes: choose from {', '.join(DTYPES)}")
    versions = [int(v) for v in args.versions.split(",") if v.strip()]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    from detfp_capture._digest.versions import SCHEMES

    routes = "; ".join(f"version {v}: {SCHEMES[v].route(device)}" for v in versions)
    print(f"digest throughput vs clone() on {name} (best of {args.repeats}; goal >= {GOAL:.0%} of copy bandwidth)")
    print(f"routes: {routes}")
    print(
        f"{'size':>9}{'dtype':>7}{'copy GB/s':>11}"
        + "".join(f"{f'v{v} GB/s':>10}{'share':>7}" for v in versions)
        + "  goal"
    )
    rows = []
    for mib in sizes:
        for d in dtypes:
            r = measure(device, mib, DTYPES[d], args.repeats, versions)
            if device.type == "cuda":
                torch.cuda.empty_cache()  # the 1 GiB tensors and their clones: gone before the next size
            r["dtype"] = d
            rows.append(r)
            verdict = "" if 2 not in versions else ("met" if r["v2"]["share"] >= GOAL else "missed")
            cells = "".join(
                f"{r[f'v{v}']['digest_bytes_per_s'] / 1e9:>10.2f}{r[f'v{v}']['share']:>7.0%}" for v in versions
            )
            print(f"{mib:>5} MiB{d:>7}{r['copy_bytes_per_s'] / 1e9:>11.2f}{cells}  {verdict}")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": name, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
