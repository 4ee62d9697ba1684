"""The native extensions' stubs (``_recorder/_hostpath.pyi``, ``_digest/_lanes.pyi``) name what the
built modules export, no more and no less, so mypy checks every call into them (issue 44: they
were ``Any``) and a function added in C without its stub entry fails here."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from tests import native_half

ROOT = Path(__file__).resolve().parents[2]
MODULES = {
    "detfp_capture._recorder._hostpath": native_half.RECORD,
    "detfp_capture._digest._lanes": native_half.DIGEST,
}


def _stub(module: str) -> ast.Module:
    return ast.parse((ROOT / (module.replace(".", "/") + ".pyi")).read_text())


def _names(tree: ast.Module | ast.ClassDef) -> set[str]:
    out: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out.add(node.target.id)
    return out - {"__init__"}


def _built(module: str):
    try:
        mod = importlib.import_module(module)
    except ImportError:
        mod = None
    native_half.check(mod is not None, MODULES[module])
    return mod


@pytest.mark.parametrize("module", sorted(MODULES))
def test_the_stub_names_every_export_of_the_built_module(module):
    mod = _built(module)
    exported = {n for n in dir(mod) if not n.startswith("__")}
    assert _names(_stub(module)) == exported


def test_the_slot_stub_has_the_native_slots_fields():
    mod = _built("detfp_capture._recorder._hostpath")
    (slot,) = (n for n in _stub("detfp_capture._recorder._hostpath").body if getattr(n, "name", "") == "Slot")
    fields = {n for n, v in vars(mod.Slot).items() if type(v).__name__ == "member_descriptor"}
    assert _names(slot) == fields
