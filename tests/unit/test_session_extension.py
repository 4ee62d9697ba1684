"""The Session's extension point (``detfp_capture._extension``; issue 44): a caller that drives a
Session (the launcher's ``_launch.mode.LaunchMode``) takes part in it through ``attach``,
``awaits_rank``, ``close_trailing`` and ``remove``, by named members, and no module of the
capture writes a Session's private fields from outside ``session.py``."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from detfp_capture import Session
from detfp_capture._extension import SessionParts
from detfp_capture._launch.mode import LaunchMode

ROOT = Path(__file__).resolve().parents[2]


class _Recording:
    followed = False

    def __init__(self, awaits: bool = False) -> None:
        self.calls: list[str] = []
        self.parts: SessionParts | None = None
        self._awaits = awaits

    def awaits_rank(self) -> bool:
        self.calls.append("awaits_rank")
        return self._awaits

    def attach(self, parts: SessionParts) -> None:
        self.calls.append("attach")
        self.parts = parts

    def close_trailing(self) -> None:
        self.calls.append("close_trailing")

    def remove(self) -> None:
        self.calls.append("remove")


def test_an_extension_is_asked_attached_and_removed(tmp_path):
    ext = _Recording()
    s = Session(tmp_path / "r", "boundaries", extension=ext)
    assert ext.calls == ["awaits_rank", "attach"]
    assert isinstance(ext.parts, SessionParts) and ext.parts.ctx.rec is not None
    model = s.watch(torch.nn.Linear(2, 2))
    with s.step(0):
        model(torch.ones(1, 2))
    s.close()
    assert ext.calls == ["awaits_rank", "attach", "remove"]  # no step open at close: none to end
    assert (tmp_path / "r" / "manifest").is_dir()


def test_an_inert_session_never_attaches(tmp_path):
    ext = _Recording()
    Session(tmp_path / "r", "metrics", ranks="5", extension=ext).close()  # this process is rank 0
    assert ext.calls == ["awaits_rank"]  # nothing attached: nothing to remove


def test_an_awaiting_extension_keeps_the_part_closed_until_the_rank_is_known(tmp_path, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    mode = LaunchMode()
    s = Session(tmp_path / "r", "metrics", extension=mode)
    assert mode.awaits_rank() and not (tmp_path / "r" / "manifest").exists()  # no rank yet: nothing opened
    mode.started_ranks()  # this process started the ranks: it writes nothing unless it becomes one
    s.close()
    assert not (tmp_path / "r" / "records").exists()
    # Closed without ever opening, it no longer holds its digest version (it did until garbage):
    # a session of another version opens beside it (ConfigError while s held version 2).
    Session(tmp_path / "v1", "metrics", digest_version=1).close()
    assert s is not None


def test_no_capture_module_writes_a_sessions_private_fields():
    # The launcher's old _LauncherSession wrote session._auto and session._part.started_ranks.
    writes = re.compile(r"\bsession\._\w+(\.\w+)*\s*=[^=]")
    found = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in sorted((ROOT / "detfp_capture").rglob("*.py"))
        if p.name != "session.py"
        for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
        if writes.search(line)
    ]
    assert found == []
    assert writes.search("        session._auto = AutoSteps(session._ctx, steps)")
