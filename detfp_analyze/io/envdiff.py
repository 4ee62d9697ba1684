"""Diff two runs' manifests: is a bitwise comparison of them meaningful at all?

Pipeline: flatten each rank's latest manifest into dotted keys (``versions.torch``,
``determinism.num_threads``, ``env.CUBLAS_WORKSPACE_CONFIG``, ``parallel.tp``, ...) ->
for every key, compare A and B. A fact that is the same on every rank of a run is
reported once (``rank`` None); a fact that varies by rank (parallel coordinates, host
names, local ranks) is compared rank by rank and reported per rank where it differs.
Keys that always differ between two launches and say nothing about numerics (rank,
segment, the command line, the output directory) are left out; ``start_step`` is the
resume logic's business (``resume.py``), ``settings_changed_at`` the settings'
(``bisect/settings.py``). A settings or versions key that no manifest of one run holds was not
recorded by that run's capture (an earlier release): not a difference.

``blocking`` entries (world size, parallel layout and process groups, digest and schema
versions) make a comparison meaningless: every record would differ or records would be
matched to the wrong peer. ``check_comparable`` raises IncomparableError for them unless
forced. Digests of two versions can never be equal, so ``check_digests`` refuses such a pair
before anything else, whatever is forced or ignored, saying how to recapture. Everything here is a pure function of manifest dicts; ``env_diff`` only reads them
off two opened runs. A manifest holds the determinism settings of the run's first step; a
setting changed later is a ``setting_changed`` event, which ``setting_changes`` lists.
"""

from __future__ import annotations

import fnmatch
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import polars as pl

from detfp_analyze.errors import IncomparableError
from detfp_analyze.io.reader import Run, as_run

__all__ = [
    "EnvDiff",
    "SettingChange",
    "check_comparable",
    "check_digests",
    "digest_versions",
    "drop_keys",
    "env_diff",
    "flatten_manifest",
    "manifest_diff",
    "setting_changes",
]

#: Top-level manifest keys that never say anything about numerics (always differ per rank or launch).
_IGNORED = frozenset({"rank", "segment", "start_step", "command", "settings_changed_at"})
#: Objects whose keys a newer capture records more of (the settings catalogue, library versions):
#: a key no manifest of one run holds was not recorded there, which is no difference (a
#: recorded null is: a library installed in one run only).
_CATALOGUED = ("determinism.", "versions.")
#: Capture options naming where the trace went: always differ between two runs.
_IGNORED_CAPTURE = frozenset({"capture.out", "capture.dir", "capture.run_dir", "capture.path"})
#: Keys (exact or prefix before a dot) whose difference makes a bitwise comparison meaningless.
_BLOCKING_EXACT = frozenset({"world_size", "digest_version", "digest_algorithm", "schema_version"})
_BLOCKING_PREFIX = ("parallel.", "groups.")


@dataclass(frozen=True)
class EnvDiff:
    """One manifest fact that differs between run A and run B."""

    #: Dotted key, e.g. ``determinism.num_threads`` or ``env.NCCL_ALGO``.
    key: str
    #: Value in run A (JSON value; None when absent or null).
    a: Any
    #: Value in run B.
    b: Any
    #: The rank this entry is about, or None when the fact is the same on every rank of each run.
    rank: int | None = None
    #: True when the difference makes a bitwise comparison meaningless (see ``check_comparable``).
    blocking: bool = False

    def to_json_dict(self) -> dict[str, Any]:
        """JSON form: ``{key, a, b, rank, blocking}``."""
        return {"key": self.key, "a": self.a, "b": self.b, "rank": self.rank, "blocking": self.blocking}


@dataclass(frozen=True, order=True)  # sorted by rank, then step
class SettingChange:
    """A determinism setting that changed between two steps of one run (a ``setting_changed`` event)."""

    rank: int
    #: The step that began with the new setting.
    step: int
    #: ``key: old -> new`` for each changed setting.
    detail: str

    def to_json_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "step": self.step, "detail": self.detail}


def setting_changes(run: Run) -> tuple[SettingChange, ...]:
    """Every ``setting_changed`` event of ``run``, sorted by rank then step."""
    ev = run.scan("events").filter(pl.col("type") == "setting_changed").select("rank", "step", "detail").collect()
    return tuple(sorted(SettingChange(int(r), int(s), d or "") for r, s, d in ev.iter_rows()))


def _is_blocking(key: str) -> bool:
    return key in _BLOCKING_EXACT or key.startswith(_BLOCKING_PREFIX) or f"{key}." in _BLOCKING_PREFIX


