"""Names in a run directory: which entries readers see, the ``rank=R`` partitions, the shard
file names the capture gives, and how a hostile name is shown in a one-line message.

Every reader of a run (manifests, shards, the run index) lists directories through these rules,
so they all skip and refuse the same names.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

from detfp_analyze.errors import ShardError
from detfp_analyze.io.store import Location, name_of

__all__ = ["SHARD_NAME", "partition_rank", "partitions", "shown_name", "visible"]

#: A shard file name as the capture writes it (``contract.shard_name``): segment, then flush window.
SHARD_NAME = re.compile(r"part-s(\d{5,})-w(\d{7,})\.parquet")


def shown_name(name: str) -> str:
    """A file name as it may appear in a one-line message: control characters and bytes that
    are not UTF-8 are escaped, so a hostile name cannot break the line or drive a terminal."""
    if name.isascii() and name.isprintable():  # the common case, unchanged: no C0 control, no DEL
        return name
    out = []
    for ch in name:
        code = ord(ch)
        if 0xDC80 <= code <= 0xDCFF:  # a byte os.listdir could not decode (surrogateescape)
            out.append(f"\\x{code - 0xDC00:02x}")
        elif code < 0x20 or 0x7F <= code < 0xA0 or 0xD800 <= code <= 0xDFFF:
            out.append(f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")
        else:
            out.append(ch)
    return "".join(out)


def partition_rank(name: str, where: str) -> int | None:
    """Rank of a ``rank=R`` directory name; None for names that are not partitions at all.

    A ``rank=`` name that is not a plain decimal (``rank=abc``, ``rank=01``, ``rank=-1``) is a
    ShardError: silently skipping it would hide a rank's data.
    """
    if not name.startswith("rank="):
        return None
    digits = name[len("rank=") :]
    if not (digits.isascii() and digits.isdigit()) or str(int(digits)) != digits:
        raise ShardError(
            f"{where}/{shown_name(name)}: partition name is not rank=<decimal rank> (no sign, no padding); "
            "rename or delete the directory"
        )
    return int(digits)


def partitions(entries: Iterable[Location], where: str) -> Iterator[tuple[int, Location, str]]:
    """(rank, location, name) of the ``rank=R`` partitions among a directory's ``entries``, in
    their order: hidden names (``visible``) and names that are not partitions are skipped, a bad
    ``rank=`` name is ``partition_rank``'s ShardError (``where``: the directory as shown)."""
    for loc in entries:
        name = name_of(loc)
        if visible(name) and (rank := partition_rank(name, where)) is not None:
            yield rank, loc, name


def visible(name: str) -> bool:
    """Readers skip writer temporaries (dot-prefixed) and Spark/Hadoop markers (underscore-prefixed)."""
    return not name.startswith((".", "_"))
