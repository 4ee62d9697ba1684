"""The rollups table of a flush window: per (step, block) fingerprints of its records (pyarrow, no torch).

Written by the shard writer's thread next to each window's records shard (never on the training
thread's per-record path), so an analysis compares a few rows per block instead of every record
and reads only the blocks that differ. Pipeline of ``window_rollups``:

1. each record's position in its rank-step: ``Positions`` carries the count of each step's records
   already written by earlier windows of this launch (a step may span windows);
2. the three hashes of ``contract.rollup_hashes``, vectorized with pyarrow compute (bit-identical
   to the reference, which a test checks);
3. per contiguous run of one (step, block): count, errors, the XORs, the kinds mask and the seq
   range. A block cut by a window boundary has one row per window: XOR and sums combine them.
"""

from __future__ import annotations

import functools
import operator

import pyarrow as pa
import pyarrow.compute as pc

from detfp_format import contract

__all__ = ["Positions", "window_rollups"]

_U64 = pa.uint64()


def _s(v: int) -> pa.Scalar:
    return pa.scalar(v, _U64)


def _mix(x: pa.Array) -> pa.Array:
    """contract._mix element-wise (pyarrow's multiply wraps on overflow)."""
    x = pc.multiply(pc.bit_wise_xor(x, pc.shift_right(x, _s(30))), _s(0xBF58476D1CE4E5B9))
    x = pc.multiply(pc.bit_wise_xor(x, pc.shift_right(x, _s(27))), _s(0x94D049BB133111EB))
    return pc.bit_wise_xor(x, pc.shift_right(x, _s(31)))


def _args_ints(args: pa.ChunkedArray | pa.Array, null: int) -> pa.Array:
    """The args digests as integers (their 16 hex digits), ``null`` for a null: parsed once per distinct text."""
    enc = (
        pc.dictionary_encode(args).combine_chunks() if isinstance(args, pa.ChunkedArray) else pc.dictionary_encode(args)
    )
    values = pa.array([int(t, 16) for t in enc.dictionary.to_pylist()], _U64)
    return pc.fill_null(pc.take(values, enc.indices), _s(null))


class Positions:
    """Records of each step this launch already wrote (the next record's position in its rank-step)."""

    def __init__(self) -> None:
        self._seen: dict[int, int] = {}

    def take(self, steps: list[int]) -> list[int]:
        """Positions of a window's records (``steps``: each record's step, in seq order); advances the counts."""
        out: list[int] = []
        i, n = 0, len(steps)
        while i < n:
            j = i + 1
            while j < n and steps[j] == steps[i]:
                j += 1
            p = self.advance(steps[i], j - i)
            out.extend(range(p, p + j - i))
            i = j
        return out

    def advance(self, step: int, count: int) -> int:
        """Position of the first of ``count`` records of ``step`` that come next; counts them."""
        seen = self._seen
        p = seen.get(step, 0)
        seen[step] = p + count
        if len(seen) > 64:  # steps only move forward: forget the oldest
            for s in sorted(seen)[:-16]:
                del seen[s]
        return p


def window_rollups(records: pa.Table, positions: Positions) -> dict[str, list]:
    """The rollups table's columns (without rank/segment) for one window's ``records`` table.

    With numpy (present wherever pyarrow brings it) the per-block XORs are vectorized; without
    it, a pure-Python path computes the same values (a test proves both equal the reference).
    """
    if records.num_rows == 0:
        return {}
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy comes with pyarrow in practice
        return _python_rollups(records, positions)
    return _numpy_rollups(records, positions, np)


