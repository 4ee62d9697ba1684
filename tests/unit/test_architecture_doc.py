"""The architecture maps keep up with the packages: every package has its page
(docs/architecture.md for the analysis, docs/architecture-capture.md, docs/architecture-format.md,
docs/architecture-guards.md), the index (docs/architecture-index.md) links every page, every
module of every package is on its package's map, and every module keeps the shape the maps
promise (a docstring saying its one job, under ~500 lines)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: Package -> (its page, whether the map names modules with the package prefix).
MAPS = {
    "detfp_analyze": ("architecture.md", False),
    "detfp_capture": ("architecture-capture.md", False),
    "detfp_format": ("architecture-format.md", True),
    "detfp_guards": ("architecture-guards.md", True),
}
INDEX = "architecture-index.md"
DOCS = {
    name: (ROOT / "docs" / name).read_text(encoding="utf-8") for name in sorted({m[0] for m in MAPS.values()} | {INDEX})
}
MODULES = sorted((pkg, p.relative_to(ROOT / pkg).as_posix()) for pkg in MAPS for p in (ROOT / pkg).rglob("*.py"))
#: Ceiling on a module's length (the house rule says ~500 lines).
MAX_LINES = 500


def _shown(package: str, module: str) -> str:
    prefixed = MAPS[package][1]
    # The CLI's command modules are one line of the map ("cli.py, _cli/"), one module per command.
    if package == "detfp_analyze" and module.startswith("_cli/"):
        return "_cli/"
    return f"{package}/{module}" if prefixed else module


@pytest.mark.parametrize(
    "package,module", [m for m in MODULES if not m[1].endswith(("__init__.py", "__main__.py"))], ids="/".join
)
def test_every_module_is_on_its_map(package, module):
    doc = MAPS[package][0]
    shown = re.escape(_shown(package, module))
    # In the map's table (`_recorder/slot.py`) or its tree (``errors.py   typed errors ...``), not
    # as the tail of a longer path (`bisect/records.py` does not put `records.py` on the map).
    assert re.search(rf"(?<![\w/.]){shown}", DOCS[doc]), (
        f"docs/{doc} does not mention {package}/{module}: add it to the module map"
    )


@pytest.mark.parametrize("package,module", MODULES, ids="/".join)
def test_every_module_has_its_one_job_and_stays_small(package, module):
    text = (ROOT / package / module).read_text(encoding="utf-8")
    assert ast.get_docstring(ast.parse(text)), f"{package}/{module} has no module docstring"
    lines = len(text.splitlines())
    assert lines <= MAX_LINES, f"{package}/{module}: {lines} lines, over {MAX_LINES}: split it by job"


#: C files under detfp_capture held to the same ceiling; the stated exceptions (named in
#: docs/architecture-capture.md with their reason) and their own ceilings.
C_FILES = sorted(p.relative_to(ROOT / "detfp_capture").as_posix() for p in (ROOT / "detfp_capture").rglob("*.c"))
C_EXCEPTIONS: dict[str, int] = {}


@pytest.mark.parametrize("module", C_FILES)
def test_every_c_file_says_its_job_and_stays_small(module):
    text = (ROOT / "detfp_capture" / module).read_text(encoding="utf-8")
    assert text.startswith("/* "), f"detfp_capture/{module} does not open with a comment saying its job"
    lines = len(text.splitlines())
    limit = C_EXCEPTIONS.get(module, MAX_LINES)
    assert lines <= limit, f"detfp_capture/{module}: {lines} lines, over {limit}: split it by job"


def test_the_c_size_exceptions_are_stated():
    assert set(C_EXCEPTIONS) <= set(C_FILES), "an exception for a C file that is gone: drop it"
    doc = DOCS["architecture-capture.md"]
    assert "C files keep the Python modules' size rule" in doc
    for module in C_EXCEPTIONS:
        assert f"`{module}`, up to {C_EXCEPTIONS[module]} lines" in doc, module


def test_functions_stay_readable():
    # A function a reader cannot hold in view is a job that wants splitting (Session.__init__ was 127 lines).
    long = []
    for package, module in MODULES:
        tree = ast.parse((ROOT / package / module).read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
                and node.end_lineno - node.lineno + 1 > MAX_FUNCTION
            ):
                long.append(f"{package}/{module}:{node.name}")
    assert long == [], f"over {MAX_FUNCTION} lines: {long}; split them by job"


#: Ceiling on a function's length, docstring included.
MAX_FUNCTION = 120


def test_every_package_has_its_page_and_the_index_links_each():
    packages = sorted(p.parent.name for p in ROOT.glob("detfp_*/__init__.py"))
    assert packages == sorted(MAPS), f"a package without an architecture page: {sorted(set(packages) - set(MAPS))}"
    linked = set(re.findall(r"\]\(([\w.-]+\.md)\)", DOCS[INDEX]))
    for package, (page, _) in MAPS.items():
        assert page in linked, f"docs/{INDEX} does not link {package}'s page {page}"
        assert INDEX in DOCS[page], f"docs/{page} does not link back to the index {INDEX}"


@pytest.mark.parametrize("doc", sorted(DOCS))
def test_the_links_resolve(doc):
    for target in sorted(set(re.findall(r"\]\(([\w.-]+\.md)(?:#[\w-]+)?\)", DOCS[doc]))):
        assert (ROOT / "docs" / target).is_file(), target
