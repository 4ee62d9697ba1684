"""``golden update``: replace a golden trace with a new run, saying first what changed.

Pipeline: open (and so validate) the new run -> open the current golden, if there is one ->
``bisect`` golden vs new (what changed, bit for bit; an IncomparableError becomes a note: a
new world size or digest version is a reason to re-record, not to refuse) -> copy the new run
next to the golden and swap the two directories with renames (a crash leaves either the old
or the new golden, never a half-copied one) -> ``GoldenUpdate``.

It refuses to replace a path that exists but is not a detfp run (a mistyped path must not
delete someone's directory), and a golden that is the new run itself.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from detfp_analyze.bisect import bisect
from detfp_analyze.bisect.result import BisectResult
from detfp_analyze.errors import IncomparableError, NotARunError, SelectionError, TraceError
from detfp_analyze.io.reader import open_run

__all__ = ["GoldenUpdate", "update_golden"]


@dataclass(frozen=True)
class GoldenUpdate:
    """What ``update_golden`` found and did."""

    #: The golden and the new run as the user named them.
    golden: str
    new: str
    #: "created" (there was no golden), "replaced", or "dry run" (nothing written).
    action: str
    #: bisect of the old golden (A) against the new run (B); None when there was no golden or
    #: the two cannot be compared bit for bit.
    change: BisectResult | None
    #: Why they cannot be compared (world size, layout, digest version), else None.
    incomparable: str | None = None

    def to_json_dict(self) -> dict[str, Any]:
        """``golden update --json``: {golden, new, action, incomparable, bisect}."""
        return {
            "golden": self.golden,
            "new": self.new,
            "action": self.action,
            "incomparable": self.incomparable,
            "bisect": None if self.change is None else self.change.to_json_dict(),
        }


def update_golden(
    golden: str | os.PathLike[str],
    new: str | os.PathLike[str],
    *,
    level: str = "op",
    ignore_env: Sequence[str] = (),
    allow_missing_ranks: bool = False,
    dry_run: bool = False,
) -> GoldenUpdate:
    """Compare the golden run at ``golden`` with ``new``, then make ``golden`` a copy of ``new``.

    ``level``/``ignore_env``: as for ``bisect``. ``dry_run``: compare only. Raises TraceError
    subclasses for an unusable new run or a golden path that holds something else.
    """
    gpath, npath = Path(golden), Path(new)
    new_run = open_run(str(new), allow_missing_ranks=allow_missing_ranks)
    if gpath.exists() and gpath.resolve() == npath.resolve():
        raise SelectionError(
            f"{golden}: the golden and the new run are the same directory; record the new run elsewhere"
        )
    old = None
    if gpath.is_dir() and not any(gpath.iterdir()):
        pass  # an empty directory (a CI step's mkdir -p): no golden yet
    elif gpath.exists():
        try:
            old = open_run(str(golden), allow_missing_ranks=True)
        except TraceError as exc:
            raise NotARunError(
                f"{golden}: exists but is not a readable detfp run ({' '.join(str(exc).split())}); "
                "refusing to replace it: remove it yourself or choose another golden path"
            ) from None
    change, why = None, None
    if old is not None:
        try:
            change = bisect(old, new_run, level=level, ignore_env=ignore_env)
        except IncomparableError as exc:
            why = " ".join(str(exc).split())
    if dry_run:
        return GoldenUpdate(str(golden), str(new), "dry run", change, why)
    _swap_in(npath, gpath)
    return GoldenUpdate(str(golden), str(new), "replaced" if old is not None else "created", change, why)


def _swap_in(new: Path, golden: Path) -> None:
    """Copy ``new`` beside ``golden``, then rename it into place (the old golden is removed last)."""
    parent = golden.resolve().parent
    parent.mkdir(parents=True, exist_ok=True)
    staged = parent / f".{golden.name}.new-{os.getpid()}"
    retired = parent / f".{golden.name}.old-{os.getpid()}"
    try:
        shutil.rmtree(staged, ignore_errors=True)
        shutil.copytree(new, staged)
        if golden.exists():
            golden.rename(retired)
        staged.rename(golden)
    except OSError as exc:
        if retired.exists() and not golden.exists():
            retired.rename(golden)  # put the old golden back
        shutil.rmtree(staged, ignore_errors=True)
        raise TraceError(
            f"{golden}: could not replace it with {new} ({exc.strerror or exc}); the golden is unchanged"
        ) from exc
    shutil.rmtree(retired, ignore_errors=True)
