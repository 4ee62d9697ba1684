"""Capture's digest paths: batched step boundaries, staged snapshots, deferred op digests and
the version cache give the digests of the values at record time, equal to single digests."""

from __future__ import annotations

import polars as pl
import pytest
import torch

from detfp_capture import Session
from tests.fixtures.models import digest_hi, read


@pytest.mark.parametrize("max_runs", [256, 0])  # levels padded by slices, or by one index gather
def test_batched_step_boundary_digests_equal_single_digests(monkeypatch, max_runs):
    from detfp_capture import digest
    from detfp_capture._digest import levels
    from detfp_capture._digest.batched import start_many

    monkeypatch.setattr(levels, "MAX_RUNS", max_runs)

    g = torch.Generator().manual_seed(3)
    ts = [
        torch.randn(300, generator=g),
        torch.randn(257, generator=g),  # 1028 bytes: two level-0 rows
        torch.randn(64, 64, generator=g),
        torch.randn(100, 70, generator=g).t(),  # non-contiguous
        torch.randn(5, generator=g),  # small: the digest arena path
        torch.zeros(0),
        torch.randn(70000, generator=g),  # three levels
        torch.randn(128, 1024, generator=g),  # 512 KiB of whole rows: hashed in place, no copy
        torch.randn(256, 300, generator=g)[:, :256],  # same size, not contiguous: copied
        torch.randn(33, 9, dtype=torch.float64, generator=g),
        torch.randn(64, 64, generator=g).to(torch.bfloat16),
        torch.arange(500),  # int64: pointer check, single path
        torch.randn(4, 4, generator=g, requires_grad=True) * 2,
        torch.randn(16 * 256 * 3, generator=g),  # 48 rows: no padding at level 1, a run with the next
        torch.randn(16 * 256 * 2 + 1, generator=g),
    ]
    batched = digest.resolve(start_many(ts))
    single = digest.resolve([digest.start(t, pointer_check=t.dtype is torch.int64) for t in ts])
    assert [a.digest for a in batched] == [b.digest for b in single]


@pytest.mark.parametrize("own_limit", [64 << 20, 0])  # a reused layout with its own buffer, or without
def test_batch_layouts_reused_only_for_the_same_signature(monkeypatch, own_limit):
    # A step boundary repeats the same dtypes, shapes and contiguity every step: the layout of
    # the batch is cached by that signature (and, used again, gets its own buffer). New values,
    # an in-place write between two calls, a changed contiguity or an unbatchable member must
    # all still give the single digests.
    from detfp_capture import digest
    from detfp_capture._digest import batched
    from detfp_capture._digest.batched import _LAYOUTS, start_many

    monkeypatch.setattr(batched, "_OWN_LIMIT", own_limit)
    g = torch.Generator().manual_seed(7)

    def batch(contiguous: bool) -> list[torch.Tensor]:
        sq = torch.randn(64, 64, generator=g)
        return [
            torch.randn(300, generator=g),  # padded to two rows
            sq if contiguous else sq.t(),
            torch.randn(128, 1024, generator=g),  # hashed in place, between copied ones
            torch.randn((), generator=g),
            torch.randn(70000, generator=g).to(torch.bfloat16),
            torch.randn(70000, generator=g),
        ]

    _LAYOUTS.clear()
    for ts in (batch(True), batch(True), batch(False), batch(True), [*batch(True), torch.arange(9)]):
        for k in range(3):  # later calls take the cached layout when there is one
            if k == 2:
                ts[0].mul_(3)
                ts[-1][5] = 7.0
            got = digest.resolve(start_many(ts, reuse=True))
            want = digest.resolve([digest.start(t, pointer_check=t.dtype is torch.int64) for t in ts])
            assert [a.digest for a in got] == [b.digest for b in want]
    assert len(_LAYOUTS) == 2  # contiguous and transposed; never the batch with an int64 member
    assert all((lay.own is not None) == (own_limit > 0) for lay in _LAYOUTS.values())
    _LAYOUTS.clear()


