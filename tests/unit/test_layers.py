"""The packages' layers, checked on every import of every module (docs/architecture-index.md).

``detfp_format`` (the trace format) is the floor: it imports none of the other packages and never
torch. ``detfp_capture`` and ``detfp_analyze`` sit on it side by side and never import each
other; the analysis never imports torch. ``detfp_guards`` sits on top of both and uses their
public names only (no module or name that starts with ``_``). Imports inside functions count: a
lazy import crosses a layer as surely as one at the top.

Inside ``detfp_capture`` the floors, lowest first (``CAPTURE_FLOORS``): ``base`` (errors, options),
``digest`` (``_digest/`` and its public face ``digest.py``), ``recorder`` (``_recorder/`` and the
manifest it writes), ``sources`` (``_sources/``: where records come from), ``face`` (the
``Session``, its placement and extension point, the launcher's ``_launch/``). A module imports
its own floor and those below, never one above (docs/architecture-capture.md).
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


#: detfp_capture's floors, lowest first, and what sits on each: a folder (``_digest/``) or a
#: module at the package's top. A module may import its own floor and the floors below it.
CAPTURE_FLOORS: dict[str, tuple[str, ...]] = {
    "base": ("errors.py", "_options.py", "_config.py"),
    "digest": ("_digest/", "digest.py"),
    "recorder": ("_recorder/", "manifest.py", "numerics.py"),
    "sources": ("_sources/",),
    "face": ("__init__.py", "__main__.py", "session.py", "_placement.py", "_extension.py", "_launch/"),
}
_FLOOR_ORDER = list(CAPTURE_FLOORS)


def capture_floor(relpath: str) -> str | None:
    """The floor of a module of detfp_capture (its path inside the package), None if unassigned."""
    for floor, places in CAPTURE_FLOORS.items():
        for place in places:
            if relpath == place or (place.endswith("/") and relpath.startswith(place)):
                return floor
    return None


def _capture_target(module: str, names: tuple[str, ...], root: Path) -> list[str]:
    """The paths inside detfp_capture an import reaches: ``from detfp_capture import digest``
    reaches ``digest.py``; ``from detfp_capture._recorder.slot import X`` reaches ``_recorder/slot.py``."""
    parts = module.split(".")[1:]
    out = []
    for name in names or ("",):
        cand = [*parts, name] if name else parts
        base = root.joinpath(*cand) if cand else root
        if base.with_suffix(".py").is_file():
            out.append("/".join(cand) + ".py")
        elif (base / "__init__.py").is_file():
            out.append("/".join([*cand, "__init__.py"]))
        elif parts:
            out.append("/".join(parts) + ".py" if root.joinpath(*parts).with_suffix(".py").is_file()
                       else "/".join([*parts, "__init__.py"]))
    return out


def floor_problems(path: Path, root: Path = ROOT / "detfp_capture") -> list[str]:
    rel = path.relative_to(root).as_posix()
    mine = capture_floor(rel)
    if mine is None:
        return [f"detfp_capture/{rel}: on no floor; add it to CAPTURE_FLOORS (and the map)"]
    found = []
    for line, module, names in imports(path):
        if module.split(".")[0] != "detfp_capture":
            continue
        for target in _capture_target(module, names, root):
            theirs = capture_floor(target)
            if theirs is not None and _FLOOR_ORDER.index(theirs) > _FLOOR_ORDER.index(mine):
                found.append(f"detfp_capture/{rel}:{line}: {mine} floor imports {module} ({theirs} floor)")
    return found


CAPTURE_MODULES = sorted((ROOT / "detfp_capture").rglob("*.py"))


@pytest.mark.parametrize("path", CAPTURE_MODULES, ids=[str(p.relative_to(ROOT)) for p in CAPTURE_MODULES])
def test_capture_floors_import_downward_only(path):
    assert floor_problems(path) == []


def test_the_floor_check_sees_an_upward_import(tmp_path):
    # The two upward imports issue 44 removed: the digest's staging reaching up to the recorder's
    # byte copy, and a record source reaching up to the launcher's Session.
    pkg = tmp_path / "detfp_capture"
    for rel in ("_digest/staging.py", "_recorder/slot.py", "_sources/launcher.py", "session.py", "stray.py"):
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text("")
    (pkg / "_digest" / "staging.py").write_text("from detfp_capture._recorder.slot import copy_bytes\n")
    (pkg / "_sources" / "launcher.py").write_text("def main():\n    from detfp_capture import session\n")
    assert floor_problems(pkg / "_digest" / "staging.py", pkg) == [
        "detfp_capture/_digest/staging.py:1: digest floor imports detfp_capture._recorder.slot (recorder floor)"
    ]
    assert floor_problems(pkg / "_sources" / "launcher.py", pkg) == [
        "detfp_capture/_sources/launcher.py:2: sources floor imports detfp_capture (face floor)"
    ]
    assert floor_problems(pkg / "stray.py", pkg) == ["detfp_capture/stray.py: on no floor; add it to CAPTURE_FLOORS (and the map)"]
