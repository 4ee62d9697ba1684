#!/usr/bin/env bash
# GPU check for detfp (needs one CUDA machine; about 4-5 minutes). Run from anywhere:
#
#     bash scripts/gpu_check.sh            # NPROC=1|2, BACKEND=nccl|gloo, ROUNDS=10 to override
#     DEVICE=cpu bash scripts/gpu_check.sh # smoke-test this script itself on a machine without a GPU
#
# 1. the example at every capture level on the GPU (torchrun, single node), traces validated,
#    including kernel identities from the profiler carrying real CUDA kernel names;
# 2. device digests equal the CPU reference digests, tensor by tensor (detfp_capture.fingerprint), for
#    each digest version (2, the default: the device's torch route against the CPU's native kernel;
#    and 1), through the single, batched and staged paths;
# 3. host synchronizations per step at each level (metrics, boundaries, ops), counted with the
#    profiler: fails if the capture adds anything like one per record (digests must stay on the
#    device until a flush);
# 4. the GPU-marked tests (pytest -m gpu), if any;
# 5. repeat checks on the device: index_add_ with duplicate indices (float atomics) is caught within 5
#    repeats, at that op, as an origin; the same op under torch.use_deterministic_algorithms(True) and a
#    transformer block forward+backward pass; then the repeat-check cost (benchmarks/repeat_check.py);
# 6. the capture-overhead table (benchmarks/capture_overhead.py --device cuda), at the default
#    sizes and at a device-bound size of the gpt2 row (--width 2048 --seq 1024);
# 7. the digest's throughput on 256 MiB and 1 GiB bf16/fp32 tensors as a share of the device's
#    clone() bandwidth, versions 2 and 1 side by side (benchmarks/digest_bandwidth.py; goal >= 50%
#    for version 2, printed, not enforced);
# 8. compiled code on the device: a compiled function's Triton kernels recorded at level ops (kind
#    kernel), capture on/off bitwise equal, a repeat check passing; and the CUDA-graph digest
#    buffer (detfp_capture/_digest/graphs.py): digests put into a captured graph, the graph
#    replayed on three inputs, each replay's snapshot resolving to the digests of that replay's
#    values (written without a GPU: its CPU half is unit-tested, this half never ran yet).
# DRY_RUN=1 (with DEVICE=cpu) runs every step at small sizes: a quick check of the script itself.
# Exits non-zero, naming the failed check, on the first failure; with KEEP_GOING=1 it runs every
# check and names all the failures at the end (one lease on a time-boxed GPU machine shows them all).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
ROUNDS=${ROUNDS:-10}
DEVICE=${DEVICE:-cuda}
export DEVICE
WORK=$(mktemp -d -t detfp-gpu-check-XXXXXX)
trap 'rm -rf "$WORK"' EXIT

DRY_RUN=${DRY_RUN:-0}
# Timeouts of the benchmark steps are multiplied by this (a loaded CPU runs a dry run ~10x slower).
SLOW=${SLOW:-1}
if [ "$DRY_RUN" = 1 ]; then
  SLOW=${SLOW_DRY:-6}
  ROUNDS=2; BIG_ARGS="--models gpt2 --width 64 --seq 32 --layers 1 --trials 1 --rounds 2 --warmup 1"
  DIGEST_MIB=${DIGEST_MIB:-1,4}
else
  BIG_ARGS="--models gpt2 --width ${BIG_WIDTH:-2048} --seq ${BIG_SEQ:-1024} --trials 1 --rounds ${BIG_ROUNDS:-5}"
  DIGEST_MIB=${DIGEST_MIB:-256,1024}
fi
export DRY_RUN

step() { printf '\n== %s\n' "$*"; }
FAILED=()
die() {
  printf 'gpu_check: FAILED: %s\n' "$*" >&2
  [ "${KEEP_GOING:-0}" = 1 ] || exit 1
  FAILED+=("$*")
}

step "environment"
"$PY" - <<'EOF' || KEEP_GOING=0 die "CUDA is not available to $PY (need a CUDA build of torch and a visible GPU)"
import os, sys, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "device", os.environ["DEVICE"])
if os.environ["DEVICE"] == "cuda" and not torch.cuda.is_available():
    sys.exit(1)
for i in range(torch.cuda.device_count()):
    print(f"cuda:{i}", torch.cuda.get_device_name(i))