@pytest.mark.parametrize("max_runs", [256, 0])
def test_staged_snapshots_digest_like_single_digests(monkeypatch, max_runs):
    # Row counts that finish at different tree levels, with and without padding, interleaved,
    # twice (the second run reuses the staging buffer).
    from detfp_capture import digest
    from detfp_capture._digest import levels
    from detfp_capture._digest.staging import Staging
    from detfp_capture._recorder.slot import Slot

    monkeypatch.setattr(levels, "MAX_RUNS", max_runs)
    g = torch.Generator().manual_seed(11)
    # Contiguous whole-row tensors of 256 KiB and more are hashed in place (65536 floats: 256
    # rows; 259 rows, not a multiple of 16: a zeroed gap before the next; the bfloat16 one); a
    # transposed one of that size is copied like the small ones.
    sizes = [5, 300, 4096, 256, 70000, 257, 16 * 256, 17 * 256, 1, 16384, 65536, 259 * 256, 33 * 256 + 3]
    for _ in range(2):
        ts = [torch.randn(n, generator=g) for n in sizes] + [torch.randn(40, 7, generator=g).t()]
        ts += [torch.randn(128, 512, generator=g).t(), torch.randn(256, 512, generator=g).to(torch.bfloat16)]
        before = [t.clone() for t in ts]
        st = Staging(torch.device("cpu"), cap_bytes=4 << 20)
        st._typed(torch.int8).fill_(0x5A)  # whatever a reused (or never zeroed) buffer holds
        slots = [Slot(None) for _ in ts]
        assert st.put_many(ts, slots)
        assert len(st.direct[0]) == 3 and len(st.items[0]) == len(ts) - 3
        for t in ts:
            t.add_(1.0)  # a snapshot: later writes do not change what was recorded
        st.run_into()
        staged = digest.resolve([s.started() for s in slots])
        single = digest.resolve([digest.start(t) for t in before])
        assert [a.digest for a in staged] == [b.digest for b in single]


def test_op_arguments_kept_flat_and_untracked_digest_like_the_originals():
    # Op arguments wait for the flush as one flat tuple of plain values (nothing for the cyclic
    # collector to keep tracking), and their args digest is that of the original arguments.
    import gc

    from detfp_capture._recorder.args import args_text, flat_args

    args = [[8, 32, 64], 1.5, [[1, 2], [3], []], (4, 5), None, "sum"]
    kwargs = {"size": [1, 2], "e": [], "alpha": 2}
    kept = flat_args(args, list(kwargs.items()))
    gc.collect()
    assert not gc.is_tracked(kept)
    assert args_text(kept) == args_text((tuple(args), kwargs))
    assert flat_args([], []) is None
    assert args_text(flat_args([[4, 5]], [])) != args_text(flat_args([(4, 5)], []))  # a list is not a tuple
    assert args_text(flat_args([1], [("k", 2)])) != args_text(flat_args([1, 2], []))  # positional vs keyword


def test_batched_digests_survive_scratch_reuse_and_small_scratch(monkeypatch):
    # The copy buffer is reused by the next batch and split into regions when a batch is bigger
    # than it: digests of earlier batches, resolved later, must be unaffected.
    from detfp_capture import digest
    from detfp_capture._digest.batched import _SCRATCH, start_many

    monkeypatch.setattr(type(_SCRATCH), "CAP", 8 << 10)
    monkeypatch.setattr(_SCRATCH, "bufs", {})
    g = torch.Generator().manual_seed(5)
    first = [torch.randn(n, generator=g) for n in (300, 700, 1500, 2100, 9000, 5)]
    second = [torch.randn(n, generator=g) for n in (301, 699, 4000)]
    pend = start_many(first)
    pend2 = start_many(second)  # overwrites the scratch bytes of the first batch
    batched = digest.resolve(pend + pend2)
    single = digest.resolve([digest.start(t) for t in first + second])
    assert [a.digest for a in batched] == [b.digest for b in single]


