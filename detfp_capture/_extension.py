"""The Session's one extension point: how a caller that drives a Session (the launcher,
``_launch``) takes part in it without writing its private fields.

An ``Extension`` is handed to ``Session(..., extension=...)``. The Session asks it once whether
this process's part of the run opens only when the rank is known (``awaits_rank``: the
launcher's processes start before their process group says their rank, ``_placement``), gives it
a ``SessionParts`` with the members it may use once the record sources are installed
(``attach``), lets it end a step it opened at ``close`` (``close_trailing``), and has it take
down what it installed at teardown (``remove``). A session that captures nothing on this rank
(``ranks=`` leaves it out) never calls ``attach``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from detfp_capture._placement import RankPart
    from detfp_capture._sources.context import CaptureContext
    from detfp_capture._sources.modules import ModuleHooks
    from detfp_capture._sources.steps import StepBoundaries

__all__ = ["Extension", "SessionParts"]


@dataclass(frozen=True)
class SessionParts:
    """What an extension may use of the Session it extends, by name."""

    #: The capture context every record source shares (recorder, scope, pending step, ...).
    ctx: CaptureContext
    #: The step boundaries (``begin``/``end`` of a step, the optimizer's boundaries).
    steps: StepBoundaries
    #: The module hooks (``install_global``: every root module's forward, watched or not).
    hooks: ModuleHooks
    #: This rank's part of the run directory (``started_ranks``: this process started the ranks).
    part: RankPart


class Extension(Protocol):
    """A caller's part in a Session (see the module docstring for when each is called)."""

    #: A process the launcher followed (a framework's re-execution of the script): its rank is
    #: its process group's, whatever its environment says.
    followed: bool

    def awaits_rank(self) -> bool:
        """Open this rank's part only once the process group names the rank."""
        ...

    def attach(self, parts: SessionParts) -> None:
        """The record sources are installed: install what the extension adds."""
        ...

    def close_trailing(self) -> None:
        """At close, before the step in progress ends: end a step the extension opened."""
        ...

    def remove(self) -> None:
        """At teardown: remove what ``attach`` installed."""
        ...
