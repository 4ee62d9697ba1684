"""The native record path's pieces (``_recorder/_hostpath.c``) against the Python they replace,
one piece at a time, in this process.

``tests/golden/test_capture_routes.py`` holds the whole native path to the whole Python one
(``DETFP_NATIVE=0`` in a child process, torch's digest route included). Here the capture runs on
a native record path with one piece left to Python (``seam.NativePath(python=...)``, handed to
the Session's Recorder by ``seam.recording_through``: no module patched), so a difference names
its piece: the dispatch mode's op entries (``op_pre``/``op_post``), the append path (``gather``,
``record_op``, ``append_fast``, ``append_plain``, ``append_batch``), the digests taken at record
time (``roots``), the flush's resolution (``rows_plan``, ``scatter``, ``split_rows``,
``assign_rows``) and its grouping and argument keys (``by_identity``, ``args_key``); and the whole
Python path in this process. And the pieces' contracts directly: ``gather`` on every shape of
argument list, ``start_digests`` on tensors of every kind against ``digest.start``,
``by_identity`` and ``args_key`` against their Python."""

from __future__ import annotations

import pytest
import torch

from detfp_capture import digest
from detfp_capture._recorder import roots
from detfp_capture._recorder import slot as slot_mod
from detfp_capture._recorder.args import gather as gather_py
from detfp_capture._recorder.flush import resolve_slots
from detfp_capture._recorder.seam import NativePath, Piece, PythonPath, configure_native, recording_through
from detfp_capture._recorder.slot import Slot, _hostpath
from tests import native_half
from tests.golden.test_capture_records import capture

native = native_half.needs(slot_mod.NATIVE, native_half.RECORD)


def _roots():
    """The native record-time route (``roots_fill``), the native path configured."""
    fill = configure_native()
    assert fill is not None, "the digest kernel is built with the record path's helpers"
    return fill


@pytest.fixture(scope="module")
def native_traces(tmp_path_factory) -> dict:
    if not slot_mod.NATIVE:
        return {}
    tmp = tmp_path_factory.mktemp("native")
    with recording_through(NativePath()):
        return {level: capture(level, tmp / level, 2) for level in ("boundaries", "ops")}


_PIECES = {
    "dispatch": {Piece.DISPATCH},
    "appends": {Piece.APPENDS},  # the native op entries call the native appends: Python's both
    "roots": {Piece.ROOTS},
    "resolve": {Piece.RESOLVE},
    "columns": {Piece.COLUMNS},
    "python": None,  # the whole Python path, in this process (the native Slot class)
}


@native
@pytest.mark.parametrize("level", ["ops", "boundaries"])
@pytest.mark.parametrize("piece", list(_PIECES))
def test_each_native_piece_writes_what_its_python_writes(level, piece, native_traces, tmp_path):
    pieces = _PIECES[piece]
    path = PythonPath() if pieces is None else NativePath(python=pieces)
    assert path.op_pre is None or piece not in ("dispatch", "appends")
    with recording_through(path):
        assert capture(level, tmp_path, 2) == native_traces[level]


def _arg_shapes() -> list[tuple[tuple, dict, frozenset, frozenset]]:
    a, b, c = torch.ones(2), torch.zeros(3), torch.arange(4)
    p = torch.nn.Parameter(torch.ones(1))
    many = [torch.full((1,), float(i)) for i in range(70)]
    return [
        ((), {}, frozenset(), frozenset()),
        ((a, 2, b), {}, frozenset(), frozenset()),
        ((a, [b, c], 1.5, "mean", None), {"dim": 0}, frozenset({0}), frozenset()),
        (([None, a, None, b],), {}, frozenset(), frozenset()),  # optional tensor lists (index)
        ((a, (b, c)), {"out": c, "alpha": 2}, frozenset(), frozenset({"out"})),
        ((a,), {"weights": [b, c], "sizes": [1, 2], "empty": []}, frozenset(), frozenset({"weights"})),
        (([],), {"x": ()}, frozenset(), frozenset()),  # empty lists: arguments, not tensors
        (([1, 2], [a]), {"k": [None, a]}, frozenset({1}), frozenset()),  # a None-led kwarg list is not tensors
        ((p, torch.float32, torch.device("cpu")), {}, frozenset(), frozenset()),
        (tuple(many), {}, frozenset({65}), frozenset()),  # past the 64 shared argument names
        ((many,), {}, frozenset(), frozenset()),
    ]


