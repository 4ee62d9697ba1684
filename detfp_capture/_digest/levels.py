"""The further levels of a batch of digests: level-0 lanes of many tensors to their final lanes.

The digest's tree (docs/digest.md) reduces each tensor's rows level by level until one row is
left. For a batch (``batched.start_many``, ``staging``) level 0 covers every tensor at once;
``finish`` then runs each further level for all the tensors that still have more than one row,
in a few device ops per level, following a ``plan`` computed once per distinct list of row
counts and fan-in (step boundaries repeat the same ones). The digest version (``Scheme``) sets
the fan-in: how many level outputs fill one 1024-byte row of the next level (16 in version 1,
64 in version 2).
"""

from __future__ import annotations

from typing import Any

import torch

from detfp_capture._digest import core
from detfp_capture._digest.core import Scheme

__all__ = ["MAX_RUNS", "finish", "plan"]

_K = core.K


#: A level whose continuing tensors form more runs than this is padded by one index gather
#: (vectorized) instead of one slice per run (Python per run).
MAX_RUNS = 256


def plan(rows: tuple[int, ...], dev: torch.device, fanin: int) -> tuple[list[tuple], torch.Tensor | None]:
    """How ``finish`` turns level-0 lanes of tensors with these row counts into final lanes:
    per level (finished rows: None, "all" or an index tensor; how the continuing tensors' rows
    become the next level's input; whether any continue), then the permutation back to tensor
    order. A reused batch layout keeps its plan (step boundaries repeat the same row counts).

    The next level's input is each continuing tensor's rows zero-padded to a multiple of
    ``fanin`` (``fanin`` rows of level outputs = one 1024-byte row). Consecutive tensors that need no padding
    form one run, so that input is usually a few slices of this level's lanes (or the lanes
    themselves: ``None``), copied once by ``torch.cat``; a level of more than ``MAX_RUNS`` runs
    uses one index gather instead."""
    n = len(rows)
    levels: list[tuple] = []
    done_ids: list[int] = []
    ids = list(range(n))
    cur = list(rows)
    while True:
        fin_pos: list[int] = []
        cont: list[int] = []
        new_rows: list[int] = []
        runs: list[list[int]] = []  # [start, end, zero rows after] over this level's rows
        off = 0
        for j, m in zip(ids, cur, strict=True):
            if m == 1:
                fin_pos.append(off)
                done_ids.append(j)
            else:
                m2 = -(-m // fanin)  # m rows of level outputs -> whole 1024-byte rows
                cont.append(j)
                new_rows.append(m2)
                if runs and runs[-1][1] == off and runs[-1][2] == 0:
                    runs[-1][1] = off + m
                    runs[-1][2] = m2 * fanin - m
                else:
                    runs.append([off, off + m, m2 * fanin - m])
            off += m
        fin: Any = None
        if fin_pos:
            fin = "all" if len(fin_pos) == off else torch.tensor(fin_pos, dtype=torch.int64, device=dev)
        nxt: Any = None  # the lanes as they are
        if cont and not (len(runs) == 1 and runs[0] == [0, off, 0]):
            nxt = [tuple(r) for r in runs] if len(runs) <= MAX_RUNS else _gather(runs, off, dev)
        levels.append((fin, nxt, bool(cont)))
        if not cont:
            break
        ids, cur = cont, new_rows
    inv = None
    if done_ids != list(range(n)):
        order = [0] * n
        for k, j in enumerate(done_ids):
            order[j] = k
        inv = torch.tensor(order, dtype=torch.int64, device=dev)
    return levels, inv


def _gather(runs: list[list[int]], off: int, dev: torch.device) -> torch.Tensor:
    """Index of each next-level row in this level's lanes followed by one zero row (index
    ``off``): the runs' rows, each run followed by its padding (built with vectorized ops)."""
    spans, reps = [], []
    dst = 0
    for a, b, pad in runs:
        spans.append((a - dst, dst + b - a))  # (source - destination, end of the run's real rows)
        reps.append(b - a + pad)
        dst += b - a + pad
    per = torch.repeat_interleave(torch.tensor(spans, dtype=torch.int64), torch.tensor(reps), dim=0)
    r = torch.arange(dst, dtype=torch.int64)
    return torch.where(r < per[:, 1], r + per[:, 0], off).to(dev)


_ZEROS: dict[tuple[torch.device, int], torch.Tensor] = {}


def finish(
    lanes: torch.Tensor,
    rows: list[int],
    dev: torch.device,
    sch: Scheme,
    planned: tuple | None = None,
    level: int = 1,
) -> torch.Tensor:
    """Level-0 lanes of consecutive tensors (``rows[i]`` rows each) -> (n, ``sch.lanes``) final
    lanes, row i = tensor i. A few device ops per level, whatever the number of tensors.
    ``planned``: ``plan`` of these rows, when the caller keeps one. ``level``: of the next call of
    the level function (lanes of a later level than 0 start further up)."""
    steps, inv = planned if planned is not None else plan(tuple(rows), dev, sch.fanin)
    width = sch.lanes
    done: list[torch.Tensor] = []
    for fin, nxt, more in steps:
        if fin is not None:
            done.append(lanes if isinstance(fin, str) else lanes.index_select(0, fin))
        if not more:
            break
        if nxt.__class__ is list:
            zeros = _ZEROS.get((dev, width))
            if zeros is None:
                with torch.inference_mode(False):
                    zeros = _ZEROS[(dev, width)] = torch.zeros(sch.fanin - 1, width, dtype=torch.int32, device=dev)
            parts = []
            for a, b, pad in nxt:
                parts.append(lanes[a:b])
                if pad:
                    parts.append(zeros[:pad])
            lanes = parts[0] if len(parts) == 1 else torch.cat(parts)
        elif nxt is not None:
            lanes = torch.cat([lanes, lanes.new_zeros(1, width)]).index_select(0, nxt)
        lanes = sch.mm(lanes.view(torch.int8).reshape(-1, _K), level)
        level += 1
    final = done[0] if len(done) == 1 else torch.cat(done)
    return final if inv is None else final.index_select(0, inv)
