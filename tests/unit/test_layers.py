"""The packages' layers, checked on every import of every module (docs/architecture.md).

``detfp_format`` (the trace format) is the floor: it imports none of the other packages and never
torch. ``detfp_capture`` and ``detfp_analyze`` sit on it side by side and never import each
other; the analysis never imports torch. ``detfp_guards`` sits on top of both and uses their
public names only (no module or name that starts with ``_``). Imports inside functions count: a
lazy import crosses a layer as surely as one at the top.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("detfp_format", "detfp_capture", "detfp_analyze", "detfp_guards")

#: What each package may not import (top-level names).
FORBIDDEN = {
    "detfp_format": {"torch", "detfp_capture", "detfp_analyze", "detfp_guards"},
    "detfp_capture": {"detfp_analyze", "detfp_guards"},
    "detfp_analyze": {"torch", "detfp_capture", "detfp_guards"},
    "detfp_guards": set(),
}
#: Packages whose private parts another package may not reach into.
PUBLIC_ONLY = {"detfp_guards": {"detfp_capture", "detfp_analyze"}}


def imports(path: Path) -> list[tuple[int, str, tuple[str, ...]]]:
    """Every import in a module: (line, module, names imported from it)."""
    out: list[tuple[int, str, tuple[str, ...]]] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, a.name, ()) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}:{node.lineno}: relative import; the packages import absolutely"
            out.append((node.lineno, node.module or "", tuple(a.name for a in node.names)))
    return sorted(out)


def problems(package: str, path: Path) -> list[str]:
    found = []
    shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    for line, module, names in imports(path):
        top = module.split(".")[0]
        where = f"{shown}:{line}"
        if top in FORBIDDEN[package]:
            found.append(f"{where}: {package} imports {module}")
        if top in PUBLIC_ONLY.get(package, ()):
            private = [p for p in module.split(".") if p.startswith("_")] + [n for n in names if n.startswith("_")]
            if private:
                found.append(f"{where}: {package} reaches into {module} ({', '.join(private)}): use public names")
    return found


MODULES = [(pkg, p) for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))]


@pytest.mark.parametrize("package,path", MODULES, ids=[str(p.relative_to(ROOT)) for _, p in MODULES])
def test_every_import_respects_the_layers(package, path):
    assert problems(package, path) == []


def test_the_check_sees_what_it_forbids(tmp_path):
    # The rule can fail: a lazy import of the capture inside an analysis function and torch; a
    # guard reaching into a private module or name; a format module importing the capture.
    bad = tmp_path / "bad.py"
    bad.write_text(
        "def f():\n    from detfp_capture.session import Session\n    import torch\n"
        "from detfp_capture._config import LEVELS\nfrom detfp_analyze.bisect import _walk\n"
    )
    assert len(problems("detfp_analyze", bad)) == 3  # its own bisect is its own
    assert [p.split(": ", 1)[1] for p in problems("detfp_guards", bad)] == [
        "detfp_guards reaches into detfp_capture._config (_config): use public names",
        "detfp_guards reaches into detfp_analyze.bisect (_walk): use public names",
    ]
    assert [p.split(": ", 1)[1] for p in problems("detfp_format", bad)] == [
        "detfp_format imports detfp_capture.session",
        "detfp_format imports torch",
        "detfp_format imports detfp_capture._config",
        "detfp_format imports detfp_analyze.bisect",
    ]


def colliding_subpackages(root: Path = ROOT) -> list[str]:
    """Subpackages named like another of the four packages (``detfp_analyze/guards`` beside
    ``detfp_guards`` read as the guards package inside the analysis)."""
    words = {pkg.removeprefix("detfp_") for pkg in PACKAGES}
    return sorted(
        f"{pkg}/{sub.name}"
        for pkg in PACKAGES
        for sub in (root / pkg).iterdir()
        if sub.is_dir() and (sub / "__init__.py").is_file() and sub.name.strip("_") in words - {pkg.removeprefix("detfp_")}
    )


def test_no_subpackage_takes_another_packages_name(tmp_path):
    assert colliding_subpackages() == []
    for pkg in PACKAGES:
        (tmp_path / pkg).mkdir()
    (tmp_path / "detfp_analyze" / "guards").mkdir()
    (tmp_path / "detfp_analyze" / "guards" / "__init__.py").write_text("")
    assert colliding_subpackages(tmp_path) == ["detfp_analyze/guards"]
