"""This rank's manifest, kept current while the run goes on (collected by ``manifest.py``).

The manifest is written when the session opens this rank's part of the run directory (at
``Session()``, or for a launcher process whose rank only the process group will tell, when that
is known), and again when something it holds becomes known: the world size, when the process
group appears after the session opened (a script that sets up distributed training itself);
the first step (``start_step``, when the session was not told), the determinism settings
and numerics environment in force when the first step begins (a script sets them after the
launcher opened the session), and the process groups the collectives used (at step ends and at
close). A setting changed between later steps is a ``setting_changed`` event instead.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from detfp_capture._recorder.recorder import Recorder

__all__ = ["RunManifest"]


class RunManifest:
    """The manifest dict of this rank and segment, and when to write it again."""

    def __init__(self, out_dir: Path, rec: Recorder, start_step: int | None) -> None:
        self.out_dir = out_dir
        #: The manifest (``manifest.collect_manifest``); None until this rank's directory is open.
        self.data: dict[str, Any] | None = None
        self.rec = rec
        #: The process groups used so far (name -> global ranks): set when collectives are traced.
        self.groups: Callable[[], dict[str, list[int]]] = dict
        #: The launch's first step (the session's ``start_step``, else the first ``step(n)``).
        self.start_step = start_step
        #: The determinism settings last seen at a step begin (the manifest holds the first).
        self._settings: dict[str, Any] | None = None

    def write(self) -> None:
        from detfp_format import writer

        if self.data is None:
            return
        self.data["groups"] = {k: list(v) for k, v in sorted(self.groups().items())}
        writer.write_manifest(self.out_dir, self.data, create=False)

    def write_safely(self) -> None:
        with self.rec.guard("writing the manifest", busy=False):
            self.write()

    def world_learned(self, world_size: int) -> None:
        """The process group appeared with this world size: the manifest says so from now on
        (its ``groups`` list the group's ranks, which must all be below it)."""
        if self.data is not None and self.data.get("world_size") != world_size:
            self.data["world_size"] = world_size
            self.write_safely()

    def step_begins(self, n: int) -> None:
        """A step begins (selected or not): the first one is the launch's start step. The part is
        open by then (``StepBoundaries.begin`` learns the place first); without a manifest there is
        nothing to say it in."""
        if self.data is None:
            return
        if self.start_step is None:
            self.start_step = n
            self.data["start_step"] = n
            self.write_safely()
        self._check_settings()

    def _check_settings(self) -> None:
        """The manifest's determinism settings and numerics environment are those in force when
        the first step begins; a later change is a ``setting_changed`` event, which ``env`` and
        ``certify`` report."""
        from detfp_capture.manifest import determinism_settings, numerics_env

        if self.data is None:
            return
        try:
            now = determinism_settings()
        except Exception:
            return
        if self._settings is None:
            self._settings = now
            if self.data.get("determinism") != now or self.data.get("env") != numerics_env():
                self.data["determinism"] = now
                self.data["env"] = numerics_env()
                self.write_safely()
            return
        rec = self.rec
        changed = sorted(k for k in now if now[k] != self._settings.get(k))
        if changed and not rec.failed:
            detail = ", ".join(f"{k}: {self._settings.get(k)!r} -> {now[k]!r}" for k in changed)
            rec.event("setting_changed", changed[0], "", len(changed), f"before step {rec.step}: {detail}")
        self._settings = now
