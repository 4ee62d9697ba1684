"""Where a run's files live: the one layer every read of a run goes through (no data parsing here).

``store(path, label, fs=None)`` -> a ``Store``: a local directory (a plain path or a
``file:`` URI), any URI ``pyarrow.fs.FileSystem.from_uri`` resolves (``s3://``, ``s3a://``/``s3n://``
as pyarrow's s3, ``gs://``, ``hdfs://``), or a path inside an explicit ``pyarrow.fs.FileSystem``
(notebook users with their own credentials). The reader, the completeness check and the footer
scan ask it to list directories, read small files with a size limit, and read shard tails; the
data scans ask it for a ``pyarrow.dataset`` (remote runs only: local runs keep polars' and
DuckDB's own Parquet readers, which are faster on local files).

Locations: a local run's files are ``Path`` objects, exactly as before this layer existed (the
same system calls, in the same order, so local runs are neither slower nor report differently).
A remote run's files are URI strings spelled as the user gave the run (``s3a://b/run/records/...``:
what reports, provenance columns and Spark see); ``Store`` maps them to the file system's own paths.
A remote run is listed once, recursively (one paginated listing on an object store instead of one
request per directory), and every read of a missing, unreadable or unreachable object is an
``OSError`` the callers turn into their one-line errors; ``unreachable`` words a network or
credential failure naming the run.
"""

from __future__ import annotations

import operator
import os
import posixpath
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from detfp_analyze.errors import NotARunError
from detfp_analyze.io.uri import filesystem, is_remote, local_path, scheme

__all__ = ["Entry", "Location", "Store", "name_of", "open_regular", "store"]

#: A file or directory of a run: a ``Path`` on the local file system, a URI string elsewhere.
Location = Path | str


@dataclass(frozen=True)
class Entry:
    """One directory entry of a remote run (local runs list ``Path`` objects)."""

    #: File name (last path component).
    name: str
    #: "dir", "file" or "other".
    kind: str
    #: Size in bytes (files only; None when unknown).
    size: int | None


