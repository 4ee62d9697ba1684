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
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ requirements-dev.txt -nt "$stamp" ]; then
  .venv/bin/python -m pip install --quiet --upgrade pip >/dev/null 2>&1 || true
  .venv/bin/python -m pip install --quiet -c requirements-dev.txt -e '.[dev]'
  touch "$stamp"
fi
# The capture's optional native extensions (setup.py): the digest's kernel and the record path's
# helpers. They are rebuilt in place when the hash of what they are built from (setup.py and every
# C source and header under detfp_capture/: scripts/native_sources.sh) differs from the last
# build's, or when one of them is missing (a `git clean`) where a C compiler is there to build it;
# comparing contents, not times, so an edit to any part (_recorder/hostpath_c/*.c included) is
# never tested against an old build, and a fresh unchanged tree costs one hash and no build.
# A build that failed (no Python headers, say) is not retried until its sources change.
built=.venv/.detfp-native-hash
unbuildable=.venv/.detfp-native-unbuildable
sources=$(bash scripts/native_sources.sh)
extensions=(detfp_capture/_digest/_lanes detfp_capture/_recorder/_hostpath)
missing=false
for ext in "${extensions[@]}"; do
  if ! compgen -G "$ext*.so" >/dev/null; then missing=true; fi
done
has_cc=false
if { command -v cc || command -v gcc; } >/dev/null 2>&1; then has_cc=true; fi
if [ "$(cat "$built" 2>/dev/null)" != "$sources" ] \
  || { $missing && $has_cc && [ "$(cat "$unbuildable" 2>/dev/null)" != "$sources" ]; }; then
  # --force: setuptools would skip a target newer than its listed sources, which a header or a
  # part not in setup.py's depends is not; optional=True there, so a failed build only warns.
  .venv/bin/python setup.py --quiet build_ext --inplace --force >/dev/null 2>&1 || true
  rm -f "$unbuildable"
  echo "$sources" >"$built"
  for ext in "${extensions[@]}"; do
    if ! compgen -G "$ext*.so" >/dev/null; then
      echo "$sources" >"$unbuildable"
      echo "bootstrap: the native extension $ext was not built (no C compiler or Python headers); the capture uses its Python route" >&2
    fi
  done
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
