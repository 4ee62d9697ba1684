"""The native extensions are rebuilt when anything they are built from changes (issue 44).

``scripts/bootstrap.sh`` keeps the hash that ``scripts/native_sources.sh`` prints for the last
build and rebuilds when it differs: an edit to ``_recorder/hostpath_c/*.c`` once went untested
because only ``setup.py`` and ``_lanes.c`` were looked at. Here: the hash covers setup.py and
every C source and header under ``detfp_capture/`` (a new part included), nothing else, and the
extensions bootstrap checks for are setup.py's."""

from __future__ import annotations

import ast
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "native_sources.sh"

pytestmark = pytest.mark.skipif(shutil.which("sha256sum") is None, reason="no sha256sum (coreutils) here")


def _hash(tree: Path) -> str:
    return subprocess.run(["bash", str(SCRIPT), str(tree)], capture_output=True, text=True, check=True).stdout.strip()


def _tree(tmp_path: Path) -> Path:
    """A copy of what the extensions are built from, plus a Python file that is not."""
    tree = tmp_path / "tree"
    for rel in ["setup.py", *(str(p.relative_to(ROOT)) for p in (ROOT / "detfp_capture").rglob("*.c"))]:
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, tree / rel)
    (tree / "detfp_capture" / "_recorder" / "hot.py").write_text("X = 1\n")
    return tree


def test_the_listed_sources_are_setup_py_and_every_c_file_and_header_under_the_capture():
    listed = subprocess.run(["bash", str(SCRIPT), "--list"], capture_output=True, text=True, check=True).stdout.split()
    found = {str(p.relative_to(ROOT)) for ext in ("*.c", "*.h") for p in (ROOT / "detfp_capture").rglob(ext)}
    assert set(listed) == found | {"setup.py"}
    assert "detfp_capture/_recorder/hostpath_c/append.c" in listed  # a part #included, not in setup.py's sources


def test_the_hash_changes_with_any_part_header_or_setup_py_and_nothing_else(tmp_path):
    tree = _tree(tmp_path)
    first = _hash(tree)
    assert _hash(tree) == first  # the same tree, the same hash: no rebuild
    (tree / "detfp_capture" / "_recorder" / "hot.py").write_text("X = 2\n")
    assert _hash(tree) == first  # Python is not built
    part = tree / "detfp_capture" / "_recorder" / "hostpath_c" / "append.c"
    part.write_text(part.read_text() + "/* edited */\n")
    second = _hash(tree)
    assert second != first
    (tree / "detfp_capture" / "_recorder" / "hostpath_c" / "shared.h").write_text("#define N 1\n")
    third = _hash(tree)
    assert third != second
    (tree / "setup.py").write_text((tree / "setup.py").read_text() + "\n# edited\n")
    assert _hash(tree) != third


def test_bootstrap_checks_for_every_extension_setup_py_builds():
    calls = [n for n in ast.walk(ast.parse((ROOT / "setup.py").read_text())) if isinstance(n, ast.Call)]
    names = {
        c.args[0].value
        for c in calls
        if getattr(c.func, "id", None) == "Extension" and isinstance(c.args[0], ast.Constant)
    }
    assert names == {"detfp_capture._digest._lanes", "detfp_capture._recorder._hostpath"}
    bootstrap = (ROOT / "scripts" / "bootstrap.sh").read_text()
    assert "scripts/native_sources.sh" in bootstrap
    for name in names:
        assert name.replace(".", "/") in bootstrap, f"bootstrap.sh does not check that {name} is built"
