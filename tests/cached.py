"""What the test suite keeps between its runs on one machine: artefacts that are a function of
their inputs alone, so a rerun does not rebuild them (issue 44: the default suite's wall time).

* ``build(name, key, make)``: a file built by ``make(path)`` once per ``key`` (a hash of
  everything it is built from: the sanitized record path is keyed by ``scripts/native_sources.sh``'s
  hash, its flags and the compiler), in a folder of its own; a build that fails leaves nothing
  behind, and concurrent runs build into private names and rename into place.
* ``folder(name)``: a folder kept between runs (Inductor's on-disk cache for the compiled zoo,
  whose entries Inductor keys itself by the graph, its options and the torch and compiler
  versions, so a stale entry is never a match).

They live under ``$DETFP_TEST_CACHE``, by default ``.venv/detfp-test-cache`` (ignored by git, and
gone with the environment it was built for); ``DETFP_TEST_CACHE=`` set to a fresh folder gives a
cold run."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from pathlib import Path

__all__ = ["build", "folder", "root"]

ROOT = Path(__file__).resolve().parents[1]


def root() -> Path:
    """The cache's root folder (not created)."""
    return Path(os.environ.get("DETFP_TEST_CACHE") or ROOT / ".venv" / "detfp-test-cache")


def folder(name: str) -> Path:
    """The kept folder ``name``, created if missing."""
    path = root() / name
    path.mkdir(parents=True, exist_ok=True)
    return path


def build(name: str, key: str, make: Callable[[Path], None]) -> tuple[Path, bool]:
    """The file ``name`` built for ``key``, and whether it was built now (False: found).

    ``make(path)`` writes the file at ``path`` or raises; what it leaves on a failure is removed."""
    final = folder(name) / key / name
    if final.is_file():
        return final, False
    final.parent.mkdir(parents=True, exist_ok=True)
    private = final.with_name(f".{name}.{uuid.uuid4().hex}")
    try:
        make(private)
        os.replace(private, final)  # atomic: a concurrent run sees the whole file or none
    finally:
        private.unlink(missing_ok=True)
    return final, True
