"""The launcher's Session (``python -m detfp_capture``): a ``Session`` that waits for its rank
when no ``RANK`` names it (``_placement``), with global module hooks and steps counted by the
script's optimizer steps (``_sources.autosteps.AutoSteps``)."""

from __future__ import annotations

import os
from typing import Any

from detfp_capture._sources.autosteps import AutoSteps
from detfp_capture.session import Session

__all__ = ["launcher_session"]


class _LauncherSession(Session):
    """The launcher's Session: it waits for its rank (``_placement``) when no ``RANK`` names it."""

    def __init__(self, *, followed: bool, **options: Any) -> None:
        self._followed = followed
        super().__init__(**options)

    def _awaits_rank(self) -> bool:
        return self._followed or "RANK" not in os.environ

    def started_ranks(self) -> None:
        """This process started (or tried to start) the ranks: unless it becomes one itself (a
        process group, a step), it writes nothing."""
        if not self._inert:
            self._part.started_ranks = True


def launcher_session(*, followed: bool = False, **options: Any) -> _LauncherSession:
    """A Session in launcher mode (``python -m detfp_capture``): global module hooks, steps
    counted by the script's optimizer steps (``autosteps.AutoSteps``), the rank learned from the
    process group when no ``RANK`` names it (``_placement``)."""
    session = _LauncherSession(followed=followed, **options)
    steps = session._steps  # None when inert (ranks= leaves this rank out)
    if steps is not None:
        session._hooks.install_global()  # level metrics: roots only
        session._auto = AutoSteps(session._ctx, steps)
        session._auto.install()
    return session
