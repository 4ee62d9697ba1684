"""Throughput and per-call cost of the detfp digest next to the alternatives, measured side by side.

Prints one table: GB/s on 1 MiB and 64 MiB float32 and bfloat16 tensors for the detfp digest
(``fingerprint``: start + resolve, one sync), ``torch.hash_tensor`` (XOR reduce, order-blind),
xxh3-128 and sha256 over the raw bytes (host hashes, CPU only), and ``clone()`` (a memory-bandwidth
reference), timed round-robin (each round times every method once); then the ratio
detfp / hash_tensor (median of per-round ratios), and the per-call cost for a tiny tensor (16
floats) through ``start`` alone (what capture pays per tensor), ``start`` + a share of a batched
``resolve``, and ``fingerprint``. Each number is the median of several rounds. On CPU, last, the
level GEMM alone (``_digest.core.mm`` on 16 MiB of rows) on each route this machine has, side by
side: the native kernel, ``torch._int_mm`` and the exact float32 GEMM (the same integers on each),
with each route's speed over the float32 GEMM's.

    .venv/bin/python benchmarks/digest.py [--device cuda] [--repeats 7] [--threads N]
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import time

import torch

import benchlib
from detfp_capture.digest import fingerprint, resolve, start

try:
    import xxhash
except ImportError:  # optional: the table says n/a
    xxhash = None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn, repeats: int, device: torch.device, inner: int = 1) -> float:
    fn()  # warm-up (weights, caches, allocator)
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        _sync(device)
        times.append((time.perf_counter() - t0) / inner)
    return statistics.median(times)


def interleaved_seconds(fns: dict, repeats: int, device: torch.device, inner: int) -> dict[str, list[float]]:
    """Per-call seconds of each function, timed round-robin so that load changes hit all alike."""
    for fn in fns.values():
        fn()  # warm-up
    out: dict[str, list[float]] = {n: [] for n in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            _sync(device)
            out[name].append((time.perf_counter() - t0) / inner)
    return out


def methods(t: torch.Tensor) -> dict[str, object]:
    out: dict[str, object] = {
        "detfp": lambda: fingerprint(t),
        "hash_tensor": lambda: torch.hash_tensor(t),
        "clone": lambda: t.clone(),
    }
    if t.device.type == "cpu":
        raw = memoryview(t.view(torch.uint8).numpy())
        out["xxh3_128"] = (lambda: xxhash.xxh3_128(raw).digest()) if xxhash is not None else None
        out["sha256"] = lambda: hashlib.sha256(raw).digest()
    else:
        out["xxh3_128"] = out["sha256"] = None
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    args = ap.parse_args()
    print(benchlib.machine_line(), flush=True)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    from detfp_capture._digest import core

    print(
        f"torch {torch.__version__}, device {device}, threads {torch.get_num_threads()}, repeats {args.repeats}, "
        f"level GEMM: {core.route(device)}"
    )
    names = ["detfp", "hash_tensor", "xxh3_128", "sha256", "clone"]
    print(f"{'tensor':<16}" + "".join(f"{n + ' GB/s':>17}" for n in names) + f"{'detfp/hash_tensor':>19}")
    for mib in (1, 64):
        for dtype in (torch.float32, torch.bfloat16):
            numel = mib * (1 << 20) // dtype.itemsize
            t = torch.randn(numel, generator=torch.Generator().manual_seed(0)).to(dtype).to(device)
            nbytes = numel * dtype.itemsize
            inner = 20 if mib == 1 else 1
            fns = {n: f for n, f in methods(t).items() if f is not None}
            secs = interleaved_seconds(fns, args.repeats, device, inner)
            gbps = {n: (nbytes / statistics.median(secs[n]) / 1e9 if n in secs else None) for n in names}
            # the ratio is the median of per-round ratios: both timed back to back in each round
            ratio = statistics.median(h / d for d, h in zip(secs["detfp"], secs["hash_tensor"], strict=True))
            cells = "".join(f"{'n/a' if gbps[n] is None else f'{gbps[n]:.2f}':>17}" for n in names)
            label = f"{mib} MiB {str(dtype).removeprefix('torch.')}"
            print(f"{label:<16}{cells}{ratio:>18.2f}x")

    tiny = torch.randn(16, device=device)
    batch = 2000
    pendings: list = []

    def start_only() -> None:
        pendings.append(start(tiny))

    def start_resolve() -> None:
        resolve([start(tiny) for _ in range(batch)])

    per_start = median_seconds(start_only, args.repeats, device, inner=batch)
    resolve(pendings)
    per_batched = median_seconds(start_resolve, args.repeats, device) / batch
    per_fp = median_seconds(lambda: fingerprint(tiny), args.repeats, device, inner=200)
    per_hash = median_seconds(lambda: torch.hash_tensor(tiny), args.repeats, device, inner=batch)
    print("tiny tensor (16 float32), microseconds per call:")
    print(f"  start()                         {per_start * 1e6:8.1f}")
    print(f"  start() + batched resolve ({batch})  {per_batched * 1e6:8.1f}")
    print(f"  fingerprint() (one sync)        {per_fp * 1e6:8.1f}")
    print(f"  torch.hash_tensor (no fetch)    {per_hash * 1e6:8.1f}")
    if device.type == "cpu":
        gemm_routes(args.repeats)


def gemm_routes(repeats: int) -> None:
    """The level GEMM on each CPU route, round-robin; a route is forced per call through the
    decisions ``core`` caches (``_NATIVE``, ``_INT_MM``), restored afterwards."""
    from detfp_capture._digest import core, native

    x = torch.randint(-128, 128, (16384, 1024), dtype=torch.int8, generator=torch.Generator().manual_seed(0))
    saved = dict(core._NATIVE), dict(core._INT_MM)
    routes = {"native": (True, False), "int8 GEMM": (False, True), "float32 GEMM": (False, False)}
    if not native.AVAILABLE:
        del routes["native"]

    def run(flags: tuple[bool, bool]):
        def fn() -> None:
            core._NATIVE["cpu"], core._INT_MM["cpu"] = flags
            core.mm(x, 0)

        return fn

    try:
        secs = interleaved_seconds({n: run(f) for n, f in routes.items()}, repeats, torch.device("cpu"), 1)
    finally:
        for cache, before in zip((core._NATIVE, core._INT_MM), saved, strict=True):
            cache.clear()
            cache.update(before)
    print("level GEMM, 16 MiB of rows, by route (the same integers on each):")
    for name, t in secs.items():
        speed = statistics.median(f / r for r, f in zip(t, secs["float32 GEMM"], strict=True))
        print(f"  {name:<14}{x.numel() / statistics.median(t) / 1e9:8.2f} GB/s {speed:6.2f}x the float32 GEMM")


if __name__ == "__main__":
    main()
