#!/usr/bin/env bash
# Create (or reuse) .venv and install detfp with every extra the demo and tests need.
# torch is pinned to the CPU build that the development machines carry; the package
# itself only asks for torch>=2.9 (see pyproject.toml). pyspark (the spark extra) comes from
# requirements-dev.txt; `bootstrap.sh --java` also checks for the Java 17+ that Spark needs.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.detfp-installed
# setup.py and the C source: the digest's native kernel is built by the editable install, so a
# change to either reinstalls (rebuilds) it, as does a built kernel gone missing (a `git clean`)
# where a C compiler is there to build it.
# A build that failed (no Python headers, say) is not retried until its sources change.
kernel_missing=false
unbuildable=.venv/.detfp-kernel-unbuildable
if { command -v cc || command -v gcc; } >/dev/null 2>&1 && ! compgen -G 'detfp_capture/_digest/_lanes*.so' >/dev/null \
  && { [ ! -f "$unbuildable" ] || [ setup.py -nt "$unbuildable" ] || [ detfp_capture/_digest/_lanes.c -nt "$unbuildable" ]; }; then
  kernel_missing=true
fi
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ requirements-dev.txt -nt "$stamp" ] \
  || [ setup.py -nt "$stamp" ] || [ detfp_capture/_digest/_lanes.c -nt "$stamp" ] || $kernel_missing; then
  .venv/bin/python -m pip install --quiet --upgrade pip >/dev/null 2>&1 || true
  .venv/bin/python -m pip install --quiet -r requirements-dev.txt
  .venv/bin/python -m pip install --quiet --no-deps -e .
  if compgen -G 'detfp_capture/_digest/_lanes*.so' >/dev/null; then
    rm -f "$unbuildable"
  else
    touch "$unbuildable"
    echo "bootstrap: the digest's native kernel was not built (no C compiler or Python headers); the digest uses torch's slower exact route" >&2
  fi
  touch "$stamp"
fi
# The Spark engine (detfp[spark], in requirements-dev.txt) needs Java 17+; its tests are in the
# default suite. With --java (scripts/test.sh) a missing or old Java stops here, in one line,
# instead of failing later as an obscure JVM gateway error.
if [ "${1:-}" = "--java" ]; then
  java_bin=java
  if [ -n "${JAVA_HOME:-}" ] && [ -x "$JAVA_HOME/bin/java" ]; then java_bin="$JAVA_HOME/bin/java"; fi
  if ! command -v "$java_bin" >/dev/null 2>&1; then
    echo "bootstrap: java not found: the Spark engine's tests need Java 17+; install a JDK (apt-get install openjdk-17-jre-headless, brew install openjdk@17) or set JAVA_HOME" >&2
    exit 1
  fi
  major=$("$java_bin" -version 2>&1 | sed -n 's/.*version "\([0-9]*\).*/\1/p' | head -1)
  if [ -z "$major" ] || [ "$major" -lt 17 ]; then
    echo "bootstrap: $java_bin is Java ${major:-of unknown version}: the Spark engine's tests need Java 17+; install a JDK 17 or set JAVA_HOME to one" >&2
    exit 1
  fi
fi
