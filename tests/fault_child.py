"""Training jobs that tests/test_faults.py runs in real child processes, with faults planted.

Children are forked from a ``forkserver`` that imported torch once (``FORKSERVER_PRELOAD``),
so each costs a fork and a few training steps, not an interpreter start. A child trains a
tiny deterministic model under ``detfp_capture.Session`` (or without capture, for the
reference losses) and writes a JSON result next to the run: the raw bits of every loss, the
detfp warnings it saw, and anything the scenario measured. Faults come from the outside
(``DETFP_FAULT``: see detfp_capture/_faults.py; SIGKILL from the parent) or from the scenario
itself at the start of a step (``at_step``): fill the file system, make the directory
read-only, remove it.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import resource
import shutil
import signal
import struct
import time
import tracemalloc
import warnings
from pathlib import Path
from typing import Any

__all__ = ["FORKSERVER_PRELOAD", "private_tmpfs", "train"]

#: Modules the forkserver imports before forking children (torch._dynamo: the optimizer's
#: constructor imports it lazily; pandas: pyarrow's from_pydict does; seconds per child otherwise).
FORKSERVER_PRELOAD = [
    "torch",
    "torch._dynamo",
    "pandas",
    "torch.distributed",
    "pyarrow.parquet",
    "detfp_capture.session",
    "detfp_capture._sources.collectives",
    "tests.fault_child",
    "tests._fault_warm",
]


def private_tmpfs(path: Path, size: int) -> bool:
    """Mount a ``size``-byte tmpfs at ``path`` in a private user and mount namespace (so that a
    full disk is real, not simulated). False where the kernel or container does not allow it."""
    libc = ctypes.CDLL(None, use_errno=True)
    clone_newuser, clone_newns, ms_rec, ms_private = 0x10000000, 0x00020000, 0x4000, 0x40000
    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(clone_newuser | clone_newns) != 0:
        return False
    try:
        Path("/proc/self/setgroups").write_text("deny")
        Path("/proc/self/uid_map").write_text(f"0 {uid} 1")
        Path("/proc/self/gid_map").write_text(f"0 {gid} 1")
    except OSError:
        return False
    if libc.mount(b"none", b"/", None, ms_rec | ms_private, None) != 0:
        return False
    path.mkdir(parents=True, exist_ok=True)
    return libc.mount(b"tmpfs", str(path).encode(), b"tmpfs", 0, f"size={size}".encode()) == 0


def _fill(path: Path) -> None:
    """Use up every free byte of the file system holding ``path`` (another job filling the disk)."""
    fd = os.open(path / ".filler", os.O_WRONLY | os.O_CREAT, 0o644)
    chunk = b"\0" * 4096
    try:
        while os.write(fd, chunk) > 0:
            pass
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            raise
    finally:
        os.close(fd)


def _read_only(path: Path) -> str:
    """Make ``path`` and every directory below it read-only; returns how ('chmod' or 'injected')."""
    for d in [path, *[p for p in path.rglob("*") if p.is_dir()]]:
        d.chmod(0o555)
    if os.geteuid() != 0:
        return "chmod"
    # root ignores permission bits: the file system's answer is planted at the writer instead.
    os.environ["DETFP_FAULT"] = "shard-mid-write:eacces"
    return "injected"


def _drained(session: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while session._writer.pending and time.monotonic() < deadline:
        time.sleep(0.005)


def _bits(loss: Any) -> int:
    return struct.unpack("<Q", struct.pack("<d", float(loss)))[0]


def train(
    out: str,
    result: str,
    *,
    rank: int = 0,
    world: int = 1,
    steps: int = 5,
    first_step: int = 0,
    level: str = "metrics",
    capture: bool = True,
    append: bool = False,
    fault: str | None = None,
    at_step: dict[int, str] | None = None,
    fsize: int | None = None,
    tmpfs: int | None = None,
    step_sleep: float = 0.0,
    measure: bool = False,
    gloo: str | None = None,
    collective_steps: int = 0,
    probe_rows: int = 0,
) -> None:
    """Train ``steps`` steps from ``first_step`` and write the result JSON to ``result``.

    ``at_step``: step -> action at its start ("fill", "read_only", "remove", "die", "big_probe");
    ``fsize``: RLIMIT_FSIZE for this process; ``tmpfs``: run on a private tmpfs of that many
    bytes (copied out to ``out`` at the end); ``measure``: tracemalloc peak and the writer's
    peak backlog; ``gloo``: init file of a process group (rank/world), ``collective_steps``:
    steps that all-reduce the loss; ``probe_rows``: probe a tensor of that many rows with row
    digests every step (windows of a known, sizeable weight: ~50 bytes of Python per row).
    """
    import torch

    from detfp_capture import Session
    from detfp_capture.errors import RunExistsError

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    if fault:
        os.environ["DETFP_FAULT"] = fault
    info: dict[str, Any] = {"losses": [], "warnings": [], "mode": None}
    run_dir = Path(out)
    if tmpfs is not None:
        mounted = private_tmpfs(run_dir.parent / f"{run_dir.name}.fs", tmpfs)
        info["mode"] = "tmpfs" if mounted else "injected"
        if mounted:
            run_dir = run_dir.parent / f"{run_dir.name}.fs" / "run"
    if fsize is not None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, resource.RLIM_INFINITY))
    if gloo is not None:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"file://{gloo}", rank=rank, world_size=world)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1234)
    if measure:
        tracemalloc.start()
    t0 = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        session = None
        if capture:
            try:
                session = Session(run_dir, level=level, flush_records=1, append=append, start_step=first_step or None)
            except RunExistsError as exc:
                info["refused"] = str(exc)
                Path(result).write_text(json.dumps(info))
                return
            session.watch(model)
            session.watch_optimizer(opt)
        for step in range(first_step, first_step + steps):
            action = (at_step or {}).get(step)
            if action in ("fill", "read_only", "remove", "die") and session is not None:
                _drained(session)  # the fault strikes after the earlier windows landed: they must survive it
            if action == "fill":
                if info["mode"] == "tmpfs":
                    _fill(run_dir)
                else:
                    os.environ["DETFP_FAULT"] = "shard-mid-write:enospc"
            elif action == "read_only":
                info["mode"] = _read_only(run_dir)
            elif action == "remove":
                shutil.rmtree(run_dir)
            elif action == "die":  # the rank dies between steps (OOM killer, node failure)
                os.kill(os.getpid(), signal.SIGKILL)
            ctx = session.step(step) if session is not None else contextlib.nullcontext()
            with ctx:
                x = torch.randn(16, 8, generator=gen)
                loss = model(x).pow(2).mean()
                if gloo is not None and step - first_step < collective_steps:
                    import torch.distributed as dist

                    dist.all_reduce(loss.detach().clone())
                if session is not None:
                    session.metric("loss", loss)
                    if probe_rows:
                        session.probe("rows", torch.full((probe_rows, 4), float(step)), rows=True)
                    if action == "big_probe":  # a window far larger than the others
                        session.probe("big", torch.arange(1 << 14, dtype=torch.float64).reshape(-1, 4), rows=True)
                opt.zero_grad()
                loss.backward()
                opt.step()
            info["losses"].append(_bits(loss))
            if step_sleep:
                time.sleep(step_sleep)
        if session is not None:
            if measure:
                info["peak_pending"] = session._writer.peak_pending
            session.close()
    info["seconds"] = time.monotonic() - t0
    if measure:
        info["traced_peak"] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    info["warnings"] = [str(w.message) for w in caught if "detfp" in str(w.message)]
    if tmpfs is not None and info["mode"] == "tmpfs":
        with contextlib.suppress(OSError):
            (run_dir / ".filler").unlink()
        shutil.copytree(run_dir, out, ignore=shutil.ignore_patterns(".filler"))
    if gloo is not None:
        import torch.distributed as dist

        dist.destroy_process_group()
    try:
        Path(result).write_text(json.dumps(info))
    except OSError as exc:  # the scenario may have made the result's own directory unusable
        if exc.errno not in (errno.EACCES, errno.EROFS):
            raise