def test_inplace_and_foreach_outputs_are_the_written_values(tmp_path):
    a = [torch.ones(300), torch.ones(400)]
    b = torch.ones(500)
    with Session(tmp_path / "r", "ops") as s, s.step(0):
        torch._foreach_add_(a, 1.0)  # returns nothing: the written list is the output
        c = b * 3  # deferred digest (large enough for the batch path)
        b.add_(1.0)  # a write: the batch runs first, so c's and b's old values are kept
        _ = c + b
    r = read(tmp_path / "r").filter(pl.col("kind") == "op")
    fe = r.filter(pl.col("name") == "aten::_foreach_add_.Scalar")
    assert fe.select("role", "arg").rows() == [
        ("input", "args[0][0]"),
        ("input", "args[0][1]"),
        ("output", "args[0][0]"),
        ("output", "args[0][1]"),
    ]
    assert fe["digest_hi"][0] != fe["digest_hi"][2]
    add_ = r.filter(pl.col("name") == "aten::add_.Tensor")
    add_ = add_ if add_.height else r.filter(pl.col("name") == "aten::add_.Scalar")
    before, after = (
        add_.filter(pl.col("role") == "input")["digest_hi"][0],
        add_.filter(pl.col("role") == "output")["digest_hi"][0],
    )
    assert before != after
    last = r.filter(pl.col("name") == "aten::add.Tensor").filter(pl.col("role") == "input")
    mul_out = r.filter((pl.col("name") == "aten::mul.Tensor") & (pl.col("role") == "output"))["digest_hi"][0]
    assert last["digest_hi"].to_list() == [mul_out, after]
    assert (r["status"] != "error").all()


def _inplace_program(tmp_path, name: str) -> tuple[pl.DataFrame, int]:
    """A chain of writes to one tensor (and a list) at level ops: its op records, and how many
    tensors capture took before a write: copied into its staging buffer, or digested then (on
    CPU with the native kernels, ``batched.start_roots``)."""
    from torch.utils._python_dispatch import _disable_current_modes

    from detfp_capture._digest import staging as _staging
    from detfp_capture._recorder import roots as _roots

    staged = []
    put = _staging.Staging.put_many
    roots = _roots.start_roots

    def counting(self, ts, slots):
        staged.append(len(ts))
        return put(self, ts, slots)

    def counting_roots(ts, slots, sch, native):
        rest = roots(ts, slots, sch, native)
        staged.append(len(ts) - len(rest))
        return rest

    p = torch.arange(300, dtype=torch.float32)
    ts = [torch.ones(40), torch.ones(50)]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_staging.Staging, "put_many", counting)
        mp.setattr(_roots, "start_roots", counting_roots)
        with Session(tmp_path / name, "ops") as s, s.step(0):
            p.mul_(2.0)
            p.add_(1.0)  # reads what mul_ wrote
            q = p * 3.0  # reads it again, out of place
            p[:10].fill_(0.0)  # a write through a view: the shared version counter moves
            p.sub_(q)  # so p is hashed anew here
            # A write the mode does not see (c10d writing from C++ does this): the capture takes
            # the waiting digests first, as its collective wrappers do. A second bump.
            s._rec.settle()
            with _disable_current_modes():
                p.add_(5.0)
            p.mul_(0.5)  # so its input is hashed anew too
            torch._foreach_mul_(ts, 2.0)
            torch._foreach_add_(ts, 1.0)  # reads what _foreach_mul_ wrote
    r = read(tmp_path / name).filter(pl.col("kind") == "op").filter(pl.col("digest_hi").is_not_null())
    return r.select("name", "role", "arg", "digest_hi", "digest_lo"), sum(staged)


