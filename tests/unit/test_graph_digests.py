"""The CUDA-graph digest buffer (``_digest/graphs.py``), its device-independent part, on the CPU:
rows in capture order, each resolving to the digest ``start`` gives the same bytes, snapshots
that later replays do not change, a full buffer refusing rather than growing. The graph itself
(capture, replays rewriting the rows) is ``scripts/gpu_check.sh``'s on a CUDA machine."""

from __future__ import annotations

import pytest
import torch

from detfp_capture import digest
from detfp_capture._digest import versions
from detfp_capture._digest.graphs import GraphDigests
from detfp_capture._digest.resolve import resolve


def _tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [
        torch.randn(3, 5, generator=g),  # small: one level
        torch.randn(700, generator=g).to(torch.bfloat16),
        torch.randn(64, 96, generator=g),  # several levels
        torch.randn(20, 30, generator=g).t(),  # not contiguous
        torch.arange(10, dtype=torch.int64),
        torch.zeros(0),
    ]


@pytest.mark.parametrize("version", [2, 1])
def test_rows_resolve_to_the_digests_of_the_same_bytes(version):
    with versions.use(version) as sch:
        gd = GraphDigests("cpu", rows=8, scheme=sch)
        ts = _tensors()
        assert [gd.put(t) for t in ts] == list(range(len(ts)))
        snap = gd.snapshot()
        got = resolve([gd.pending(snap, i) for i in range(gd.used)])
        want = [digest.fingerprint(t) for t in ts]
    assert [(f.digest, f.dtype, f.shape) for f in got] == [(f.digest, f.dtype, f.shape) for f in want]


def test_a_snapshot_keeps_its_replay_and_a_full_buffer_refuses():
    gd = GraphDigests("cpu", rows=2)
    x = torch.arange(6, dtype=torch.float32)
    assert gd.put(x) == 0
    first = gd.snapshot()
    x.add_(1)  # the next replay's bytes (a replay rewrites the row: here, the next put's)
    assert gd.put(x) == 1 and gd.put(x) is None  # full: refused, never reallocated
    second = gd.snapshot()
    a, b, c = resolve([gd.pending(first, 0), gd.pending(second, 0), gd.pending(second, 1)])
    assert a.digest == b.digest != c.digest == digest.fingerprint(x).digest
    assert gd.used == 2 and gd.rows == 2


def test_what_a_graph_row_cannot_hold_is_refused():
    gd = GraphDigests("cpu", rows=4)
    assert gd.put(torch.zeros(2, 2).to_sparse()) is None
    assert gd.used == 0
    with pytest.raises(ValueError, match="rows must be >= 1"):
        GraphDigests("cpu", rows=0)
