"""What the reader knows of one shard without reading its data: ``ShardInfo`` (from its footer
or from its commit line) and the flat form of a commit line's facts about a shard."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields

from detfp_analyze.io.store import Location
from detfp_format.commitlog import ShardFact

__all__ = ["Committed", "CommittedShard", "ShardInfo", "committed_shard", "stated_shard"]


@dataclass(frozen=True)
class ShardInfo:
    """What one shard's footer says (no data read)."""

    #: The Parquet file: an absolute local path, or a URI on the run's file system (``io.store``).
    path: Location
    #: Table the shard belongs to.
    table: str
    #: Rank of its ``rank=R`` partition (checked against the rank column statistics).
    rank: int
    #: Segment of its rows (segment column statistics; the file name when statistics are absent).
    segment: int
    #: Number of rows.
    num_rows: int
    #: Smallest and largest step in the shard; None when the footer has no statistics.
    step_min: int | None
    step_max: int | None
    #: Flush window from the file name ``part-sSSSSS-wWWWWWWW.parquet``; None for other names.
    window: int | None = None
    #: The shard's footer checksum from its commit line when the footer was not parsed at open
    #: (``committed_footers.FooterChecks`` checks it before the first read); None: validated from its footer.
    footer_crc32: int | None = None
    #: The file as one-line messages name it (set with ``footer_crc32``).
    shown: str | None = None


#: What a commit line states of one shard, flat (no object per shard: a seed-scale run holds
#: hundreds of thousands): its rows, size in bytes, first and last step, footer CRC-32
#: (``commitlog.ShardFact``), segment and window.
CommittedShard = tuple[int, int, int, int, int, int, int]
#: (table, rank, file name) -> the ``CommittedShard`` of every shard a commit line states, by the
#: name the capture gives it (``contract.shard_name``): a listed file is looked up by its name,
#: without parsing it. A file of another name is validated from its footer.
Committed = Mapping[tuple[str, int, str], CommittedShard]


def committed_shard(rows: int, fact: ShardFact, segment: int, window: int) -> CommittedShard:
    """The ``CommittedShard`` of a window's commit line's fact about one of its shards."""
    return (rows, fact.size, fact.step_min, fact.step_max, fact.footer_crc32, segment, window)


def stated_shard(
    path: Location,
    table: str,
    rank: int,
    segment: int,
    num_rows: int,
    step_min: int | None,
    step_max: int | None,
    window: int,
    footer_crc32: int,
    shown: str,
) -> ShardInfo:
    """``ShardInfo(...)`` of a shard its commit line states, built without the frozen dataclass's
    ``__init__`` (an ``object.__setattr__`` per field: a fifth of a run's opening on hundreds of
    thousands of shards); the same object: equal, hashed and printed alike."""
    info = _new(ShardInfo)
    d = info.__dict__
    d["path"], d["table"], d["rank"], d["segment"], d["num_rows"] = path, table, rank, segment, num_rows
    d["step_min"], d["step_max"], d["window"], d["footer_crc32"], d["shown"] = (
        step_min,
        step_max,
        window,
        footer_crc32,
        shown,
    )
    return info


_new = object.__new__
# stated_shard sets every field, in the dataclass's order (its repr and comparisons follow that order).
assert tuple(stated_shard(*range(10)).__dict__) == tuple(f.name for f in fields(ShardInfo))