def test_inplace_chain_reuses_the_written_digest_and_follows_every_write(tmp_path, monkeypatch):
    from detfp_capture import digest
    from detfp_capture._recorder.vcache import VersionCache

    def fp(t: torch.Tensor) -> tuple[int, int]:
        d = digest.fingerprint(t).digest
        return int(d[:16], 16), int(d[16:], 16)

    got, staged = _inplace_program(tmp_path, "promoted")
    # Every record is the digest of the values at that point, replayed independently.
    p = torch.arange(300, dtype=torch.float32)
    want = [fp(p)]
    p.mul_(2.0)
    want += [fp(p), fp(p)]  # mul_ output, add_ input
    p.add_(1.0)
    want += [fp(p), fp(p)]  # add_ output, mul input
    q = p * 3.0
    want += [fp(q)]
    v = p[:10]  # fill_'s destination is write-only: recorded, never digested
    v.fill_(0.0)
    want += [fp(v), fp(p), fp(q)]
    p.sub_(q)
    want += [fp(p)]
    p.add_(5.0)
    want += [fp(p)]
    p.mul_(0.5)
    want += [fp(p)]
    ts = [torch.ones(40), torch.ones(50)]
    want += [fp(t) for t in ts]
    torch._foreach_mul_(ts, 2.0)
    want += [fp(t) for t in ts] * 2
    torch._foreach_add_(ts, 1.0)
    want += [fp(t) for t in ts]
    assert list(zip(got["digest_hi"], got["digest_lo"], strict=True)) == want, got
    # The reads right after a write reuse its digest: without the re-keying, the same trace
    # costs more copies (each in-place input is snapshotted before the op writes it).
    monkeypatch.setattr(VersionCache, "promote", lambda cache: cache.written.clear())
    plain, staged_plain = _inplace_program(tmp_path, "plain")
    assert plain.equals(got)
    assert staged < staged_plain, (staged, staged_plain)


@pytest.mark.parametrize("numel", [65536, 1024, 300, 10])  # hashed in place, whole rows, padded, small
def test_snapshots_keep_the_values_at_record_time(tmp_path, numel):

    lin = torch.nn.Linear(4, numel, bias=False)
    x = torch.ones(1, 4)
    with torch.no_grad():
        want = digest_hi(lin(x))
    with Session(tmp_path / "b", "boundaries") as s, s.step(0), torch.no_grad():
        s.watch(lin)
        lin(x).add_(1.0)  # written after the module-output record: the record keeps the old values
    out = read(tmp_path / "b").filter(pl.col("kind") == "module_output")
    assert out["digest_hi"].to_list() == [want]
    t = torch.ones(numel)
    with Session(tmp_path / "o", "ops") as s, s.step(0):
        t.mul_(2.0)  # the in-place op's input record is what it read
    r = read(tmp_path / "o").filter(pl.col("name").str.starts_with("aten::mul_."))
    got = dict(zip(r["role"].to_list(), r["digest_hi"].to_list(), strict=True))
    assert got["input"] == digest_hi(torch.ones(numel))
    assert got["output"] == digest_hi(torch.full((numel,), 2.0))


def test_staged_int64_pointer_checks_match_single_digests():
    # int64 boundary tensors are snapshotted like the others; their pointer check runs for the
    # whole batch at once and must say what digest.start's per-tensor check says.
    from detfp_capture import digest
    from detfp_capture._digest.staging import Staging
    from detfp_capture._recorder.slot import Slot

    g = torch.Generator().manual_seed(5)
    ptrs = torch.randint(1 << 28, 1 << 44, (300,), generator=g) * 16  # multi-row, pointer-like
    ts = [
        torch.randint(0, 256, (8, 33), generator=g),  # token ids: not pointers
        torch.randn(100, generator=g),
        ptrs,
        torch.cat([ptrs[:50], torch.tensor([7])]),  # one value spoils it (the last)
        torch.tensor([1 << 40]),  # one pointer-like value
        ptrs[:128].clone(),  # exactly one 1024-byte row
        torch.arange(0, 4096 * 16, 16) + (1 << 33),  # 512 KiB of whole rows: still a snapshot
    ]
    st = Staging(torch.device("cpu"))
    slots = [Slot(None) for _ in ts]
    assert st.put_many(ts, slots) and not st.direct[0]
    st.run_into()
    staged = digest.resolve([s.started() for s in slots])
    single = digest.resolve([digest.start(t, pointer_check=t.dtype is torch.int64) for t in ts])
    assert [(a.digest, a.pointer_like) for a in staged] == [(b.digest, b.pointer_like) for b in single]
    assert [f.pointer_like for f in staged] == [False, False, True, False, True, True, True]


