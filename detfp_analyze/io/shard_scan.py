"""Every shard of a run, listed and described for ``reader.open_run`` (metadata only, never data).

Pipeline: list ``<table>/rank=R/*.parquet`` (partition names must be ``rank=<decimal>``;
dot- and underscore-prefixed names are writer temporaries or markers and are skipped,
``names``) -> read each footer in a small thread pool (one open per file: the tail, then the
footer, parsed from memory; ``footer_bytes``) -> check it against the contract
(``footer_contract``) -> one ``ShardInfo`` per file. Every problem is a ``ShardError`` or
``SchemaVersionError`` whose one-line message names the file.

Shards whose commit line states their size, steps and footer checksum (``commitlog.ShardFact``,
``commit_logs.committed_shards``) skip the footer at open: their size is checked against the
commit (``stat``), and their ``ShardInfo`` comes from it. ``committed_footers.FooterChecks``
checks such a shard's footer bytes against the committed checksum when a read first selects it
(a few microseconds, no parse); a footer that differs is validated as above, so a damaged shard
gives the same one-line error as when every footer was parsed at open, and one that passes all
the same differs from its commit: also refused. A size that differs from the commit is refused
at open, after the footer checks.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import cast

from detfp_analyze.errors import ShardError
from detfp_analyze.io.footer_bytes import FOOTER_CHUNK, read_footer
from detfp_analyze.io.footer_contract import FIX_SHARD, FooterValidator
from detfp_analyze.io.names import SHARD_NAME, partitions, shown_name, visible
from detfp_analyze.io.shard_info import Committed, CommittedShard, ShardInfo, stated_shard
from detfp_analyze.io.store import Location, Store, name_of
from detfp_format import contract

__all__ = ["scan_shards"]


def _listdir(st: Store, path: Location, shown: str) -> list[Location]:
    """The entries of a directory by name, or a one-line ShardError naming it."""
    try:
        return st.listdir(path)
    except OSError as exc:
        raise ShardError(f"{shown}: cannot list the directory ({type(exc).__name__}); check permissions") from None


def _entries(st: Store, path: Location, shown: str) -> list[tuple[Location, str, int | None]]:
    """(entry, name, size) of a directory's visible Parquet entries by name (``_shard_like``);
    locally one listing and a ``stat`` per entry (links followed; thousands of shards per rank,
    each a Path built once); size -2 where ``_size`` must ask (a remote store)."""
    if not isinstance(path, Path):
        return [(f, n, -2) for f in _listdir(st, path, shown) if _shard_like(n := name_of(f))]
    try:
        names = sorted(filter(_shard_like, os.listdir(path)))
    except OSError as exc:
        raise ShardError(f"{shown}: cannot list the directory ({type(exc).__name__}); check permissions") from None
    out: list[tuple[Location, str, int | None]] = []
    # A child path from a name known to be one (a directory entry): pathlib's own fast route
    # (what iterdir uses), 10x cheaper than ``path / name``'s parse on hundreds of thousands of
    # shards; ``os.stat`` of a string, cheaper than a DirEntry's (the same call, links followed).
    child = getattr(path, "_make_child_relpath", path.joinpath)
    base = os.path.join(path, "")
    stat_of, regular = os.stat, stat.S_ISREG
    for name in names:
        try:
            info = stat_of(base + name)
            size = info.st_size if regular(info.st_mode) else None
        except (OSError, ValueError):
            size = None
        out.append((child(name), name, size))
    return out


def _shard_like(name: str) -> bool:
    """A visible Parquet file name: what ``scan_shards`` lists as a shard."""
    return visible(name) and name.endswith(".parquet")


def _size(st: Store, loc: Location) -> int | None:
    """The size of a regular file (links followed), None for anything else (as ``Path.is_file``);
    a remote file's from the run's one listing (-1 when the listing does not say: its footer is
    then parsed at open, committed or not)."""
    if not isinstance(loc, Path):
        if not st.is_file(loc):
            return None
        size = st.size(loc)
        return -1 if size is None else size
    try:
        info = os.stat(loc)
    except (OSError, ValueError):
        return None
    return info.st_size if stat.S_ISREG(info.st_mode) else None


def _partitions(
    st: Store, root: Location, label: str, ranks: set[int], world_size: int
) -> Iterator[tuple[str, int, Location, str]]:
    """(table, rank, directory, shown prefix) of every partition of ``ranks``, by table, then
    rank directory; a partition that is not a directory or outside the world size is refused."""
    for table in contract.TABLES:
        tdir = st.join(root, table)
        if not st.is_dir(tdir):
            continue
        for rank, rdir, rname in partitions(_listdir(st, tdir, f"{label}/{table}"), f"{label}/{table}"):
            if not st.is_dir(rdir):
                raise ShardError(
                    f"{label}/{table}/{rname}: not a directory (a file, a dangling link or a link loop); "
                    "delete it or re-run the capture"
                )
            if rank >= world_size:
                raise ShardError(
                    f"{label}/{table}/{rname}: rank {rank} is outside world size {world_size}; "
                    "delete the partition or check that it belongs to this run"
                )
            if rank in ranks:  # a rank without a manifest: tolerated (or refused) as a missing rank
                yield table, rank, rdir, f"{label}/{table}/{rname}/"


def _fact(committed: Committed | None, table: str, rank: int, path: Location) -> CommittedShard | None:
    """What a commit line states of the window a parsed shard's name names (any zero padding)."""
    if not committed:
        return None
    m = SHARD_NAME.fullmatch(name_of(path))
    return None if m is None else committed.get((table, rank, contract.shard_name(int(m.group(1)), int(m.group(2)))))


