"""The local engine's held rank-steps (``bisect.held``): reads served from memory are the reads
of the shards, and reports do not depend on whether anything was held.

* ``HeldRun.scan`` / ``scan_spans`` of held rank-steps give the frames ``Run.scan`` /
  ``Run.scan_spans`` give: rows, order, columns and types, for any subset of ranks and columns;
  reads of what is not held go to the run;
* ``LocalStages.prefetch`` holds each rank's first candidate step only within ``HOLD_ROWS``;
* every sample pair and golden plant gives the same report held or not (``HOLD_ROWS = 0``), and
  the held bisect of each pair that diverged did serve reads from memory (a comparison of two
  bisects that held nothing would pass whatever holding did).
"""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest

from detfp_analyze.bisect import bisect
from detfp_analyze.bisect import engine as _engine
from detfp_analyze.bisect.held import HeldRun, hold
from detfp_analyze.io.reader import open_run

SAMPLES = Path(__file__).resolve().parents[2] / "sample_traces"
SAMPLE_PAIRS = [("data_rank", "a", "b"), ("moe_permute", "a", "b"), ("nondet", "a", "b"), ("ops", "a", "b"),
                ("resume", "full", "resumed"), ("resume", "full", "restored")]  # fmt: skip


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from detfp_analyze.testing.seedpair import SeedSpec, write_seed_run
    from detfp_analyze.testing.synth import Plant

    root = tmp_path_factory.mktemp("held")
    spec = SeedSpec(ranks=8, steps=12, records=20, layout=(("tp", 2), ("dp", 2), ("pp", 2)), step_time=5.0)
    write_seed_run(root / "a", spec, workers=1)
    write_seed_run(root / "b", spec, Plant(rank=3, step=9, index=5), link_from=root / "a", workers=1)
    return open_run(root / "a"), open_run(root / "b")


def _same(got: pl.LazyFrame, want: pl.LazyFrame) -> None:
    g, w = got.collect(), want.collect()
    assert g.schema == w.schema
    assert g.equals(w), (g, w)


def test_held_reads_are_the_runs_reads(pair):
    run, other = pair
    held, held_b = HeldRun(run), HeldRun(other)
    hold(held, held_b, {0: 9, 1: 9, 2: 9, 3: 9, 5: 4, 6: 4})
    assert held.held == {(0, 9), (1, 9), (2, 9), (3, 9), (5, 4), (6, 4)} == held_b.held
    for ranks, step in (([0, 1, 2, 3], 9), ([3, 1], [9]), ([2], range(9, 10)), (3, 9), ([5, 6], 4), ([6], (4,))):
        for columns in (None, ["rank", "seq", "key_hash", "digest_lo"], ["name", "shape", "rank"]):
            _same(held.scan("records", ranks, step, columns), run.scan("records", ranks, step, columns))
    spans = {(1, 9): (3, 11), (3, 9): (0, 40), (5, 4): (2, 2), (6, 4): (7, 6)}
    for columns in (None, ["rank", "step", "seq", "call_hash"]):
        _same(held.scan_spans("records", spans, columns), run.scan_spans("records", spans, columns))
        one = {(0, 9): (4, 9), (2, 9): (1, 19)}
        _same(held.scan_spans("records", one, columns), run.scan_spans("records", one, columns))


def test_reads_of_what_is_not_held_go_to_the_run(pair, monkeypatch):
    run, other = pair
    held = HeldRun(run)
    hold(held, HeldRun(other), {0: 9, 1: 9})
    asked: list[tuple] = []
    real = type(run).scan
    monkeypatch.setattr(type(run), "scan", lambda self, *a, **k: asked.append(a) or real(self, *a, **k))
    _same(held.scan("records", [0, 1], 9), real(run, "records", [0, 1], 9))
    assert asked == []  # served
    for args in (("records", [0, 2], 9), ("records", [0], [8, 9]), ("records", None, 9), ("metrics", [0], 9),
                 ("records", [], 9), ("records", [], 7)):  # fmt: skip
        _same(held.scan(*args), real(run, *args))
    assert len(asked) == 6
    _same(held.scan_spans("records", {}), run.scan_spans("records", {}))
    assert held.world_size == run.world_size and held.label == run.label  # every other attribute is the run's


def test_prefetch_holds_first_steps_within_the_budget(pair, monkeypatch):
    stages = _engine.local(*pair)
    stages.prefetch({1: [9, 10], 3: [9], 4: []}, None)
    assert stages.a.held == stages.b.held == {(1, 9), (3, 9)}
    monkeypatch.setattr(_engine, "HOLD_ROWS", 39)  # 2 rank-steps of 20 records: past it
    small = _engine.local(*pair)
    small.prefetch({1: [9], 3: [9]}, None)
    assert small.a.held == frozenset()


def _report(a, b, **kw) -> str:
    return json.dumps(bisect(a, b, **kw).to_json_dict(), sort_keys=True)


def _walked(report: str) -> bool:
    """Whether the report's walk read records (a pair that diverged; an identical pair stops at
    the step sums, with nothing to hold)."""
    return json.loads(report)["status"] != "identical"


def _served(monkeypatch, a, b, **kw) -> tuple[str, int]:
    """The report of ``bisect(a, b)`` and how many of its reads were served from held records."""
    served = [0]
    real = HeldRun._of

    def counted(self, step, ranks):
        served[0] += 1
        return real(self, step, ranks)

    with monkeypatch.context() as m:
        m.setattr(HeldRun, "_of", counted)
        return _report(a, b, **kw), served[0]


def _held_or_not(monkeypatch, a, b, **kw) -> None:
    """The report is the same held or not, and the held bisect did serve reads from memory
    whenever its walk read records (without that the comparison would be of two unheld runs);
    with ``HOLD_ROWS = 0`` none is served."""
    held, served = _served(monkeypatch, a, b, **kw)
    assert served > 0 or not _walked(held), f"a diverged pair's walk served nothing from held records: {held[:300]}"
    with monkeypatch.context() as m:
        m.setattr(_engine, "HOLD_ROWS", 0)
        assert _served(monkeypatch, a, b, **kw) == (held, 0)


@pytest.mark.parametrize(("name", "x", "y"), SAMPLE_PAIRS)
def test_sample_pairs_report_the_same_held_or_not(monkeypatch, name, x, y):
    a = open_run(SAMPLES / name / x, allow_missing_ranks=True)
    b = open_run(SAMPLES / name / y, allow_missing_ranks=True)
    for level in ("op", "kernel"):
        _held_or_not(monkeypatch, a, b, level=level)


def test_golden_plants_and_a_seed_pair_report_the_same_held_or_not(planted_pairs, pair, monkeypatch):
    for _, p in sorted(planted_pairs.items()):
        opts = {"allow_missing_ranks": True, "allow_incomplete": True}
        _held_or_not(monkeypatch, open_run(p.a, **opts), open_run(p.b, **opts))
    _held_or_not(monkeypatch, *pair)


def test_the_check_fails_when_nothing_is_held(pair, monkeypatch):
    """The comparison above is not vacuous: a bisect whose prefetch holds nothing fails it."""
    monkeypatch.setattr(_engine.LocalStages, "prefetch", lambda self, cands, slices: None)
    with pytest.raises(AssertionError, match="served nothing from held records"):
        _held_or_not(monkeypatch, *pair)
