"""No silent skips of the native tests (issue 44): under ``DETFP_REQUIRE_NATIVE=1`` (set by
``scripts/test.sh``, so CI) a test whose extension is missing fails where a compiler could have
built it, skips otherwise; and no test in the suite skips on a missing extension on its own."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests import conftest, native_half

ROOT = Path(__file__).resolve().parents[2]


def _item(available: bool) -> SimpleNamespace:
    mark = native_half.needs(available, native_half.RECORD).mark
    return SimpleNamespace(get_closest_marker=lambda name: mark if name == "native" else None)


@pytest.mark.parametrize("required", ["1", "0", ""])
def test_a_missing_extension_fails_when_required_where_it_can_be_built(monkeypatch, required):
    monkeypatch.setenv("DETFP_REQUIRE_NATIVE", required)
    monkeypatch.setattr(native_half, "can_build", lambda: True)
    conftest.pytest_runtest_setup(_item(True))  # built: runs
    if required == "1":
        with pytest.raises(pytest.fail.Exception, match=r"_hostpath\) is not built .* run scripts/bootstrap.sh"):
            conftest.pytest_runtest_setup(_item(False))
        with pytest.raises(pytest.fail.Exception, match="DETFP_REQUIRE_NATIVE=0"):
            native_half.present(False, native_half.DIGEST)
    else:
        with pytest.raises(pytest.skip.Exception, match="not built"):
            conftest.pytest_runtest_setup(_item(False))
        assert native_half.present(False, native_half.DIGEST) is False


def test_without_a_compiler_a_missing_extension_skips_even_when_required(monkeypatch):
    monkeypatch.setenv("DETFP_REQUIRE_NATIVE", "1")
    monkeypatch.setattr(native_half, "can_build", lambda: False)
    with pytest.raises(pytest.skip.Exception):
        conftest.pytest_runtest_setup(_item(False))


def test_the_test_command_requires_the_native_tests():
    assert re.search(r'^export DETFP_REQUIRE_NATIVE="\$\{DETFP_REQUIRE_NATIVE:-1\}"$',
                     (ROOT / "scripts" / "test.sh").read_text(), re.M)  # fmt: skip


#: A skip decided by an extension's availability, outside native_half.
_OWN_SKIP = re.compile(
    r"skipif\(\s*not\s+[\w.]*(NATIVE|AVAILABLE|_hostpath|_lanes)\b"
    r"|if\s[^\n]*\bnot\s+[\w.]*(NATIVE|AVAILABLE)\b[^\n]*:\s*\n\s*pytest\.skip"
    r"|if\s+[\w.]*(_hostpath|_lanes)\s+is\s+None\b[^\n]*:\s*\n\s*pytest\.skip"
)


def test_no_native_test_skips_on_its_own():
    found = [
        f"{p.relative_to(ROOT)}: {m.group(0)!r}"
        for p in sorted((ROOT / "tests").rglob("*.py"))
        if p.name != "test_native_half.py"
        for m in _OWN_SKIP.finditer(p.read_text())
    ]
    assert found == [], f"skips on a missing extension that DETFP_REQUIRE_NATIVE cannot fail (use native_half): {found}"
