"""The native record path and the pure-Python one write the same trace, record for record.

``tests/golden/test_capture_records.py``'s fixed capture runs here in this process (the native
Slot and byte copies where ``_recorder/_hostpath`` is built) and in a child process with
``DETFP_NATIVE=0`` (the Python Slot and torch's copies, and torch's digest route), on the same
machine: every column of every table, the content digests included, must be equal."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from detfp_capture._recorder import slot
from tests import native_half
from tests.golden.test_capture_records import LEVELS, capture

ROOT = Path(__file__).resolve().parents[2]


def _python_route(level: str, tmp: Path, version: int) -> dict:
    code = (
        "import json, sys; from pathlib import Path; "
        "from detfp_capture._recorder import slot; assert not slot.NATIVE; "
        "from tests.golden.test_capture_records import capture; "
        "print(json.dumps(capture(sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]))))"
    )
    env = {**os.environ, "DETFP_NATIVE": "0"}
    out = subprocess.run(
        [sys.executable, "-c", code, level, str(tmp), str(version)],
        cwd=ROOT, env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@native_half.needs(slot.NATIVE, native_half.RECORD)
@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("level", LEVELS)
def test_native_and_python_record_paths_write_the_same_trace(level, version, tmp_path):
    # Version 2 is where the native path also digests at record time (``_recorder/roots.py``).
    native = capture(level, tmp_path / "native", version)
    python = _python_route(level, tmp_path / "python", version)
    assert native == python
