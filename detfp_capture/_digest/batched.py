"""Start the digests of many tensors at once (parameters, gradients, optimizer states).

``digest.start`` costs a handful of small device ops per tensor; at a step boundary capture
digests every parameter, gradient and optimizer state (hundreds of tensors), so this module
runs the same tree levels (docs/digest.md) for a whole batch: level 0 is one concatenation of
every tensor's bytes, each zero-padded to whole 1024-byte rows, and one call of the level
function; each further level does the same for the tensors that still have more than one row.
The result per tensor is its final lanes row (of the version active when the batch started),
handed to ``digest.resolve`` in an ordinary ``Pending``, so the digests are identical to
``digest.start``'s (a test checks it).
Tensors the batch path does not cover (small ones, which go to the digest arena anyway,
subclasses, int64 pointer checks, byte-viewed dtypes, conjugate views) use ``digest.start``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from detfp_capture._digest import core, levels, versions
from detfp_capture._digest import pending as digest
from detfp_capture._digest.core import Scheme

__all__ = [
    "BATCHED",
    "DIRECT",
    "INT64",
    "PLAIN",
    "SPECIAL",
    "STRIDED",
    "BatchLanes",
    "K",
    "fill",
    "in_place",
    "start_many",
]

# Shared with staging.py, which stages the same tensors into its own arena.
#: Bytes per hashed row.
K = core.K
#: Tensor types batched as they are (subclasses take their own path).
PLAIN = (torch.Tensor, torch.nn.Parameter)
#: Dtypes hashed through a byte view, never batched.
SPECIAL = digest._BYTE_DTYPES
# Module-level aliases: the checks run per tensor at every step boundary.
INT64 = torch.int64
STRIDED = torch.strided


def _batchable(t: torch.Tensor) -> bool:
    # Small tensors too: a one-row tensor's digest is its level-0 row, as in digest.start's arena.
    # Cheapest tests first: this runs for every parameter, gradient and state at a step boundary.
    dt = t.dtype
    return (
        type(t) in PLAIN
        and dt is not INT64
        and t.layout is STRIDED
        and dt not in SPECIAL
        and t.numel() > 0
        and not t.is_nested
        and not t.is_meta
        and not t.is_conj()
        and not t.is_neg()
        and not (t.is_cuda and torch.cuda.is_current_stream_capturing())
    )


#: ``slot.pending`` of a slot filled by ``fill``: the slot itself carries the batched row.
BATCHED = object()


def fill(
    slot: Any, held: BatchLanes, row: int, dtype: torch.dtype, shape: tuple, numel: int, dev: Any, pointer: bool = False
) -> None:
    """Make ``slot`` (a capture Slot) stand for the pending of row ``row`` of ``held``
    (``pointer``: its pointer flag is in ``held.ptr_out``)."""
    slot.arena = held
    slot.arena_pointer = pointer
    slot.row = row
    slot.dtype = dtype
    slot.shape = shape
    slot.numel = numel
    slot.device = dev
    slot.pending = BATCHED


def start_many(
    tensors: Sequence[torch.Tensor], slots: Sequence[Any] | None = None, *, reuse: bool = False
) -> list[digest.Pending] | None:
    """``digest.start(t, pointer_check=...)`` for every tensor, batched where possible.

    With ``slots`` (capture Slots, one per tensor) the results go into them instead (``fill``
    for batched rows, ``slot.pending`` otherwise) and nothing is returned. ``reuse``: the same
    set of tensor shapes comes back (a step boundary): keep the batch's layout and finishing
    plan for it. Other batches (op-level, staged) rarely repeat and are not worth a signature."""
    sch = versions.active()
    sig = _signature(tensors) if reuse else None
    if sig is not None:
        sig = (sch.version, sig)
    lay = _LAYOUTS.get(sig) if sig is not None else None
    if lay is not None and not (lay.dev.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        try:
            if lay.own is None and lay.need:
                _own(lay)  # a layout used twice is a step boundary's: worth its own buffer
            final = _run_owned(tensors, lay) if lay.own is not None else _run_layout(list(tensors), lay)
        except Exception:
            lay = None
        else:
            return _hand_out(tensors, slots, BatchLanes(final, sch), lay)
    out: list[digest.Pending | None] = [None] * len(tensors)
    groups: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        try:
            ok = _batchable(t)
        except Exception:
            ok = False
        if ok:
            groups.setdefault(t.device, []).append(i)
        else:
            out[i] = digest.start(t, pointer_check=t.dtype is torch.int64, version=sch.version)
    for dev, idx in groups.items():
        sub = [tensors[i] for i in idx]
        try:
            lay = _layout(sub, dev, sch)
            final = _run_layout(sub, lay)
        except Exception:
            for i in idx:
                out[i] = digest.start(tensors[i], version=sch.version)
            continue
        if sig is not None and len(idx) == len(tensors):  # all batchable, one device: reusable
            if len(_LAYOUTS) >= _LAYOUT_LIMIT:
                _LAYOUTS.clear()
            _LAYOUTS[sig] = lay
        got = _hand_out(sub, None if slots is None else [slots[i] for i in idx], BatchLanes(final, sch), lay)
        if got is not None:
            for i, p in zip(idx, got, strict=True):
                out[i] = p
    if slots is None:
        return out  # type: ignore[return-value]
    for s, p in zip(slots, out, strict=True):
        if p is not None:
            s.pending = p
    return None


def _hand_out(ts: Sequence[torch.Tensor], slots: Sequence[Any] | None, held: BatchLanes, lay: _Layout):
    """Each tensor's result is a row of one (n, lanes) tensor, the way an arena hands out rows:
    resolve gathers a whole batch at once instead of one (1, lanes) view per tensor."""
    dev = lay.dev
    if slots is not None:
        for i, slot in enumerate(slots):
            fill(slot, held, lay.pos[i], lay.dtypes[i], lay.shapes[i], lay.numels[i], dev)
        return None
    out = []
    for i in range(len(ts)):
        p = digest.Pending(lay.dtypes[i], lay.shapes[i], lay.numels[i], dev)
        p.arena = held
        p.row = lay.pos[i]
        out.append(p)
    return out


def _signature(ts: Sequence[torch.Tensor]) -> tuple | None:
    """Everything a batch's layout and batchability depend on, per tensor (None: not cacheable).
    Step boundaries repeat the same signature every step (parameters, gradients, states)."""
    try:
        return tuple(
            (type(t), t.dtype, t.shape, t.device, t.layout, t.is_contiguous(), t.is_conj(), t.is_neg(), t.is_nested)
            for t in ts
        )
    except Exception:  # e.g. a nested tensor's shape
        return None


_LAYOUTS: dict[tuple, _Layout] = {}
_LAYOUT_LIMIT = 16
#: The most bytes the cached layouts' own buffers (``_own``) may hold together.
_OWN_LIMIT = 64 << 20


class BatchLanes:
    """Final-level lanes of a batch, one row per tensor, of digest version ``scheme``. Stands
    where ``digest.resolve`` expects an arena (``seal`` returns the lanes). Pointer flags of its
    int64 rows, if any, are ``ptr_out`` (bool, one per such row) at ``ptr_pos`` (row -> index),
    as an arena has them; no moments."""

    __slots__ = ("lanes", "ptr_out", "ptr_pos", "scheme")

    def __init__(self, lanes: torch.Tensor, scheme: Scheme) -> None:
        self.lanes = lanes
        self.scheme = scheme
        self.ptr_out: torch.Tensor | None = None
        self.ptr_pos: dict[int, int] = {}

    def seal(self) -> torch.Tensor:
        return self.lanes


class _Scratch:
    """A reused device buffer that small and odd-sized tensors are concatenated into before the
    level-0 GEMM. Reuse matters: a fresh allocation of tens of MiB per batch is paid in page
    faults (5x the cost of the copy itself on CPU). Stream order (CUDA) or eager execution (CPU)
    makes the next batch's writes land after this batch's GEMM has read the bytes."""

    CAP = 64 << 20  # bytes; bigger batches are hashed in several regions

    def __init__(self) -> None:
        self.bufs: dict[torch.device, torch.Tensor] = {}

    def get(self, dev: torch.device, nbytes: int) -> torch.Tensor:
        buf = self.bufs.get(dev)
        if buf is None or buf.numel() < nbytes:
            size = min(self.CAP, max(nbytes, 1 << 20, 0 if buf is None else 2 * buf.numel()))
            with torch.inference_mode(False):  # reused in and out of inference mode
                buf = self.bufs[dev] = torch.empty(size, dtype=torch.int8, device=dev)
        return buf


_SCRATCH = _Scratch()


class _Layout:
    """Where each tensor of a batch goes: computed from the tensors' dtypes, shapes and
    contiguity only, so a batch with the same signature reuses it (``_LAYOUTS``)."""

    __slots__ = (
        "dev", "dst", "dtypes", "flat_rows", "need", "numels", "own", "plan", "pos", "rows", "scheme", "segments",
        "shapes", "src", "stretches",
    )  # fmt: skip

    def __init__(self, dev: torch.device, scheme: Scheme) -> None:
        self.dev = dev
        self.scheme = scheme
        # In lanes order: (None, tensor index) hashed in place, or (dtype, tensor indices,
        # bytes) copied together into the scratch buffer.
        self.segments: list[tuple] = []
        self.flat_rows: list[int] = []  # level-0 rows of each tensor, in lanes order
        self.pos: list[int] = []  # tensor index -> its row in the final lanes
        self.need = 0  # scratch bytes
        self.dtypes: list[torch.dtype] = []
        self.shapes: list[tuple[int, ...]] = []  # tuples: gc untracks them, not Sizes
        self.numels: list[int] = []
        self.plan: tuple | None = None  # levels.plan of flat_rows, built on the first run
        self.rows = 0  # level-0 rows of the whole batch (sum of flat_rows)
        # Set by _own for a reused layout: its own zeroed buffer (int8), the views of it that
        # the copied tensors (indices ``src``) go to, and the level-0 GEMMs in lanes order:
        # (int8 rows of ``own``, or the index of a tensor hashed in place; first lanes row).
        self.own: torch.Tensor | None = None
        self.dst: list[torch.Tensor] = []
        self.src: list[int] = []
        self.stretches: list[tuple] = []


def _layout(ts: list[torch.Tensor], dev: torch.device, sch: Scheme) -> _Layout:
    """Tensors grouped by (dtype, rows): large contiguous ones hashed in place, the others
    concatenated per dtype into the scratch buffer (one C++ call per run) and hashed by one
    level-0 GEMM per region; then ``levels.finish`` runs the further levels for the whole batch."""
    lay = _Layout(dev, sch)
    groups: dict[tuple, list[int]] = {}
    for i, t in enumerate(ts):
        dt = t.dtype
        groups.setdefault((dt, -(-(t.numel() * dt.itemsize) // K) or 1), []).append(i)
        lay.dtypes.append(dt)
        lay.shapes.append(tuple(t.shape))
        lay.numels.append(t.numel())
    keys = sorted(groups, key=lambda k: (str(k[0]), k[1]))
    direct = [in_place(t) for t in ts]
    rows_of = {i: k[1] for k in keys for i in groups[k]}
    for dt in dict.fromkeys(k[0] for k in keys):
        idx: list[int] = []
        for k in keys:
            if k[0] is dt:
                idx += groups[k]
        run: list[int] = []
        for i in idx:
            if direct[i]:
                if run:
                    lay.segments.append((dt, run, sum(rows_of[j] for j in run) * K))
                    run = []
                lay.segments.append((None, i))
            else:
                run.append(i)
        if run:
            lay.segments.append((dt, run, sum(rows_of[j] for j in run) * K))
    lay.need = sum(seg[2] for seg in lay.segments if seg[0] is not None)
    lay.pos = [0] * len(ts)
    for k in keys:
        for i in groups[k]:
            lay.pos[i] = len(lay.flat_rows)
            lay.flat_rows.append(k[1])
    lay.rows = sum(lay.flat_rows)
    return lay


def _run_layout(ts: list[torch.Tensor], lay: _Layout) -> torch.Tensor:
    """Final lanes of ``ts`` (laid out by ``lay``) as one (n, lanes) tensor, row ``lay.pos[i]``."""
    dev = lay.dev
    with torch.no_grad():
        # Level-0 lanes of every segment, in order, written by each GEMM straight into its rows
        # of one tensor (no concatenation copy afterwards).
        sch = lay.scheme
        lanes = torch.empty(lay.rows, sch.lanes, dtype=torch.int32, device=dev)
        at = [0]  # next row of ``lanes``
        buf = _SCRATCH.get(dev, lay.need) if lay.need else None
        region = [0, 0]  # scratch bytes [start, end) written but not hashed yet

        def hash_rows(x: torch.Tensor) -> None:
            r = at[0]
            sch.mm(x, 0, out=lanes[r : r + x.shape[0]])
            at[0] = r + x.shape[0]

        def hash_region() -> None:
            a, b = region
            if b > a:
                assert buf is not None  # a region is written only into a scratch (lay.need > 0)
                hash_rows(buf[a:b].view(-1, K))
            region[0] = b

        for seg in lay.segments:
            if seg[0] is None:  # hashed in place: no copy (at a step boundary, most bytes)
                hash_region()
                hash_rows(core.bytes_view(ts[seg[1]]).view(-1, K))
                continue
            dt, run, nb = seg
            pieces = [ts[i] for i in run]
            if buf is None or nb > buf.numel():
                hash_region()
                hash_rows(_flat_rows(pieces, dev)[0].view(-1, K))
                continue
            if region[1] + nb > buf.numel():
                hash_region()
                region[0] = region[1] = 0
            a = region[1]
            _cat_rows(pieces, buf[a : a + nb].view(dt), dev)
            region[1] = a + nb
        hash_region()
        if at[0] != lay.rows:  # never leave rows of ``lanes`` unwritten (caller falls back)
            raise RuntimeError(f"batch layout wrote {at[0]} of {lay.rows} level-0 rows")
        return _finish_layout(lanes, lay)


def _finish_layout(lanes: torch.Tensor, lay: _Layout) -> torch.Tensor:
    """The further levels of a layout's level-0 lanes, with the layout's plan (built once)."""
    if lay.plan is None:
        lay.plan = levels.plan(tuple(lay.flat_rows), lay.dev, lay.scheme.fanin)
    return levels.finish(lanes, lay.flat_rows, lay.dev, lay.scheme, lay.plan)


def _own(lay: _Layout) -> None:
    """Give a reused layout its own buffer, zeroed once, with a view of it shaped like each
    tensor that is copied: ``_run_owned`` then takes the copies in one ``_foreach_copy_`` call
    instead of building per-tensor views and padding pieces every time (at a step boundary of
    a small model, that Python costs more than the hashing). The padding stays zero: nothing
    else writes the buffer. Skipped past ``_OWN_LIMIT`` bytes for all layouts together."""
    if sum(other.need for other in _LAYOUTS.values() if other.own is not None) + lay.need > _OWN_LIMIT:
        return
    with torch.inference_mode(False):  # reused in and out of inference mode
        own = torch.zeros(lay.need, dtype=torch.int8, device=lay.dev)
        dst: list[torch.Tensor] = []
        src: list[int] = []
        stretches: list[tuple] = []
        off = row = start = 0  # start: first byte of the copied rows not in a stretch yet

        def close() -> None:  # the copied rows so far become one stretch (one GEMM)
            nonlocal row, start
            if off > start:
                stretches.append((own[start:off].view(-1, K), row))
                row += (off - start) // K
            start = off

        for seg in lay.segments:
            if seg[0] is None:
                close()
                stretches.append((seg[1], row))
                row += lay.flat_rows[lay.pos[seg[1]]]
                continue
            dt, run, _ = seg
            for i in run:
                nb = lay.numels[i] * dt.itemsize
                dst.append(own[off : off + nb].view(dt).view(lay.shapes[i]))
                src.append(i)
                off += (-(-nb // K) or 1) * K
        close()
    if off != lay.need or row != lay.rows:  # never a layout that would leave bytes or rows out
        raise RuntimeError(f"own buffer of {off} bytes, {row} rows for a layout of {lay.need} bytes, {lay.rows} rows")
    lay.own, lay.dst, lay.src, lay.stretches = own, dst, src, stretches


def _run_owned(ts: Sequence[torch.Tensor], lay: _Layout) -> torch.Tensor:
    """``_run_layout`` for a layout with its own buffer: one call copies every tensor that is
    not hashed in place, then one level-0 GEMM per stretch of rows writes the lanes."""
    with torch.no_grad():
        torch._foreach_copy_(lay.dst, [ts[i] for i in lay.src])
        sch = lay.scheme
        lanes = torch.empty(lay.rows, sch.lanes, dtype=torch.int32, device=lay.dev)
        mm = sch.mm
        for x, r in lay.stretches:
            if x.__class__ is int:
                x = core.bytes_view(ts[x]).view(-1, K)
            mm(x, 0, out=lanes[r : r + x.shape[0]])
        return _finish_layout(lanes, lay)


#: Tensors of at least this many bytes (whole 1024-byte rows, contiguous) are hashed where they
#: are, without a copy: in batches here and when staged (_staging).
DIRECT = 256 << 10


def in_place(t: torch.Tensor) -> bool:
    """Whether ``t`` is hashed where it lies: contiguous, whole rows, at least the direct size."""
    nb = t.numel() * t.dtype.itemsize
    return nb >= DIRECT and nb % K == 0 and t.is_contiguous()


def _pieces(ts: list[torch.Tensor], dev: torch.device) -> tuple[list[torch.Tensor], list[int]]:
    """Each tensor's elements followed by zeros up to whole 1024-byte rows; each row count."""
    pieces: list[torch.Tensor] = []
    rows: list[int] = []
    item = ts[0].dtype.itemsize
    for t in ts:
        nb = t.numel() * item
        m = -(-nb // K) or 1
        pieces.append(t)
        pad = m * K - nb  # a multiple of the item size: 1024 is
        if pad:
            key = (t.dtype, dev, pad)
            z = _PADS.get(key)
            if z is None:
                z = _PADS[key] = torch.zeros(pad // item, dtype=t.dtype, device=dev)
            pieces.append(z)
        rows.append(m)
    return pieces, rows


def _cat_rows(ts: list[torch.Tensor], out: torch.Tensor, dev: torch.device) -> None:
    """``_flat_rows`` into ``out`` (1-D, the tensors' dtype, exactly the rows' size): one copy.

    Contiguous pieces go through one ``torch.cat``; a non-contiguous one (a transposed weight
    read by a GEMM, at level ops) is copied straight into its place, since ``reshape`` would
    first materialize it in a fresh allocation (two copies, and page faults for large ones)."""
    pieces, _ = _pieces(ts, dev)
    flat: list[torch.Tensor] = []
    start = off = 0
    for p in pieces:
        n = p.numel()
        if p.is_contiguous():
            flat.append(p.view(-1))
        else:
            if flat:
                torch.cat(flat, out=out[start:off])
                flat = []
            out[off : off + n].view(p.shape).copy_(p)
            start = off + n
        off += n
    if flat:
        torch.cat(flat, out=out[start:off])


_PADS: dict[tuple, torch.Tensor] = {}


def _flat_rows(ts: list[torch.Tensor], dev: torch.device) -> tuple[torch.Tensor, list[int]]:
    """Bytes of same-dtype tensors, each zero-padded to whole 1024-byte rows, as one int8 tensor
    (one ``flatten_dense_tensors`` call, a fresh allocation: only for runs bigger than the
    scratch buffer); returns it and each tensor's row count."""
    pieces, rows = _pieces(ts, dev)
    # flatten_dense_tensors: contiguous logical elements, a copy (it needs two pieces or more).
    flat = pieces[0].reshape(-1) if len(pieces) == 1 else torch._C._nn.flatten_dense_tensors(pieces)
    return flat.view(torch.int8), rows
