"""The run index: the reader's cache of what it parsed from a run's manifests and commit logs.

Opening a run parses every manifest (JSON holding every group's members) and every commit log
(a JSON line per window, the step folds of each step): per rank, in Python, tens of
microseconds per rank-step. ``reader.open_run`` is the only caller: it consults the index first
(``load``) and, when there is none or it is stale, parses the files and fills it (``fill``) with
exactly what it parsed (``Indexed``: the manifests, the commit logs, the step folds and the
shards the commit lines state), keyed by the digests of the bytes it parsed (``Hashing``, the
store it reads them through). ``detfp-analyze index`` (``reader.index_run``) pre-warms it.
Layout (``INDEX_VERSION``; docs/trace-format.md §5b), in ``<run>/_detfp_index/`` (ignored by
readers like every underscore name) or, for a run that cannot be written, in the user cache
directory:

* ``index.json``: the version, every manifest and commit log by path, size and digest of its
  bytes (``_digest``); each manifest as its key order and, per key, the id of a distinct value
  (values deduplicated by their JSON text: thousands of ranks share their groups, versions,
  settings, so each distinct value is parsed once); each commit log's facts but the folds and
  the shard facts;
* ``folds.arrow``: the step folds as one Arrow IPC table (rank, segment, step, SUM_FIELDS), the
  frame ``stepsums`` searches with polars;
* ``shards.arrow``: the shards the commit lines state (``commit_logs.committed_shards``), one
  row each: columns, not a JSON object per shard (a seed-scale run states hundreds of thousands);
* ``index.seal``: SHA-256 over the three files above (``_seal``), checked before any is parsed.

``load`` trusts an index only when its seal matches its three files, the run's manifest directory
lists exactly the indexed files, and every one of them has the indexed size and digest (a damaged, stale, partial or foreign
index, or one of another version, is None: the caller parses the files as without one). The
bytes are read and hashed, never parsed, so an index is as good as the files it was built from;
what the files then mean is judged exactly as without an index. ``open_run(..., use_index=False)``
(``bisect --no-index``) neither reads nor fills it (benchmarks, tests of the path without one).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from detfp_analyze.errors import DetfpError
from detfp_analyze.io.commit_logs import Logs
from detfp_analyze.io.manifests import MAX_MANIFEST_BYTES, list_dir
from detfp_analyze.io.names import partitions, visible
from detfp_analyze.io.shard_info import CommittedShard
from detfp_analyze.io.stepsums import FOLD_SCHEMA, Folds
from detfp_analyze.io.store import Location, Store, open_regular
from detfp_format import commitlog, contract, strictjson

__all__ = [
    "INDEX_DIR",
    "INDEX_VERSION",
    "Hashing",
    "Indexed",
    "Written",
    "cache_dir",
    "fill",
    "load",
    "locate",
    "write",
]

#: Version of the index layout; an index of another version is rebuilt, never read. (2: the
#: seal; 3: the shard facts in ``shards.arrow``, SHA-256 file digests; 4: a window line whose
#: step folds do not count its rows is unreadable, ``commitlog.LogState.contradictions``.)
INDEX_VERSION = 4
#: The index's directory inside a run (underscore: every reader of the run skips it).
INDEX_DIR = "_detfp_index"
_MAIN, _FOLDS, _SHARDS, _SEAL = "index.json", "folds.arrow", "shards.arrow", "index.seal"
#: ``shards.arrow``'s columns: the key of ``footers.Committed`` then its ``CommittedShard``.
_SHARD_COLUMNS = ("table", "rank", "name", "rows", "size", "step_min", "step_max", "footer_crc32", "segment", "window")
#: Domain of the seal's hash (``_seal``): a digest of these bytes is no other file's digest.
_SEAL_DOMAIN = b"detfp-run-index-seal\0"


@dataclass(frozen=True)
class Indexed:
    """What an index holds: the values ``open_run`` would parse from the files."""

    #: rank -> segment -> manifest (``manifests.read_manifests``).
    manifests: dict[int, dict[int, dict]]
    #: (rank, segment) -> its commit log, or None (``commit_logs.read_logs``; loaded from the
    #: index: without the folds and the shard facts, which are in ``folds`` and ``committed``).
    logs: Logs
    #: The step folds (``stepsums.from_logs``).
    folds: Folds
    #: The shards the commit lines state (``commit_logs.committed_shards`` of the parsed logs).
    committed: Mapping[tuple[str, int, str], CommittedShard]


def _digest(data: bytes) -> str:
    """A file's digest in the index: the first 128 bits of its SHA-256 (hex). SHA-256 rather
    than BLAKE2b since index version 3: the CPU's SHA instructions hash the 232 MB of a seed-scale
    run's commit logs 1.4x faster."""
    return hashlib.sha256(data).hexdigest()[:32]