def _gathered(fn, args, kwargs, dest_pos, dest_kw):
    tensors, other = fn(args, kwargs, dest_pos, dest_kw)
    return [(r, n, id(t)) for r, n, t in tensors], repr(other)


@native
@pytest.mark.parametrize("case", range(len(_arg_shapes())))
def test_gather_splits_arguments_as_python_does(case):
    args, kwargs, dest_pos, dest_kw = _arg_shapes()[case]
    configure_native()
    assert _gathered(_hostpath.gather, args, kwargs, dest_pos, dest_kw) == _gathered(
        gather_py, args, kwargs, dest_pos, dest_kw
    )


def _tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    base = torch.randn(300, 300, generator=g)
    return [
        torch.randn(3, 17, generator=g),
        torch.randn(256, generator=g),  # exactly one 1024-byte row
        torch.randn(257, generator=g),  # one byte row and a bit
        torch.randn(1, generator=g).to(torch.bfloat16),
        torch.tensor(2.5),  # zero-dimensional
        base,  # hashed in place by the batch path (over 256 KiB, whole rows)
        torch.randn(70_000, generator=g),  # several tree levels, a partial last row
        base.t(),  # not contiguous: left to the batch path
        base[7],  # contiguous at an offset
        torch.ones(33, dtype=torch.bool),
        torch.arange(12, dtype=torch.int32),
        torch.randn(4, generator=g, dtype=torch.complex64),
        torch.randint(0, 9, (5,), generator=g),  # int64: left to the pointer check
        torch.randn(6, generator=g).to(torch.float8_e4m3fn),  # a byte-view dtype: left to start
        torch.nn.Parameter(torch.randn(9, generator=g)),
        torch.empty(0),  # no bytes: left to the batch path
    ]


@native
@pytest.mark.parametrize("version", [1, 2])
def test_start_digests_digests_as_digest_start(version):
    from detfp_capture._digest import versions

    tensors = _tensors()
    slots = [Slot(None) for _ in tensors]
    with versions.use(version):
        roots.start_digests(tensors, slots, _roots())
        want = digest.resolve([digest.start(t, pointer_check=t.dtype is torch.int64) for t in tensors])
    resolve_slots(slots, NativePath().resolve_rows)
    assert [(s.hi, s.lo) for s in slots] == [(r.hi, r.lo) for r in want]
    if version == 2:  # the plain contiguous CPU tensors took the native route, the others not
        taken = [getattr(s, "arena", None) is roots._POOL.held for s in slots]
        assert taken == [True] * 7 + [False, True, True, True, True, False, False, True, False]


@native
def test_roots_keep_the_values_at_record_time():
    t = torch.arange(500, dtype=torch.float32)
    want = digest.resolve([digest.start(t.clone())])[0]
    s = Slot(None)
    assert roots.start_roots([t], [s], roots.active(), _roots()) == []
    t.mul_(3)  # a write after the record: the digest is of the values it had
    resolve_slots([s], NativePath().resolve_rows)
    assert (s.hi, s.lo) == (want.hi, want.lo)


@native
def test_by_identity_groups_as_python_does():
    from detfp_capture._recorder import records

    a, b, c = (1, "x"), tuple([1, "x"]), (2,)  # a and b equal, not identical: two calls
    items = [a, a, b, c, a, c, c, b]
    assert _hostpath.by_identity(items) == records.by_identity(items)
    distinct, index, first = _hostpath.by_identity(items)
    assert (
        [id(x) for x in distinct] == [id(a), id(b), id(c)] and index == [0, 0, 1, 2, 0, 2, 2, 1] and first == [0, 2, 3]
    )
    assert _hostpath.by_identity([]) == ([], [], [])