def _hashes(records: pa.Table, inblock: pa.Array) -> tuple[pa.Array, pa.Array, pa.Array]:
    """contract.rollup_hashes of every record, vectorized: (key, value, ordered)."""
    k_salt, _, o_salt, null = contract.ROLLUP_SALTS
    status = pc.cast(pc.index_in(records.column("status"), value_set=pa.array(contract.STATUSES)), _U64)
    k = _mix(pc.bit_wise_xor(records.column("key_hash"), _s(k_salt)))
    v = _mix(pc.bit_wise_xor(k, status))
    v = _mix(pc.bit_wise_xor(v, pc.fill_null(records.column("digest_hi"), _s(null))))
    v = _mix(pc.bit_wise_xor(v, pc.fill_null(records.column("digest_lo"), _s(null))))
    v = _mix(pc.bit_wise_xor(v, _args_ints(records.column("args_digest"), null)))
    o = _mix(pc.bit_wise_xor(v, _mix(pc.bit_wise_xor(inblock, _s(o_salt)))))
    return k, v, o


def _numpy_rollups(records: pa.Table, positions: Positions, np) -> dict[str, list]:
    steps = records.column("step").to_numpy()
    n = len(steps)
    change = np.flatnonzero(np.diff(steps)) + 1
    starts, ends = np.concatenate(([0], change)), np.concatenate((change, [n]))
    pos = np.empty(n, np.int64)
    for a, b in zip(starts.tolist(), ends.tolist(), strict=True):
        p = positions.advance(int(steps[a]), b - a)
        pos[a:b] = np.arange(p, p + b - a)
    block = contract.ROLLUP_BLOCK
    blk = pos // block
    k, v, o = (x.to_numpy() for x in _hashes(records, pa.array(pos % block, _U64)))
    idx = np.concatenate(([0], np.flatnonzero((np.diff(steps) != 0) | (np.diff(blk) != 0)) + 1))
    last = np.concatenate((idx[1:], [n])) - 1
    seq = records.column("seq").to_numpy()
    err = pc.equal(records.column("status"), "error").to_numpy(zero_copy_only=False).astype(np.int64)
    kind_idx = pc.index_in(records.column("kind"), value_set=pa.array(contract.KINDS)).to_numpy().astype(np.int64)
    bits = np.left_shift(np.int64(1), kind_idx)
    return {
        "step": steps[idx].tolist(),
        "seq": seq[idx].tolist(),
        "block": blk[idx].tolist(),
        "seq_hi": seq[last].tolist(),
        "n": (last - idx + 1).tolist(),
        "n_err": np.add.reduceat(err, idx).tolist(),
        "kx": np.bitwise_xor.reduceat(k, idx).tolist(),
        "vx": np.bitwise_xor.reduceat(v, idx).tolist(),
        "ox": np.bitwise_xor.reduceat(o, idx).tolist(),
        "kinds": np.bitwise_or.reduceat(bits, idx).tolist(),
    }


def _python_rollups(records: pa.Table, positions: Positions) -> dict[str, list]:
    n = records.num_rows
    steps = records.column("step").to_pylist()
    pos = positions.take(steps)
    block = contract.ROLLUP_BLOCK
    k, v, o = _hashes(records, pa.array([p % block for p in pos], _U64))
    ks, vs, os_ = k.to_pylist(), v.to_pylist(), o.to_pylist()
    seq = records.column("seq").to_pylist()
    kinds = records.column("kind").to_pylist()
    errs = records.column("status").to_pylist()
    cols: dict[str, list] = {c: [] for c in ("step", "seq", "block", "seq_hi", "n", "n_err", "kx", "vx", "ox", "kinds")}
    xor = functools.partial(functools.reduce, operator.xor)
    i = 0
    while i < n:
        s, b = steps[i], pos[i] // block
        j = i + 1
        while j < n and steps[j] == s and pos[j] // block == b:
            j += 1
        cols["step"].append(s)
        cols["seq"].append(seq[i])
        cols["block"].append(b)
        cols["seq_hi"].append(seq[j - 1])
        cols["n"].append(j - i)
        cols["n_err"].append(errs[i:j].count("error"))
        cols["kx"].append(xor(ks[i:j]))
        cols["vx"].append(xor(vs[i:j]))
        cols["ox"].append(xor(os_[i:j]))
        cols["kinds"].append(contract.kinds_mask(kinds[i:j]))
        i = j
    return cols