def _seal(main: bytes, folds: bytes, shards: bytes) -> str:
    """The seal over the index's own three files: SHA-256 of their lengths and bytes. The files'
    digests in ``index.json`` say the run's files are the indexed ones; the seal says the index
    holds what was written (a value changed inside ``index.json`` or a damaged ``folds.arrow``
    that still parses would otherwise be trusted). SHA-256: the CPU's SHA instructions make it
    the cheapest strong hash of the ~140 MB a seed-scale index holds."""
    h = hashlib.sha256(_SEAL_DOMAIN)
    h.update(len(main).to_bytes(8, "little"))
    h.update(main)
    h.update(len(folds).to_bytes(8, "little"))
    h.update(folds)
    h.update(shards)
    return h.hexdigest()


def _files(st: Store, root: Path, label: str) -> dict[str, Path]:
    """Relative path -> file of every manifest and commit log of the run (a listing, no read)."""
    out: dict[str, Path] = {}
    mroot = root / contract.MANIFEST_DIR
    shown = f"{label}/{contract.MANIFEST_DIR}"
    for _, rdir, rname in partitions(list_dir(st, mroot, shown), shown):
        if not isinstance(rdir, Path) or not rdir.is_dir():
            continue
        for f in os.scandir(rdir):
            if visible(f.name) and f.name.startswith("segment-") and f.name.endswith((".json", ".commits")):
                out[f"{contract.MANIFEST_DIR}/{rname}/{f.name}"] = Path(f.path)
    return out


def _digests(paths: list[Path], pool: ThreadPoolExecutor | None = None) -> list[tuple[int, str] | None]:
    """(size, digest) of each file (None: unreadable): read and hashed in threads (both release
    the GIL), ``pool``'s when given."""

    def one(p: Path) -> tuple[int, str] | None:
        try:
            data = _read(p)
        except OSError:
            return None
        return None if data is None else (len(data), _digest(data))

    # In chunks of 64 files per task: ThreadPoolExecutor.map ignores its chunksize, and a task
    # (a future, a lock, a wake-up) per file cost as much as hashing a small one.
    parts = [paths[i : i + 64] for i in range(0, len(paths), 64)]
    if pool is None:
        with ThreadPoolExecutor(max_workers=_HASHERS) as own:
            return _digests(paths, own)
    return [got for part in pool.map(lambda ps: [one(p) for p in ps], parts) for got in part]


def _read(p: Path) -> bytes | None:
    """A regular file's bytes (``store.open_regular``: a pipe or a device is None, never waited on)."""
    f = open_regular(p)
    if f is None:
        return None
    with f:
        return f.read()


#: The largest unparsed file ``fill`` hashes: as large as a manifest or commit log may be.
_MAX_UNREAD = max(commitlog.COMMIT_LOG_MAX_BYTES, MAX_MANIFEST_BYTES)


def _size(p: Path) -> int:
    """A file's size (links followed); an unreadable one counts as too large."""
    try:
        return os.stat(p).st_size
    except (OSError, ValueError):
        return _MAX_UNREAD + 1


#: Threads reading and hashing files (``_digests``, the seal).
_HASHERS = 4


@dataclass(frozen=True)
class Written:
    """What ``reader.index_run`` did."""

    #: The directory the index was written to (beside the run, or in the user cache).
    path: Path
    #: Manifests and commit logs indexed.
    files: int
    #: Distinct manifest values stored (each parsed once when the index is read).
    values: int
    #: Rows of step folds.
    folds: int


class Hashing(Store):
    """A local run's store that keeps the size and digest of every file it reads whole (the
    manifests and commit logs the reader parses), by its path relative to the run: the index
    ``fill`` writes names exactly the bytes that were parsed, so a file appended to while it was
    read (a capture still running) is stale on the next ``load``, never trusted."""

    def __init__(self, st: Store) -> None:
        super().__init__(st.root, st.label)
        #: ``manifest/rank=R/<file>`` -> (size, digest) of the bytes read.
        self.hashed: dict[str, tuple[int, str]] = {}

    def read_limited(self, loc: Location, limit: int) -> bytes | None:
        data = super().read_limited(loc, limit)
        if data is not None and isinstance(loc, Path) and len(data) <= limit:
            self.hashed["/".join(loc.parts[-3:])] = (len(data), _digest(data))
        return data


