"""``blocks.slices`` equals its per-step definition on random stored-rollup blocks.

The function tests every candidate step in one aggregation; the reference below is the
per-step loop it replaced. Blocks of B are A's with random changes: an ordered fingerprint
that differs, a record count that differs, a block missing on one side, digest errors, key
sets that differ, and steps that are not candidates.
"""

from __future__ import annotations

import polars as pl
from hypothesis import given, settings
from hypothesis import strategies as st

from detfp_analyze.bisect import blocks

_SCHEMA = {"rank": pl.Int32, "step": pl.Int64, "block": pl.Int64, "n": pl.UInt32, "n_err": pl.UInt32,
           "kx": pl.UInt64, "vx": pl.UInt64, "ox": pl.UInt64, "kinds": pl.Int64, "seq_lo": pl.Int64,
           "seq_hi": pl.Int64}  # fmt: skip


def _reference(blocks_a, blocks_b, cands):
    want = pl.DataFrame(
        [(r, s) for r, ss in cands.items() for s in ss], schema={"rank": pl.Int32, "step": pl.Int64}, orient="row"
    )
    if not want.height:
        return {}
    j = (
        blocks_a.join(want, on=["rank", "step"], how="semi")
        .join(blocks_b, on=["rank", "step", "block"], how="full", coalesce=True, suffix="_b")
        .sort("rank", "step", "block")
    )
    xor = lambda s: int(s.bitwise_xor() or 0)  # noqa: E731
    out = {}
    for (rank, step), g in j.group_by("rank", "step", maintain_order=True):
        if g["n"].null_count() or g["n_b"].null_count():
            continue
        same_keys = g["n"].sum() == g["n_b"].sum() and xor(g["kx"]) == xor(g["kx_b"])
        if not same_keys or g["n_err"].sum() or g["n_err_b"].sum():
            continue
        idx = ((g["n"] != g["n_b"]) | (g["ox"] != g["ox_b"])).arg_true()
        if not len(idx):
            continue
        first, last = int(idx[0]), int(idx[-1])
        start = max(first - 1, 0)
        out[(int(rank), int(step))] = (
            (int(g["seq_lo"][start]), int(g["seq_hi"][last])),
            (int(g["seq_lo_b"][start]), int(g["seq_hi_b"][last])),
            start > 0,
            int(g["kinds"].bitwise_or() or 0) | int(g["kinds_b"].bitwise_or() or 0),
        )
    return out


@st.composite
def _pairs(draw):
    a, b, cands = [], [], {}
    for rank in draw(st.lists(st.integers(0, 4), min_size=1, max_size=3, unique=True)):
        for step in range(draw(st.integers(1, 3))):
            if draw(st.booleans()):
                cands.setdefault(rank, []).append(step)
            seq = 0
            for block in range(draw(st.integers(1, 6))):
                n = draw(st.integers(1, 4))
                row = dict(rank=rank, step=step, block=block, n=n, n_err=0, kx=draw(st.integers(0, 7)),
                           vx=draw(st.integers(0, 7)), ox=draw(st.integers(0, 7)), kinds=draw(st.integers(0, 15)),
                           seq_lo=seq, seq_hi=seq + n - 1)  # fmt: skip
                seq += n
                a.append(row)
                change = draw(st.sampled_from(["same", "same", "ox", "n", "missing", "err", "kx", "kinds"]))
                if change == "missing":
                    continue
                other = dict(row)
                if change == "ox":
                    other["ox"] = row["ox"] + 8
                elif change == "n":
                    other["n"] = row["n"] + 1
                elif change == "err":
                    other["n_err"] = 1
                elif change == "kx":
                    other["kx"] = row["kx"] + 8
                elif change == "kinds":
                    other["kinds"] = row["kinds"] | 16
                other["seq_lo"] += draw(st.integers(0, 2))
                other["seq_hi"] = other["seq_lo"] + other["n"] - 1
                b.append(other)
    frame = lambda rows: pl.DataFrame(rows, schema=_SCHEMA)  # noqa: E731
    return frame(a), frame(b), cands


@settings(max_examples=200, deadline=None)
@given(pair=_pairs())
def test_slices_equal_the_per_step_definition(pair):
    a, b, cands = pair
    got = {k: (v.seq_a, v.seq_b, v.cut, v.kinds) for k, v in blocks.slices(a, b, cands).items()}
    want = {k: (sa, sb, cut, blocks._kinds(mask)) for k, (sa, sb, cut, mask) in _reference(a, b, cands).items()}
    assert got == want
