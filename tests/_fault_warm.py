"""Imported only by the fault tests' forkserver (tests/fault_child.py): run one tiny capture so
every child forked from it starts warm (digest weights, first kernels, Parquet writer), paying a
fork instead of a second of first-use costs. Single-threaded, so forking after it is safe."""

from __future__ import annotations

import shutil
import tempfile

import torch

from detfp_capture import Session

torch.set_num_threads(1)
_dir = tempfile.mkdtemp(prefix="detfp-warm-")
try:
    _m = torch.nn.Linear(8, 4)
    _opt = torch.optim.SGD(_m.parameters(), lr=0.1)
    with Session(_dir + "/run", level="boundaries", flush_records=1) as _s:
        _s.watch(_m)
        _s.watch_optimizer(_opt)
        with _s.step(0):
            _loss = _m(torch.randn(2, 8)).sum()
            _s.metric("loss", _loss)
            _loss.backward()
            _opt.step()
finally:
    shutil.rmtree(_dir, ignore_errors=True)