def fill(st: Hashing, root: Path, label: str, values: Indexed) -> Written | None:
    """Store the index of ``values``, what the reader parsed from the files ``st`` read: beside
    the run, else in the cache directory (``write``); what was written. None when the run's manifest directory no
    longer lists what was parsed (a capture still writing: no index of a moving target). OSError
    when the index can be written nowhere."""
    on_disk = _files(st, root, label)
    rels = sorted(on_disk)
    if not set(st.hashed) <= set(on_disk):
        return None
    # A listed file the reader did not parse (a commit log without a manifest) is hashed here,
    # unless it is larger than any file the reader parses: a hostile run is not read whole for a cache.
    unread = [r for r in rels if r not in st.hashed]
    if any(_size(on_disk[r]) > _MAX_UNREAD for r in unread):
        return None
    sums = dict(st.hashed)
    for rel, got in zip(unread, _digests([on_disk[r] for r in unread]), strict=True):
        if got is None:
            return None
        sums[rel] = got
    values_ids: dict[str, int] = {}
    doc_manifests = []
    found = values.manifests
    try:
        for r in sorted(found):
            for s in sorted(found[r]):
                keys = []
                for k, v in found[r][s].items():
                    keys.append([k, values_ids.setdefault(_text(v), len(values_ids))])
                doc_manifests.append([r, s, keys])
    except ValueError:
        return None  # a number past the double range (parsed as infinity): no JSON text states it
    logs = values.logs
    if any(isinstance(v, Exception) for v in logs.values()):
        return None  # a commit log that cannot be read: its error is the reader's, nothing to cache
    doc_logs = [
        [r, s, None if log is None else _log_doc(cast(commitlog.LogState, log))] for (r, s), log in sorted(logs.items())
    ]
    doc = {
        "version": INDEX_VERSION,
        "files": [[rel, *sums[rel]] for rel in rels],
        "values": list(values_ids),
        "manifests": doc_manifests,
        "logs": doc_logs,
        "folds_usable": sorted(values.folds.usable),
    }
    where = write(root, doc, (values.folds.frame, _shards_frame(values.committed)))
    return Written(where, len(rels), len(values_ids), values.folds.frame.height)


#: A manifest value's text in ``index.json`` (its dedup key): strict JSON in C. A manifest parsed
#: by ``strictjson.loads`` holds no NaN; ``allow_nan=False`` refuses the infinity a number past
#: the double range parses to (``strictjson.dumps`` would walk every value in Python to spell it
#: as a string, which would not read back as the number: most of the cost of filling the index).
_text = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode


def _shards_frame(committed: Mapping[tuple[str, int, str], CommittedShard]) -> Any:
    """``shards.arrow``'s table: one row per committed shard, in key order."""
    import polars as pl

    rows = [(*key, *fact) for key, fact in sorted(committed.items())]
    return pl.DataFrame(rows, schema=_shard_schema(), orient="row")


def _shard_schema() -> dict[str, Any]:
    """``shards.arrow``'s polars schema: the names are text, every other column int64."""
    import polars as pl

    return {c: pl.String if c in ("table", "name") else pl.Int64 for c in _SHARD_COLUMNS}


def _log_doc(log: commitlog.LogState) -> list:
    return [
        log.opened,
        log.version,
        [[w, rows, span] for w, (rows, span) in sorted(log.windows.items())],
        log.failure,
        log.close,
        log.bad_lines,
        log.torn_tail,
        log.contradictions,
    ]


def _log_state(d: list) -> commitlog.LogState:
    """The LogState of a ``_log_doc``: without its folds and shard facts (``Indexed``)."""
    opened, version, windows, failure, close, bad, torn, contradictions = d
    wins = {w: (rows, None if span is None else (span[0], span[1])) for w, rows, span in windows}
    return commitlog.LogState(
        opened=opened,
        version=version,
        windows=wins,
        failure=None if failure is None else (failure[0], failure[1]),
        close=None if close is None else (close[0], close[1], close[2]),
        bad_lines=bad,
        torn_tail=torn,
        shards={},
        sums={},
        contradictions=[int(w) for w in contradictions],
    )


def cache_dir(root: Path) -> Path:
    """Where the index of a run that cannot be written lives: the user cache directory, by the
    run's resolved path (``$XDG_CACHE_HOME``, default ``~/.cache``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    key = hashlib.blake2b(os.fsencode(str(root.resolve())), digest_size=12).hexdigest()
    return Path(base) / "detfp" / "index" / key


def locate(root: Path) -> Path | None:
    """The directory holding the run's index (beside the run, else in the cache); None: none."""
    for d in (root / INDEX_DIR, cache_dir(root)):
        try:
            if (d / _MAIN).is_file():
                return d
        except OSError:  # an unreadable run: no index there, its own error comes from the reader
            continue
    return None


