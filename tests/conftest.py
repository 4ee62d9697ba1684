"""Shared pytest configuration: torch's CPU thread count fixed so results are stable, and
fixtures used by several test modules."""

from __future__ import annotations

import os

import pytest

# Reductions and matmuls on CPU change with the thread count; fix it for every test process
# (and the subprocesses they spawn, which inherit the environment).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")


@pytest.fixture
def gloo1(tmp_path):
    """A one-rank gloo process group in this process (collectives without spawning)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
