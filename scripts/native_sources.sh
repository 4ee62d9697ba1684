#!/usr/bin/env bash
# Print one hash of everything the capture's native extensions are built from: setup.py and every
# C source and header under detfp_capture/ (found, not listed, so a new part such as another
# _recorder/hostpath_c/*.c or a header counts without an edit here). scripts/bootstrap.sh keeps
# the hash of the last build and rebuilds when this one differs. `native_sources.sh --list`
# prints the files instead; an optional directory argument is the tree to read (default: the repo).
set -euo pipefail
list=false
if [ "${1:-}" = "--list" ]; then list=true; shift; fi
cd "${1:-$(dirname "$0")/..}"
# LC_ALL=C: the same order on every machine, so the same tree gives the same hash.
files=$( { echo setup.py; find detfp_capture -type f \( -name '*.c' -o -name '*.h' \); } | LC_ALL=C sort)
if $list; then
  echo "$files"
else
  # Names and contents both: a file renamed or moved between parts changes the hash too.
  echo "$files" | while IFS= read -r f; do printf '%s\n' "$f"; cat "$f"; done | sha256sum | cut -d' ' -f1
fi
