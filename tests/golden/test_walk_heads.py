"""The walk's first pass reads a sliced step only to its head (up to the first differing block)
and settles the pick there, or reads the whole slice: either way, the answer of the whole slice.

* plants whose first divergence lies before the slice's last block (values, arguments, hazards,
  structural, a digest error, missing records): the report with the stored rollups (heads) is
  the report of the records path;
* a head that ends inside the picked call (a record of the call after it) is not trusted: the
  walk reads the whole slice and finds what a walk without heads finds, the call's records whole;
* batches walked two at a time (the walk's threads) give the report, and the error, of one batch
  at a time.
"""

from __future__ import annotations

import dataclasses
import importlib
import shutil

import polars as pl
import pytest

from detfp_analyze.bisect import blocks
from detfp_analyze.bisect.pipeline import bisect
from detfp_analyze.bisect.reads import ReadPaths
from detfp_analyze.bisect.walk import walk
from detfp_analyze.errors import ShardError
from detfp_analyze.io.reader import open_run
from detfp_analyze.testing.synth import Plant, SynthSpec, write_pair
from tests.fixtures.pairs import write_planted
from tests.fixtures.shards import flip_in_footer

#: The walk's module, for its batch settings (``import detfp_analyze.bisect.walk as ...`` would look
#: ``bisect`` up as an attribute of ``detfp_analyze``: the ``bisect`` function).
walk_mod = importlib.import_module("detfp_analyze.bisect.walk")

SPEC = SynthSpec(ranks=3, steps=2, records=4000)  # four blocks per step: the head is a part of the slice
EARLY = 1500  # block 1: the slice starts at block 0, its head ends with block 1
PLANTS = {
    "values": Plant(rank=1, step=1, index=EARLY),
    "all_ranks": Plant(step=1, index=EARLY, all_ranks=True),
    "arguments": Plant(rank=0, step=1, index=EARLY, how="arguments"),
    "structural": Plant(rank=2, step=1, index=EARLY, how="structural"),
    "digest_error": Plant(rank=1, step=1, index=EARLY, how="digest_error"),
    "missing_records": Plant(rank=0, step=1, index=EARLY, how="missing"),
    "hazard": Plant(rank=1, step=1, index=EARLY, hazard=True),
}


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    return write_planted(tmp_path_factory.mktemp("heads"), SPEC, PLANTS)


def _slices(a, b, cands):
    read = [blocks.block_rollup(run.scan("rollups")).collect().sort("rank", "step", "block") for run in (a, b)]
    return blocks.slices(*read, cands)


@pytest.mark.parametrize("name", PLANTS)
def test_heads_give_the_report_of_the_records_path(planted, name):
    p = planted[name]
    # The stored blocks (slices with heads), then the records path.
    with_heads = bisect(open_run(p.a), open_run(p.b), reads=ReadPaths(step_sums=False)).to_json_dict()
    assert with_heads == bisect(open_run(p.a), open_run(p.b), reads=ReadPaths(stored_rollups=False)).to_json_dict()


def test_the_values_plant_is_read_by_its_head(planted):
    p = planted["values"]
    sl = _slices(open_run(p.a), open_run(p.b), {1: [1]})
    c = sl[(1, 1)]
    assert c.head is not None and c.seq_a[0] <= c.head[0] < c.seq_a[1]


def _two_output_call(a) -> int:
    """Index (in rank 0's step 1) of the first output of a call with two outputs in block 1."""
    recs = a.scan("records", ranks=[0], steps=[1]).collect().with_row_index("pos")
    outs = recs.filter(pl.col("role") == "output", pl.col("status") == "ok", pl.col("pos").is_between(1100, 1900))
    many = outs.group_by("call_hash").agg(pl.col("pos").min().alias("first"), pl.len()).filter(pl.col("len") >= 2)
    return int(many["first"].min())


def test_a_head_that_cuts_the_picked_call_reads_the_whole_slice(tmp_path):
    probe = write_pair(tmp_path / "pa", tmp_path / "pb", SynthSpec(ranks=1, steps=2, records=4000))
    index = _two_output_call(open_run(probe.a))
    p = write_pair(
        tmp_path / "a", tmp_path / "b", SynthSpec(ranks=1, steps=2, records=4000), Plant(step=1, index=index)
    )
    a, b = open_run(p.a), open_run(p.b)
    [expected] = p.expected
    sl = _slices(a, b, {0: [1]})
    assert sl[(0, 1)].head is not None
    whole = {k: dataclasses.replace(c, head=None) for k, c in sl.items()}
    # A head ending with the picked record: the call's second output lies past it.
    # (An artificial head: no block ends there, so no fold of blocks binds its read.)
    cut = {k: dataclasses.replace(c, head=(expected.seq, expected.seq), head_folds=None) for k, c in sl.items()}
    want = walk(a, b, {0: [1]}, (), None, slices=whole)
    assert want[0].first.record.seq_a == expected.seq
    assert sum(r.role == "output" for r in want[0].first.call) >= 2
    assert walk(a, b, {0: [1]}, (), None, slices=cut) == want
    assert walk(a, b, {0: [1]}, (), None, slices=sl) == want


@pytest.mark.parametrize("name", ["all_ranks", "structural", "hazard"])
def test_batches_walked_at_once_give_the_report_of_one_at_a_time(planted, name, monkeypatch):
    """One rank per batch, so the three ranks' batches run two at a time in the walk's threads and
    may finish in any order: the report is the one of a single batch, walked one at a time, and
    the findings come back in rank order."""
    p = planted[name]
    a, b = open_run(p.a), open_run(p.b)
    whole = bisect(a, b).to_json_dict()
    monkeypatch.setattr(walk_mod, "walk_batch", lambda a, b: 1)
    assert bisect(open_run(p.a), open_run(p.b)).to_json_dict() == whole
    cands = {r: [1] for r in (2, 0, 1)}
    found = walk(a, b, cands, (), None)
    assert list(found) == sorted(found) and found
    monkeypatch.setattr(walk_mod, "_WORKERS", 1)
    assert bisect(open_run(p.a), open_run(p.b)).to_json_dict() == whole
    assert walk(a, b, cands, (), None) == found


def test_the_first_failing_batch_raises_whichever_thread_fails_first(planted, tmp_path, monkeypatch):
    """Ranks 1 and 2 each hold a damaged records shard of the walked step, each in its own batch:
    whichever thread meets its damage first, the error is rank 1's, as one batch at a time gives."""
    p = planted["all_ranks"]
    a, b = shutil.copytree(p.a, tmp_path / "a"), shutil.copytree(p.b, tmp_path / "b")
    for r in (1, 2):
        [shard] = (b / "records" / f"rank={r}").glob("*-w0000001.parquet")
        flip_in_footer(shard, b"parquet-cpp")  # still a valid footer, not the committed one
    monkeypatch.setattr(walk_mod, "walk_batch", lambda a, b: 1)
    errors = set()
    for workers in (2, 2, 1):
        monkeypatch.setattr(walk_mod, "_WORKERS", workers)
        with pytest.raises(ShardError) as err:
            bisect(open_run(a), open_run(b))
        errors.add(str(err.value))
    [msg] = errors
    assert "rank=1" in msg and "its footer is not the one its commit line recorded" in msg
