"""The commit log: what one rank's process launch committed, and whether it closed cleanly (stdlib only).

Completeness contract (docs/trace-format.md §5a, docs/reliability.md). Next to each manifest,
``manifest/rank=R/segment-S.commits`` is an append-only log of checksummed lines:

    <crc32 of JSON, 8 hex> <JSON object>\\n

* ``{"t": "open", "version": 1, "rank": R, "segment": S}`` first, written when the writer
  starts; the file is created with ``O_EXCL``, so two launches can never share a segment;
* ``{"t": "window", "window": W, "rows": {table: n, ...}, "steps": [lo, hi] | null,
  "shards": {table: [bytes, first step, last step, footer crc32], ...}}`` after every shard of
  flush window W is renamed into place (tables with no rows are left out; windows are numbered
  0, 1, 2, ... without gaps). ``shards`` (``SHARD_FACTS_VERSION``, manifest key
  ``shard_facts``) lets a reader trust a shard by its size and check its footer's bytes only
  when it reads the shard, instead of parsing every footer up front; lines without it (older
  writers) are read as before, and readers before it ignore it;
  ``"sums": {step: [n, errors, kx, vx, metrics, metrics hash], ...}`` (``STEP_SUMS_VERSION``,
  manifest key ``step_sums``): per step of the window, its records' rollup folded over the
  window's blocks (count, digest errors, key XOR, value XOR: ``step_sums``) and its metrics
  (count, sum of ``metric_hash`` mod 2^64). The folds combine across windows, so a reader
  decides which (rank, step)s differ from the commit logs alone and reads only those shards. A
  line whose folds do not count its ``records`` and ``metrics`` rows contradicts itself and is
  unreadable (``LogState.contradictions``);
* ``{"t": "fail", "window": W, "reason": "..."}`` when the writer stops at window W (disk full,
  file-size limit, permissions): W and every later window are lost;
* ``{"t": "close", "windows": N, "status": "ok" | "incomplete", "reason": str | null}`` last,
  once the session closed and every window was handled.

A line is one ``write`` on an ``O_APPEND`` descriptor, so a process killed mid-append leaves
at most one torn last line; its checksum (or its missing newline) marks it, and the reader
ignores it. Any unreadable line can only make a run look *less* complete (a commit that is
not read is a window that is not trusted), never more. The reader needs nothing but this
file, the manifest and the shard footers to decide what a run holds completely.
"""

from __future__ import annotations

import hashlib
import json
import os
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from itertools import chain
from typing import Any, NamedTuple

from detfp_format import strictjson

__all__ = [
    "COMMIT_LOG_MAX_BYTES",
    "COMMIT_LOG_VERSION",
    "SHARD_FACTS_VERSION",
    "STEP_SUMS_VERSION",
    "SUM_FIELDS",
    "CommitLog",
    "LogState",
    "ShardFact",
    "commit_log_relpath",
    "encode",
    "metric_hash",
    "parse",
    "shard_fact",
    "step_sums",
]

#: Version of the commit-log format; a manifest written with a commit log says so in its
#: ``commit_log`` key (absent: a legacy run written before the completeness contract).
COMMIT_LOG_VERSION = 1
#: Version of the ``shards`` field of window lines (per shard: bytes, step range, footer checksum).
#: An addition to COMMIT_LOG_VERSION 1, not a new log format: readers that predate it ignore the
#: field (and still parse every footer), so runs written with it stay readable by older releases.
#: A manifest whose launch writes the field says so under the key ``shard_facts``.
SHARD_FACTS_VERSION = 1
#: Version of the ``sums`` field of window lines (per step: the records' rollup and the metrics,
#: folded); an addition to COMMIT_LOG_VERSION 1 like SHARD_FACTS_VERSION. A manifest whose launch
#: writes the field says so under the key ``step_sums``.
STEP_SUMS_VERSION = 1
#: Readers refuse larger logs (a window line is ~150 bytes, ~300 with its shard facts, ~400 with
#: the step folds of one step: this is 160,000 to 400,000 windows).
COMMIT_LOG_MAX_BYTES = 64 << 20
#: Longer lines are unreadable (a legitimate line is a few hundred bytes; a reason is capped).
_MAX_LINE = 64 << 10
_MAX_REASON = 2000


