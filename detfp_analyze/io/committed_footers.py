"""Footers of committed shards, checked on first read (the reader's side of ``commitlog.ShardFact``).

``shard_scan.scan_shards`` takes a shard whose commit line states its size, steps and footer CRC-32
from that line when the sizes agree, without parsing its footer. ``FooterChecks.verify`` (called
by ``Run.scan`` and ``Run.files`` with the shards they are about to hand out) reads each such
shard's footer bytes once and compares their CRC-32 with the committed one; then, whatever the
checksum says (a matching checksum only says the footer is the one the writer committed, not that
the writer wrote this contract: a shard of another table committed in its place), the footer
against the contract and the commit: its row count (``footer_head``, no parse), its schema version,
and its schema, checked once per distinct schema with polars (``_contract_schema``). A bisect of
committed runs so loads no pyarrow. Anything wrong, and a footer that differs from its commit, goes
through ``footer_contract``'s full checks (pyarrow), so a damaged shard gives the same one-line error as
when every footer was parsed at open; one that passes them all the same is refused with its own
message (other rows than committed, or not the committed footer).
"""

from __future__ import annotations

import io
import os
import threading
import zlib
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from detfp_analyze.errors import DetfpError, ShardError
from detfp_analyze.io.footer_bytes import FOOTER_CHUNK, footer_bytes, parse_footer, read_footer
from detfp_analyze.io.footer_contract import FIX_SHARD, FooterValidator
from detfp_analyze.io.footer_head import head, stated_versions
from detfp_analyze.io.shard_info import ShardInfo
from detfp_analyze.io.store import Location, Store
from detfp_format import contract
from detfp_format.types import polars_type

__all__ = ["FooterChecks"]


class FooterChecks:
    """Which committed shards of one opened run have had their footer checked (``verify``).

    A shard that ``scan_shards`` took from its commit line (``ShardInfo.footer_crc32``) is
    checked once, before the first read that selects it: the CRC-32 of its footer bytes against
    the committed one, the footer against the contract, its rows and steps against the commit.
    Thread-safe (the walk reads in a background thread).
    """

    def __init__(self, st: Store | None = None) -> None:
        #: The run's store (None: the local file system).
        self.st = st
        self._done: set[Location] = set()
        #: (table, schema bytes) -> whether that schema is the contract's (``_schema_ok``).
        self._schemas: dict[tuple[str, bytes], bool] = {}
        self._lock = threading.Lock()

    def verify(self, shards: Iterable[ShardInfo]) -> None:
        """Raise the one-line ShardError (or SchemaVersionError) of the first of ``shards`` whose
        footer is not the one its commit line recorded, breaks the contract, or holds other rows
        or steps than committed; shards validated at open pass."""
        with self._lock:
            todo = [s for s in shards if s.footer_crc32 is not None and s.path not in self._done]
        if not todo:
            return
        if len(todo) > FOOTER_CHUNK:
            # In chunks, as in scan_shards (ThreadPoolExecutor.map ignores its chunksize); one
            # validator (its cache of distinct schemas) per chunk: no state shared across threads.
            parts = [todo[i : i + FOOTER_CHUNK] for i in range(0, len(todo), FOOTER_CHUNK)]
            with ThreadPoolExecutor(max_workers=min(8, (os.cpu_count() or 2) * 2)) as pool:
                found = [e for part in pool.map(self._check_all, parts) for e in part]
        else:
            found = self._check_all(todo)
        for problem in found:
            if problem is not None:
                raise problem  # the first in the order asked: the same error whatever the threads did
        with self._lock:
            self._done.update(s.path for s in todo)

    def _check_all(self, shards: list[ShardInfo]) -> list[DetfpError | None]:
        check = FooterValidator()
        out: list[DetfpError | None] = []
        for s in shards:
            try:
                self._check(s, check)
                out.append(None)
            except DetfpError as exc:
                out.append(exc)
        return out

    def _check(self, s: ShardInfo, check: FooterValidator) -> None:
        shown = s.shown or str(s.path)
        try:
            end = footer_bytes(self.st, s.path)
        except DetfpError:  # a remote file system failing: its own one-line error
            raise
        except OSError:
            end = None
        if end is None or isinstance(end, str) or zlib.crc32(end) != s.footer_crc32:
            self._refuse(s, check)
        assert isinstance(end, bytes)
        got = head(end)
        versions = stated_versions(end, contract.SCHEMA_VERSION_KEY)
        if (
            got is not None
            and got.num_rows == s.num_rows
            and versions <= {str(contract.SCHEMA_VERSION)}
            and self._schema_ok(s.table, got.schema, end)
        ):
            return
        # Something is wrong: the footer parsed in full says what (the same message as at open).
        info = check.info(s.table, s.rank, s.path, shown, _parsed(end))
        if info.num_rows != s.num_rows:
            raise ShardError(
                f"{shown}: holds {info.num_rows} row(s), its commit line says {s.num_rows}: the shard or its "
                f"commit line was rewritten after the window was committed; {FIX_SHARD}"
            )
        raise ShardError(f"{shown}: its footer does not describe a {s.table} shard of this contract; {FIX_SHARD}")

    def _schema_ok(self, table: str, schema: bytes, end: bytes) -> bool:
        """Whether a footer's schema (its bytes: ``footer_head``) is the contract's for ``table``,
        and its schema version this reader's: read once per distinct schema, with polars."""
        key = (table, schema)
        with self._lock:
            known = self._schemas.get(key)
        if known is None:
            known = _contract_schema(table, end)
            with self._lock:
                self._schemas[key] = known
        return known

    def _refuse(self, s: ShardInfo, check: FooterValidator) -> None:
        """The error of a committed shard whose footer bytes differ from its commit: the footer
        checks of ``scan_shards`` (the same message as when it is parsed at open), else its own."""
        shown = s.shown or str(s.path)
        check.info(s.table, s.rank, s.path, shown, read_footer(self.st, s.path))
        raise ShardError(
            f"{shown}: its footer is not the one its commit line recorded (checksum differs): the shard was "
            f"rewritten or damaged after its window was committed; {FIX_SHARD}"
        )


def _parsed(end: bytes) -> Any:
    """The footer parsed by pyarrow (``footer_bytes.parse_footer``), or why it cannot be."""
    try:
        return parse_footer(end)
    except Exception as exc:  # the committed bytes themselves are not a footer pyarrow reads
        return " ".join(str(exc).split())[:160] or type(exc).__name__


def _contract_schema(table: str, end: bytes) -> bool:
    """Whether the footer ``end`` states this reader's schema version (or none) and holds every
    column of ``table`` with the contract's type (polars reads the schema from the footer bytes:
    no pyarrow, which a bisect of committed runs does not load)."""
    import polars as pl

    buf = b"PAR1" + end
    try:
        version = pl.read_parquet_metadata(io.BytesIO(buf)).get(contract.SCHEMA_VERSION_KEY)
        schema = pl.read_parquet_schema(io.BytesIO(buf))
    except Exception:  # polars cannot read it: the full parse says why
        return False
    if version is not None and version != str(contract.SCHEMA_VERSION):
        return False
    return all(schema.get(c.name) == polars_type(c.type) for c in contract.columns(table))
