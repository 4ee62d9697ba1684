#!/usr/bin/env bash
# The test command: set up .venv if needed (and check Java for the Spark tests), lint, then run
# the default (CPU, not slow) suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh --java
.venv/bin/ruff check .
exec .venv/bin/python -m pytest -q "$@"