def write(root: Path, doc: Mapping[str, Any], tables: tuple[Any, Any]) -> Path:
    """Store an index beside the run, or in the cache directory when the run cannot be written;
    atomically (temporary names, then renames: the folds and shards tables (``fill``'s), the
    document, then the seal over all three). Returns the directory. OSError when neither place
    can be written."""
    last: OSError | None = None
    for d in (root / INDEX_DIR, cache_dir(root)):
        try:
            d.mkdir(parents=True, exist_ok=True)
            folds, shards = (_ipc(t) for t in tables)
            main = _text(doc).encode("utf-8")  # ints and strings only: strict JSON as it is
            # The seal is renamed last: a reader between the renames sees a seal that does not
            # match, and parses the run's files as without an index.
            seal = _seal(main, folds, shards).encode()
            for name, data in ((_FOLDS, folds), (_SHARDS, shards), (_MAIN, main), (_SEAL, seal)):
                tmp = d / f".{name}.{os.getpid()}.tmp"
                tmp.write_bytes(data)
                os.replace(tmp, d / name)
            return d
        except OSError as exc:
            last = exc
    assert last is not None
    raise last


def _ipc(frame: Any) -> bytes:
    buf = io.BytesIO()
    frame.write_ipc(buf)
    return buf.getvalue()


def load(st: Store, root: Location, label: str) -> Indexed | None:
    """The run's index when there is one and it matches the run's files exactly; else None."""
    if not isinstance(root, Path) or not st.local:
        return None
    try:
        d = locate(root)
        return None if d is None else _load(st, root, label, d)
    except (OSError, ValueError, KeyError, TypeError, IndexError, DetfpError):
        return None  # damaged or foreign: not trusted, the files are parsed instead


def _load(st: Store, root: Path, label: str, d: Path) -> Indexed | None:
    import polars as pl

    main, folds_bytes, shards_bytes, seal = (_read(d / n) for n in (_MAIN, _FOLDS, _SHARDS, _SEAL))
    if main is None or folds_bytes is None or shards_bytes is None or seal is None:
        return None  # a pipe or a device where an index file should be: never read, not trusted
    # The seal and the run's manifests and commit logs are hashed together (hashing releases the
    # GIL); nothing the index holds is used unless both agree.
    with ThreadPoolExecutor(max_workers=_HASHERS) as pool:
        sealed = pool.submit(_seal, main, folds_bytes, shards_bytes)
        on_disk = _files(st, root, label)
        rels = sorted(on_disk)
        hashed = _digests([on_disk[r] for r in rels], pool)
        if seal.decode("ascii") != sealed.result():
            return None  # damaged, partly rewritten, or of another version
    doc = strictjson.loads(main)
    if not isinstance(doc, dict) or doc.get("version") != INDEX_VERSION:
        return None
    indexed = {rel: (size, digest) for rel, size, digest in doc["files"]}
    if set(on_disk) != set(indexed):
        return None
    if any(got is None or got != tuple(indexed[r]) for r, got in zip(rels, hashed, strict=True)):
        return None
    # Every distinct value in one parse (each is the JSON text of one value: as an array, the same values).
    values = doc["values"]
    if not all(isinstance(v, str) for v in values):
        return None
    parsed = strictjson.loads("[" + ",".join(values) + "]")
    if len(parsed) != len(values):
        return None
    found: dict[int, dict[int, dict]] = {}
    for r, s, keys in doc["manifests"]:
        # Values are shared between ranks (one parse each): no reader of a manifest mutates it.
        found.setdefault(r, {})[s] = {k: parsed[i] for k, i in keys}
    logs = {(r, s): None if v is None else _log_state(v) for r, s, v in doc["logs"]}
    frame = pl.read_ipc(io.BytesIO(folds_bytes))
    if dict(frame.schema) != FOLD_SCHEMA:
        return None
    committed = _committed(pl.read_ipc(io.BytesIO(shards_bytes)), found)
    if committed is None:
        return None
    folds = Folds(frame, frozenset((int(r), int(s)) for r, s in doc["folds_usable"]))
    return Indexed(found, logs, folds, committed)


def _committed(
    frame: Any, found: Mapping[int, Mapping[int, dict]]
) -> dict[tuple[str, int, str], CommittedShard] | None:
    """``footers.Committed`` from ``shards.arrow``'s table, of the launches whose manifest
    promises this reader's shard facts (as ``commit_logs.committed_shards``); None: not the
    table ``fill`` writes. Built from whole columns (a tuple per shard, no object)."""
    import polars as pl

    if dict(frame.schema) != _shard_schema() or tuple(frame.columns) != _SHARD_COLUMNS:
        return None
    other = [
        (r, s)
        for r, ms in found.items()
        for s, m in ms.items()
        if m.get("shard_facts") != commitlog.SHARD_FACTS_VERSION
    ]
    if other:
        drop = pl.DataFrame(other, schema={"rank": pl.Int64, "segment": pl.Int64}, orient="row")
        frame = frame.join(drop, on=["rank", "segment"], how="anti", maintain_order="left")
    cols = [frame[c].to_list() for c in _SHARD_COLUMNS]
    return dict(zip(zip(*cols[:3], strict=True), zip(*cols[3:], strict=True), strict=True))