@pytest.mark.parametrize("n", [5, 40])  # finalized on the host (<= 32 digests), on the device
def test_bulk_resolve_of_batched_rows_matches_resolve(n):
    # The flush resolves batched rows in bulk (resolve.resolve_rows, as integers): same digests as
    # the general resolve, for rows in any order and from two batches at once.
    from detfp_capture import digest
    from detfp_capture._digest.batched import start_many
    from detfp_capture._digest.resolve import resolve_rows
    from detfp_capture._recorder.slot import Slot

    g = torch.Generator().manual_seed(n)
    ts = [torch.randn(1 + 37 * i, generator=g) for i in range(n)]
    a, b = [Slot(None) for _ in ts], [Slot(None) for _ in ts]
    start_many(ts, a)
    start_many([t * 2 for t in ts], b)
    items = [*a[::-1], *b[::2]]
    want = [f.digest for f in digest.resolve([s.started() for s in items])]
    his, los = resolve_rows(items)
    assert [f"{hi:016x}{lo:016x}" for hi, lo in zip(his, los, strict=True)] == want
    assert [(hi, lo) for hi, lo in zip(his, los, strict=True)] == [(int(d[:16], 16), int(d[16:], 16)) for d in want]


def test_args_digest_memo_keeps_values_that_compare_equal_apart():
    # Memoized across flushes, the args digest must still tell apart arguments that Python
    # considers equal but whose text differs: -0.0 and 0.0, True and 1 and 1.0, a float and
    # the string of its hex text.
    from detfp_capture._recorder.args import ArgsColumn, args_text, flat_args
    from detfp_capture._recorder.call import make_call
    from detfp_capture._recorder.records import RecordBuffer, record_columns

    variants = [[0.0], [-0.0], [1], [True], [1.0], [(1.0).hex()], [float("nan")], [[1, 2]], [[1, 2.0]]]
    for _ in range(2):  # the second pass reads the memo
        buf = RecordBuffer()
        for i, v in enumerate(variants):
            call = make_call(0, -1, "forward", "", "op", "aten::x", i, flat_args(v, []))
            buf.add(call, i, "output", "out", "torch.float32", (1,), 1, None, ())
        got = record_columns(buf, ArgsColumn())[0]["args_digest"].expand()  # by call: detfp_format.indexed
        assert got == [args_text(flat_args(v, [])) for v in variants]
        assert len(set(got)) == len(variants)


def test_int64_probe_keeps_its_pointer_check_when_staging_fails(tmp_path, monkeypatch):
    # int64 tensors are staged like the others; when staging cannot take them, the digest taken
    # instead must still check for device-pointer tables.
    from detfp_capture._digest.staging import Staging

    def broken(*a, **k):
        raise RuntimeError("staging unavailable")

    monkeypatch.setattr(Staging, "put_many", broken)
    table = torch.arange(0, 64 * 16, 16) + (1 << 33)
    with Session(tmp_path / "r", "boundaries") as s, s.step(0):
        s.probe("table", table)
    r = read(tmp_path / "r").filter(pl.col("kind") == "probe")
    assert r["hazards"].to_list() == [["pointer_like"]]


@pytest.mark.parametrize("level", ["metrics", "boundaries", "ops"])
def test_step_end_parameters_after_a_data_write_are_the_current_values(tmp_path, level):
    # Weight clipping through .data after optimizer.step() moves no version counter: the
    # step-end parameter record must still be the clipped values, not the optimizer's output.
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    with Session(tmp_path / "r", level) as s:
        s.watch(lin)
        s.watch_optimizer(opt)
        for step in range(2):
            with s.step(step):
                lin(torch.ones(2, 4)).sum().backward()
                opt.step()
                after_step = lin.weight.detach().clone()
                lin.weight.data.clamp_(-0.01, 0.01)
                opt.zero_grad()
    r = read(tmp_path / "r").filter((pl.col("kind") == "param") & (pl.col("phase") == "step"))
    got = r.filter(pl.col("name") == "weight")["digest_hi"].to_list()
    assert got[-1] == digest_hi(lin.weight.detach()) != digest_hi(after_step)


