"""The run index: what ``open_run`` reads from manifests and commit logs, stored once, verified on use.

Opening a run parses every manifest (JSON holding every group's members) and every commit log
(a JSON line per window, the step folds of each step): per rank, in Python, tens of
microseconds per rank-step. The index keeps the outcome of exactly that parse
(``manifests.read_manifests``, ``completeness.read_logs``, ``stepsums.from_logs``): ``build``
runs them, ``write`` stores the result, ``load`` hands the same values back. Layout
(``INDEX_VERSION``; docs/trace-format.md §5b), in ``<run>/_detfp_index/`` (ignored by readers
like every underscore name) or, for a run that cannot be written, in the user cache directory:

* ``index.json``: the version, every manifest and commit log by path, size and digest of its
  bytes (``_digest``); each manifest as its key order and, per key, the id of a distinct value
  (values deduplicated by their JSON text: thousands of ranks share their groups, versions,
  settings, so each distinct value is parsed once); each commit log's facts but the folds and
  the shard facts;
* ``folds.arrow``: the step folds as one Arrow IPC table (rank, segment, step, SUM_FIELDS), the
  frame ``stepsums`` searches with polars;
* ``shards.arrow``: the shards the commit lines state (``completeness.committed_shards``), one
  row each: columns, not a JSON object per shard (a seed-scale run states hundreds of thousands);
* ``index.seal``: SHA-256 over the three files above (``_seal``), checked before any is parsed.

``load`` trusts an index only when its seal matches its three files, the run's manifest directory
lists exactly the indexed files, and every one of them has the indexed size and digest (a damaged, stale, partial or foreign
index, or one of another version, is None: the caller parses the files as without one). The
bytes are read and hashed, never parsed, so an index is as good as the files it was built from;
what the files then mean is judged exactly as without an index. ``open_run(..., use_index=False)``
(``bisect --no-index``) ignores every index (benchmarks, tests of the path without one).
"""

from __future__ import annotations

import hashlib
import io
import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from detfp_analyze.errors import DetfpError
from detfp_analyze.io.footers import CommittedShard, partitions, visible
from detfp_analyze.io.store import Location, Store, open_regular
from detfp_format import commitlog, contract, strictjson

