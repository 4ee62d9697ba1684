"""The bisect stages are numbered once (``bisect/pipeline.py``: ``STAGES``; issue 44): every place
that lists them (docs/report.md's *How bisect narrows*, docs/architecture.md's data flow, the
docstrings of ``bisect/pipeline.py`` and ``bisect/__init__.py``) numbers the same stages the same
way, in the same order, and says nothing else with a number."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

from detfp_analyze.bisect import pipeline
from detfp_analyze.bisect.pipeline import STAGES

ROOT = Path(__file__).resolve().parents[2]
#: A numbered item at the start of a line: its number and the stage's name (the item's first
#: word, bold in the docs, lower-cased, its "?" or "." dropped).
ITEM = re.compile(r"^(\d+)\. (?:\*\*)?([A-Za-z]+)", re.M)


def _section(text: str, heading: str) -> str:
    start = text.index(heading)
    end = text.find("\n## ", start + len(heading))
    return text[start : end if end >= 0 else len(text)]


def numbered(text: str) -> list[tuple[int, str]]:
    """The numbered items of ``text``: (number, first word, lower-cased)."""
    return [(int(n), word.lower()) for n, word in ITEM.findall(text)]


LISTS = {
    "docs/report.md": lambda: _section((ROOT / "docs/report.md").read_text(), "## How bisect narrows"),
    "docs/architecture.md": lambda: _section(
        (ROOT / "docs/architecture.md").read_text(), "## Data flow: a run directory to a report"
    ),
    "bisect/pipeline.py": lambda: pipeline.__doc__ or "",
    # The package itself (``detfp_analyze.bisect`` as an attribute is the function).
    "bisect/__init__.py": lambda: importlib.import_module("detfp_analyze.bisect").__doc__ or "",
}


def test_the_stages_are_distinct_names():
    assert len(set(STAGES)) == len(STAGES) >= 5


@pytest.mark.parametrize("where", sorted(LISTS))
def test_every_list_of_the_stages_numbers_them_as_pipeline_does(where):
    assert numbered(LISTS[where]()) == list(enumerate(STAGES, 1)), (
        f"{where} numbers the bisect stages otherwise than bisect/pipeline.py's STAGES {STAGES}"
    )


def test_a_list_numbered_otherwise_is_caught():
    assert numbered("1. **Comparable?** x\n2. **Window.** y\n") != list(enumerate(STAGES, 1))[:2]
    assert numbered("1. **CLI** x\n2. **Open** y\n3. **Comparable?**") != list(enumerate(STAGES, 1))[:3]
