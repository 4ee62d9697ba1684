"""``resolve``: started digests (``digest.Pending``) to their values, in batches.

A resolve finalizes every digest of a device and digest version at once (the lanes of each mixed
with its metadata words, on the device or, for a few, on the host) and fetches them, with the moments and
pointer flags asked for, in one device-to-host copy per device. A digest arrives as two unsigned
64-bit words (high, low) and stays two integers all the way to the trace's ``digest_hi`` /
``digest_lo`` columns; only ``Fingerprint.digest`` and row digests are 32-hex text.
``resolve`` gives ``Fingerprint`` objects (public, through ``detfp_capture.digest``);
``resolve_raw`` gives ``Resolved`` tuples and ``resolve_rows`` resolves rows of batches in bulk:
both for the capture's flush.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import MappingProxyType
from typing import Any, NamedTuple

import torch

from detfp_capture._digest import core
from detfp_capture._digest.core import Scheme
from detfp_capture._digest.results import Fingerprint, Moments, _fingerprint_fast
from detfp_capture._digest.subclass import combined

__all__ = ["Resolved", "resolve", "resolve_raw", "resolve_rows"]

#: Batches up to this size are finalized on the host (cheaper than ~120 tiny device ops).
_HOST_FINALIZE = 32

Pending = Any  # digest.Pending (not imported: the pending module imports this one)
_Arena = Any  # digest._Arena, or a batch with the same seal()/rows/scheme interface


def _key(p: Pending) -> tuple[Any, Scheme]:
    """What a digest is finalized with: its device and its version (its arena's, or its own)."""
    a = p.arena
    return p.device, (a.scheme if a is not None else p.scheme)


class Resolved(NamedTuple):
    """One digest as the capture's flush takes it (``resolve_raw``): no ``Fingerprint`` object,
    which is two objects for the cyclic collector to track, and no hex text."""

    #: High and low 64 bits of the digest as unsigned integers; None when ``error`` is set.
    hi: int | None
    lo: int | None
    #: Why the tensor could not be digested; None when the digest is valid.
    error: str | None
    #: Row or chunk digests (32 hex each) when asked for, else None.
    rows: tuple[str, ...] | None
    #: Magnitude moments when asked for, else None.
    moments: Moments | None
    #: int64 values that all look like device pointers (when the check was asked for).
    pointer_like: bool


class _Fetched(NamedTuple):
    """What one device's part of a resolve brought back to the host."""

    #: Two words (hi, lo) per digest, in the order of the device's ``_Batch``.
    words: list[int]
    #: Arena (or batch) -> index of its first digest in ``words`` (in digests, not words).
    offsets: dict[_Arena, int]
    #: Four float64 values (sum, absmax, nan, inf) per digest that asked for moments.
    moments: list[float]
    #: One 0/1 per digest that asked for the pointer check.
    pointers: list[int]


def _hex(hi: int | None, lo: int | None) -> str:
    """32 hex digits of a digest (``_raw`` sets both words; a None here is a bug, and fails)."""
    return f"{hi:016x}{lo:016x}"


class _Batch:
    """Everything one device and digest version contribute to a resolve: lanes to finalize,
    moments, pointer flags."""

    def __init__(self, scheme: Scheme) -> None:
        self.scheme = scheme
        self.direct: list[torch.Tensor] = []
        self.direct_meta: list[tuple[int, int]] = []
        self.arenas: dict[_Arena, tuple[list[int], list[tuple[int, int]]]] = {}
        self.slots: dict[int, tuple[_Arena | None, int]] = {}  # id(pending) -> (group, index)
        self.row_slots: dict[int, int] = {}  # id(pending) -> first direct index of its rows
        self.moments = _Column()  # (4,) float64 per pending
        self.pointers = _Column()  # 0-dim bool per pending

    def add(self, p: Pending) -> None:
        key = id(p)
        if key in self.slots:
            return
        sch = self.scheme
        meta = core.meta_words(sch, p.dtype, p.shape)
        if p.arena is not None:
            rows, metas = self.arenas.setdefault(p.arena, ([], []))
            self.slots[key] = (p.arena, len(rows))
            rows.append(p.row)
            metas.append(meta)
        else:
            self.slots[key] = (None, len(self.direct_meta))
            self.direct.append(p.lanes)
            self.direct_meta.append(meta)
        if p.rows_lanes is not None:
            self.row_slots[key] = len(self.direct_meta)
            self.direct.append(p.rows_lanes)
            for count, shape in p.rows_meta:
                self.direct_meta += [core.meta_words(sch, p.dtype, shape)] * count
        if p.moments is not None:
            self.moments.add(key, p.moments)
        elif p.arena_moments:
            self.moments.add_row(key, p.arena, p.row)
        if p.pointer is not None:
            self.pointers.add(key, p.pointer)
        elif p.arena_pointer:
            self.pointers.add_row(key, p.arena, p.row)

    def run(self, device: torch.device) -> _Fetched:
        """Finalize and fetch once."""
        parts = list(self.direct)
        metas = list(self.direct_meta)
        offsets: dict[_Arena, int] = {}
        for arena, (rows, ameta) in self.arenas.items():
            offsets[arena] = len(metas)
            parts.append(_arena_rows(arena, rows))
            metas += ameta
        lanes_all = parts[0] if len(parts) == 1 else torch.cat(parts)
        final, on_host = _final_words(lanes_all, metas, device, self.scheme)
        pack = [final]
        moments = self.moments.gather(lambda a: (a.mom_out, a.mom_pos))
        pointers = self.pointers.gather(lambda a: (a.ptr_out, a.ptr_pos))
        if moments is not None:
            pack.append(moments.view(torch.int64).reshape(-1))
        if pointers is not None:
            pack.append(pointers.to(torch.int64))
        host = (pack[0] if len(pack) == 1 else torch.cat(pack)).cpu()  # the one device->host copy
        nd = pack[0].numel()
        nm = 0 if moments is None else moments.numel()
        words = _words(host[:nd], metas, on_host, self.scheme)
        moms = host[nd : nd + nm].view(torch.float64).tolist() if nm else []
        ptrs = host[nd + nm :].tolist() if pointers is not None else []
        return _Fetched(words, offsets, moms, ptrs)


def _arena_rows(arena: Any, rows: list[int]) -> torch.Tensor:
    """Lanes of these rows of a sealed arena (or batch), in this order."""
    lanes = arena.seal()
    if rows == list(range(len(rows))):
        return lanes[: len(rows)]
    return lanes.index_select(0, torch.tensor(rows, dtype=torch.int64, device=lanes.device))


def _final_words(
    lanes: torch.Tensor, metas: list[tuple[int, int]], device: torch.device, sch: Scheme
) -> tuple[torch.Tensor, bool]:
    """What to fetch for these digests (1-D int64 on ``device``), and whether the host still
    finalizes it: a few digests are finalized in Python (~120 tiny device ops cost more than a
    few mixes), the rest on the device."""
    if len(metas) <= _HOST_FINALIZE:
        return lanes.reshape(-1).to(torch.int64), True
    meta = torch.tensor(metas, dtype=torch.int64).to(device)
    return sch.finalize(lanes, meta).reshape(-1), False


def _words(host: torch.Tensor, metas: list[tuple[int, int]], on_host: bool, sch: Scheme) -> list[int]:
    """The fetched ``_final_words`` as unsigned 64-bit integers, two (hi, lo) per digest."""
    if not on_host:
        return host.view(torch.uint64).tolist()  # int64 bits read as unsigned: one C call
    head = host.tolist()
    n = sch.lanes
    words: list[int] = []
    for i, meta in enumerate(metas):
        words += sch.finalize_host(head[n * i : n * i + n], meta)
    return words


class _Column:
    """Per-pending device values (moments, pointer flags) from two sources, gathered in one order:
    tensors computed at start, and rows of arenas computed at seal."""

    def __init__(self) -> None:
        self.direct: list[torch.Tensor] = []
        self.rows: dict[_Arena, list[int]] = {}
        self.slots: dict[int, tuple[_Arena | None, int]] = {}  # id(pending) -> (source, index)
        self.offsets: dict[_Arena | None, int] = {}

    def add(self, key: int, value: torch.Tensor) -> None:
        self.slots[key] = (None, len(self.direct))
        self.direct.append(value)

    def add_row(self, key: int, arena: _Arena, row: int) -> None:
        rows = self.rows.setdefault(arena, [])
        self.slots[key] = (arena, len(rows))
        rows.append(row)

    def gather(self, source) -> torch.Tensor | None:
        """One tensor: the direct values, then each arena's rows (arenas already sealed)."""
        parts = []
        at = 0
        if self.direct:
            parts.append(torch.stack(self.direct))
            self.offsets[None] = 0
            at = len(self.direct)
        for arena, rows in self.rows.items():
            out, pos = source(arena)
            parts.append(out[torch.tensor([pos[r] for r in rows], dtype=torch.int64, device=out.device)])
            self.offsets[arena] = at
            at += len(rows)
        if not parts:
            return None
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def index(self, key: int) -> int | None:
        slot = self.slots.get(key)
        return None if slot is None else self.offsets[slot[0]] + slot[1]


def _leaves(p: Pending, out: list[Pending]) -> None:
    if p.error is not None:
        return
    if p.components is not None:
        for c in p.components.values():
            _leaves(c, out)
    else:
        out.append(p)


def resolve(pendings: Sequence[Pending]) -> list[Fingerprint]:
    """Fingerprints of started digests, in order: one batched finalize and one fetch per device."""
    batches, results, failed = _run_batches(pendings)
    return [_build(p, batches, results, failed) for p in pendings]


def resolve_raw(pendings: Sequence[Pending]) -> list[Resolved]:
    """``resolve`` as ``Resolved`` tuples, for the capture's flush: no Fingerprint objects (two
    objects each for the cyclic collector to track) and no hex text."""
    batches, results, failed = _run_batches(pendings)
    out: list[Resolved] = []
    for p in pendings:
        if p.error is None and p.components is None and _key(p) not in failed:
            out.append(_raw(p, batches, results))
        else:
            f = _build(p, batches, results, failed)
            if f.error is not None:
                out.append(Resolved(None, None, f.error, f.rows, f.moments, f.pointer_like))
            else:
                out.append(Resolved(f.hi, f.lo, None, f.rows, f.moments, f.pointer_like))
    return out


def _rows_plan(items: Sequence[Any], meta_words: Callable[[Scheme, Any, Any], tuple[int, int]]) -> list[tuple]:
    """How ``resolve_rows`` gathers ``items``: per (device, scheme), in order of first appearance,
    (device, scheme, [(arena, its items' rows)], the items' indices in that order, their meta
    words). The native record path has it in C (``_hostpath.rows_plan``, the same plan)."""
    by_dev: dict[tuple[Any, Scheme], dict[Any, list[int]]] = {}
    for i, it in enumerate(items):
        key = (it.device, it.arena.scheme)
        arenas = by_dev.get(key)
        if arenas is None:
            arenas = by_dev[key] = {}
        idx = arenas.get(it.arena)
        if idx is None:
            arenas[it.arena] = [i]
        else:
            idx.append(i)
    plan = []
    for (dev, sch), arenas in by_dev.items():
        parts, order = [], []
        for arena, idx in arenas.items():
            parts.append((arena, [items[i].row for i in idx]))
            order += idx
        plan.append((dev, sch, parts, order, [meta_words(sch, items[i].dtype, items[i].shape) for i in order]))
    return plan


def _scatter(his: list, los: list, order: list[int], words: list[int]) -> None:
    """Word pairs ``words`` (hi, lo, hi, lo, ...) into ``his``/``los`` at ``order``."""
    for i, hi, lo in zip(order, words[0::2], words[1::2], strict=True):
        his[i] = hi
        los[i] = lo


def resolve_rows(
    items: Sequence[Any], plan: Callable[..., list[tuple]] = _rows_plan, scatter: Callable[..., None] = _scatter
) -> tuple[list[int | None], list[int | None]]:
    """Digests of rows of sealed-at-resolve batches, in bulk, as (high words, low words): each
    item has ``arena`` (something with ``seal()`` -> lanes and a ``scheme``), ``row``, ``dtype``,
    ``shape`` and ``device``, and no row digests, moments or pointer flag (the capture's batched Slots). What
    ``resolve_raw`` does per pending in Python (a dozen dictionary operations) done per batch
    instead: one finalize and one fetch per device. None for items on a device that failed.
    ``plan``/``scatter``: ``_rows_plan``/``_scatter`` or the native record path's same."""
    his: list[int | None] = [None] * len(items)
    los: list[int | None] = [None] * len(items)
    try:
        groups = plan(items, core.meta_words)
    except Exception:  # (a meta that cannot be made, as below: every item gets the general path)
        return his, los
    with torch.no_grad():
        for dev, sch, parts, order, metas in groups:
            try:
                lanes = [_arena_rows(arena, rows) for arena, rows in parts]
                final, on_host = _final_words(lanes[0] if len(lanes) == 1 else torch.cat(lanes), metas, dev, sch)
                words = _words(final.cpu(), metas, on_host, sch)  # the one device->host copy
            except Exception:  # a device error surfacing late: these items get the general path
                continue
            scatter(his, los, order, words)
    return his, los


def _run_batches(pendings: Sequence[Pending]) -> tuple[dict, dict, dict]:
    leaves: list[Pending] = []
    for p in pendings:
        _leaves(p, leaves)
    batches: dict[Any, _Batch] = {}
    for p in leaves:
        key = _key(p)
        b = batches.get(key)
        if b is None:
            b = batches[key] = _Batch(key[1])
        b.add(p)
    results: dict[Any, Any] = {}
    failed: dict[Any, str] = {}
    with torch.no_grad():
        for key, b in batches.items():
            try:
                results[key] = b.run(key[0])
            except Exception as e:  # e.g. a device error surfacing late: mark that device's digests
                failed[key] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
    return batches, results, failed


_DTYPE_STR: dict[torch.dtype | None, str] = {}


def _build(p: Pending, batches: dict, results: dict, failed: dict) -> Fingerprint:
    dtype = _DTYPE_STR.get(p.dtype)
    if dtype is None:
        dtype = _DTYPE_STR[p.dtype] = str(p.dtype) if p.dtype is not None else ""
    shape = tuple(p.shape)  # torch.Size holds Python ints
    if p.error is not None:
        return Fingerprint(dtype, shape, p.numel, "", error=p.error)
    if p.components is not None:
        comps = {n: _build(c, batches, results, failed) for n, c in p.components.items()}
        view = MappingProxyType(comps)
        parts = [(n, f.digest, f.error) for n, f in comps.items()]
        digest, error = combined(p.scheme, p.type_name, dtype, shape, parts, p.meta)
        return Fingerprint(dtype, shape, p.numel, digest, components=view, error=error)
    why = failed.get(_key(p))
    if why is not None:
        return Fingerprint(dtype, shape, p.numel, "", error=why)
    r = _raw(p, batches, results)
    return _fingerprint_fast(dtype, shape, p.numel, _hex(r.hi, r.lo), r.rows, r.moments, r.pointer_like)


def _raw(p: Pending, batches: dict, results: dict) -> Resolved:
    group_key = _key(p)
    b = batches[group_key]
    fetched: _Fetched = results[group_key]
    words = fetched.words
    key = id(p)
    group, i = b.slots[key]
    if group is not None:
        i += fetched.offsets[group]
    rows = None
    if key in b.row_slots:
        r0 = b.row_slots[key]
        n = sum(c for c, _ in p.rows_meta)
        rows = tuple(_hex(words[2 * j], words[2 * j + 1]) for j in range(r0, r0 + n))
    m = None
    j = b.moments.index(key)
    if j is not None:
        moms = fetched.moments
        j *= 4
        m = Moments(moms[j], moms[j + 1], int(moms[j + 2]), int(moms[j + 3]))
    j = b.pointers.index(key)
    ptr = bool(fetched.pointers[j]) if j is not None else False
    return Resolved(words[2 * i], words[2 * i + 1], None, rows, m, ptr)
