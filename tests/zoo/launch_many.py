"""Several launcher runs in one process: ``python tests/zoo/launch_many.py RUNS.json``.

``RUNS.json`` is a list of ``{"port": P, "argv": ["--out", DIR, "--level", L, "--", script,
...]}``. Each ``argv`` is run by ``detfp_capture``'s launcher ``main`` in turn, as
``python -m detfp_capture ARGS`` would, so a multi-rank zoo test pays the torch and
transformers imports once per rank instead of once per run. Started once per rank with the
environment torchrun sets; each run gets its own ``MASTER_PORT`` (``port``) so a script
that creates and destroys its process group per run never meets the previous run's store. Exits with the first non-zero launcher status.
"""

from __future__ import annotations

import json
import os
import sys

import torch

from detfp_capture._sources.launcher import main as launcher_main


def run_all(runs: list[dict]) -> int:
    for run in runs:
        os.environ["MASTER_PORT"] = str(run["port"])
        saved = (sys.argv, list(sys.path), torch.get_num_threads(), torch.get_rng_state())
        try:
            code = launcher_main(run["argv"])
        finally:
            sys.argv, sys.path[:] = saved[0], saved[1]
            torch.set_num_threads(saved[2])
            torch.set_rng_state(saved[3])
        if code:
            return code
    return 0


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        sys.exit(run_all(json.load(f)))