EOF
if [ "$DEVICE" = cuda ]; then
  NGPU=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
  NPROC=${NPROC:-$(( NGPU >= 2 ? 2 : 1 ))}
  BACKEND=${BACKEND:-nccl}
  if [ "$BACKEND" = nccl ] && [ "$NPROC" -gt "$NGPU" ]; then
    die "NPROC=$NPROC ranks but only $NGPU GPU(s): NCCL needs one GPU per rank (set NPROC=$NGPU or BACKEND=gloo)"
  fi
else
  NPROC=${NPROC:-2}
  BACKEND=${BACKEND:-gloo}
fi
echo "ranks $NPROC, backend $BACKEND"

step "1/8 example at every level on $DEVICE (torchrun --nproc_per_node $NPROC)"
for level in metrics boundaries ops; do
  steps=3; extra=""
  if [ "$level" = ops ]; then steps=2; extra="--capture-steps 1 --kernels 1"; fi
  # shellcheck disable=SC2086
  timeout 240 "$PY" -m torch.distributed.run --nproc_per_node "$NPROC" examples/train_tiny.py \
      --device "$DEVICE" --backend "$BACKEND" --out "$WORK/$level" --level "$level" --steps "$steps" --quiet $extra \
      > "$WORK/$level.log" 2>&1 || { tail -n 30 "$WORK/$level.log" >&2; die "example at level $level (log above)"; continue; }
  echo "level $level: ok"
done
"$PY" - "$WORK" "$NPROC" <<'EOF' || die "trace validation (see the message above)"
import os, sys
import polars as pl
from detfp_analyze.io.reader import open_run
work, nproc, device = sys.argv[1], int(sys.argv[2]), os.environ["DEVICE"]
want = {"metrics": {"rng_state", "param"}, "boundaries": {"module_output", "optimizer_state"},
        "ops": {"op", "module_output"}}
if nproc > 1:  # DDP's gradient reduction only exists with several ranks
    want["boundaries"].add("reduced_grad")
for level, kinds in want.items():
    run = open_run(f"{work}/{level}")
    assert run.ranks == tuple(range(nproc)), f"{level}: ranks {run.ranks}, expected {nproc}"
    got = set(run.scan("records").select("kind").unique().collect()["kind"].to_list())
    missing = kinds - got
    assert not missing, f"{level}: record kinds {sorted(missing)} missing (have {sorted(got)})"
    errors = run.scan("records").filter(pl.col("status") == "error").select(pl.len()).collect().item()
    assert errors == 0, f"{level}: {errors} records failed to digest on {device}"
    print(f"{level}: ranks {run.ranks}, kinds {sorted(got)}")
k = open_run(f"{work}/ops").scan("kernels").collect()
assert k.height > 0, "ops: no kernel identities recorded for --kernels 1"
dev = k.filter(pl.col("device_type") == device)
assert dev.height > 0, f"ops: kernels table has no {device} kernels (device types {k['device_type'].unique().to_list()})"
print("kernels: e.g.", ", ".join(sorted(set(dev["kernel"].head(200).to_list()))[:4]))
EOF

step "2/8 device digests == CPU reference digests (versions 2 and 1; single, batched, staged)"
"$PY" - <<'EOF' || die "a $DEVICE digest differs from the CPU reference (see above)"
import os, torch
from detfp_capture import fingerprint
from detfp_capture._digest import versions
g = torch.Generator().manual_seed(0)
cases = {
    "f32 small": torch.randn(7, 5, generator=g),
    "f32 4MiB": torch.randn(1024, 1024, generator=g),
    "f32 odd": torch.randn(3, 1000, 37, generator=g),
    "bf16": torch.randn(513, 257, generator=g).bfloat16(),
    "f16": torch.randn(4096, generator=g).half(),
    "f64": torch.randn(100, 3, generator=g).double(),
    "int64": torch.randint(-2**62, 2**62, (999,), generator=g),
    "int8": torch.randint(-128, 127, (5000,), generator=g, dtype=torch.int8),
    "bool": torch.rand(333, generator=g) > 0.5,
    "complex64": torch.randn(64, 8, generator=g, dtype=torch.complex64),
    "0-dim": torch.tensor(3.5),
    "empty": torch.empty(0, 4),
    "non-contiguous": torch.randn(64, 48, generator=g).t()[::2],
    "-0.0": torch.tensor([-0.0, 0.0, float("nan"), float("inf")]),
}
if hasattr(torch, "float8_e4m3fn"):
    cases["fp8 e4m3"] = torch.randn(2048, generator=g).to(torch.float8_e4m3fn)
