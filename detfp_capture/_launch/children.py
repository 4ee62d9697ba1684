"""The processes a training script starts under the launcher: ranks a framework starts itself.

Some frameworks start their ranks from inside the training script. Lightning's DDP launcher
(and its Hydra variant) runs the script again for each further rank,
``subprocess.Popen([sys.executable, <script>, *sys.argv[1:]])`` (``-m <module>`` for a module),
with ``LOCAL_RANK``/``WORLD_SIZE`` in its environment; ``torch.multiprocessing.start_processes``
and ``spawn`` (Lightning's ``ddp_spawn``/``ddp_fork``, accelerate's ``notebook_launcher``) run a
function in new processes.

* A re-execution of the training script is followed. While the script runs, ``Popen`` turns
  exactly that command (the same interpreter, then the script's path, or ``-m`` and its module)
  into the same command through the launcher, with this launch's options and ``--followed``;
  every other command runs as given. A followed process takes its rank from its process group,
  never from a guess (``_placement``), so it cannot write into another rank's part. Only a
  launcher process that no ``RANK`` names follows: under torchrun every rank exists already, and
  a followed process does not follow further, so nothing is captured twice. The launcher waits
  for the processes it followed before it returns, so their traces are closed when it exits.
* ``start_processes``/``spawn`` are refused (``LaunchRefusedError``, one line saying how to launch
  instead): their processes run a function of the script, not the script, and the launcher
  cannot wrap them.

Without the launcher nothing here is installed, and ``restore`` puts everything back when the
script returns.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from detfp_capture._sources.patches import Patches
from detfp_capture.errors import LaunchRefusedError

__all__ = ["Children"]

#: How long the launcher waits for a followed process after the script returned (seconds).
WAIT_S = 300.0


def _refuse(orig: Any) -> Any:
    def refused(*args: Any, **kwargs: Any) -> Any:
        raise LaunchRefusedError(
            "the script starts its ranks with torch.multiprocessing (spawn/start_processes, Lightning's "
            "ddp_spawn/ddp_fork, accelerate's notebook_launcher), which the launcher cannot follow; start one "
            "process per rank instead: torchrun --nproc_per_node N -m detfp_capture --out DIR -- SCRIPT "
            "(Lightning: strategy='ddp')"
        )

    refused.__wrapped__ = orig  # type: ignore[attr-defined]
    return refused


class Children:
    """Follow re-executions of the training script ``target`` (``[script, ...]`` or ``["-m",
    module, ...]``) through the launcher with ``options`` (the launcher's own, ``--followed``
    included); ``on_follow`` is called for each process followed."""

    def __init__(self, options: list[str], target: list[str], on_follow: Callable[[], None]) -> None:
        self.options = options
        self.module = target[1] if target[0] == "-m" else None
        self.script = None if self.module is not None else os.path.realpath(target[0])
        self.python = os.path.realpath(sys.executable)
        self.on_follow = on_follow
        #: The processes followed (``subprocess.Popen`` objects), in start order.
        self.followed: list[subprocess.Popen] = []
        self.patches = Patches()

    def install(self, follow: bool) -> None:
        """Refuse ``start_processes``; with ``follow``, follow re-executions of the script."""
        import torch.multiprocessing as mp

        spawn_module = sys.modules["torch.multiprocessing.spawn"]  # ``mp.spawn`` is the function
        for owner, name in ((mp, "start_processes"), (mp, "spawn"), (spawn_module, "start_processes")):
            self.patches.wrap(owner, name, _refuse)
        if follow:
            self.patches.wrap(subprocess.Popen, "__init__", self._popen_init)

    def restore(self) -> None:
        self.patches.restore()

    def command(self, args: Any) -> list[str] | None:
        """``args`` through the launcher when they re-execute the training script, else None."""
        if isinstance(args, (str, bytes)) or not isinstance(args, Sequence) or len(args) < 2:
            return None
        parts = [os.fspath(a) for a in args]
        if not all(isinstance(p, str) for p in parts) or os.path.realpath(parts[0]) != self.python:
            return None
        if self.module is not None:
            if parts[1:3] != ["-m", self.module]:
                return None
        elif os.path.realpath(parts[1]) != self.script:
            return None
        return [parts[0], "-m", "detfp_capture", *self.options, "--", *parts[1:]]

    def _popen_init(self, orig: Any) -> Any:
        children = self

        def __init__(popen: subprocess.Popen, args: Any, *a: Any, **k: Any) -> None:
            try:
                new = children.command(args)
            except Exception:  # an unusual argument: run it as given
                new = None
            orig(popen, args if new is None else new, *a, **k)
            if new is not None:
                children.followed.append(popen)
                children.on_follow()

        __init__.__wrapped__ = orig  # type: ignore[attr-defined]
        return __init__

    def wait(self, timeout: float = WAIT_S) -> None:
        """Wait for the followed processes to end (their sessions close and write as they exit)."""
        for p in self.followed:
            try:
                p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                warnings.warn(
                    f"detfp_capture: followed process {p.pid} still runs {timeout:.0f} s after the script ended; "
                    "its trace is complete only once it exits",
                    RuntimeWarning,
                    stacklevel=2,
                )
