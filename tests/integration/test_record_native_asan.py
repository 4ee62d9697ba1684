"""The record path's C (``_recorder/_hostpath.c`` and ``hostpath_c/``: hand-written reference
counts, raw copies) under AddressSanitizer and UndefinedBehaviorSanitizer (issue 44), as the
digest kernel's is (``tests/property/test_native_lanes.py``).

The extension is compiled with ``-fsanitize=address,undefined`` into a temporary folder and the
record path's native tests run against it in a child Python (``tests/fixtures/hostpath_asan.py``
loads that build in place of the installed one) with the sanitizer runtimes preloaded and
``PYTHONMALLOC=malloc``, so a Python object freed by one reference too few and then read is a
use-after-free ASan reports. A copy past a buffer's end is shown reported (the harness is live),
in the same child right after the tests (one start of Python and torch under the sanitizers).
In the default suite, not the fast tier: about 60 s to run on 2 cores, and the sanitized build
about 20 s more once per change of the C sources (kept between runs by ``tests/cached.py``, keyed
by ``scripts/native_sources.sh``'s hash, the flags and the compiler)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests import cached, native_half
from tests.fixtures.hostpath_asan import PASSED_LINE

ROOT = Path(__file__).resolve().parents[2]
DRIVER = ROOT / "tests" / "fixtures" / "hostpath_asan.py"
#: The record path's native tests: each piece against its Python, the native Slot and copies.
TESTS = ["tests/unit/test_record_native.py", "tests/unit/test_record_native_paths.py"]
FLAGS = ["-O1", "-g", "-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer"]


def _runtimes(cc: str) -> list[str] | None:
    """The ASan and UBSan runtimes to preload into Python (not built with them), or None."""
    found = []
    for lib in ("libasan.so", "libubsan.so"):
        path = subprocess.run([cc, f"-print-file-name={lib}"], capture_output=True, text=True).stdout.strip()
        if not os.path.isabs(path) or not os.path.exists(path):
            return None
        found.append(path)
    return found


def _build_key(cc: str) -> str:
    """What the sanitized build is a function of: the native sources (``scripts/native_sources.sh``:
    every C file and header, setup.py), the flags, the compiler and Python's headers."""
    sources = subprocess.run(["bash", str(ROOT / "scripts" / "native_sources.sh")], capture_output=True, text=True,
                             check=True).stdout.strip()  # fmt: skip
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    parts = [sources, " ".join(FLAGS), shutil.which(cc) or cc, version, sysconfig.get_paths()["include"]]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:24]


def _build(cc: str, out: Path) -> None:
    src = ROOT / "detfp_capture" / "_recorder" / "_hostpath.c"
    include = sysconfig.get_paths()["include"]
    done = subprocess.run([cc, "-shared", "-fPIC", *FLAGS, f"-I{include}", str(src), "-o", str(out)],
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.fixture(scope="module")
def sanitized() -> tuple[Path, dict[str, str]]:
    """The sanitized build of ``_hostpath`` and the environment that runs Python under it."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if not native_half.present(cc is not None and native_half.can_build(), native_half.RECORD):
        pytest.skip("no C compiler or Python headers to build the sanitized record path")
    assert cc is not None
    runtimes = _runtimes(cc)
    if runtimes is None:
        pytest.skip(f"{cc} has no ASan/UBSan runtime libraries to preload")
    out, _ = cached.build("_hostpath.so", _build_key(cc), lambda path: _build(cc, path))
    env = {
        **os.environ,
        "LD_PRELOAD": " ".join(runtimes),
        # Python and torch keep their allocations until exit: leaks are not this test's question.
        "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=0",
        "UBSAN_OPTIONS": "print_stacktrace=1",
        "PYTHONMALLOC": "malloc",  # every object its own allocation, its end and its free seen
        "DETFP_NATIVE": "",
        "DETFP_REQUIRE_NATIVE": "1",
        "PYTHONPATH": str(ROOT),
    }
    return out, env


@pytest.fixture(scope="module")
def child(sanitized) -> subprocess.CompletedProcess[str]:
    """One Python under the sanitizers: the record path's native tests, then (only if they
    passed) a copy past a buffer's end (``hostpath_asan.py SO --overflow PYTEST_ARGS``)."""
    so, env = sanitized
    args = [sys.executable, str(DRIVER), str(so), "--overflow", "-q", "-n", "0", "-p", "no:cacheprovider", *TESTS]
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_the_record_paths_native_tests_pass_under_asan_and_ubsan(child):
    # A sanitizer report during the tests ends the process there (-fno-sanitize-recover), before
    # the line that says they passed.
    report = child.stdout + child.stderr
    assert PASSED_LINE in child.stdout, report[-4000:]
    # No UBSan report at all, and one ASan report: the planted overflow's, after the tests.
    assert "runtime error" not in report and child.stderr.count("ERROR: AddressSanitizer") == 1, report[-4000:]


def test_the_sanitizer_reports_a_copy_past_a_buffers_end(child):
    report = child.stdout + child.stderr
    assert PASSED_LINE in child.stdout, report[-4000:]
    assert child.returncode != 0 and "heap-buffer-overflow" in child.stderr, report[-3000:]
    assert "went unreported" not in child.stdout