cases["4 levels (v2)"] = torch.randint(-128, 128, (64 * 64 * 1024 + 777,), generator=g, dtype=torch.int8)
bad = 0
dev_type = torch.device(os.environ["DEVICE"])
for version in (2, 1):
    sch = versions.SCHEMES[version]
    print(f"digest version {version}: CPU route {sch.route(torch.device('cpu'))}, {dev_type} route {sch.route(dev_type)}")
    for name, t in cases.items():
        kw = dict(rows=t.dim() > 0 and t.shape[0] > 0, moments=t.is_floating_point(), version=version)
        cpu = fingerprint(t, **kw)
        dev = fingerprint(t.to(dev_type), **kw)
        same = cpu.digest == dev.digest and cpu.rows == dev.rows and not cpu.error and not dev.error
        bad += not same
        print(f"{'ok  ' if same else 'DIFF'} v{version} {name:<18} {cpu.digest or cpu.error}  {dev.digest or dev.error}")
# The batched paths capture takes on the device: step-boundary batches (start_many) and
# boundary staging (snapshots, and tensors hashed in place with their lanes buffer).
from detfp_capture import digest
from detfp_capture._digest.batched import start_many
from detfp_capture._recorder.deferred import Slot
from detfp_capture._digest.staging import Staging
kinds = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64)
plain = [t for t in cases.values() if t.numel() and t.dtype in kinds]
plain += [torch.randn(256, 1024, generator=g), torch.randn(259 * 256, generator=g)]  # hashed in place
plain += [torch.arange(0, 300 * 16, 16) + (1 << 33)]  # int64 that looks like device pointers
for version in (2, 1):
  with versions.use(version):  # what a Session with digest_version=version makes the batch paths take
    want = [(f.digest, f.pointer_like) for f in (fingerprint(t, pointer_check=True) for t in plain)]
    devts = [t.to(os.environ["DEVICE"]) for t in plain]
    got_batch = [(f.digest, f.pointer_like) for f in digest.resolve(start_many(devts))]
    st = Staging(devts[0].device)
    slots = [Slot(None) for _ in devts]
    assert st.put_many(devts, slots), "staging refused the batch"
    st.run_into()
    got_staged = [(f.digest, f.pointer_like) for f in digest.resolve([s.started() for s in slots])]
    for path, got in (("start_many", got_batch), ("staging", got_staged)):
        same = got == want
        bad += not same
        print(f"{'ok  ' if same else 'DIFF'} v{version} {path:<16} {sum(a == b for a, b in zip(got, want))}/{len(want)} tensors")
    # A step boundary's layout, reused: the second call gives it its own buffer (one
    # _foreach_copy_ on the device), the third follows an in-place write.
    floats = [t for t in devts if t.dtype is not torch.int64]
    for k in range(3):
        if k == 2:
            floats[0].mul_(3)
        ref = [fingerprint(t.cpu()).digest for t in floats]
        got = [f.digest for f in digest.resolve(start_many(floats, reuse=True))]
        same = got == ref
        bad += not same
        print(f"{'ok  ' if same else 'DIFF'} v{version} {'reused layout ' + str(k):<16} {sum(a == b for a, b in zip(got, ref))}/{len(ref)} tensors")
raise SystemExit(1 if bad else 0)
EOF

step "3/8 host synchronizations per step at each level (profiler count)"
"$PY" - "$WORK" <<'EOF' || die "capture synchronizes with the host per record (see counts above)"
import os, sys, types
from pathlib import Path
import torch
from torch.profiler import ProfilerActivity, profile
from detfp_analyze.io.reader import open_run
sys.path.insert(0, "benchmarks")  # the benchmark's modules (capture_overhead, benchlib), as when run as a script
import capture_overhead as bench
tt = bench.load_example()
device = os.environ["DEVICE"]
args = types.SimpleNamespace(device=device, seed=1234, model="tiny", no_probes=False, **bench.SHAPES["tiny"])
activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
SYNC = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
def syncs(config):
    out = Path(sys.argv[1]) / f"sync-{config}"
    r = bench.Runner(tt, config, args, out.parent if config == "none" else Path(str(out)))
    r.step(); r.step()  # warm-up: allocator, cuBLAS handles, arenas
    with profile(activities=activities) as prof:
        r.step()
    r.close()
    # cudaMemcpy (the synchronous one) blocks; cudaMemcpyAsync counts only if followed by a sync.
    return sum(e.count for e in prof.key_averages() if e.key in SYNC), r
