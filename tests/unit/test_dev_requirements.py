"""One list of development dependencies: pyproject's ``dev`` extra says what, requirements-dev.txt
says which versions (bootstrap installs ``.[dev]`` under those pins as constraints)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

# Python 3.11+ (pyproject is read with the standard library; 3.10 has no tomllib).
tomllib = pytest.importorskip("tomllib")

ROOT = Path(__file__).resolve().parents[2]


def _name(requirement: str) -> str:
    """The normalized project name of a requirement line (PEP 503)."""
    name = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement.strip())
    assert name, requirement
    return re.sub(r"[-_.]+", "-", name.group(0)).lower()


def _wanted() -> set[str]:
    """Every project the ``dev`` extra asks for, through the extras of detfp it includes."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    names: set[str] = {_name(r) for r in project["dependencies"]}
    todo, seen = ["dev"], set()
    while todo:
        extra = todo.pop()
        seen.add(extra)
        for req in extras[extra]:
            own = re.fullmatch(r"detfp\[([^\]]+)\]", req.replace(" ", ""))
            if own:
                todo += [e for e in own.group(1).split(",") if e not in seen]
            else:
                names.add(_name(req))
    return names


def _pinned() -> list[str]:
    lines = (ROOT / "requirements-dev.txt").read_text().splitlines()
    return [ln for ln in (x.split("#", 1)[0].strip() for x in lines) if ln]


def test_every_dev_dependency_is_pinned_and_every_pin_is_a_dev_dependency():
    pinned = {_name(r) for r in _pinned()}
    wanted = _wanted()
    assert wanted - pinned == set(), (
        f"in pyproject's dev extra but not in requirements-dev.txt: {sorted(wanted - pinned)}"
    )
    assert pinned - wanted == set(), (
        f"pinned in requirements-dev.txt but not asked for by .[dev]: {sorted(pinned - wanted)}"
    )


def test_pins_are_constraints_pip_accepts():
    """A constraints file takes no extras, no options and no editable lines."""
    for line in _pinned():
        assert "[" not in line and not line.startswith("-"), f"not a constraint line: {line!r}"


def test_the_dev_extra_brings_what_the_spark_s3_and_notebook_tests_import():
    """The disagreement this list ended: `pip install -e .[dev]` lacked pyspark, moto and nbclient."""
    wanted = _wanted()
    assert {"pyspark", "moto", "nbclient", "torch", "matplotlib", "transformers"} <= wanted
