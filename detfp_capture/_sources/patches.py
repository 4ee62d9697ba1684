"""Class attributes replaced while a session is open, and the level-ops observers built on them.

``Patches`` wraps an attribute (``torch.cuda.synchronize``, ``DistributedDataParallel.forward``...)
and restores it at close, unless another session wrapped it since (then ours stays inside
theirs, and checks that its own session is still open). A replacement with a ``release`` method
(``collectives.Wrapper``) is released at close either way: a reference kept elsewhere then runs
the original and holds nothing of the session.

``unrecorded`` makes a method a framework's own work (DDP's bucket bookkeeping, a pipeline stage's
shape inference): it runs without being recorded.

Level ``ops`` also needs three things no dispatch mode sees:

* explicit synchronizations (``watch_syncs``): they end the ``nonblocking_pending`` hazard;
* the job entering autocast (``watch_autocast``): only then does the dispatch mode restore the
  autocast keys of each op (``CaptureMode._call``), a check that costs nothing until then;
* storage resizes (``watch_storage_resizes``): FSDP (and ZeRO-3) free the unsharded parameters
  with ``storage.resize_(0)`` after a module's forward and allocate them again before its
  backward. Digests still waiting for a batch over that storage are taken first (reading it
  afterwards would read freed memory), and cached digests over it are dropped.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["Patches", "unrecorded", "watch_autocast", "watch_storage_resizes", "watch_syncs"]


class Patches:
    """The attributes this session replaced: (owner, name, original, replacement)."""

    def __init__(self) -> None:
        self._done: list[tuple[Any, str, Any, Any]] = []

    def wrap(self, owner: Any, name: str, make: Callable[[Any], Any]) -> None:
        """Replace ``owner.name`` by ``make(original)`` (nothing when it does not exist)."""
        orig = getattr(owner, name, None)
        if orig is None:
            return
        new = make(orig)
        self._done.append((owner, name, orig, new))
        setattr(owner, name, new)

    def restore(self) -> None:
        for owner, name, orig, new in reversed(self._done):
            if getattr(owner, name, None) is new:  # another session may have wrapped it since
                setattr(owner, name, orig)
            # A replacement torch kept a reference to while the session was open (an op packet
            # added to a set by a module imported meanwhile: ``torch.fx.node.has_side_effect``)
            # outlives the restore; released, it calls the original and holds nothing of the
            # session (its recorder would otherwise live, and record, as long as torch does).
            release = getattr(type(new), "release", None)
            if release is not None:
                release(new)
        self._done.clear()


def watch_syncs(patches: Patches, synchronized: Callable[[], None]) -> None:
    """Call ``synchronized`` after every explicit synchronization (``torch.cuda.synchronize``,
    ``Stream.synchronize``, ``Event.synchronize``)."""

    def wrap(orig: Any) -> Any:
        def synced(*a: Any, **k: Any) -> Any:
            r = orig(*a, **k)
            synchronized()
            return r

        synced.__wrapped__ = orig  # type: ignore[attr-defined]
        return synced

    patches.wrap(torch.cuda, "synchronize", wrap)
    if hasattr(torch.cuda, "Stream"):
        patches.wrap(torch.cuda.Stream, "synchronize", wrap)
    if hasattr(torch.cuda, "Event"):
        patches.wrap(torch.cuda.Event, "synchronize", wrap)


def watch_autocast(patches: Patches, seen: Callable[[], None]) -> None:
    """Call ``seen`` when the job enters an autocast region (now, if the session was opened
    inside one)."""

    def wrap(orig: Any) -> Any:
        def enter(ctx: Any, *a: Any, **k: Any) -> Any:
            seen()
            return orig(ctx, *a, **k)

        enter.__wrapped__ = orig  # type: ignore[attr-defined]
        return enter

    patches.wrap(torch.amp.autocast_mode.autocast, "__enter__", wrap)
    if torch.is_autocast_enabled() or torch.is_autocast_enabled("cpu"):
        seen()  # the session was opened inside an autocast region


def watch_storage_resizes(patches: Patches, rec: Any) -> None:
    """Before a storage is resized, hand its data pointer to ``rec.storage_changing`` (``rec``:
    the ``Recorder``) when digests wait for a batch or are cached."""

    def wrap(orig: Any) -> Any:
        def resize_(storage: Any, *a: Any, **k: Any) -> Any:
            if not rec.busy and rec.selected and not rec.failed and rec.holds_digests:
                try:
                    ptr = storage.data_ptr()
                except Exception:  # a fake or functional storage (torch.compile tracing): no data
                    ptr = None
                if ptr:
                    with rec.guard("storage resize", busy=False):
                        rec.storage_changing(ptr)
            return orig(storage, *a, **k)

        resize_.__wrapped__ = orig  # type: ignore[attr-defined]
        return resize_

    patches.wrap(torch.UntypedStorage, "resize_", wrap)


def unrecorded(rec: Any, scope: Any) -> Callable[[Any], Any]:
    """A ``Patches.wrap`` maker: the method (or function) runs as a framework's own work, not recorded
    (``scope.bookkeeping``: the dispatch mode and the module hooks pass). It writes buffers
    unseen, so digests waiting for a batch are taken before it and cached ones dropped after it.
    ``rec``: the ``Recorder``; ``scope``: the ``Scope``."""

    def wrap(orig: Any) -> Any:
        def method(*a: Any, **k: Any) -> Any:  # a method (the object first) or a function
            if not rec.selected or rec.failed:
                return orig(*a, **k)
            rec.settle()
            scope.bookkeeping += 1
            try:
                return orig(*a, **k)
            finally:
                scope.bookkeeping -= 1
                rec.vcache.clear()

        method.__wrapped__ = orig  # type: ignore[attr-defined]
        return method

    return wrap
