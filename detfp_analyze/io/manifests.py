"""Read and validate a run's manifests (``manifest/rank=R/segment-SSSSS.json``) for ``reader.open_run``.

Every manifest is read with a size limit (``MAX_MANIFEST_BYTES``) through the run's store and
checked key by key against what the reader relies on (rank, world size, segment, digest
algorithm, the JSON objects it reads later); every problem is a one-line ``ManifestError`` or
``SchemaVersionError`` naming the file.
"""

from __future__ import annotations

import json
from typing import Any

from detfp_analyze.errors import DuplicateRankError, ManifestError, NotARunError, SchemaVersionError
from detfp_analyze.io.names import partitions, shown_name, visible
from detfp_analyze.io.store import Location, Store, name_of
from detfp_format import contract, strictjson

__all__ = ["FIX_RUN", "MAX_MANIFEST_BYTES", "list_dir", "read_manifests"]

#: Manifests larger than this are refused before parsing (a real one is a few KiB; the largest
#: part, the command line, is bounded by the OS at about 2 MiB).
MAX_MANIFEST_BYTES = 4 << 20
#: What a one-line error about a path that is not a run tells the user to pass instead.
FIX_RUN = "pass the directory given to detfp_capture.Session(...) or --out"

#: World sizes above this are refused: no job has a million ranks, and the reader enumerates them.
_MAX_WORLD = 1 << 20
#: Manifest keys that hold JSON objects, and the one that holds a list of strings.
_OBJECT_KEYS = ("parallel", "groups", "versions", "host", "determinism", "env", "git", "capture")


def list_dir(st: Store, path: Location, shown: str) -> list[Location]:
    """The entries of a directory of the manifest tree, or a one-line ManifestError naming it."""
    try:
        return st.listdir(path)
    except OSError as exc:
        raise ManifestError(f"{shown}: cannot list the directory ({type(exc).__name__}); check permissions") from None


def read_manifests(st: Store, root: Location, label: str) -> dict[int, dict[int, dict]]:
    mroot = st.join(root, contract.MANIFEST_DIR)
    if not st.is_dir(mroot):
        raise NotARunError(f"{label}: not a detfp run (no {contract.MANIFEST_DIR}/ directory); {FIX_RUN}")
    found: dict[int, dict[int, dict]] = {}
    mshown = f"{label}/{contract.MANIFEST_DIR}"
    for rank, rdir, rname in partitions(list_dir(st, mroot, mshown), mshown):
        rshown = f"{label}/{contract.MANIFEST_DIR}/{rname}"
        if not st.is_dir(rdir):
            raise ManifestError(f"{rshown}: not a directory (a file, a dangling link or a link loop); delete it")
        for mfile in list_dir(st, rdir, rshown):
            name = name_of(mfile)
            if not visible(name) or not (name.startswith("segment-") and name.endswith(".json")):
                continue
            digits = name[len("segment-") : -len(".json")]
            shown = f"{rshown}/{shown_name(name)}"
            if not (digits.isascii() and digits.isdigit()):
                raise ManifestError(f"{shown}: file name is not segment-<number>.json; rename or delete it")
            segment = int(digits)
            manifest = _load_manifest(st, mfile, shown)
            if manifest["rank"] != rank or manifest["segment"] != segment:
                raise ManifestError(
                    f"{shown}: says rank {manifest['rank']} segment {manifest['segment']} but its path says "
                    f"rank {rank} segment {segment}; move it to "
                    f"{contract.manifest_relpath(manifest['rank'], manifest['segment'])} or re-run the capture"
                )
            per_rank = found.setdefault(rank, {})
            if segment in per_rank:
                raise DuplicateRankError(
                    f"{shown}: a second manifest for rank {rank} segment {segment}; delete the stray copy"
                )
            per_rank[segment] = manifest
    if not found:
        raise NotARunError(
            f"{label}: not a detfp run (no {contract.MANIFEST_DIR}/rank=N/segment-N.json files); {FIX_RUN}"
        )
    return found


def _read_limited(st: Store, path: Location, shown: str) -> bytes:
    """The manifest's bytes, refusing anything that is not a regular file or is too large to be one."""
    try:
        data = st.read_limited(path, MAX_MANIFEST_BYTES)
    except OSError as exc:
        raise ManifestError(
            f"{shown}: unreadable ({type(exc).__name__}: a dangling link, a link loop or no permission); "
            "check the file or re-run the capture"
        ) from None
    if data is None:
        raise ManifestError(f"{shown}: not a regular file; delete it or re-run the capture")
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestError(
            f"{shown}: larger than {MAX_MANIFEST_BYTES >> 20} MiB, far beyond any manifest; "
            "it was not written by detfp, restore the file or re-run the capture"
        )
    return data


