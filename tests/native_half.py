"""Tests whose native half cannot run: skipped on a machine that cannot build it, failed where it can.

The capture's C extensions (``_digest/_lanes``, ``_recorder/_hostpath``) are optional, so their
tests skip without them; but a suite that skips them all reads green with the native paths
untested (a build that silently failed, a stale install). ``scripts/test.sh`` (and so CI) sets
``DETFP_REQUIRE_NATIVE=1``: then a native test that finds its extension missing or switched off
(``DETFP_NATIVE=0``) fails in one line, wherever a C compiler and Python's headers are there to
build it. Without a compiler it still skips, and ``DETFP_REQUIRE_NATIVE=0`` restores the skips
(a run of the Python path on purpose). ``needs`` marks a test (tests/conftest.py applies it at
setup); ``present`` is the same decision inside a test."""

from __future__ import annotations

import os
import shutil
import sysconfig
from pathlib import Path

import pytest

__all__ = ["DIGEST", "RECORD", "can_build", "check", "needs", "present", "required"]

#: The digest's native kernel (``detfp_capture._digest._lanes``; ``native.AVAILABLE``).
DIGEST = "the digest's native kernel (detfp_capture._digest._lanes)"
#: The record path's native helpers (``detfp_capture._recorder._hostpath``; ``slot.NATIVE``).
RECORD = "the record path's native helpers (detfp_capture._recorder._hostpath)"


def can_build() -> bool:
    """A C compiler and Python's headers: what building the optional extensions needs."""
    has_cc = shutil.which("cc") is not None or shutil.which("gcc") is not None
    return has_cc and (Path(sysconfig.get_paths()["include"]) / "Python.h").is_file()


def required() -> bool:
    """Whether a native test that cannot run fails (``DETFP_REQUIRE_NATIVE=1`` and a compiler here)."""
    return os.environ.get("DETFP_REQUIRE_NATIVE", "") == "1" and can_build()


def _missing(what: str) -> str:
    return (
        f"{what} is not built or is off (DETFP_NATIVE=0) although a C compiler is here and "
        "DETFP_REQUIRE_NATIVE=1: run scripts/bootstrap.sh (or set DETFP_REQUIRE_NATIVE=0 to let native tests skip)"
    )


def present(available: bool, what: str) -> bool:
    """``available``, failing the test instead of returning False where the native half is required."""
    if not available and required():
        pytest.fail(_missing(what), pytrace=False)
    return available


def check(available: bool, what: str) -> None:
    """Skip the running test without its native half, or fail it where that half is required."""
    if not present(available, what):
        pytest.skip(f"{what} is not built (or DETFP_NATIVE=0)")


def needs(available: bool, what: str) -> pytest.MarkDecorator:
    """A mark for a test that needs ``what``: ``check`` at its setup (tests/conftest.py)."""
    return pytest.mark.native(available=available, what=what)