import polars as pl
base, _ = syncs("none")
print(f"host syncs per step: no capture {base}")
bad = 0
for level in ("metrics", "boundaries", "ops"):
    n, _ = syncs(level)
    run = open_run(str(Path(sys.argv[1]) / f"sync-{level}" / level))
    recs = run.scan("records").filter((pl.col("step") == 2) & (pl.col("rank") == 0))
    n_recs = recs.select(pl.len()).collect().item()
    n_ops = recs.filter(pl.col("kind") == "op").select(pl.col("call_hash").n_unique()).collect().item()
    extra = n - base
    print(f"  {level:<11} {n} (extra {extra:+d}) for {n_recs} records, {n_ops} op calls in the step")
    assert n_recs > 0, f"{level}: no records for the profiled step"
    # A flush makes one or two device-to-host copies per device; allow a handful per step, never
    # one per record (or per op).
    bad += extra > max(16, n_recs // 20)
raise SystemExit(1 if bad else 0)
EOF

step "4/8 GPU-marked tests"
if [ "$DEVICE" = cuda ]; then
  # Only the files that hold GPU tests are collected: the rest of the suite needs the analysis
  # and notebook dependencies, which a GPU box carrying just torch may not have.
  mapfile -t GPU_TESTS < <(grep -l 'mark\.gpu' tests/test_*.py || true)
  set +e
  if [ "${#GPU_TESTS[@]}" -gt 0 ]; then "$PY" -m pytest -q -m gpu -p no:cacheprovider "${GPU_TESTS[@]}"; rc=$?; else rc=5; fi
  set -e
  if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then die "pytest -m gpu (exit $rc)"; fi  # 5: no gpu tests collected
else
  echo "skipped on $DEVICE"
fi

step "5/8 repeat checks on $DEVICE: float atomics caught, deterministic code passes"
CUBLAS_WORKSPACE_CONFIG=${CUBLAS_WORKSPACE_CONFIG:-:4096:8} "$PY" - <<'EOF' || die "repeat check on $DEVICE (see above)"
import os, torch
from detfp_capture import repeat_check
dev = os.environ["DEVICE"]
g = torch.Generator().manual_seed(0)
src = torch.randn(1 << 18, 16, generator=g).to(dev)
index = torch.randint(0, 100, (1 << 18,), generator=g).to(dev)  # ~2600 duplicates per row: float atomics
out = torch.zeros(100, 16, device=dev)
combine = lambda o, i, s: o.index_add_(0, i, s)
bad = 0
res = repeat_check(combine, out, index, src, runs=5, backward=False)
d = res.divergence
print(f"index_add_ with duplicate indices: ok={res.ok} runs={res.runs}",
      "" if d is None else f"-> {d.verdict} at {d.op} ({res.diff.detail if res.diff else ''})")
if dev == "cuda":  # must be caught within the 5 runs, at that op, as an origin
    bad += res.ok or d is None or d.verdict != "origin" or not d.op.startswith("aten::index_add")
    if res.kernels is not None:
        print("  kernels:", ", ".join(res.kernels.a[:3]))
torch.use_deterministic_algorithms(True)
try:
    res = repeat_check(combine, out, index, src, runs=3, backward=False)
    print(f"same op under use_deterministic_algorithms(True): ok={res.ok}")
    bad += not res.ok
    torch.manual_seed(0)
    block = torch.nn.TransformerEncoderLayer(256, 4, 1024, batch_first=True).to(dev)
    x = torch.randn(8, 128, 256, device=dev)
    res = repeat_check(block, x, runs=3)
    print(f"transformer block forward+backward: ok={res.ok}")
    if not res.ok:
        print(res.report)
    bad += not res.ok
finally:
    torch.use_deterministic_algorithms(False)
raise SystemExit(1 if bad else 0)
EOF
CUBLAS_WORKSPACE_CONFIG=${CUBLAS_WORKSPACE_CONFIG:-:4096:8} timeout $((240 * SLOW)) \
  "$PY" benchmarks/repeat_check.py --device "$DEVICE" --trials 3 --deterministic \
  || die "benchmarks/repeat_check.py --device $DEVICE"

step "6/8 capture overhead on $DEVICE"
if [ "$DRY_RUN" = 1 ]; then SMALL_ARGS="--models tiny --rounds 2 --warmup 1"; else SMALL_ARGS="--rounds $ROUNDS"; fi
# shellcheck disable=SC2086
timeout $((150 * SLOW)) "$PY" benchmarks/capture_overhead.py --device "$DEVICE" $SMALL_ARGS --trials 1 \
  || die "benchmarks/capture_overhead.py --device $DEVICE"
echo "device-bound size: $BIG_ARGS"
# shellcheck disable=SC2086
timeout $((300 * SLOW)) "$PY" benchmarks/capture_overhead.py --device "$DEVICE" $BIG_ARGS \
  || die "benchmarks/capture_overhead.py --device $DEVICE $BIG_ARGS"

step "7/8 digest throughput vs copy bandwidth on $DEVICE ($DIGEST_MIB MiB; versions 2 and 1; goal >= 50% for 2)"
timeout $((240 * SLOW)) "$PY" benchmarks/digest_bandwidth.py --device "$DEVICE" --sizes-mib "$DIGEST_MIB" \
  || die "benchmarks/digest_bandwidth.py --device $DEVICE"

step "8/8 compiled code on $DEVICE: Triton kernels recorded, on/off bitwise; the CUDA-graph digest buffer"
timeout $((300 * SLOW)) "$PY" - "$WORK" <<'EOF' || die "compiled code / CUDA-graph digests on $DEVICE (see above)"
import os, sys
import polars as pl
import torch
from detfp_analyze.io.reader import open_run
from detfp_capture import Session, digest
from detfp_guards import repeat_check

dev, work = os.environ["DEVICE"], sys.argv[1]
torch.manual_seed(0)
x, w, b = torch.randn(64, 128, device=dev), torch.randn(128, 256, device=dev), torch.randn(256, device=dev)

def f(x, w, b):
    return torch.nn.functional.layer_norm(torch.nn.functional.gelu(x @ w) + b, (256,)).sum(-1)

fn = torch.compile(f)
want = fn(x, w, b)
with Session(f"{work}/compiled", "ops") as s, s.step(0):
    got = fn(x, w, b)
assert torch.equal(got, want), "compiled function: capture on/off not bitwise equal"
k = open_run(f"{work}/compiled").scan("records").filter(pl.col("kind") == "kernel").collect()
prefix = "triton_" if dev == "cuda" else "cpp_"
assert k.height > 0 and all(n.startswith(prefix) for n in k["name"]), f"kernel records: {sorted(set(k['name']))}"
assert (k["status"] == "ok").all(), "undigested kernel records"
print("kernels recorded:", ", ".join(sorted(set(k["name"]))))
assert repeat_check(fn, x, w, b, runs=3, backward=False).ok, "repeat_check on the compiled function"
if dev != "cuda":
    print("no CUDA graphs on", dev, "(the buffer's CPU half: tests/unit/test_graph_digests.py)")
    raise SystemExit(0)
from detfp_capture._digest.graphs import GraphDigests
from detfp_capture._digest.resolve import resolve
src = torch.zeros(4096, device=dev)
gd = GraphDigests(dev, rows=8)
g = torch.cuda.CUDAGraph()
stream = torch.cuda.Stream()
stream.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(stream):
    y = src * 2 + 1  # warm-up outside the capture
    torch.cuda.current_stream().synchronize()
    with torch.cuda.graph(g, stream=stream):
        y = src * 2 + 1
        rows = [gd.put(src), gd.put(y)]
torch.cuda.current_stream().wait_stream(stream)
assert rows == [0, 1], rows
for i in range(3):
    src.copy_(torch.randn(4096, device=dev))
    g.replay()
    snap = gd.snapshot()
    got = [f.digest for f in resolve([gd.pending(snap, r) for r in rows])]
    want = [digest.fingerprint(t).digest for t in (src, src * 2 + 1)]
    assert got == want, f"replay {i}: graph digests {got} != {want}"
print("CUDA graph: 3 replays, each replay's digests equal its values' digests")
EOF

if [ "${#FAILED[@]}" -gt 0 ]; then
  printf '\ngpu_check: %d check(s) FAILED:\n' "${#FAILED[@]}" >&2
  printf '  %s\n' "${FAILED[@]}" >&2
  exit 1
fi
printf '\ngpu_check: all checks passed\n'