def commit_log_relpath(rank: int, segment: int) -> str:
    """Path of one rank's commit log for one process launch, next to its manifest."""
    return f"manifest/rank={rank}/segment-{segment:05d}.commits"


def encode(record: Mapping[str, Any]) -> bytes:
    """One log line: crc32 (8 hex) of the compact, key-sorted JSON, a space, the JSON, a newline."""
    body = json.dumps(dict(record), sort_keys=True, separators=(",", ":"), allow_nan=False, ensure_ascii=True)
    data = body.encode("ascii")
    return b"%08x %s\n" % (zlib.crc32(data), data)


class ShardFact(NamedTuple):
    """What a window line commits about one of its shards (``shards`` field)."""

    #: Size of the file in bytes.
    size: int
    #: First and last step of its rows.
    step_min: int
    step_max: int
    #: CRC-32 of the file's last ``footer length + 8`` bytes: the Parquet footer, its length, the magic.
    footer_crc32: int


def shard_fact(data: bytes, step_min: int, step_max: int) -> ShardFact:
    """The fact of a Parquet file whose whole content is ``data`` (the writer has it in memory)."""
    length = int.from_bytes(data[-8:-4], "little")
    return ShardFact(len(data), step_min, step_max, zlib.crc32(data[len(data) - 8 - length :]))


#: Entries of one step's sums: records, digest errors, key XOR, value XOR, metrics, metrics hash.
SUM_FIELDS = ("n", "n_err", "kx", "vx", "m_n", "m_h")
_U64 = 1 << 64


def metric_hash(microbatch: int, name: str, occurrence: int, bits: int) -> int:
    """64-bit hash of one metric row as the bisect compares it (its key and raw bits; not its
    value text or dtype). Summed mod 2^64 per step: a sum, not a XOR, so a repeated row counts."""
    body = json.dumps([int(microbatch), str(name), int(occurrence), int(bits)], separators=(",", ":"))
    return int.from_bytes(hashlib.blake2b(body.encode(), digest_size=8).digest(), "little")


def step_sums(rollups: Mapping[str, list] | None, metrics: Mapping[str, list] | None) -> dict[str, list[int]]:
    """The ``sums`` field of one window: step (as text) -> SUM_FIELDS, from the window's rollups
    columns (``rollups.window_rollups``: one row per (step, block)) and metrics columns."""
    out: dict[int, list[int]] = {}
    if rollups:
        for s, n, e, kx, vx in zip(*(rollups[c] for c in ("step", "n", "n_err", "kx", "vx")), strict=True):
            acc = out.setdefault(int(s), [0, 0, 0, 0, 0, 0])
            acc[0] += int(n)
            acc[1] += int(e)
            acc[2] ^= int(kx)
            acc[3] ^= int(vx)
    if metrics:
        cols = (metrics[c] for c in ("step", "microbatch", "name", "occurrence", "bits"))
        for s, mb, name, occ, bits in zip(*cols, strict=True):
            acc = out.setdefault(int(s), [0, 0, 0, 0, 0, 0])
            acc[4] += 1
            acc[5] = (acc[5] + metric_hash(mb, name, occ, bits)) % _U64
    return {str(s): v for s, v in sorted(out.items())}


def _decode(line: bytes) -> dict | None:
    """The record of one complete line (without its newline), or None when it is unreadable."""
    if len(line) > _MAX_LINE or len(line) < 10 or line[8:9] != b" ":
        return None
    head, body = line[:8], line[9:]
    try:
        if int(head, 16) != zlib.crc32(body):
            return None
        rec = strictjson.loads(body)  # the writer's strict JSON: a bare NaN is damage
    except (ValueError, UnicodeDecodeError):
        return None
    return rec if isinstance(rec, dict) and isinstance(rec.get("t"), str) else None