def test_a_write_through_a_data_alias_is_seen_by_the_next_read_at_level_ops(tmp_path):
    t = torch.ones(300)
    with Session(tmp_path / "r", "ops") as s, s.step(0):
        _ = t * 2  # t's digest is cached
        t.data.fill_(5.0)  # a write through an alias with its own version counter
        _ = t * 3
    r = read(tmp_path / "r").filter((pl.col("name") == "aten::mul.Tensor") & (pl.col("role") == "input"))
    assert r["digest_hi"].to_list() == [digest_hi(torch.ones(300)), digest_hi(torch.full((300,), 5.0))]


class _Doubler(torch.nn.Module):
    def forward(self, x):
        return x * 2


class _InPlace(torch.nn.Module):
    def forward(self, y):
        return y.mul_(10)


def test_a_write_in_a_module_left_out_keeps_the_recorded_values(tmp_path):
    # modules= leaves "b" out: its in-place write is not recorded, but it must not change what
    # was recorded for "a" (whose output digest waits for a batch until a write comes).
    m = torch.nn.Sequential()
    m.add_module("a", _Doubler())
    m.add_module("b", _InPlace())
    with Session(tmp_path / "r", "ops", modules=r"^a$") as s, s.step(0):
        s.watch(m)
        m(torch.ones(300))
    r = read(tmp_path / "r").filter(pl.col("kind") == "op")
    assert r.select("module", "name", "role").rows() == [
        ("a", "aten::mul.Tensor", "input"),
        ("a", "aten::mul.Tensor", "output"),
    ]
    assert r["digest_hi"].to_list() == [digest_hi(torch.ones(300)), digest_hi(torch.full((300,), 2.0))]


def test_a_write_through_a_wrapper_subclass_inner_tensor_is_seen_at_level_ops(tmp_path):
    # A wrapper subclass (DTensor, FSDP2's parameters) has no storage of its own and its own
    # version counter: a write through its inner tensor must still drop its cached digest.
    two = pytest.importorskip("torch.testing._internal.two_tensor")

    tt = two.TwoTensor(torch.ones(300), torch.zeros(300))
    before = digest_hi(tt)
    with Session(tmp_path / "r", "ops") as s, s.step(0):
        _ = tt * 2
        tt.a.add_(5.0)
        _ = tt * 3
    after = digest_hi(tt)
    r = read(tmp_path / "r").filter((pl.col("name") == "aten::mul.Tensor") & (pl.col("role") == "input"))
    assert r["arg"].to_list() == ["args[0]::a", "args[0]::b", "args[0]"] * 2  # parts, then the whole
    assert r.filter(pl.col("arg") == "args[0]")["digest_hi"].to_list() == [before, after]
    parts = r.filter(pl.col("arg") != "args[0]")["digest_hi"].to_list()
    assert parts == [
        digest_hi(torch.ones(300)),
        digest_hi(torch.zeros(300)),
        digest_hi(torch.full((300,), 6.0)),
        digest_hi(torch.zeros(300)),
    ]


def test_digests_waiting_at_step_end_keep_the_values_of_the_step(tmp_path):
    # Between steps no dispatch mode sees writes: a digest still waiting for a batch when the
    # step ends is taken then, before code between steps (or a step left out) writes the tensor.

    x = torch.ones(300)
    with Session(tmp_path / "r", "ops", steps="0,2") as s:
        for step in range(3):
            with s.step(step):
                if step == 0:
                    y = x * 2
                if step == 1:
                    y.mul_(10)  # a step left out
                if step == 2:
                    _ = x + 1
            if step == 0:
                y.add_(100)  # between steps
    r = read(tmp_path / "r").filter((pl.col("name") == "aten::mul.Tensor") & (pl.col("role") == "output"))
    assert r.select("status", "digest_hi").rows() == [("ok", digest_hi(torch.full((300,), 2.0)))]


