"""A run directory's per-rank layout before any shard is written (pathlib + stdlib, no torch).

Which launches (segments) a rank already holds, preparing the directory for a new launch
(refusing to mix runs, or clearing this rank's old files when asked), and clearing one rank.
The shard writer (``writer.py``) writes into what this module prepared.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from detfp_format import contract
from detfp_format.errors import RunExistsError

__all__ = ["clear_rank", "existing_segments", "held_ranks", "prepare_run_dir"]


def existing_segments(run_dir: str | os.PathLike[str], rank: int) -> list[int]:
    """Segments this rank already wrote into ``run_dir`` (from its manifests and shard names), sorted.

    Looks only at this rank's own partitions, so ranks never need to coordinate.
    """
    root = Path(run_dir)
    found: set[int] = set()
    mdir = root / contract.MANIFEST_DIR / f"rank={rank}"
    if mdir.is_dir():
        # A commit log without a manifest (a launch killed while starting) occupies its segment too.
        for p in (*mdir.glob("segment-*.json"), *mdir.glob("segment-*.commits")):
            digits = p.stem.removeprefix("segment-")
            if digits.isdigit():
                found.add(int(digits))
    # Shards without a manifest (a launch killed before writing it) still occupy their segment.
    for table in contract.TABLES:
        sdir = root / table / f"rank={rank}"
        if sdir.is_dir():
            for p in sdir.glob("part-s*-w*.parquet"):
                digits = p.name[len("part-s") :].split("-", 1)[0]
                if digits.isdigit():
                    found.add(int(digits))
    return sorted(found)


def held_ranks(run_dir: str | os.PathLike[str]) -> list[int]:
    """Ranks that already wrote into ``run_dir`` (any segment), sorted: what a launch must not
    mix with before it knows which rank it is (``python -m detfp_capture`` without ``RANK``)."""
    root = Path(run_dir)
    found: set[int] = set()
    for sub in (contract.MANIFEST_DIR, *contract.TABLES):
        base = root / sub
        if base.is_dir():
            for part in base.glob("rank=*"):
                r = part.name.removeprefix("rank=")
                if r.isdigit() and existing_segments(root, int(r)):
                    found.add(int(r))
    return sorted(found)


def prepare_run_dir(
    run_dir: str | os.PathLike[str],
    rank: int,
    *,
    append: bool,
    overwrite: bool = False,
    world_size: int | None = None,
) -> int:
    """Create ``run_dir`` if needed and return the segment this launch of ``rank`` writes.

    Create-only: if this rank already wrote into ``run_dir`` and ``append`` is false, raise
    RunExistsError. With ``append``, return one past the highest existing segment (0 when none).
    With ``overwrite``, first delete what this rank wrote there before (see ``clear_rank``).
    """
    root = Path(run_dir)
    if root.exists() and not root.is_dir():
        raise RunExistsError(f"{root}: exists and is not a directory; choose another run directory")
    if overwrite:
        clear_rank(root, rank, world_size)
    root.mkdir(parents=True, exist_ok=True)
    segments = existing_segments(root, rank)
    if not segments:
        return 0
    if not append:
        raise RunExistsError(
            f"{root}: already holds a trace for rank {rank} (segment {segments[-1]}); "
            "choose a new run directory, pass overwrite=True (--overwrite) to replace it, or append=True "
            "(--append) to continue it as a resumed run"
        )
    return segments[-1] + 1


def clear_rank(run_dir: str | os.PathLike[str], rank: int, world_size: int | None = None) -> None:
    """Delete ``rank``'s partitions (manifests and shards) from an earlier run in ``run_dir``.

    Refuses (RunExistsError) a non-empty directory that holds no detfp run, so a mistyped path
    never deletes anything else. Each rank deletes only its own ``rank=R`` partitions, so the
    ranks of a job never race; rank 0 also deletes ranks at or beyond ``world_size`` (left by an
    earlier, larger job), which no rank of this job writes.
    """
    root = Path(run_dir)
    if not root.is_dir():
        return
    ours = {contract.MANIFEST_DIR, *contract.TABLES}
    entries = [p for p in root.iterdir() if not p.name.startswith(".")]
    if entries and not any(p.name in ours and p.is_dir() for p in entries):
        raise RunExistsError(
            f"{root}: is not a detfp run directory (no {contract.MANIFEST_DIR}/ or table folders); refusing to "
            "overwrite it; choose an empty or new run directory"
        )
    for sub in sorted(ours):
        base = root / sub
        if not base.is_dir():
            continue
        for part in base.iterdir():
            r = part.name.removeprefix("rank=")
            if not (part.is_dir() and part.name.startswith("rank=") and r.isdigit()):
                continue
            if int(r) == rank or (rank == 0 and world_size is not None and int(r) >= world_size):
                shutil.rmtree(part)
