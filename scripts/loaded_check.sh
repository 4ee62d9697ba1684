#!/usr/bin/env bash
# The capture-route and golden tests on a deliberately loaded machine (docs/reliability.md,
# "The suite under load"): a trace whose layout depends on time or thread scheduling (a flush
# on a clock, a window cut where a thread happened to be) passes on an idle machine and fails
# on a busy one, one run in ten. Here the machine is made busy on purpose: LOAD_PER_CORE
# (default 4) busy processes per core, at the tests' own priority, next to the suite's two
# workers, so every capture runs several times slower than alone, every time. Exit status:
# pytest's. The load generators are this script's children and are stopped on every exit
# (success, failure, Ctrl-C). Extra arguments go to pytest.
#
#   bash scripts/loaded_check.sh                 # ~5-10 minutes on 2 cores
#   LOAD_PER_CORE=8 bash scripts/loaded_check.sh -x
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
cores=$(getconf _NPROCESSORS_ONLN 2>/dev/null || echo 2)
per_core=${LOAD_PER_CORE:-4}
burners=()
stop_load() {
  for pid in "${burners[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${burners[@]}"; do wait "$pid" 2>/dev/null || true; done
  burners=()
}
trap stop_load EXIT INT TERM
for _ in $(seq $((cores * per_core))); do
  # A pure CPU loop (no I/O, no memory): what competes with the capture is CPU time alone.
  .venv/bin/python -c 'while True: pass' &
  burners+=("$!")
done
sleep 2
echo "loaded_check: ${#burners[@]} busy processes on $cores cores; load before the tests: $(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo unknown)"
rc=0
# The tests whose answer is the trace a capture writes: both record paths must write the same
# trace (test_capture_routes), the fixed capture must write the golden one (test_capture_records),
# and a clock running fast moves no window (test_flush_windows).
.venv/bin/python -m pytest -q -n 2 --dist loadfile tests/golden/test_capture_routes.py \
  tests/golden/test_capture_records.py tests/unit/test_flush_windows.py "$@" || rc=$?
echo "loaded_check: load at the end: $(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo unknown); pytest exit $rc"
exit "$rc"