def scan_shards(
    root: Location,
    label: str,
    ranks: set[int],
    world_size: int,
    st: Store | None = None,
    committed: Committed | None = None,
) -> dict[str, tuple[ShardInfo, ...]]:
    """Every shard of ``ranks`` under ``root``, by table, sorted by (rank, name): validated from
    its footer, or, when ``committed`` states it and its size agrees, from its commit line (its
    footer is then checked on first read: ``committed_footers.FooterChecks``). ``st``: the run's store
    (default: the local file system)."""
    st = st if st is not None else Store(Path(root), str(root))
    # Hundreds of thousands of shards per run: one pass, the per-file work kept to what each
    # needs; a shard its commit line states is described on the spot, the others (their place
    # kept in their table's list) once their footers are read below, in listing order.
    by_table: dict[str, list[ShardInfo | None]] = {}
    candidates: list[tuple[list[ShardInfo | None], int, str, int, Location, str, int]] = []
    stated = (committed or {}).get
    for table, rank, rdir, prefix in _partitions(st, root, label, ranks, world_size):
        infos = by_table.setdefault(table, [])
        for path, fname, size in _entries(st, rdir, prefix[:-1]):
            shown = prefix + shown_name(fname)
            if size == -2:
                size = _size(st, path)
            if size is None:  # silently skipping it would hide a shard
                raise ShardError(
                    f"{shown}: not a regular file (a directory, a dangling link or a link loop); {FIX_SHARD}"
                )
            got = stated((table, rank, fname))
            if got is not None and got[1] == size:
                rows, _, lo, hi, crc, segment, window = got
                infos.append(
                    stated_shard(
                        path, table, rank, segment, rows, lo if rows else None, hi if rows else None, window, crc, shown
                    )
                )
            else:
                candidates.append((infos, len(infos), table, rank, path, shown, size))
                infos.append(None)
    # Footers in chunks: one pool task per file costs more in task overhead than the
    # parsing it overlaps (measured on thousands of small shards). Results are consumed in
    # candidate order as they arrive, so checking them overlaps reading the next chunks.
    step = FOOTER_CHUNK
    chunked = [[c[4] for c in candidates[j : j + step]] for j in range(0, len(candidates), step)]
    check = FooterValidator()
    with ThreadPoolExecutor(max_workers=min(8, (os.cpu_count() or 2) * 2)) as pool:
        footers = (md for part in pool.map(lambda ps: [read_footer(st, p) for p in ps], chunked) for md in part)
        for (infos, i, table, rank, path, shown, size), md in zip(candidates, footers, strict=True):
            infos[i] = info = check.info(table, rank, path, shown, md)
            got = _fact(committed, table, rank, path)
            # Other rows than committed: the completeness check's row_mismatch gap, as always.
            if (
                got is not None and 0 <= size != got[1] and info.num_rows == got[0]
            ):  # a usable footer, not the committed file
                raise ShardError(
                    f"{shown}: {size} bytes, its commit line says {got[1]}: the shard was truncated, "
                    f"rewritten or replaced after its window was committed; {FIX_SHARD}"
                )
    # Every place is filled in by now: from its commit line or its footer.
    return {t: cast(tuple[ShardInfo, ...], tuple(v)) for t, v in by_table.items() if v}