def _load_manifest(st: Store, path: Location, shown: str) -> dict:
    data = _read_limited(st, path, shown)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ManifestError(f"{shown}: not UTF-8 text; restore the file or re-run the capture") from None
    try:
        manifest = strictjson.loads(text, unique=True)  # RFC 8259: no bare NaN; no name twice
    except json.JSONDecodeError as exc:
        raise ManifestError(
            f"{shown}: not valid JSON ({exc.msg} at line {exc.lineno}); restore the file or re-run the capture"
        ) from None
    except RecursionError:
        raise ManifestError(f"{shown}: JSON nested too deeply; restore the file or re-run the capture") from None
    except ValueError as exc:  # e.g. an integer of thousands of digits
        reason = " ".join(str(exc).split())[:80]
        raise ManifestError(f"{shown}: not valid JSON ({reason}); restore the file or re-run the capture") from None
    if not isinstance(manifest, dict):
        raise ManifestError(f"{shown}: not a JSON object; restore the file or re-run the capture")
    missing = [k for k in contract.MANIFEST_KEYS if k not in manifest]
    if missing:
        raise ManifestError(
            f"{shown}: missing key(s) {', '.join(missing)}; the file was not written by a detfp capture "
            "of this schema, re-run the capture"
        )
    for key, known in (("schema_version", (contract.SCHEMA_VERSION,)), ("digest_version", contract.DIGEST_VERSIONS)):
        v = manifest[key]
        if type(v) is not int or v not in known:
            want = " or ".join(map(str, sorted(known)))
            raise SchemaVersionError(
                f"{shown}: {key} {_short(v)} is not supported (this detfp reads {key} {want}); "
                "analyze it with the detfp release that wrote it, or re-run the capture with this one"
            )
    for key, top in (("rank", _MAX_WORLD), ("world_size", _MAX_WORLD + 1), ("segment", 1 << 31)):
        v = manifest[key]
        if not isinstance(v, int) or isinstance(v, bool) or not (1 if key == "world_size" else 0) <= v < top:
            raise ManifestError(
                f"{shown}: {key} is {_short(v)}, expected an integer in "
                f"{1 if key == 'world_size' else 0}..{top - 1}; re-run the capture"
            )
    start = manifest["start_step"]
    if start is not None and (not isinstance(start, int) or isinstance(start, bool) or not 0 <= start < (1 << 62)):
        raise ManifestError(
            f"{shown}: start_step is {_short(start)}, expected a non-negative integer or null; re-run the capture"
        )
    for key in _OBJECT_KEYS:
        if not isinstance(manifest[key], dict):
            raise ManifestError(
                f"{shown}: {key} is {_short(manifest[key])}, expected a JSON object; restore the file or re-run the capture"
            )
    world = manifest["world_size"]
    if not all(_ranks_list(v) for v in manifest["groups"].values()):
        raise ManifestError(
            f"{shown}: groups must map names to lists of ranks below world_size {world}; "
            "restore the file or re-run the capture"
        )
    name = next((k for k, v in sorted(manifest["groups"].items()) if v and max(v) >= world), None)
    if name is not None:
        ranks = sorted(r for r in manifest["groups"][name] if r >= world)
        # A manifest whose world size was read before its process group existed (a launcher
        # process whose framework started the other ranks, before detfp_capture learned the
        # world size from the group): its groups name ranks the manifest says do not exist.
        raise ManifestError(
            f"{shown}: group {name!r} lists rank(s) {', '.join(map(str, ranks))}, outside the manifest's world_size "
            f"{world}: the world size was read before the process group existed; re-run the capture with this "
            "detfp_capture (it learns the world size from the process group)"
        )
    if not isinstance(manifest["command"], list) or not all(isinstance(x, str) for x in manifest["command"]):
        raise ManifestError(f"{shown}: command must be a list of strings; restore the file or re-run the capture")
    if not isinstance(manifest["digest_algorithm"], str):
        raise ManifestError(f"{shown}: digest_algorithm must be a string; restore the file or re-run the capture")
    return manifest


def _ranks_list(v: Any) -> bool:
    """``v`` is a list of ranks (non-negative integers). Every manifest holds its groups' members,
    so a run's manifests hold world_size^2 of them: one type test each, then one min (and the
    caller one max against the world size)."""
    if not isinstance(v, list):
        return False
    # type() is int: JSON integers are exactly int, and a bool (an int subclass) is refused. The
    # types are collected without a Python-level loop: a run of N ranks holds N^2 members.
    return _INT.issuperset(map(type, v)) and (not v or min(v) >= 0)


_INT = frozenset({int})


def _short(value: Any) -> str:
    """A JSON value for a one-line message: at most 40 characters, no control characters."""
    text = shown_name(json.dumps(value, ensure_ascii=False)[:60])
    return text if len(text) <= 40 else text[:37] + "..."
