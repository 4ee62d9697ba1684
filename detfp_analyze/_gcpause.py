"""The cyclic garbage collector paused while an analysis builds its bulk of objects.

Opening a seed-scale run makes hundreds of thousands of shard descriptions, paths and commit
facts, and a bisect of thousands of diverged ranks as many rows and records: none of them forms
a reference cycle, so reference counting frees them all, yet each of the collector's full passes
walks every live object again (a fifth to a quarter of the CPU time of a 2,432-rank bisect, with
nothing to collect). ``paused`` turns the collector off for the duration and back on after, only
if it was on: nested and concurrent uses leave it as the outermost found it (a pause that ends
early only lets a collection run sooner). Nothing is lost: a cycle made meanwhile is collected
by the first pass after.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["paused"]


@contextmanager
def paused() -> Iterator[None]:
    """The cyclic collector off inside the block (as it was after)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
