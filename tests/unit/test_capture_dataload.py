"""A DataLoader's worker processes never make records of the step (``_sources/dataload.py``).

With ``num_workers > 0`` the main process rebuilds each batch a worker delivers (``empty`` +
``set_`` over shared memory) whenever it arrives, so which step those ops fell in depended on the
workers' timing: an identical pair at level ops was ``structural`` at ``aten::empty`` (Hugging
Face ``Trainer``, ``dataloader_num_workers=2``: 4 pairs in 9). And a forked worker inherits the
session: it must not record (it is not a rank, and has no writer thread to flush to).
"""

from __future__ import annotations

import multiprocessing

import polars as pl
import torch
from torch.utils.data import DataLoader, Dataset

from detfp_capture import Session
from tests.fixtures.models import read


class _Rows(Dataset):
    """Sample ``i``: a row of ``i``; ``probe`` is called in the process that makes the sample."""

    def __init__(self, probe=None) -> None:
        self.probe = probe

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> torch.Tensor:
        flag = float(self.probe()) if self.probe is not None else 0.0
        return torch.tensor([float(i), flag])


def _loader(ds: Dataset) -> DataLoader:
    return DataLoader(ds, batch_size=2, num_workers=2, multiprocessing_context=multiprocessing.get_context("fork"))


def test_receiving_a_workers_batch_is_not_recorded(tmp_path):
    net = torch.nn.Linear(2, 1)
    with Session(tmp_path / "r", "ops") as s:
        s.watch(net)
        it = iter(_loader(_Rows()))
        for step in range(3):
            with s.step(step):
                net(next(it)).sum().backward()
                net.zero_grad(set_to_none=True)
    r = read(tmp_path / "r")
    # The rebuild over shared memory (empty + set_) is the loader's: only the model's ops remain.
    assert r.filter(pl.col("name").is_in(["aten::empty.memory_format", "aten::set_.source_Storage_storage_offset"])).height == 0
    per_step = r.filter(pl.col("kind") == "op").group_by("step").agg(pl.len()).sort("step")["len"].to_list()
    assert len(set(per_step)) == 1, per_step
    # The batch itself is recorded, with its values: as the loader delivered it (the step's first
    # record of the data), and where the model takes it.
    batch = r.filter(pl.col("kind") == "batch").sort("seq")
    assert batch.select("step", "name").rows() == [(s, n) for s in range(3) for n in ("DataLoader", "Linear")]
    assert batch["status"].to_list() == ["ok"] * 6


def test_a_forked_worker_records_nothing(tmp_path):
    with Session(tmp_path / "r", "ops") as s:
        rec = s._rec
        loader = _loader(_Rows(lambda: rec.closed and not rec.selected))
        with s.step(0):
            seen = torch.cat(list(loader))
        assert not rec.closed  # the parent still records
    assert seen[:, 1].tolist() == [1.0] * 8  # every sample was made with capture off in its worker
