"""The shortcuts that make opening and bisecting a seed-scale run cheap give what the long way gives.

* a committed shard's ShardInfo built without the dataclass ``__init__`` (``shard_info.stated_shard``)
  is equal to, hashes and prints as the one ``__init__`` builds;
* the step folds' sort is skipped only for a frame already in strictly increasing (rank, step)
  order: ``stepsums._by_rank_step`` equals ``sort`` on sorted, unsorted, tied, empty frames;
* ``Run._select`` by rank positions hands out the same shards in the same order as a filter of
  every shard (rank directories list as rank=0, rank=1, rank=10, rank=11, rank=2, ...);
* the index's committed map equals ``commit_logs.committed_shards`` of the parsed commit logs;
* ``_gcpause.paused`` leaves the collector as it found it (on, off, nested, on an error).
"""

from __future__ import annotations

import gc
from pathlib import Path

import polars as pl
import pytest

from detfp_analyze import _gcpause
from detfp_analyze.io import commit_logs, runindex, stepsums
from detfp_analyze.io.manifests import read_manifests
from detfp_analyze.io.reader import index_run, open_run
from detfp_analyze.io.shard_info import ShardInfo, stated_shard
from detfp_analyze.io.store import store


def test_a_stated_shard_info_is_the_dataclass_one():
    values = (Path("/r/records/rank=3/part-s00000-w0000001.parquet"), "records", 3, 0, 20, 40, 79, 1, 123, "x/y")
    fast, slow = stated_shard(*values), ShardInfo(*values)
    assert fast == slow and hash(fast) == hash(slow) and repr(fast) == repr(slow)
    assert stated_shard(*values[:-1], "other") != slow


@pytest.mark.parametrize(
    "rows",
    [
        [(0, 0), (0, 1), (1, 0), (1, 5), (2, 2)],  # sorted: returned as it is
        [(1, 0), (0, 1), (0, 0), (2, 2)],  # unsorted
        [(0, 0), (0, 0), (1, 3)],  # a tie: not strictly increasing, sorted
        [(0, 3), (0, 1)],
        [(5, 5)],
        [],
    ],
)
def test_folds_are_sorted_exactly_when_they_need_it(rows):
    frame = pl.DataFrame(
        {"rank": [r for r, _ in rows], "step": [s for _, s in rows], "n": list(range(len(rows)))},
        schema={"rank": pl.Int32, "step": pl.Int64, "n": pl.Int64},
    )
    got = stepsums._by_rank_step(frame)
    # The sort's answer: the same rows in (rank, step) order (tied rows in either order, as sort leaves them).
    assert got.select("rank", "step").equals(frame.sort("rank", "step").select("rank", "step"))
    assert got.sort("rank", "step", "n").equals(frame.sort("rank", "step", "n"))
    if rows == sorted(set(rows)):
        assert got.equals(frame)


@pytest.fixture(scope="module")
def seed_run(tmp_path_factory):
    from detfp_analyze.testing.seedpair import SeedSpec, write_seed_run

    root = tmp_path_factory.mktemp("seed") / "a"
    spec = SeedSpec(ranks=12, steps=12, records=5, layout=(("tp", 2), ("dp", 3), ("pp", 2)), step_time=5.0)
    write_seed_run(root, spec, workers=1)
    return root


def test_select_by_rank_positions_is_the_filter_of_every_shard(seed_run):
    run = open_run(seed_run)
    shards = run.shards["records"]
    assert [s.rank for s in shards][:: len(shards) // 12][:3] == [0, 1, 10]  # the listing's order
    for ranks in ([2], [10, 2], [11, 0, 5], list(range(12)), [99]):
        expect = [s for s in shards if s.rank in set(ranks)]
        assert run._select("records", ranks, None) == expect
        assert run._select("records", ranks, [7]) == [s for s in expect if s.step_min <= 7 <= s.step_max]


def test_the_index_states_the_committed_shards_the_logs_state(seed_run):
    assert index_run(seed_run) is not None
    st = store(seed_run, "a", None)
    got = runindex.load(st, seed_run.resolve(), "a")
    assert got is not None
    found = read_manifests(st, seed_run, "a")
    manifests = {r: tuple(found[r][s] for s in sorted(found[r])) for r in sorted(found)}
    logs = commit_logs.read_logs(st, seed_run, "a", manifests)
    assert got.committed == dict(commit_logs.committed_shards(manifests, logs)) and len(got.committed) > 0


def test_the_collector_is_left_as_it_was():
    was = gc.isenabled()
    try:
        gc.enable()
        with _gcpause.paused():
            assert not gc.isenabled()
            with _gcpause.paused():
                assert not gc.isenabled()
            assert not gc.isenabled()
        assert gc.isenabled()
        with pytest.raises(ValueError), _gcpause.paused():
            raise ValueError
        assert gc.isenabled()
        gc.disable()
        with _gcpause.paused():
            pass
        assert not gc.isenabled()
    finally:
        (gc.enable if was else gc.disable)()