def flatten_manifest(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """Dotted-key view of one manifest; lists stay values (compared whole), dicts are walked."""
    out: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        # An empty object contributes no fact: {} vs {"tp_size": 2} is one key, not two.
        if isinstance(value, Mapping):
            for k in value:
                walk(f"{prefix}.{k}" if prefix else str(k), value[k])
        else:
            out[prefix] = value

    for key in manifest:
        if key in _IGNORED:
            continue
        walk(str(key), manifest[key])
    for key in _IGNORED_CAPTURE:
        out.pop(key, None)
    return out


def _canon(value: Any) -> str:
    # Compare JSON values by their canonical text: 1 == 1.0 == True must not hide a difference.
    return json.dumps(value, sort_keys=True, default=str)


#: Types of JSON scalars whose text is a function of (type, value) and equality: no float (NaN
#: is unequal to itself, 1.0 == 1) and no bool (True == 1).
_PLAIN = frozenset({str, int, type(None)})


def _same_key(value: Any) -> Any:
    """A value that compares equal exactly when ``_canon`` texts do, cheaper for the scalars that
    most manifest values are (thousands of ranks x hundreds of keys): a text or an integer by
    its type and value (True, 1 and 1.0 stay apart), a list of those by its element types and
    values (a group's member list is as long as the group, and every rank's manifest holds its
    groups: by canonical text that was ranks x group size of JSON written per run), anything
    else by its canonical text."""
    t = type(value)
    if t is str or t is int or value is None:
        return (t, value)
    if t is list:
        types = tuple(map(type, value))
        if _PLAIN.issuperset(types):
            return (list, types, tuple(value))
    return _canon(value)


def manifest_diff(
    manifests_a: Mapping[int, Mapping[str, Any]], manifests_b: Mapping[int, Mapping[str, Any]]
) -> tuple[EnvDiff, ...]:
    """Diff per-rank manifests (rank -> manifest dict) of two runs; sorted by (key, rank).

    A rank present in only one of the runs contributes nothing (the reader and the rank
    selection report missing ranks); ``world_size`` catches different job sizes.
    """
    flat_a = {r: flatten_manifest(m) for r, m in manifests_a.items()}
    flat_b = {r: flatten_manifest(m) for r, m in manifests_b.items()}
    ranks = sorted(set(flat_a) & set(flat_b))
    if not ranks:
        # No common rank (e.g. disjoint selections): compare the lowest rank of each side.
        if flat_a and flat_b:
            ra, rb = min(flat_a), min(flat_b)
            return _diff_pairs({None: (flat_a[ra], flat_b[rb])})
        return ()
    keys = sorted(set().union(*(flat_a[r].keys() | flat_b[r].keys() for r in ranks)))
    out: list[EnvDiff] = []
    # A list value shared by many ranks' manifests (a run index parses each distinct value once,
    # io.runindex) is keyed once, and equal keys of both runs become one object, so comparing
    # thousands of ranks' group lists is an identity test. ``seen`` holds the lists, so ids stay theirs.
    seen: dict[int, tuple[Any, Any]] = {}
    same: dict[Any, Any] = {}

    def keyed(v: Any) -> Any:
        if type(v) is not list:
            return _same_key(v)
        got = seen.get(id(v))
        if got is None:
            k = _same_key(v)
            got = seen[id(v)] = (v, same.setdefault(k, k))
        return got[1]

    fa, fb = [flat_a[r] for r in ranks], [flat_b[r] for r in ranks]
    for key in keys:
        if key.startswith(_CATALOGUED) and (all(key not in f for f in fa) or all(key not in f for f in fb)):
            continue
        raw_a, raw_b = [f.get(key) for f in fa], [f.get(key) for f in fb]
        # One value object on every rank of each run (a run index shares them): one comparison.
        shared = len(set(map(id, raw_a))) == 1 and len(set(map(id, raw_b))) == 1
        if shared and keyed(raw_a[0]) == keyed(raw_b[0]):
            continue
        va, vb = [keyed(v) for v in raw_a], [keyed(v) for v in raw_b]
        if va == vb:
            continue
        if len(set(va)) == 1 and len(set(vb)) == 1:
            r0 = ranks[0]
            out.append(EnvDiff(key, flat_a[r0].get(key), flat_b[r0].get(key), None, _is_blocking(key)))
            continue
        for r, ca, cb in zip(ranks, va, vb, strict=False):
            if ca != cb:
                out.append(EnvDiff(key, flat_a[r].get(key), flat_b[r].get(key), r, _is_blocking(key)))
    return tuple(sorted(out, key=lambda d: (d.key, -1 if d.rank is None else d.rank)))


def _diff_pairs(pairs: Mapping[Any, tuple[dict, dict]]) -> tuple[EnvDiff, ...]:
    out = []
    for rank, (fa, fb) in pairs.items():
        for key in sorted(fa.keys() | fb.keys()):
            if key.startswith(_CATALOGUED) and (key not in fa or key not in fb):
                continue
            if _canon(fa.get(key)) != _canon(fb.get(key)):
                out.append(EnvDiff(key, fa.get(key), fb.get(key), rank, _is_blocking(key)))
    return tuple(out)


def _latest(run: Run, ranks: Iterable[int] | None) -> dict[int, dict]:
    wanted = None if ranks is None else set(ranks)
    out = {}
    for rank, segs in run.manifests.items():
        if segs and (wanted is None or rank in wanted):
            out[int(rank)] = dict(segs[-1])
    return out


def env_diff(run_a: Run | str, run_b: Run | str, *, ranks: Iterable[int] | None = None) -> tuple[EnvDiff, ...]:
    """Manifest diff of two runs (``reader.Run`` or run directories), each rank's latest segment.

    ``world_size`` is taken from the runs themselves too, so a job that lost ranks still
    shows a different size even when no single manifest says so.
    """
    run_a, run_b = as_run(run_a), as_run(run_b)
    diffs = list(manifest_diff(_latest(run_a, ranks), _latest(run_b, ranks)))
    if run_a.world_size != run_b.world_size and not any(d.key == "world_size" for d in diffs):
        diffs.append(EnvDiff("world_size", run_a.world_size, run_b.world_size, None, True))
    return tuple(sorted(diffs, key=lambda d: (d.key, -1 if d.rank is None else d.rank)))


def drop_keys(diffs: Iterable[EnvDiff], patterns: Sequence[str]) -> tuple[tuple[EnvDiff, ...], tuple[str, ...]]:
    """Leave out the differences whose key matches a pattern (a shell glob on the dotted key:
    ``git.commit``, ``host.*``, ``env.NCCL_*``): (the rest, the keys left out, sorted and unique).

    For keys a golden-trace gate expects to differ between the golden run and a CI run. A
    blocking key left out no longer blocks the comparison: the caller asked for that.
    """
    kept, dropped = [], set()
    for d in diffs:
        if any(fnmatch.fnmatchcase(d.key, p) for p in patterns):
            dropped.add(d.key)
        else:
            kept.append(d)
    return tuple(kept), tuple(sorted(dropped))


def check_comparable(diffs: Iterable[EnvDiff], *, label_a: str = "A", label_b: str = "B", force: bool = False) -> None:
    """Raise IncomparableError naming the first blocking difference, unless ``force``."""
    blocking = [d for d in diffs if d.blocking]
    if not blocking or force:
        return
    d = blocking[0]
    where = "" if d.rank is None else f" on rank {d.rank}"
    more = f" (and {len(blocking) - 1} more)" if len(blocking) > 1 else ""
    raise IncomparableError(
        f"{label_a} vs {label_b}: {d.key} differs{where} ({_canon(d.a)} vs {_canon(d.b)}){more}, "
        "so records cannot be compared bit for bit; rerun with matching settings or pass --force"
    )


def digest_versions(run: Run) -> dict[int, str]:
    """Digest version -> algorithm name, over every manifest of ``run`` (all ranks, all segments):
    one entry for a run captured with one version."""
    return {int(m["digest_version"]): str(m["digest_algorithm"]) for segs in run.manifests.values() for m in segs}


def check_digests(run_a: Run, run_b: Run) -> None:
    """Raise IncomparableError (one line) unless both runs hold digests of one and the same
    version: digests of different versions never compare equal, so neither ``force`` nor
    ignored environment keys can make such a comparison mean anything."""
    va, vb = digest_versions(run_a), digest_versions(run_b)
    for run, got in ((run_a, va), (run_b, vb)):
        if len(got) > 1:
            raise IncomparableError(
                f"{run.label}: its launches captured digests of versions {_versions_text(got)}, which never "
                "compare equal; recapture it with one digest version (Session(digest_version=N), "
                "python -m detfp_capture --digest-version N)"
            )
    if va == vb:
        return
    (a, name_a), (b, name_b) = next(iter(va.items())), next(iter(vb.items()))
    raise IncomparableError(
        f"{run_a.label} vs {run_b.label}: digest version {a} ({name_a}) vs {b} ({name_b}) never compare "
        f"equal; recapture {run_a.label} with digest version {b} (Session(digest_version={b}), python -m "
        f"detfp_capture --digest-version {b}) or {run_b.label} with version {a}"
    )


def _versions_text(versions: Mapping[int, str]) -> str:
    return " and ".join(f"{v} ({name})" for v, name in sorted(versions.items()))
