"""This rank's manifest, kept current while the run goes on (collected by ``manifest.py``).

The manifest is written when the session opens this rank's part of the run directory (at
``Session()``, or for a launcher process whose rank only the process group will tell, when that
is known), and again when something it holds becomes known: the world size, when the process
group appears after the session opened (a script that sets up distributed training itself);
the first step (``start_step``, when the session was not told), the numerics settings
(``numerics.Catalogue``) and environment in force when the first step begins (a script sets
them after the launcher opened the session), the autocast state the first step's forward runs
under (read at its first root forward: autocast is entered inside the step), and the process
groups the collectives used (at step ends and at close). A setting changed between later steps
is a ``setting_changed`` event instead, one per key (``name`` the key, ``detail``
``before step N: KEY: OLD -> NEW`` with JSON values; the autocast state ``in step N: ...``).
Reading the catalogue costs tens of microseconds per step begin; only a change converts it.
"""

from __future__ import annotations

import json
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
        #: The catalogue's getters (``numerics.Catalogue``), resolved when first needed.
        self._catalogue: Any = None
        #: The settings last seen at a step begin, as read (the manifest holds the first, converted).
        self._raw: list[Any] | None = None
        #: The autocast state of the last step's first root forward, as read, and that step.
        self._autocast: tuple[Any, ...] | None = None
        self._autocast_step: int | None = None

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

    def _numerics(self) -> Any:
        if self._catalogue is None:
            from detfp_capture.numerics import Catalogue

            self._catalogue = Catalogue()
        return self._catalogue

    def _check_settings(self) -> None:
        """The manifest's settings and numerics environment are those in force when the first
        step begins; a later change is a ``setting_changed`` event per key, which ``env``,
        ``certify`` and ``bisect`` read."""
        from detfp_capture.manifest import numerics_env

        if self.data is None:
            return
        try:
            cat = self._numerics()
            now = cat.raw()
        except Exception:
            return
        if self._raw is None:
            self._raw = now
            settings = cat.snapshot(now)
            if self.data.get("determinism") != settings or self.data.get("env") != numerics_env():
                self.data["determinism"] = settings
                self.data["env"] = numerics_env()
                self.write_safely()
            return
        if now == self._raw:
            return
        old, new = cat.snapshot(self._raw), cat.snapshot(now)
        self._raw = now
        self._changed(old, new, f"before step {self.rec.step}", autocast=False)

    def _changed(self, old: dict[str, Any], new: dict[str, Any], when: str, *, autocast: bool) -> None:
        rec = self.rec
        if rec.failed:
            return
        keys = [k for k in sorted(new) if k.startswith("autocast.") == autocast and new[k] != old.get(k)]
        for key in keys:
            a, b = (json.dumps(x, sort_keys=True) for x in (old.get(key), new[key]))
            rec.event("setting_changed", key, "", 1, f"{when}: {key}: {a} -> {b}")
        if keys and self.data is not None and "settings_changed_at" not in self.data:
            # Said once in the manifest, so an analysis reads the events only of runs that changed one.
            self.data["settings_changed_at"] = rec.step
            self.write_safely()

    def forward_begins(self) -> None:
        """A root module's forward begins: the first one of a step reads the autocast state it
        runs under (autocast is entered inside the step, around the forward). The first step's
        goes into the manifest; a later step whose state differs from the step before says so in
        a ``setting_changed`` event."""
        rec = self.rec
        if not rec.in_step or self._autocast_step == rec.step or self.data is None:
            return
        self._autocast_step = rec.step
        try:
            cat = self._numerics()
            now = cat.autocast_raw()
        except Exception:
            return
        before, self._autocast = self._autocast, now
        if before is None:
            settings = self.data.get("determinism")
            fresh = cat.autocast(now)
            if isinstance(settings, dict) and any(settings.get(k) != v for k, v in fresh.items()):
                settings.update(fresh)
                self.write_safely()
        elif now != before:
            self._changed(cat.autocast(before), cat.autocast(now), f"in step {rec.step}", autocast=True)
