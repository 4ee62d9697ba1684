"""docs/cli.md is generated from the commands' --help and must not go stale."""

from __future__ import annotations

from pathlib import Path

from typer.main import get_command

from detfp_analyze._cli.reference import render
from detfp_analyze.cli import app

DOC = Path(__file__).parent.parent.parent / "docs" / "cli.md"


def test_cli_reference_is_current():
    assert DOC.read_text() == render(), (
        "docs/cli.md is stale: regenerate it with `python -m detfp_analyze._cli.reference --write docs/cli.md`"
    )


def test_reference_covers_every_command_and_option():
    text = render()
    group = get_command(app)
    for name, cmd in group.commands.items():
        assert f"## `detfp-analyze {name}`" in text
        for param in cmd.params:
            for opt in getattr(param, "opts", []):
                if opt.startswith("--"):
                    assert opt in text, (name, opt)


def test_pictures_doc_lists_every_state_in_order():
    from detfp_analyze.render.frames import STATE_HELP, STATES

    text = (DOC.parent / "pictures.md").read_text()
    rows = [line.split("|")[1:3] for line in text.splitlines() if line.startswith("| `") and line.count("|") == 3]
    assert [(s.strip().strip("`"), h.strip()) for s, h in rows] == [(s, STATE_HELP[s]) for s in STATES]


def test_guides_link_to_each_other_and_name_real_fields():
    guide = (DOC.parent / "guide.md").read_text()
    symptoms = (DOC.parent / "symptoms.md").read_text()
    assert "docs/symptoms.md" in guide and "docs/guide.md" in symptoms
    report = (DOC.parent / "report.md").read_text()
    for field in ("all_one_ulp", "max_ulp", "shared_coordinates", "peers_differing", "rows_differing",
                  "boundary_differing", "contradiction", "consumer", "presence", "likely_false_root"):  # fmt: skip
        assert field in symptoms and field in report, field