class Store:
    """The file system a run lives on, and its root there. Build it with ``store``."""

    def __init__(self, root: Location, label: str, fs: Any = None, fs_root: str = "") -> None:
        #: The run's root: a local Path, or the URI (query string and trailing slash removed).
        self.root = root
        #: The run as the user gave it (messages).
        self.label = label
        #: The pyarrow FileSystem of a remote run; None for a local one.
        self.fs = fs
        self._fs_root = fs_root
        self._tree: dict[str, dict[str, Entry]] | None = None

    @property
    def local(self) -> bool:
        """Whether the run is a local directory (read with the standard library, polars and DuckDB)."""
        return self.fs is None

    # ------------------------------------------------------------------ locations
    def join(self, base: Location, *names: str) -> Location:
        """``base`` / ``names``."""
        if isinstance(base, Path):
            return base.joinpath(*names)
        return "/".join((base, *names))

    def fs_path(self, loc: Location) -> str:
        """The file system's own path of a location of this run."""
        if isinstance(loc, Path):
            return str(loc)
        if loc == self.root:
            return self._fs_root
        if not loc.startswith(f"{self.root}/"):
            raise ValueError(f"{loc} is not under {self.root}")
        return self._fs_root + loc[len(str(self.root)) :]

    # ------------------------------------------------------------------ remote listing
    def _listing(self) -> dict[str, dict[str, Entry]]:
        """directory (relative to the root, "" for the root) -> name -> Entry, from one recursive listing."""
        if self._tree is None:
            from pyarrow import fs as pafs

            infos = self.fs.get_file_info(pafs.FileSelector(self._fs_root, recursive=True, allow_not_found=True))
            tree: dict[str, dict[str, Entry]] = {"": {}}
            base = self._fs_root.rstrip("/") + "/"
            for info in infos:
                if not info.path.startswith(base):
                    continue
                rel = info.path[len(base) :].strip("/")
                kind = {pafs.FileType.Directory: "dir", pafs.FileType.File: "file"}.get(info.type, "other")
                parent, _, name = rel.rpartition("/")
                tree.setdefault(parent, {})[name] = Entry(name, kind, info.size if kind == "file" else None)
                if kind == "dir":
                    tree.setdefault(rel, {})
                # Object stores have no directories: a key's prefixes are its directories.
                while parent:
                    up, _, pname = parent.rpartition("/")
                    tree.setdefault(up, {}).setdefault(pname, Entry(pname, "dir", None))
                    tree.setdefault(parent, {})
                    parent = up
            self._tree = tree
        return self._tree

    def _rel(self, loc: str) -> str:
        return "" if loc == self.root else loc[len(str(self.root)) + 1 :]

    def kind(self, loc: Location) -> str:
        """ "dir", "file", "missing" (nothing there, or a dangling link) or "other"."""
        if isinstance(loc, Path):
            return "dir" if loc.is_dir() else "file" if loc.is_file() else "missing" if not loc.exists() else "other"
        rel = self._rel(loc)
        if not rel:
            return self._root_kind()
        parent, _, name = rel.rpartition("/")
        entry = self._listing().get(parent, {}).get(name)
        return "missing" if entry is None else entry.kind

    def is_dir(self, loc: Location) -> bool:
        """Whether ``loc`` is a directory (following links, as ``Path.is_dir``)."""
        return loc.is_dir() if isinstance(loc, Path) else self.kind(loc) == "dir"

    def is_file(self, loc: Location) -> bool:
        """Whether ``loc`` is a regular file (following links, as ``Path.is_file``)."""
        return loc.is_file() if isinstance(loc, Path) else self.kind(loc) == "file"

    def _root_kind(self) -> str:
        from pyarrow import fs as pafs

        info = self.fs.get_file_info(self._fs_root)
        if info.type == pafs.FileType.NotFound:
            # An object store has no directories: a prefix with keys under it is one, else nothing is there.
            return "dir" if self._listing()[""] else "missing"
        return {pafs.FileType.Directory: "dir", pafs.FileType.File: "file"}.get(info.type, "other")

    def listdir(self, loc: Location) -> list[Location]:
        """The entries of a directory, sorted by name. OSError when it cannot be listed."""
        if isinstance(loc, Path):
            return sorted(loc.iterdir(), key=operator.attrgetter("name"))
        return [self.join(loc, name) for name in sorted(self._listing().get(self._rel(loc), {}))]

    def size(self, loc: str) -> int | None:
        """A remote file's size from the listing (None: unknown)."""
        rel = self._rel(loc)
        parent, _, name = rel.rpartition("/")
        entry = self._listing().get(parent, {}).get(name)
        return None if entry is None else entry.size

    # ------------------------------------------------------------------ reading
    def read_limited(self, loc: Location, limit: int) -> bytes | None:
        """Up to ``limit`` + 1 bytes of a file (the caller refuses more than ``limit``); None when
        it is not a regular file (``open_regular``: a pipe, a device, a directory; never opened
        so that the read could block). OSError (FileNotFoundError when absent) when it cannot be read."""
        if isinstance(loc, Path):
            f = open_regular(loc)
            if f is None:
                return None
            with f:
                return f.read(limit + 1)
        kind = self.kind(loc)
        if kind == "missing":
            raise FileNotFoundError(loc)
        if kind == "dir":
            raise IsADirectoryError(loc)
        if kind != "file":
            return None
        with self.fs.open_input_stream(self.fs_path(loc)) as f:
            return f.read(limit + 1)

    def open_sized(self, loc: str) -> tuple[int, Any]:
        """(size, pyarrow RandomAccessFile) of a remote file. The size comes from the listing: a
        native file system (S3, GCS, HDFS) opens a FileInfo carrying it without another request."""
        from pyarrow import fs as pafs

        size = self.size(loc)
        path = self.fs_path(loc)
        if size is not None:
            try:
                return size, self.fs.open_input_file(pafs.FileInfo(path, pafs.FileType.File, size=size))
            except TypeError:  # a Python-implemented file system (PyFileSystem) takes paths only
                pass
        f = self.fs.open_input_file(path)
        return f.size(), f

    def unreachable(self, exc: BaseException) -> NotARunError:
        """The one-line error of a run whose file system cannot be read (network, credentials)."""
        reason = " ".join(str(exc).split())[:300] or type(exc).__name__
        where = (
            f"{scheme(str(self.root))}://" if isinstance(self.root, str) and scheme(self.root) else "its file system"
        )
        return NotARunError(
            f"{self.label}: cannot read {where} ({reason}); check the URI, the network and the credentials"
        )

    # ------------------------------------------------------------------ data
    def dataset(self, schema: Any, files: Sequence[str], provenance: str | None = None) -> Any:
        """A ``pyarrow.dataset`` over exactly ``files`` (remote locations) in ``schema`` (columns the
        files lack are nulls, extra columns are ignored), in file order; with ``provenance`` a string
        column of that name holding each row's file location (a virtual partition column: filters on
        it prune files)."""
        import pyarrow as pa
        import pyarrow.dataset as ds

        partitions = None
        if provenance is not None:
            schema = schema.append(pa.field(provenance, pa.string()))
            partitions = [ds.field(provenance) == pa.scalar(f, pa.string()) for f in files]
        return ds.FileSystemDataset.from_paths(
            [self.fs_path(f) for f in files],
            schema=schema,
            format=ds.ParquetFileFormat(),
            filesystem=self.fs,
            partitions=partitions,
        )


def store(path: str | os.PathLike[str], label: str, fs: Any = None) -> Store:
    """The ``Store`` of a run given as a path or URI (``label``: as shown in messages), or as a path
    inside the explicit pyarrow FileSystem ``fs``. NotARunError naming the run when the URI's file
    system cannot be built (unknown scheme, a file system pyarrow lacks, bad credentials)."""
    text = os.fspath(path)
    if fs is not None:
        root = text.rstrip("/") or "/"
        return Store(root, label, fs, root)
    if not is_remote(text):
        return Store(Path(local_path(text, label)), label)
    resolved, fs_root = filesystem(text, label)
    # The root as the user spelled it, less a query string (pyarrow's options, e.g. endpoint_override)
    # and a trailing slash: the prefix of every file location of the run.
    root = text.split("?", 1)[0].rstrip("/")
    return Store(root, label, resolved, fs_root.rstrip("/"))


def open_regular(path: str | os.PathLike[str]) -> BinaryIO | None:
    """``path`` opened for reading when it is a regular file (symbolic links followed, as
    everywhere in a run), else None. Never blocks and never opens anything else: a named pipe
    opened for reading waits for a writer forever, and opening a device can act on it, so the
    path is ``stat``ed first and only a regular file is opened, non-blocking, then checked again
    on the descriptor (a file swapped for a pipe in between is refused, not waited on).
    OSError (FileNotFoundError when absent) when it cannot be read."""
    if not stat.S_ISREG(os.stat(path).st_mode):
        return None
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            return None
        os.set_blocking(fd, True)  # the usual semantics for the reads (a regular file never blocks anyway)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def name_of(loc: Location) -> str:
    """The last component of a location."""
    return loc.name if isinstance(loc, Path) else posixpath.basename(loc)