__all__ = [
    "INDEX_DIR",
    "INDEX_VERSION",
    "Indexed",
    "Written",
    "build",
    "cache_dir",
    "index_run",
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
    #: (rank, segment) -> its commit log's facts without the folds and the shard facts, or None
    #: (``completeness.read_logs``; the shard facts are in ``committed``).
    logs: dict[tuple[int, int], commitlog.LogState | None]
    #: The step folds (``stepsums.Folds``).
    folds: Any
    #: The shards the commit lines state (``completeness.committed_shards`` of the parsed logs).
    committed: dict[tuple[str, int, str], CommittedShard]


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
    from detfp_analyze.io.manifests import _listdir

    out: dict[str, Path] = {}
    mroot = root / contract.MANIFEST_DIR
    shown = f"{label}/{contract.MANIFEST_DIR}"
    for _, rdir, rname in partitions(_listdir(st, mroot, shown), shown):
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


#: Threads reading and hashing files (``_digests``, the seal).
_HASHERS = 4


def build(st: Store, root: Path, label: str) -> tuple[Indexed, dict[str, Any], tuple[Any, Any]] | None:
    """Parse the run's manifests and commit logs as ``open_run`` does, and the index of them:
    (the values, ``index.json``'s document, the folds and shards tables); None when a commit log cannot be
    read (its error is ``open_run``'s to raise). Raises the manifests' typed errors."""
    from detfp_analyze.io import completeness, stepsums
    from detfp_analyze.io.manifests import read_manifests

    found = read_manifests(st, root, label)  # first: its errors name what is wrong with the run
    files_before = _files(st, root, label)
    rels = sorted(files_before)
    sums = _digests([files_before[r] for r in rels])
    manifests = {r: tuple(found[r][s] for s in sorted(found[r])) for r in sorted(found)}
    logs = completeness.read_logs(st, root, label, manifests)
    if any(isinstance(v, Exception) for v in logs.values()):
        return None
    folds = stepsums.from_logs(manifests, logs)
    # A commit log appended to while it was read (a capture still running): no index of a moving target.
    if any(s is None for s in sums) or _files(st, root, label) != files_before:
        return None
    if _digests([files_before[r] for r in rels]) != sums:
        return None
    values: dict[str, int] = {}
    doc_manifests = []
    for r in sorted(found):
        for s in sorted(found[r]):
            m = found[r][s]
            keys = []
            for k, v in m.items():
                text = strictjson.dumps(v, ensure_ascii=False, separators=(",", ":"))
                keys.append([k, values.setdefault(text, len(values))])
            doc_manifests.append([r, s, keys])
    # No Exception is left among the logs: a failed read returned above.
    doc_logs = [
        [r, s, None if log is None else _log_doc(cast(commitlog.LogState, log))] for (r, s), log in sorted(logs.items())
    ]
    doc = {
        "version": INDEX_VERSION,
        "files": [[rel, size, digest] for rel, (size, digest) in zip(rels, sums, strict=True)],  # type: ignore[misc]
        "values": list(values),
        "manifests": doc_manifests,
        "logs": doc_logs,
        "folds_usable": sorted(folds.usable),
    }
    stripped = {k: (None if v is None else _strip(v)) for k, v in logs.items()}  # type: ignore[arg-type]
    committed = dict(completeness.committed_shards(manifests, logs))
    return Indexed(found, stripped, folds, committed), doc, (folds.frame, _shards_frame(committed))


def _shards_frame(committed: Mapping[tuple[str, int, str], CommittedShard]) -> Any:
    """``shards.arrow``'s table: one row per committed shard, in key order."""
    import polars as pl

    rows = [(*key, *fact) for key, fact in sorted(committed.items())]
    return pl.DataFrame(rows, schema=_shard_schema(), orient="row")


def _shard_schema() -> dict[str, Any]:
    """``shards.arrow``'s polars schema: the names are text, every other column int64."""
    import polars as pl

    return {c: pl.String if c in ("table", "name") else pl.Int64 for c in _SHARD_COLUMNS}


def _strip(log: commitlog.LogState) -> commitlog.LogState:
    return commitlog.LogState(log.opened, log.version, log.windows, log.failure, log.close, log.bad_lines,
                              log.torn_tail, {}, {}, log.contradictions)  # fmt: skip


def _log_doc(log: commitlog.LogState) -> list:
    return [
        log.opened, log.version,
        [[w, rows, span] for w, (rows, span) in sorted(log.windows.items())],
        log.failure, log.close, log.bad_lines, log.torn_tail, log.contradictions,
    ]  # fmt: skip


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
    atomically (temporary names, then renames: the folds and shards tables (``build``'s), the
    document, then the seal over all three). Returns the directory. OSError when neither place
    can be written."""
    last: OSError | None = None
    for d in (root / INDEX_DIR, cache_dir(root)):
        try:
            d.mkdir(parents=True, exist_ok=True)
            folds, shards = (_ipc(t) for t in tables)
            main = strictjson.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
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

    from detfp_analyze.io import stepsums

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
    if dict(frame.schema) != stepsums.FOLD_SCHEMA:
        return None
    committed = _committed(pl.read_ipc(io.BytesIO(shards_bytes)), found)
    if committed is None:
        return None
    folds = stepsums.Folds(frame, frozenset((int(r), int(s)) for r, s in doc["folds_usable"]))
    return Indexed(found, logs, folds, committed)


def _committed(
    frame: Any, found: Mapping[int, Mapping[int, dict]]
) -> dict[tuple[str, int, str], CommittedShard] | None:
    """``footers.Committed`` from ``shards.arrow``'s table, of the launches whose manifest
    promises this reader's shard facts (as ``completeness.committed_shards``); None: not the
    table ``build`` writes. Built from whole columns (a tuple per shard, no object)."""
    import polars as pl

    if dict(frame.schema) != _shard_schema() or tuple(frame.columns) != _SHARD_COLUMNS:
        return None
    other = [(r, s) for r, ms in found.items() for s, m in ms.items()
             if m.get("shard_facts") != commitlog.SHARD_FACTS_VERSION]  # fmt: skip
    if other:
        drop = pl.DataFrame(other, schema={"rank": pl.Int64, "segment": pl.Int64}, orient="row")
        frame = frame.join(drop, on=["rank", "segment"], how="anti", maintain_order="left")
    cols = [frame[c].to_list() for c in _SHARD_COLUMNS]
    return dict(zip(zip(*cols[:3], strict=True), zip(*cols[3:], strict=True), strict=True))


@dataclass(frozen=True)
class Written:
    """What ``index_run`` did."""

    #: The directory the index was written to (beside the run, or in the user cache).
    path: Path
    #: Manifests and commit logs indexed.
    files: int
    #: Distinct manifest values stored (each parsed once when the index is read).
    values: int
    #: Rows of step folds.
    folds: int


def index_run(path: str | os.PathLike[str], *, check: bool = False) -> Written | None:
    """Build the run index of a local run and store it (``write``); with ``check``, only say
    whether a current one exists (None: none, or a stale or damaged one). Raises the typed
    errors ``open_run`` raises for the run's manifests and commit logs (NotARunError,
    ManifestError, SchemaVersionError, ...), and NotARunError for a remote run or one whose
    index can be written nowhere."""
    from detfp_analyze.errors import NotARunError
    from detfp_analyze.io.footers import shown_name
    from detfp_analyze.io.manifests import FIX_RUN
    from detfp_analyze.io.store import store

    label = shown_name(os.fspath(path))
    st = store(path, label, None)
    root = st.root
    if not st.local or not isinstance(root, Path):
        raise NotARunError(f"{label}: a run index is built for local runs only; copy the run to a local directory")
    if not root.is_dir():
        raise NotARunError(f"{label}: no such directory; {FIX_RUN}")
    root = root.resolve()
    if check:
        d = locate(root)
        got = load(st, root, label) if d is not None else None
        return None if got is None or d is None else Written(d, 0, 0, got.folds.frame.height)
    built = build(st, root, label)
    if built is None:
        from detfp_analyze.io import completeness
        from detfp_analyze.io.manifests import read_manifests

        found = read_manifests(st, root, label)
        manifests = {r: tuple(found[r][s] for s in sorted(found[r])) for r in sorted(found)}
        for err in completeness.read_logs(st, root, label, manifests).values():
            if isinstance(err, Exception):
                raise err
        raise NotARunError(
            f"{label}: the run changed while it was indexed; run detfp-analyze index again once it is written"
        )
    _, doc, tables = built
    try:
        where = write(root, doc, tables)
    except OSError as exc:
        raise NotARunError(
            f"{label}: the index can be written neither beside the run nor in {cache_dir(root)} "
            f"({type(exc).__name__}); set XDG_CACHE_HOME to a writable directory"
        ) from None
    return Written(where, len(doc["files"]), len(doc["values"]), tables[0].height)
