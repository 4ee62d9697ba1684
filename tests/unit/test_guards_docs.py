"""docs/guards.md shows the example guards (examples/guards) verbatim, and they pass: kernel and
module guards through the pytest plugin, the recipe guard against a golden recorded here."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

import tests.fixtures.planted

pytest_plugins = ("pytester",)

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples" / "guards").glob("test_*.py"))
DOC = (REPO / "docs" / "guards.md").read_text(encoding="utf-8")


@pytest.fixture(scope="module", autouse=True)
def _capture_imported():
    tests.fixtures.planted.warm_capture()


def test_docs_show_every_example_guard_verbatim():
    assert [p.name for p in EXAMPLES] == ["test_kernel_guard.py", "test_module_guard.py", "test_recipe_guard.py"]
    for p in EXAMPLES:
        assert f"```python\n{p.read_text(encoding='utf-8').rstrip()}\n```" in DOC, (
            f"docs/guards.md: paste {p.name} again"
        )


def test_example_guards_pass(pytester, monkeypatch):
    spec = importlib.util.spec_from_file_location("recipe_guard_example", EXAMPLES[2])
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    golden = pytester.path / "golden"
    recipe.record(golden)  # what `detfp-analyze golden update` would have stored
    monkeypatch.setenv("DETFP_GOLDEN", str(golden))
    monkeypatch.setenv("DETFP_EXPECT", str(pytester.path / "no-expectations.toml"))
    for p in EXAMPLES:
        pytester.makepyfile(**{p.stem: p.read_text(encoding="utf-8")})
    # Three points of the kernel grid (float8 among them where torch has it): the rest costs time
    # and adds nothing here.
    fp8 = hasattr(torch, "float8_e4m3fn")
    pick = "float32 or bfloat16" + (" or float8_e4m3fn" if fp8 else "")
    result = pytester.runpytest("-p", "no:randomly", "-k", f"not test_combine or (64x32 and ({pick}))")
    grid = 2 * (3 + sum(hasattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2")))
    result.assert_outcomes(passed=3 + 2 + fp8, deselected=grid - 2 - fp8)


def test_the_expectations_example_loads(tmp_path):
    from detfp_analyze.gate.expectations import load_expectations

    start = DOC.index("```toml\n") + len("```toml\n")
    (tmp_path / "expect.toml").write_text(DOC[start : DOC.index("```", start)])
    first, second = load_expectations(tmp_path / "expect.toml")
    assert (first.module, first.phase, first.steps, second.metric) == ("blocks.*.attn", "backward", "1-", "loss")