@dataclass
class LogState:
    """What a commit log says, as parsed by ``parse`` (facts only; judging them is the reader's job)."""

    #: The open record was read (the writer started and follows COMMIT_LOG_VERSION or later).
    opened: bool = False
    #: Version from the open record (None when it was not read).
    version: int | None = None
    #: window -> (rows per table, (first step, last step) or None) for every readable commit.
    windows: dict[int, tuple[dict[str, int], tuple[int, int] | None]] = field(default_factory=dict)
    #: (window, reason) of the writer's failure record, when one was read.
    failure: tuple[int, str] | None = None
    #: The close record: (windows, status, reason); None when the session never closed.
    close: tuple[int, str, str | None] | None = None
    #: Lines that could not be read: a torn last line (killed mid-append) or damage.
    bad_lines: int = 0
    #: The last line is incomplete (no newline): the writer was stopped mid-append.
    torn_tail: bool = False
    #: window -> table -> ShardFact, for the readable window lines that carry a well-formed
    #: ``shards`` field (a malformed one is left out: those shards are checked from their footers).
    shards: dict[int, dict[str, ShardFact]] = field(default_factory=dict)
    #: window -> step -> SUM_FIELDS values, for the readable window lines that carry a
    #: well-formed ``sums`` field (a malformed one is left out: readers then read the shards).
    sums: dict[int, dict[int, tuple[int, ...]]] = field(default_factory=dict)
    #: Windows whose line was unreadable because its step folds do not count the rows it commits.
    contradictions: list[int] = field(default_factory=list)


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < (1 << 62) else None


def _record(state: LogState, rec: dict) -> bool:
    """Fold one decoded record into ``state``; False when its fields are not what the format says."""
    kind = rec["t"]
    if kind == "open":
        version = _int(rec.get("version"))
        if version is None or state.opened:  # one open line per log, the first
            return False
        state.opened, state.version = True, version
        return True
    if kind == "window":
        w, rows, steps = _int(rec.get("window")), rec.get("rows"), rec.get("steps")
        if w is None or not isinstance(rows, dict):
            return False
        counts = {str(t): _int(n) for t, n in rows.items()}
        if any(n is None for n in counts.values()):
            return False
        span = None
        if steps is not None:
            if not (isinstance(steps, list) and len(steps) == 2):
                return False
            lo, hi = _int(steps[0]), _int(steps[1])
            if lo is None or hi is None or lo > hi:
                return False
            span = (lo, hi)
        sums = _sums(rec.get("sums"), span)
        if sums is not None and not _counted(sums, counts):
            # The line contradicts itself (which half is right is unknown): not trusted at all.
            state.contradictions.append(w)
            return False
        state.windows[w] = (counts, span)  # type: ignore[assignment]
        facts = _facts(rec.get("shards"), counts)
        if facts is not None:
            state.shards[w] = facts
        elif w in state.shards:  # a later line for the same window without facts: trust neither
            del state.shards[w]
        if sums is not None:
            state.sums[w] = sums
        elif w in state.sums:
            del state.sums[w]
        return True
    if kind == "fail":
        w, reason = _int(rec.get("window")), rec.get("reason")
        if w is None or not isinstance(reason, str):
            return False
        if state.failure is None:
            state.failure = (w, reason[:_MAX_REASON])
        return True
    if kind == "close":
        n, status, reason = _int(rec.get("windows")), rec.get("status"), rec.get("reason")
        if n is None or status not in ("ok", "incomplete") or not (reason is None or isinstance(reason, str)):
            return False
        state.close = (n, status, None if reason is None else reason[:_MAX_REASON])
        return True
    return False  # an unknown record type from a newer writer: not understood, not trusted


