"""The suite's kept builds (``tests/cached.py``): built once per key, found afterwards, rebuilt
for another key, and a failed build leaves nothing that a later run would take for a build."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import cached


def test_a_build_is_made_once_per_key_and_a_failure_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("DETFP_TEST_CACHE", str(tmp_path / "cache"))
    made: list[Path] = []

    def make(path: Path) -> None:
        made.append(path)
        path.write_text(f"built {len(made)}")

    first, built = cached.build("thing.so", "k1", make)
    assert built and first.read_text() == "built 1" and first.parent.name == "k1"
    again, built = cached.build("thing.so", "k1", make)
    assert (again, built) == (first, False) and len(made) == 1
    other, built = cached.build("thing.so", "k2", make)
    assert built and other != first and other.read_text() == "built 2"

    def fail(path: Path) -> None:
        path.write_text("half")
        raise RuntimeError("compiler failed")

    with pytest.raises(RuntimeError, match="compiler failed"):
        cached.build("thing.so", "k3", fail)
    assert [p.name for p in (tmp_path / "cache" / "thing.so" / "k3").iterdir()] == []
    rebuilt, built = cached.build("thing.so", "k3", make)
    assert built and rebuilt.read_text() == "built 3"


def test_the_cache_lives_where_the_environment_says(tmp_path, monkeypatch):
    monkeypatch.setenv("DETFP_TEST_CACHE", str(tmp_path / "elsewhere"))
    assert cached.folder("inductor") == tmp_path / "elsewhere" / "inductor"
    assert (tmp_path / "elsewhere" / "inductor").is_dir()
    monkeypatch.delenv("DETFP_TEST_CACHE")
    assert cached.root() == cached.ROOT / ".venv" / "detfp-test-cache"
