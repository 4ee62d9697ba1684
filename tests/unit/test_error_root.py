"""One error tree (house rule 20; issue 44): every exception class the four packages define
derives from ``detfp_format.errors.DetfpError``, so one ``except DetfpError`` catches whatever detfp
raises on purpose: a format ``SelectorError`` as well as an analysis ``MissingRankError``, a capture
``ConfigError`` or the guards' ``NotReproducibleError``.

The walk imports every module of the four packages and takes every exception class defined in it,
at module level or nested (an AST pass finds classes the import does not bind at module level).
"""

from __future__ import annotations

import ast
import builtins
import importlib
import inspect
from pathlib import Path

import pytest

from detfp_format.errors import DetfpError

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("detfp_format", "detfp_capture", "detfp_analyze", "detfp_guards")

#: Exception classes deliberately outside the tree, each with the reason.
OUTSIDE = {
    # A private control-flow signal of the footer parser, raised and caught inside that module
    # (a truncated field); it never reaches a caller, who gets a ShardError instead.
    "detfp_analyze.io.footer_head._Bad": "private signal, never escapes its module",
}
#: Builtin exception names a class may derive from besides the root (checked in the AST pass).
_BUILTIN = {n for n, o in vars(builtins).items() if inspect.isclass(o) and issubclass(o, BaseException)}


def _modules() -> list[tuple[str, Path]]:
    out = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__main__":
                continue  # runs the launcher or the CLI on import
            out.append((".".join(parts[:-1] if parts[-1] == "__init__" else parts), path))
    return out


def exception_classes() -> dict[str, type[BaseException]]:
    """Every exception class the packages define, by qualified name (module.Class)."""
    found: dict[str, type[BaseException]] = {}
    for name, _ in _modules():
        module = importlib.import_module(name)
        for obj in vars(module).values():
            if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == name:
                found[f"{name}.{obj.__qualname__}"] = obj
    return found


def defined_exception_names() -> set[str]:
    """Classes whose bases name an exception (by a name ending Error/Exception or a builtin one),
    found in the source: a class nested in a function is seen here though no import binds it."""
    names = set()
    for module, path in _modules():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                bases = [ast.unparse(b).rpartition(".")[2] for b in node.bases]
                if any(b in _BUILTIN or b.endswith(("Error", "Exception")) for b in bases):
                    names.add(f"{module}.{node.name}")
    return names


def outside_the_root(classes: dict[str, type[BaseException]]) -> list[str]:
    return sorted(n for n, c in classes.items() if not issubclass(c, DetfpError) and n not in OUTSIDE)


def test_every_exception_derives_from_the_one_root():
    classes = exception_classes()
    assert len(classes) > 25  # the walk saw the packages (format, capture, analysis, guards)
    assert outside_the_root(classes) == [], "derive these from detfp_format.errors.DetfpError (or a subclass)"
    assert sorted(OUTSIDE) == sorted(n for n in OUTSIDE if n in classes), "an exception listed in OUTSIDE is gone"


def test_no_exception_class_hides_from_the_walk():
    # A class defined inside a function (not bound at module level) would escape the import walk.
    assert defined_exception_names() <= set(exception_classes())


def test_the_check_sees_a_stray_root():
    stray = type("StrayError", (ValueError,), {"__module__": "detfp_capture.fake"})
    assert outside_the_root({"detfp_capture.fake.StrayError": stray}) == ["detfp_capture.fake.StrayError"]


@pytest.mark.parametrize(
    "module,name",
    [
        ("detfp_format.errors", "SelectorError"),
        ("detfp_capture.errors", "ConfigError"),
        ("detfp_capture._digest.results", "DigestError"),
        ("detfp_analyze.errors", "MissingRankError"),
        ("detfp_guards.repeat", "NotReproducibleError"),
    ],
)
def test_one_except_catches_every_family(module, name):
    import detfp_analyze

    cls = getattr(importlib.import_module(module), name)
    # The analysis's exported DetfpError is the root itself, so its users catch the other families too.
    assert detfp_analyze.DetfpError is DetfpError
    with pytest.raises(detfp_analyze.DetfpError):
        raise cls.__new__(cls)  # not __init__: NotReproducibleError takes a RepeatResult
