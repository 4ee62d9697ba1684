"""Footers of committed shards, checked on first read (the reader's side of ``commitlog.ShardFact``).

``footers.scan_shards`` takes a shard whose commit line states its size, steps and footer CRC-32
from that line when the sizes agree, without parsing its footer. ``FooterChecks.verify`` (called
by ``Run.scan`` and ``Run.files`` with the shards they are about to hand out) reads each such
shard's footer bytes once and compares their CRC-32 with the committed one (one small read, no
parse). A footer that differs goes through ``footers``' checks, so a damaged shard gives the same
one-line error as when every footer was parsed at open; one that passes them all the same is
not the committed footer either, and is refused with its own message.
"""

from __future__ import annotations

import os
import threading
import zlib
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

from detfp_analyze.errors import DetfpError, ShardError
from detfp_analyze.io.footer_read import footer_bytes, read_footer
from detfp_analyze.io.footers import _FOOTER_CHUNK, FIX_SHARD, ShardInfo, _Validator
from detfp_analyze.io.store import Location, Store

__all__ = ["FooterChecks"]


class FooterChecks:
    """Which committed shards of one opened run have had their footer checked (``verify``).

    A shard that ``scan_shards`` took from its commit line (``ShardInfo.footer_crc32``) is
    checked once, before the first read that selects it: the CRC-32 of its footer bytes against
    the committed one. Thread-safe (the walk reads in a background thread).
    """

    def __init__(self, st: Store | None = None) -> None:
        #: The run's store (None: the local file system).
        self.st = st
        self._done: set[Location] = set()
        self._lock = threading.Lock()

    def verify(self, shards: Iterable[ShardInfo]) -> None:
        """Raise the one-line ShardError (or SchemaVersionError) of the first of ``shards`` whose
        footer is not the one its commit line recorded; shards validated at open pass."""
        with self._lock:
            todo = [s for s in shards if s.footer_crc32 is not None and s.path not in self._done]
        if not todo:
            return
        if len(todo) > _FOOTER_CHUNK:
            # In chunks, as in scan_shards (ThreadPoolExecutor.map ignores its chunksize).
            parts = [todo[i : i + _FOOTER_CHUNK] for i in range(0, len(todo), _FOOTER_CHUNK)]
            with ThreadPoolExecutor(max_workers=min(8, (os.cpu_count() or 2) * 2)) as pool:
                ok = [good for part in pool.map(lambda p: [self._matches(s) for s in p], parts) for good in part]
        else:
            ok = [self._matches(s) for s in todo]
        for s, good in zip(todo, ok, strict=True):
            if not good:
                self._refuse(s)
        with self._lock:
            self._done.update(s.path for s in todo)

    def _matches(self, s: ShardInfo) -> bool:
        try:
            end = footer_bytes(self.st, s.path)
        except DetfpError:  # a remote file system failing: its own one-line error
            raise
        except OSError:
            return False
        return not isinstance(end, str) and zlib.crc32(end) == s.footer_crc32

    def _refuse(self, s: ShardInfo) -> None:
        """The error of a committed shard whose footer bytes differ from its commit: the footer
        checks of ``scan_shards`` (the same message as when it is parsed at open), else its own."""
        shown = s.shown or str(s.path)
        _Validator().info(s.table, s.rank, s.path, shown, read_footer(self.st, s.path))
        raise ShardError(
            f"{shown}: its footer is not the one its commit line recorded (checksum differs): the shard was "
            f"rewritten or damaged after its window was committed; {FIX_SHARD}"
        )
