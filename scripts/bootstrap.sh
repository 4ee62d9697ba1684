#!/usr/bin/env bash
# Create (or reuse) .venv and install detfp with its `dev` extra (pyproject.toml: every extra the
# demo and tests need) under the development pins of requirements-dev.txt, where torch is pinned
# to the CPU build the development machines carry (the package itself asks for torch>=2.9).
# `bootstrap.sh --java` also provides the Java 17+ that the Spark engine's tests need.
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
  .venv/bin/python -m pip install --quiet -c requirements-dev.txt -e '.[dev]'
  if compgen -G 'detfp_capture/_digest/_lanes*.so' >/dev/null; then
    rm -f "$unbuildable"
  else
    touch "$unbuildable"
    echo "bootstrap: the digest's native kernel was not built (no C compiler or Python headers); the digest uses torch's slower exact route" >&2
  fi
  touch "$stamp"
fi
# The Spark engine (detfp[spark], in requirements-dev.txt) needs Java 17+; its tests are in the
# default suite. With --java (scripts/test.sh) a missing or old Java is installed from the system
# packages where this runs as root with apt-get (as the browser test installs Chromium), else it
# stops here in one line naming the command, instead of failing later as an obscure JVM error.
java_major() {
  "$1" -version 2>&1 | sed -n 's/.*version "\([0-9]*\).*/\1/p' | head -1
}
if [ "${1:-}" = "--java" ]; then
  java_bin=java
  if [ -n "${JAVA_HOME:-}" ] && [ -x "$JAVA_HOME/bin/java" ]; then java_bin="$JAVA_HOME/bin/java"; fi
  major=""
  if command -v "$java_bin" >/dev/null 2>&1; then major=$(java_major "$java_bin"); fi
  if [ -z "$major" ] || [ "$major" -lt 17 ]; then
    install="apt-get install -y openjdk-17-jre-headless"
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
      echo "bootstrap: Java 17+ is missing (found: ${major:-none}); installing it for the Spark engine's tests: $install" >&2
      if ! { apt-get install -y -q openjdk-17-jre-headless >/dev/null 2>&1 \
        || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q openjdk-17-jre-headless >/dev/null 2>&1; }; }; then
        echo "bootstrap: could not install Java with '$install'; install a JDK 17+ or set JAVA_HOME to one" >&2
        exit 1
      fi
      java_bin=java
      major=$(java_major "$java_bin")
      if [ -z "$major" ] || [ "$major" -lt 17 ]; then
        echo "bootstrap: installed openjdk-17-jre-headless but '$java_bin' on PATH is Java ${major:-of unknown version}; set JAVA_HOME to a JDK 17+" >&2
        exit 1
      fi
    else
      echo "bootstrap: the Spark engine's tests need Java 17+ (found: ${major:-none}); run as root: $install (or brew install openjdk@17, or set JAVA_HOME)" >&2
      exit 1
    fi
  fi
fi
