"""Run locations given as URIs: the path or file system each engine reads them with.

* ``local_path``: a ``file:`` URI (``file:///x``, ``file:/x``, ``file://localhost/x``) is the
  local path ``/x``; a plain path is itself. Every engine accepts both for the same run.
* ``arrow_uri``: the spelling pyarrow's file systems resolve: Hadoop's ``s3a://`` and ``s3n://``
  are pyarrow's ``s3://`` (same bucket, same key), everything else is unchanged.
* ``filesystem``: (pyarrow ``FileSystem``, path inside it) for any URI
  ``pyarrow.fs.FileSystem.from_uri`` resolves (``s3://``, ``gs://``, ``hdfs://``, ``file://``);
  NotARunError naming the URI and pyarrow's reason when it cannot.
* ``spark_uri``: what Spark reads: a local path as a ``file://`` URI (so a cluster whose default
  file system is HDFS still reads the local file), a URI unchanged (Spark resolves ``s3a://``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from detfp_analyze.errors import NotARunError

__all__ = ["arrow_uri", "filesystem", "is_remote", "local_path", "scheme", "spark_uri"]

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):")
#: Hadoop's names for S3 that pyarrow spells s3.
_ARROW_ALIASES = {"s3a": "s3", "s3n": "s3"}


def scheme(text: str) -> str | None:
    """The URI scheme of ``text`` in lower case, or None for a plain path (a Windows drive letter
    such as ``C:`` is a path, not a scheme)."""
    m = _SCHEME.match(text)
    if m is None or len(m.group(1)) == 1:
        return None
    return m.group(1).lower()


def is_remote(text: str) -> bool:
    """Whether ``text`` is a URI of a scheme other than ``file``."""
    s = scheme(text)
    return s is not None and s != "file"


def local_path(text: str, label: str) -> str:
    """The local path of ``text``: itself, or the path of a ``file:`` URI. NotARunError for a
    ``file:`` URI naming another host, or for a URI of another scheme (see ``filesystem``)."""
    s = scheme(text)
    if s is None:
        return text
    if s != "file":
        raise NotARunError(f"{label}: a {s}:// URI is not a local path")
    parts = urlsplit(text)
    if parts.netloc not in ("", "localhost"):
        raise NotARunError(f"{label}: a file URI on another host ({parts.netloc}); use a local or mounted path")
    return unquote(parts.path)


def arrow_uri(text: str) -> str:
    """``text`` as pyarrow's file systems spell it (``s3a://b/k`` -> ``s3://b/k``)."""
    s = scheme(text)
    if s in _ARROW_ALIASES:
        return _ARROW_ALIASES[s] + text[len(s) :]
    return text


def filesystem(text: str, label: str) -> tuple[Any, str]:
    """(pyarrow FileSystem, path in it) for ``text``: a plain path or ``file:`` URI on the local file
    system, any other URI through ``pyarrow.fs.FileSystem.from_uri`` (after ``arrow_uri``).
    NotARunError with pyarrow's one-line reason when the URI does not resolve (an unknown scheme,
    a file system pyarrow was built without, bad credentials)."""
    from pyarrow import fs

    if not is_remote(text):
        return fs.LocalFileSystem(), local_path(text, label)
    try:
        return fs.FileSystem.from_uri(arrow_uri(text))
    except (ValueError, OSError, NotImplementedError, ImportError) as exc:
        reason = " ".join(str(exc).split()) or type(exc).__name__
        raise NotARunError(
            f"{label}: cannot open {scheme(text)}:// ({reason[:300]}); check the URI and its credentials"
        ) from None


def spark_uri(text: str | Path) -> str:
    """``text`` as Spark should read it: a local path as a ``file://`` URI, a URI unchanged."""
    t = str(text)
    if scheme(t) is not None:
        return t
    # Raw, not percent-encoded: Hadoop parses the path itself ("rank=1" must stay as it is).
    return "file://" + str(Path(t).absolute())