def _clone_program(tmp_path, name: str) -> tuple[pl.DataFrame, int, dict]:
    """Copies at level ops: their op records, the level-0 rows capture hashed, and the values."""
    from detfp_capture._digest import versions

    rows = []
    sch = versions.active()
    mm = sch.mm

    def counting(x, level, out=None):
        if level == 0:
            rows.append(x.shape[0])
        return mm(x, level, out)

    g = torch.Generator().manual_seed(5)
    x = torch.randn(64, 300, generator=g)
    img = torch.randn(2, 3, 16, 16, generator=g)
    want = {"a": x.t().contiguous(), "c": img.clone(), "d": x * 2.0}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sch, "mm", counting)
        with Session(tmp_path / name, "ops") as s, s.step(0):
            a = x.t().clone()  # a non-contiguous input, a contiguous copy
            b = a.clone()  # a copy of a copy
            c = img.clone(memory_format=torch.channels_last)  # another memory format, the same values
            x.mul_(2.0)  # a write to the input of the first copy while its digest waits for a batch
            d = x.clone()
            _ = a + b + 1.0, c * 2.0, d - 1.0  # the copies read again: their cached digests
    r = read(tmp_path / name).filter(pl.col("kind") == "op").filter(pl.col("name") == "aten::clone.default")
    return r.select("role", "arg", "status", "digest_hi", "digest_lo"), sum(rows), want


def test_a_copy_shares_its_input_digest_and_keeps_the_value_at_record_time(tmp_path, monkeypatch):
    from detfp_capture import digest
    from detfp_capture._recorder.recorder import Recorder

    def fp(t: torch.Tensor) -> tuple[int, int]:
        d = digest.fingerprint(t).digest
        return int(d[:16], 16), int(d[16:], 16)

    got, hashed, want = _clone_program(tmp_path, "shared")
    assert got["role"].to_list() == ["input", "output"] * 4 and (got["status"] == "ok").all()
    pairs = list(zip(got["digest_hi"], got["digest_lo"], strict=True))
    a, c, d = fp(want["a"]), fp(want["c"]), fp(want["d"])
    assert pairs == [a, a, a, a, c, c, d, d]
    # The same trace with every copy hashed: the same records, more bytes through the GEMM.
    monkeypatch.setattr(Recorder, "append_copy", lambda *args: False)
    plain, hashed_plain, _ = _clone_program(tmp_path, "hashed")
    assert plain.equals(got)
    assert hashed < hashed_plain, (hashed, hashed_plain)


def test_staging_rows_reused_by_another_layout_digest_like_single_digests():
    # The staging buffer's rows are zeroed in bulk ahead of the rows taken (again from the start
    # of each batch), not per tensor: a batch whose small tensors land on rows that held the
    # middle of a bigger tensor in the batch before must still see zero padding tails.
    from detfp_capture import digest
    from detfp_capture._digest.staging import Staging
    from detfp_capture._recorder.slot import Slot

    g = torch.Generator().manual_seed(5)
    st = Staging(torch.device("cpu"), cap_bytes=1 << 20)
    batches = [
        [torch.randn(300, 7, generator=g).t(), torch.randn(3, generator=g)],  # 9 rows of nonzero bytes
        [torch.randn(5, generator=g), torch.randn(2, 3, generator=g), torch.randn(7, generator=g).double()],
        [torch.randn(5, generator=g), torch.randn(3, 2, generator=g), torch.randn(257, generator=g)],
    ]
    for ts in batches:
        slots = [Slot(None) for _ in ts]
        assert st.put_many(ts, slots)
        st.run_into()
        staged = digest.resolve([s.started() for s in slots])
        single = digest.resolve([digest.start(t) for t in ts])
        assert [a.digest for a in staged] == [b.digest for b in single]
