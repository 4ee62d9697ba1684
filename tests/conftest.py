"""Shared pytest configuration: keep torch's CPU thread count fixed so results are stable."""

from __future__ import annotations

import os

# Reductions and matmuls on CPU change with the thread count; fix it for every test process
# (and the subprocesses they spawn, which inherit the environment).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
