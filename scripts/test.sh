#!/usr/bin/env bash
# The test command: set up .venv if needed (and Java for the Spark tests), lint and type-check, then run the
# default (CPU, not slow) suite. `--fast` is the edit loop's tier: lint and the unit, golden and
# property tests (no JVM, no multi-rank launches, no notebooks); CI runs the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
# A native test that cannot run (its extension not built) fails instead of skipping where a C
# compiler is here (tests/native_half.py); DETFP_REQUIRE_NATIVE=0 lets them skip (a run of the
# Python path on purpose, DETFP_NATIVE=0).
export DETFP_REQUIRE_NATIVE="${DETFP_REQUIRE_NATIVE:-1}"
if [ "${1:-}" = "--fast" ]; then
  shift
  bash scripts/bootstrap.sh
  .venv/bin/ruff check .
  .venv/bin/python -m mypy
  exec .venv/bin/python -m pytest -q -n 2 --dist loadfile tests/unit tests/golden tests/property "$@"
fi
bash scripts/bootstrap.sh --java
.venv/bin/ruff check .
# The type checker over the four packages ([tool.mypy] in pyproject.toml; its cache makes a rerun fast).
.venv/bin/python -m mypy
# Two workers, one test file each at a time (--dist loadfile): a file's module-scoped launches
# (the zoo, the example's multi-rank jobs) run once; the Spark files are one unit, so one worker
# starts the one Spark JVM while the other runs Python, and the longest units go out first
# (tests/conftest.py: pytest_xdist_make_scheduler). Serial: 8m51s; two workers: 6m29s (1003
# tests, load 1-5), before those two changes. Pass -n 0 to run serially.
exec .venv/bin/python -m pytest -q -n 2 --dist loadfile "$@"
