#!/usr/bin/env bash
# The detfp demo (about 1-2 minutes on 2 CPU cores):
#   1. set up .venv (scripts/bootstrap.sh);
#   2. capture two real 2-rank DDP runs of examples/train_tiny.py (torchrun, gloo) that both carry
#      a genuinely nondeterministic MoE combine, at the cheap `boundaries` level;
#   3. `detfp-analyze summary` and `detfp-analyze bisect` on them: the first divergent step;
#   4. recapture only that step at `ops` level and bisect again: the op, on every rank;
#   5. bisect the bundled sample_traces/ pairs (data on one rank, lost RNG state on resume, ...);
#   6. write the HTML report, the pictures and a Perfetto timeline of the demo's own runs.
# bisect exits 1 when runs diverge, which is the expected answer here, not a failure.
# Traces go to $DEMO_DIR (default: a fresh temporary directory, kept for exploring).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
PY=.venv/bin/python
CLI=.venv/bin/detfp-analyze
DEMO_DIR=${DEMO_DIR:-$(mktemp -d -t detfp-demo-XXXXXX)}
mkdir -p "$DEMO_DIR"  # a DEMO_DIR given by the user may not exist yet (the training log goes there first)
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1

say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
train() {  # train OUT ARGS...: one 2-rank run of the example
  local out=$1; shift
  echo "\$ torchrun --nproc_per_node 2 examples/train_tiny.py --out $out $*"
  "$PY" -m torch.distributed.run --standalone --nproc_per_node 2 examples/train_tiny.py --quiet \
      --out "$out" "$@" 2> "$DEMO_DIR/train.log" > /dev/null \
      || { cat "$DEMO_DIR/train.log" >&2; echo "demo: the training run failed (log above)" >&2; exit 1; }
}
bisect() {  # bisect A B [ARGS...]: show the report; exit 1 (diverged) is an answer, 2 is an error
  echo "\$ detfp-analyze bisect $*"
  local rc=0
  "$CLI" bisect "$@" || rc=$?
  [ "$rc" -le 1 ] || { echo "demo: bisect failed with exit $rc" >&2; exit "$rc"; }
  echo "(exit $rc: $([ "$rc" -eq 0 ] && echo identical || echo diverged))"
}

say "1. two 2-rank runs, each with a nondeterministic MoE combine from step 1 (boundaries level)"
train "$DEMO_DIR/a" --level boundaries --steps 3 --plant nondet_op
train "$DEMO_DIR/b" --level boundaries --steps 3 --plant nondet_op

say "2. what a run holds"
"$CLI" summary "$DEMO_DIR/a"

say "3. where they stop being bitwise identical"
bisect "$DEMO_DIR/a" "$DEMO_DIR/b"
REPORT=$("$CLI" bisect "$DEMO_DIR/a" "$DEMO_DIR/b" --json 2>/dev/null || true)  # exit 1 = diverged
STEP=$(printf '%s' "$REPORT" | "$PY" -c 'import json,sys; s=json.load(sys.stdin).get("first_step"); print(1 if s is None else s)')

say "4. the same runs again, every ATen op recorded for step $STEP only"
train "$DEMO_DIR/a-ops" --level ops --capture-steps "$STEP" --steps $((STEP + 1)) --plant nondet_op
train "$DEMO_DIR/b-ops" --level ops --capture-steps "$STEP" --steps $((STEP + 1)) --plant nondet_op
bisect "$DEMO_DIR/a-ops" "$DEMO_DIR/b-ops"

say "5. the bundled sample traces"
for pair in data_rank/a:data_rank/b resume/full:resume/resumed resume/full:resume/restored moe_permute/a:moe_permute/b; do
  bisect "sample_traces/${pair%%:*}" "sample_traces/${pair##*:}"
done

say "6. the HTML report, the pictures and a timeline of the demo's runs"
rc=0
"$CLI" bisect "$DEMO_DIR/a-ops" "$DEMO_DIR/b-ops" --html "$DEMO_DIR/report.html" > /dev/null || rc=$?
[ "$rc" -le 1 ] || { echo "demo: bisect --html failed with exit $rc" >&2; exit "$rc"; }
"$CLI" plot "$DEMO_DIR/a-ops" "$DEMO_DIR/b-ops" --out "$DEMO_DIR/plots/ops"
"$CLI" plot "$DEMO_DIR/a" "$DEMO_DIR/b" --out "$DEMO_DIR/plots/boundaries"
"$CLI" export "$DEMO_DIR/a-ops" "$DEMO_DIR/b-ops" --perfetto "$DEMO_DIR/trace.json"

say "done; traces kept in $DEMO_DIR (try: $CLI sql $DEMO_DIR/a-ops $DEMO_DIR/b-ops \"SELECT * FROM first_divergence\")"
echo "HTML report (open it in a browser): $DEMO_DIR/report.html"
echo "pictures of the ops-level runs:      $DEMO_DIR/plots/ops/"
echo "pictures of the boundaries runs:     $DEMO_DIR/plots/boundaries/"
echo "Perfetto timeline (ui.perfetto.dev): $DEMO_DIR/trace.json"
