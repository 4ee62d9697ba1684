"""Old flat module paths (``detfp_analyze.reader``, ...) kept importable after the package was
grouped by role: each name below is the same module object as its new home.

The table is also the map from the old layout to the new one. A finder appended to
``sys.meta_path`` (last, so it only answers for names no file provides) serves an old path by
importing the new module; ``import detfp_analyze.reader`` and ``from detfp_analyze.reader import
open_run`` keep working, with ``detfp_analyze.reader is detfp_analyze.io.reader``. New code
imports the new paths. A module path resolves; a helper that moved between modules when a module
was split (``walk.collect`` is ``bisect.reads.collect``) is found at its new home only.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType

__all__ = ["MOVED", "install"]

#: Old path -> new path.
MOVED = {
    "detfp_analyze.reader": "detfp_analyze.io.reader",
    "detfp_analyze.completeness": "detfp_analyze.io.completeness",
    "detfp_analyze.integrity": "detfp_analyze.io.integrity",
    "detfp_analyze.envdiff": "detfp_analyze.io.envdiff",
    "detfp_analyze._footers": "detfp_analyze.io.footers",
    "detfp_analyze.align": "detfp_analyze.bisect.align",
    "detfp_analyze.narrow": "detfp_analyze.bisect.narrow",
    "detfp_analyze.walk": "detfp_analyze.bisect.walk",
    "detfp_analyze.verdict": "detfp_analyze.bisect.verdict",
    "detfp_analyze.diagnose": "detfp_analyze.bisect.diagnose",
    "detfp_analyze.diffkind": "detfp_analyze.bisect.diffkind",
    "detfp_analyze.evidence": "detfp_analyze.bisect.evidence",
    "detfp_analyze.resume": "detfp_analyze.bisect.resume",
    "detfp_analyze.result": "detfp_analyze.bisect.result",
    "detfp_analyze.certify": "detfp_analyze.single.certify",
    "detfp_analyze.summary": "detfp_analyze.single.summary",
    "detfp_analyze.replicas": "detfp_analyze.single.replicas",
    "detfp_analyze.report": "detfp_analyze.render.report",
    "detfp_analyze.plot": "detfp_analyze.render.plot",
    "detfp_analyze.figdata": "detfp_analyze.render.figdata",
    "detfp_analyze.figures": "detfp_analyze.render.figures",
    "detfp_analyze.html": "detfp_analyze.render.html",
    "detfp_analyze.perfetto": "detfp_analyze.render.perfetto",
    "detfp_analyze.pictures": "detfp_analyze.render.pictures",
    "detfp_analyze.recipes": "detfp_analyze.render.recipes",
    "detfp_analyze.layout": "detfp_analyze.render.layout",
    "detfp_analyze.gate": "detfp_analyze.guards.gate",
    "detfp_analyze.golden": "detfp_analyze.guards.golden",
    "detfp_analyze.synth": "detfp_analyze.testing.synth",
    "detfp_analyze._synth_template": "detfp_analyze.testing.template",
}


class _Loader(importlib.abc.Loader):
    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(self.target)

    def exec_module(self, module: ModuleType) -> None:
        pass  # the new module was executed when it was imported


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        new = MOVED.get(fullname)
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Loader(new))


def install() -> None:
    """Append the finder to ``sys.meta_path`` once per process."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.append(_Finder())
