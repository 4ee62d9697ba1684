"""Which rank this process writes its trace as, and opening that rank's part of the run directory.

A rank's part (its segment, the shard writer and its commit log, the manifest) is opened as soon
as the rank is known, and never under a rank that is only a guess:

* ``Session()`` in user code, and the launcher under torchrun (``RANK`` set): the rank is the
  process group's when it exists, else ``RANK``/``WORLD_SIZE``, else 0 of 1; opened at once.
* The launcher started with no ``RANK`` (``python -m detfp_capture -- train.py``): a framework may
  still make the process one rank of several (Lightning's DDP launcher makes it rank 0 and starts
  the others itself), so the part is opened when the rank is known: the process group's, read
  when the first step begins (DDP, FSDP and Lightning set it up before the first forward) or at
  close; with no process group by then, rank 0 of 1 (a single-process job).
* A process the launcher followed (``--followed``: a framework re-ran the training script, and the
  launcher ran it under capture instead): its rank is whatever the framework chose, known only
  from the process group. Without one at its first step (or at close) it captures nothing.

Whichever way it opened, the process group is read once it appears (``learn``): a world size that
differs from the one the manifest holds is written into it (a script that creates its process
group after ``Session()``: the manifest never disagrees with its ``groups``); a rank that differs
means this process has been writing another rank's part: capture stops, with the reason.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from detfp_capture._recorder.manifest import RunManifest
from detfp_capture._recorder.recorder import Recorder
from detfp_capture._sources.context import Place
from detfp_capture.errors import ConfigError

__all__ = ["RankPart", "env_place", "group_place"]


def group_place() -> tuple[int, int] | None:
    """(rank, world size) of the default process group, or None while there is none."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except Exception:
        pass
    return None


def env_place() -> tuple[int, int]:
    """(rank, world size): the process group's, else ``RANK``/``WORLD_SIZE``, else 0 of 1."""
    group = group_place()
    if group is not None:
        return group
    try:
        return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise ConfigError(
            f"RANK={os.environ.get('RANK')!r} WORLD_SIZE={os.environ.get('WORLD_SIZE')!r}: not integers; fix the launcher environment"
        ) from None


