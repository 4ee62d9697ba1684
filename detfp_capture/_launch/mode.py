"""The launcher's part in its Session (``Session(..., extension=LaunchMode(...))``): the part of
the run directory waits for the rank when no ``RANK`` names it (``_placement``), every root
module's forward is hooked, and steps are counted by the script's optimizer steps
(``_sources.autosteps.AutoSteps``). It goes through the Session's extension point
(``_extension``), never its private fields.
"""

from __future__ import annotations

import os

from detfp_capture._extension import SessionParts
from detfp_capture._sources.autosteps import AutoSteps

__all__ = ["LaunchMode"]


class LaunchMode:
    """The launcher's ``Extension`` of the Session it opens."""

    def __init__(self, *, followed: bool = False) -> None:
        #: A re-execution of the script the launcher follows (``--followed``).
        self.followed = followed
        self._parts: SessionParts | None = None
        self._auto: AutoSteps | None = None

    def awaits_rank(self) -> bool:
        return self.followed or "RANK" not in os.environ

    def attach(self, parts: SessionParts) -> None:
        self._parts = parts
        parts.hooks.install_global()  # level metrics: roots only
        self._auto = AutoSteps(parts.ctx, parts.steps)
        self._auto.install()

    def close_trailing(self) -> None:
        if self._auto is not None:
            self._auto.close_trailing()

    def remove(self) -> None:
        if self._auto is not None:
            self._auto.remove()

    def started_ranks(self) -> None:
        """This process started (or tried to start) the ranks: unless it becomes one itself (a
        process group, a step), it writes nothing. Nothing to do when the session is inert."""
        if self._parts is not None:
            self._parts.part.started_ranks = True