def _facts(raw: Any, counts: Mapping[str, int | None]) -> dict[str, ShardFact] | None:
    """The ``shards`` field of a window line, or None when absent or not what the format says
    (then the reader checks those shards from their footers, as for older writers)."""
    if not isinstance(raw, dict) or set(raw) != {t for t, n in counts.items() if n}:
        return None
    out = {}
    for table, v in raw.items():
        if not (isinstance(v, list) and len(v) == 4):
            return None
        size, lo, hi, crc = (_int(x) for x in v)
        if size is None or lo is None or hi is None or crc is None or lo > hi or crc >= 1 << 32:
            return None
        out[str(table)] = ShardFact(size, lo, hi, crc)
    return out


_INT = frozenset({int})
_LIST = frozenset({list})
_N_SUMS = len(SUM_FIELDS)


def _sums(raw: Any, span: tuple[int, int] | None) -> dict[int, tuple[int, ...]] | None:
    """The ``sums`` field of a window line, or None when absent or not what the format says:
    steps within the line's step span, SUM_FIELDS non-negative integers (hashes below 2^64)."""
    if not isinstance(raw, dict) or (span is None and raw):
        return None
    if not raw:
        return {}
    assert span is not None
    # Every test over all of the line's steps at once, in C (joins, maps, min and max), not per
    # step in Python: the reader parses a log of thousands of steps per rank, on thousands of ranks.
    keys, values = list(raw), list(raw.values())
    joined = "".join(keys)  # JSON object names are strings
    if not (joined.isascii() and joined.isdigit() and min(map(len, keys)) >= 1 and max(map(len, keys)) < 20):
        return None
    steps = list(map(int, keys))
    if min(steps) < span[0] or max(steps) > span[1]:
        return None
    # type() is list / int: JSON arrays and integers are exactly those, and a bool (an int
    # subclass) is refused.
    if not (_LIST.issuperset(map(type, values)) and set(map(len, values)) == {_N_SUMS}):
        return None
    flat = list(chain.from_iterable(values))
    if not (_INT.issuperset(map(type, flat)) and min(flat) >= 0 and max(flat) < _U64):
        return None
    return dict(zip(steps, map(tuple, values), strict=True))


def _counted(sums: Mapping[int, tuple[int, ...]], counts: Mapping[str, int | None]) -> bool:
    """Whether a window line's step folds count the rows it commits: its records' (the folds are of
    the window's rollups, one row per record) and its metrics'. A line restated with other row
    counts (a buggy writer, an edit) fails, and is then not trusted at all."""
    return sum(v[0] for v in sums.values()) == (counts.get("records") or 0) and sum(
        v[4] for v in sums.values()
    ) == (counts.get("metrics") or 0)


def parse(data: bytes) -> LogState:
    """Parse a whole commit log (the caller enforces COMMIT_LOG_MAX_BYTES). Never raises."""
    state = LogState()
    lines = data.split(b"\n")
    tail = lines.pop()  # b"" when the file ends with a newline
    if tail:
        state.torn_tail = True
        state.bad_lines += 1
    for line in lines:
        rec = _decode(line)
        if rec is None or not _record(state, rec):
            state.bad_lines += 1
    return state


class CommitLog:
    """The writer's side: create the log exclusively, then append one record per ``os.write``."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        # O_EXCL: the create-only rule holds even when two launches race for one segment.
        self._fd: int | None = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
        self.path = os.fspath(path)
        #: An append failed or was short: the log may hold a torn line, later lines start fresh.
        self.damaged = False

    def append(self, record: Mapping[str, Any], *, half: Any = None) -> None:
        """Append one record; raises OSError (the caller decides what a failed append means).

        ``half``: a callable run after writing the first half of the line (fault injection only).
        """
        if self._fd is None:
            raise OSError("commit log is closed")
        line = encode(record)
        if self.damaged:
            line = b"\n" + line  # end a torn fragment, so this line stays readable on its own
        try:
            if half is not None:
                cut = len(line) // 2
                self._write_all(line[:cut])
                half()
                self._write_all(line[cut:])
            else:
                self._write_all(line)
        except BaseException:
            self.damaged = True
            raise

    def _write_all(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            n = os.write(self._fd, view)  # type: ignore[arg-type]
            if n <= 0:
                raise OSError("short write to the commit log")
            view = view[n:]

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)
