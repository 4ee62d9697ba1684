"""The type checker's list of modules it still ignores errors in may only shrink.

pyproject.toml had one ``[[tool.mypy.overrides]]`` with ``ignore_errors = true``: modules mypy
still found errors in (164 errors when it was added; none left since 2026-12-04, and the override
is gone). ``PINNED`` below is that list at its largest allowed, now empty: a module added to an
ignore_errors override fails here, and so does a listed module that no longer exists (renamed or
split: its successors are checked, not ignored).

To shrink it: delete the module from pyproject's list, run ``.venv/bin/python -m mypy``, fix
what it reports (narrowing, real annotations; ``# type: ignore[code]`` only with a reason, where
a library's stubs are wrong), then delete the module from ``PINNED`` too so it cannot come back.
"""

from __future__ import annotations

from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # pragma: no cover - Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[2]

#: The most the ignore_errors list may hold. Only ever delete from it: since 2026-12-04 it is
#: empty (the last thirteen modules' 54 errors fixed), so no module may be ignored again.
PINNED: frozenset[str] = frozenset()


def ignored_modules(pyproject: dict) -> list[str]:
    """The modules of every mypy override that sets ``ignore_errors = true``, in file order."""
    out: list[str] = []
    for o in pyproject.get("tool", {}).get("mypy", {}).get("overrides", []):
        if o.get("ignore_errors"):
            mods = o["module"]
            out += [mods] if isinstance(mods, str) else list(mods)
    return out


def problems(listed: list[str], pinned: frozenset[str], root: Path) -> list[str]:
    """Why ``listed`` (pyproject's ignore_errors modules) breaks the shrink-only rule, one line each."""
    out = [f"{m}: listed twice" for m in sorted({m for m in listed if listed.count(m) > 1})]
    for m in listed:
        if "*" in m:
            out.append(f"{m}: a pattern ignores modules not yet written; name each module")
            continue
        if m not in pinned:
            out.append(f"{m}: added to the ignore_errors list, which may only shrink; fix its errors instead")
        base = root / m.replace(".", "/")
        if not (base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()):
            out.append(f"{m}: no such module; delete it from the list (and from PINNED)")
    return out


def test_the_ignore_errors_list_only_shrinks():
    listed = ignored_modules(tomllib.loads((ROOT / "pyproject.toml").read_text()))
    assert problems(listed, PINNED, ROOT) == []


def test_the_check_sees_what_it_forbids(tmp_path):
    # The rule can fail: a new module, a module that is gone, a pattern, a repeat.
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "kept.py").write_text("")
    (tmp_path / "pkg" / "new.py").write_text("")
    (tmp_path / "pkg" / "sub").mkdir()
    (tmp_path / "pkg" / "sub" / "__init__.py").write_text("")
    pinned = frozenset({"pkg.kept", "pkg.sub", "pkg.gone"})
    assert problems(["pkg.kept", "pkg.sub"], pinned, tmp_path) == []
    assert problems(["pkg.kept", "pkg.new", "pkg.gone", "pkg.*", "pkg.kept"], pinned, tmp_path) == [
        "pkg.kept: listed twice",
        "pkg.new: added to the ignore_errors list, which may only shrink; fix its errors instead",
        "pkg.gone: no such module; delete it from the list (and from PINNED)",
        "pkg.*: a pattern ignores modules not yet written; name each module",
    ]
    toml = '[[tool.mypy.overrides]]\nmodule = ["a"]\nignore_missing_imports = true\n'
    toml += '[[tool.mypy.overrides]]\nmodule = "b"\nignore_errors = true\n'
    assert ignored_modules(tomllib.loads(toml)) == ["b"]