class RankPart:
    """This process's part of the run directory, opened once its rank is known (see the module
    docstring). ``writer`` and ``segment`` are None until then."""

    def __init__(
        self,
        out_dir: Path,
        rec: Recorder,
        manifest: RunManifest,
        place: Place,
        *,
        awaiting: bool,
        followed: bool,
        append: bool,
        overwrite: bool,
        ranks: Any,
        fields: Mapping[str, Any],
        digest_version: Callable[[int], int],
    ) -> None:
        self.out_dir = out_dir
        self.rec = rec
        self.manifest = manifest
        self.place = place
        #: The rank is not known yet: the part opens in ``learn``.
        self.awaiting = awaiting
        #: A process the launcher followed: its rank comes from the process group only.
        self.followed = followed
        #: The launcher followed processes this one started (they are the ranks, not this one).
        self.started_ranks = False
        self._append = append
        self._overwrite = overwrite
        self._ranks = ranks
        #: ``collect_manifest``'s keyword arguments other than rank, world size, segment and digest version.
        self._fields = dict(fields)
        #: The digest version of the part, given its segment (a resumed run keeps its version;
        #: ConfigError when another was asked for).
        self._digest_version = digest_version
        from detfp_capture.manifest import redact_command

        self._command = redact_command(sys.argv)  # the command as launched, not as it is at open
        self.writer: Any = None
        self.segment: int | None = None
        self._grouped = False  # the process group has been read

    def open(self) -> None:
        """Open the part for ``place``: segment (RunExistsError if this rank already wrote here),
        shard writer and commit log, manifest. An OSError leaves nothing open and is re-raised."""
        from detfp_capture.errors import RunExistsError
        from detfp_capture.manifest import collect_manifest
        from detfp_format import errors as _format_errors
        from detfp_format import writer as _writer

        rank, world = self.place.rank, self.place.world_size
        try:
            segment = _writer.prepare_run_dir(
                self.out_dir, rank, append=self._append, overwrite=self._overwrite, world_size=world
            )
            version = self._digest_version(segment)
            w = _writer.ShardWriter(self.out_dir, rank, segment, rollups=True)
        except _format_errors.RunExistsError as exc:
            # The capture's own error type (a CaptureError too), with the format's message.
            raise RunExistsError(str(exc)) from None
        data = collect_manifest(
            rank=rank, world_size=world, segment=segment, groups={}, digest_version=version, **self._fields
        )
        data["command"] = self._command
        self.manifest.data = data
        try:
            self.manifest.write()
        except OSError as exc:
            self.manifest.data = None
            w.mark_incomplete(f"the manifest could not be written: {type(exc).__name__}: {exc}")
            w.close(timeout=300.0)
            raise
        self.writer, self.segment = w, segment
        self.rec.writer, self.rec.rank = w, rank

    def close_writer(self, timeout_s: float) -> None:
        """Wait for the writer to write every flushed window: a slow disk under load only delays
        close (data the user flushed is never dropped for time); a writer that makes no progress
        for ``timeout_s`` (a hung filesystem) must not hang the end of training: give up, saying
        how many windows are missing (the writer thread, a daemon, dies with the process)."""
        w = self.writer
        last = None
        while not w.close(timeout=timeout_s):
            progress = (w.windows_written, w.dropped_windows, w.files_written)
            if progress == last:
                missing = w.windows_queued - w.windows_written - w.dropped_windows
                warnings.warn(
                    f"detfp: trace writer of rank {self.place.rank} made no progress for {timeout_s:.0f} s; "
                    f"gave up with {missing} flushed window(s) not written: the trace of this rank is "
                    "truncated (check the file system of the trace directory)",
                    RuntimeWarning,
                    stacklevel=3,
                )
                return
            last = progress

    def learn(self, closing: bool = False) -> str | None:
        """Read the process group if it has appeared (at a step begin, and at close); open the
        part if it waits and its rank is now known. Returns None to go on, or why capture stops
        in this process (``""``: stop without a word, a rank that ``ranks=`` leaves out).
        Raises what ``open`` raises."""
        if self._grouped:
            return None
        group = group_place()
        if group is not None:
            self._grouped = True
        if not self.awaiting:
            if group is None:
                return None
            rank, world = group
            if rank != self.place.rank:
                return (
                    f"this process opened its trace as rank {self.place.rank} of {self.place.world_size} before "
                    f"its process group existed, which says rank {rank} of {world}: nothing more is recorded; "
                    "open the Session after init_process_group, or set RANK"
                )
            if world != self.place.world_size:
                self.place.world_size = world
                self.manifest.world_learned(world)
            return None
        if group is None:
            if self.followed:
                return (
                    ""
                    if closing
                    else "its rank is unknown: it was started for a framework and no process group exists at its first step"
                )
            if closing and self.started_ranks:
                return ""  # it only started the ranks, which wrote their own parts
            group = env_place()
        self.awaiting = False
        self.place.rank, self.place.world_size = group
        if group[1] > 1 and not self.followed and not self.started_ranks:
            # A group of several ranks, none of which the launcher saw start: they are captured
            # only if each runs under the launcher too. Said now, not discovered at analysis.
            warnings.warn(
                f"detfp_capture: this process joined a process group as rank {group[0]} of {group[1]}, and the "
                "launcher started no other rank: ranks not started under python -m detfp_capture are not "
                "captured; launch all of them with torchrun --nproc_per_node N -m detfp_capture ...",
                RuntimeWarning,
                stacklevel=5,
            )
        if self._ranks is not None and group[0] not in self._ranks:
            return ""
        self.open()
        return None
