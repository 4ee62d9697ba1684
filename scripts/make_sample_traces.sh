#!/usr/bin/env bash
# Regenerate sample_traces/: small recorded run pairs from examples/train_tiny.py, each with
# one planted cause of divergence whose location is the known answer (2 ranks, gloo, CPU).
#
#   nondet/{a,b}          boundaries, 3 steps: MoE combine index_add_ in a per-process random order
#                         from step 1 on every rank -> all_ranks_same_op
#   data_rank/{a,b}       boundaries, 3 steps: b changes one token of rank 1's batch from step 1
#                         -> single_rank, a source (the batch) on rank 1
#   moe_permute/{a,b}     boundaries, 2 steps, row digests: b dispatches tokens to experts in
#                         another order from step 1 -> a permutation in the moe.dispatch probe
#   resume/full           boundaries, steps 0-3, checkpoint saved at the start of step 2
#   resume/resumed        steps 2-3 resumed from it WITHOUT restoring RNG state -> rng_state source at step 2
#   resume/restored       steps 2-3 resumed with every state restored -> identical over steps 2-3
#   ops/{a,b}             ops level, only step 1 captured (--capture-steps 1), nondet_op from step 1
#                         -> origin at detfp_example::index_add on every rank
#
# Deterministic apart from the planted nondeterminism (and host facts in the manifests).
# Total size stays well under 3 MB; the script prints it. Usage: bash scripts/make_sample_traces.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=sample_traces
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1

run() {  # run DIR ARGS... : one 2-rank capture of the example into DIR
  local dir=$1; shift
  "$PY" -m torch.distributed.run --standalone --nproc_per_node 2 examples/train_tiny.py --quiet \
      --out "$dir" "$@" > /dev/null 2> "$TMP/log" || { cat "$TMP/log" >&2; echo "make_sample_traces: failed: $dir" >&2; exit 1; }
  echo "  $dir"
}

TMP=$(mktemp -d -t detfp-samples-XXXXXX)
trap 'rm -rf "$TMP"' EXIT
rm -rf "$OUT"
mkdir -p "$OUT"

echo "writing $OUT/"
run "$OUT/nondet/a" --level boundaries --steps 3 --plant nondet_op
run "$OUT/nondet/b" --level boundaries --steps 3 --plant nondet_op
run "$OUT/data_rank/a" --level boundaries --steps 3
run "$OUT/data_rank/b" --level boundaries --steps 3 --plant data_rank --plant-rank 1
run "$OUT/moe_permute/a" --level boundaries --steps 2 --rows
run "$OUT/moe_permute/b" --level boundaries --steps 2 --rows --plant moe_permute
run "$OUT/resume/full" --level boundaries --steps 4 --save-ckpt 2 "$TMP/ckpt"
run "$OUT/resume/resumed" --level boundaries --steps 4 --resume "$TMP/ckpt" --no-restore-rng
run "$OUT/resume/restored" --level boundaries --steps 4 --resume "$TMP/ckpt"
run "$OUT/ops/a" --level ops --capture-steps 1 --steps 2 --plant nondet_op
run "$OUT/ops/b" --level ops --capture-steps 1 --steps 2 --plant nondet_op

cat > "$OUT/README.md" <<'EOF'
# Sample traces

Recorded by `bash scripts/make_sample_traces.sh` from `examples/train_tiny.py` (2 ranks, gloo,
CPU). Each pair has one planted cause of divergence; the header of the script lists what
`detfp-analyze bisect` should find for each. Try:

    detfp-analyze bisect sample_traces/nondet/a sample_traces/nondet/b
    detfp-analyze bisect sample_traces/data_rank/a sample_traces/data_rank/b
    detfp-analyze bisect sample_traces/moe_permute/a sample_traces/moe_permute/b
    detfp-analyze bisect sample_traces/resume/full sample_traces/resume/resumed
    detfp-analyze bisect sample_traces/resume/full sample_traces/resume/restored
    detfp-analyze bisect sample_traces/ops/a sample_traces/ops/b
EOF
echo "$(du -sb "$OUT" | cut -f1) bytes in $OUT (keep under 3000000)"