@native
def test_args_key_keys_as_python_does():
    from detfp_capture._recorder import args

    flat = args.flat_args
    srcs = [
        None,
        (),
        ("not flat", 1),
        flat([1, "mean", None], []),
        flat([0.0], []),
        flat([-0.0], []),
        flat([True, 1, 1.0], []),
        flat([float("nan"), float("inf")], []),
        flat([[1, 2], [3.5]], [("dim", 0), ("keepdim", False)]),
        flat([torch.float32, torch.device("cpu"), torch.contiguous_format], []),
        flat([[1, [2, 3]]], []),  # lists: markers inline
        flat([{"a": 1}], []),  # unhashable: no key
    ]
    configure_native()
    for src in srcs:
        assert _hostpath.args_key(src) == args.args_key(src), src
    assert _hostpath.args_key(flat([0.0], [])) != _hostpath.args_key(flat([-0.0], []))


@native
def test_root_stats_count_what_the_record_time_route_hashed():
    t = torch.arange(300, dtype=torch.float32)
    calls, nbytes, seconds = _hostpath.root_stats()
    assert roots.start_roots([t, t.t()[None]], [Slot(None), Slot(None)], roots.active(), _roots()) == []
    after = _hostpath.root_stats()
    assert (after[0] - calls, after[1] - nbytes) == (2, 2 * 1200) and after[2] >= seconds


@native
def test_record_time_digests_from_two_threads_keep_their_own_rows():
    # The native call lets the interpreter go while it hashes a large tensor: a second thread
    # recording meanwhile must not be handed the same rows of the pool.
    import threading

    g = torch.Generator().manual_seed(5)
    work = [[torch.randn(40_000, generator=g) for _ in range(4)] for _ in range(2)]
    got: list[list[tuple[torch.Tensor, Slot]]] = [[], []]
    sch, native_route = roots.active(), _roots()
    go = threading.Barrier(2)

    def record(i: int) -> None:
        go.wait()  # both at once, each letting the interpreter go in every large hash
        for _ in range(100):
            for t in work[i]:
                s = Slot(None)
                assert roots.start_roots([t], [s], sch, native_route) == []
                got[i].append((t, s))

    threads = [threading.Thread(target=record, args=(i,)) for i in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    pairs = got[0] + got[1]
    assert len({(id(s.arena), s.row) for _, s in pairs}) == len(pairs)  # one row each
    resolve_slots([s for _, s in pairs], NativePath().resolve_rows)
    want = {id(t): digest.resolve([digest.start(t)])[0] for ts in work for t in ts}
    assert [(s.hi, s.lo) for t, s in pairs] == [(want[id(t)].hi, want[id(t)].lo) for t, _ in pairs]


@native
def test_the_version_caches_references_and_storage_lists_are_left_out_of_the_collector(tmp_path):
    # Held until a flush, tracked they were promoted by the young collections of a window and
    # brought on full collections of the whole heap (benchmarks/capture_gc.py).
    import gc

    from detfp_capture import Session

    x = torch.randn(4, 4)
    with Session(tmp_path / "r", "ops") as s, s.step(0):
        y = (x @ x).relu()
        z = y + 1
        vc = s._rec.vcache
        slots = list(vc.by_id.values())
        refs = [sl.ref for sl in slots if sl.ref is not None]
        assert refs and not any(gc.is_tracked(r) for r in refs)
        assert {id(r()) for r in refs if r() is not None} >= {id(y), id(z)}
        lists = [v for v in vc.by_storage.values() if isinstance(v, list)]
        assert lists and not any(gc.is_tracked(v) for v in lists)
        vc.put(x, Slot(None), x._version)  # the Python put (a call the native path does not make)
        assert not gc.is_tracked(vc.by_id[id(x)].ref) and vc.by_id[id(x)].ref() is x
    assert slot_mod.held_ref is not __import__("weakref").ref
