"""The docs' layout (issue 44): user references apart from dated lab notes, links that resolve,
and the README's two set-up commands with the fast tier beside them.

* docs/capture.md and docs/report.md say what is true now: no dated measurement in them (a date
  is how a lab note reads); the figures live in docs/measurements/, one file per topic, each
  with its dates in the title and listed in the folder's README;
* every relative link in docs/ (measurements included) names a file that exists;
* the README's set-up block is exactly two commands, and the fast tier is named with its time."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
MEASUREMENTS = DOCS / "measurements"
#: The user references that once held dated measurement notes.
REFERENCES = ("capture.md", "report.md")
DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")
LINK = re.compile(r"\]\(([^)#\s]+\.md)(?:#[\w-]+)?\)")


@pytest.mark.parametrize("name", REFERENCES)
def test_the_references_hold_no_dated_measurements(name):
    dated = [line for line in (DOCS / name).read_text().splitlines() if DATE.search(line)]
    assert dated == [], f"docs/{name} holds dated notes (move them to docs/measurements/): {dated[:3]}"


def test_every_measurement_note_is_dated_and_listed():
    notes = sorted(p.name for p in MEASUREMENTS.glob("*.md") if p.name != "README.md")
    assert notes, "docs/measurements/ holds no notes"
    listed = set(LINK.findall((MEASUREMENTS / "README.md").read_text()))
    for name in notes:
        title = (MEASUREMENTS / name).read_text().splitlines()[0]
        assert title.startswith("# ") and DATE.search(title), f"measurements/{name}: no date in its title {title!r}"
        assert name in listed, f"docs/measurements/README.md does not list {name}"


@pytest.mark.parametrize("doc", sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")))
def test_the_relative_links_resolve(doc):
    path = DOCS / doc
    missing = [t for t in LINK.findall(path.read_text()) if "://" not in t and not (path.parent / t).is_file()]
    assert missing == [], f"docs/{doc} links to missing files: {missing}"


def test_the_readme_sets_up_with_two_commands_and_names_the_fast_tier():
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Set up and run") :]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block is not None
    commands = [line.split("#")[0].strip() for line in block.group(1).splitlines() if line.strip()]
    assert commands == ["bash scripts/demo.sh", "bash scripts/test.sh"]
    fast = section[: section.index("## Use")]
    assert re.search(r"`--fast`.*?about \d+(-\d+)? minutes", fast, re.S), "the README names --fast without its time"
