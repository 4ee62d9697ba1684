"""The shortcuts past the records are explicit options (``ReadPaths``), not the environment.

* ``detfp-analyze bisect --no-step-sums`` and ``--no-stored-rollups`` reach the step search: the
  stages it calls differ (the folds name the ranks to read; without them every compared rank's
  metrics and stored rollups are read; without the stored rollups the records are), and the JSON
  report is byte-identical on every path;
* the library reads no environment variable for them: the old switches set to 0 change neither
  the stages called nor the report.
"""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from detfp_analyze.bisect.pipeline import bisect
from detfp_analyze.bisect.reads import ReadPaths
from detfp_analyze.io.reader import open_run
from detfp_analyze.testing.synth import Plant, SynthSpec, write_pair
from tests.fixtures.stages import spy

SPEC = SynthSpec(ranks=4, steps=3, records=300)
#: rank 1, late in the last step (after its all-reduce): only rank 1's records and no metric differ.
PLANT = Plant(rank=1, step=2, index=290)
#: The stages that read shards, each call recorded as (ranks, first step, last step).
STAGES = ("metric_divergence", "block_rollups", "rollup_candidates")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("paths")
    return write_pair(root / "a", root / "b", SPEC, PLANT)


@pytest.fixture
def calls(monkeypatch) -> dict[str, list]:
    """Which of ``STAGES`` the local engine was asked for, in order."""
    return spy(monkeypatch, STAGES)


def _cli(pair, *flags: str) -> str:
    from detfp_analyze.cli import app

    res = CliRunner().invoke(app, ["bisect", str(pair.a), str(pair.b), "--json", *flags])
    assert res.exit_code == 1, res.output  # diverged
    return res.stdout


ALL = list(range(SPEC.ranks))
#: flags -> the stages the search calls on the pair.
PATHS = {
    # The folds: rank 1's last step alone differs, no metric does; its records are held in
    # memory for the walk (bisect.held), so no stored rollups are read to slice them.
    (): {"metric_divergence": [], "block_rollups": [], "rollup_candidates": []},
    # The shards of every compared rank: all metrics, all stored rollups.
    ("--no-step-sums",): {
        "metric_divergence": [(ALL, 0, 2)],
        "block_rollups": [(ALL, 0, 2)],
        "rollup_candidates": [],
    },
    # The records path of runs written without rollups.
    ("--no-stored-rollups",): {
        "metric_divergence": [(ALL, 0, 2)],
        "block_rollups": [],
        "rollup_candidates": [(ALL, 0, 2)],
    },
    ("--no-step-sums", "--no-stored-rollups"): {
        "metric_divergence": [(ALL, 0, 2)],
        "block_rollups": [],
        "rollup_candidates": [(ALL, 0, 2)],
    },
}


def test_the_cli_flags_choose_the_path_and_the_report_is_the_same(pair, calls):
    reports = set()
    for flags, expected in PATHS.items():
        for got in calls.values():
            got.clear()
        reports.add(_cli(pair, *flags))
        assert calls == expected, flags
    assert len(reports) == 1
    (first,) = reports
    assert '"rank": 1' in first


def test_the_options_are_the_cli_flags(pair, calls):
    # The library call with the same options takes the same path as the command line.
    bisect(open_run(pair.a), open_run(pair.b), reads=ReadPaths(step_sums=False))
    assert calls == PATHS[("--no-step-sums",)]


@pytest.mark.parametrize("variable", ["DETFP_BISECT_SUMS", "DETFP_BISECT_ROLLUPS"])
def test_the_old_environment_switches_change_nothing(pair, calls, monkeypatch, variable):
    expect = bisect(open_run(pair.a), open_run(pair.b)).to_json_dict()
    before = {k: list(v) for k, v in calls.items()}
    for got in calls.values():
        got.clear()
    monkeypatch.setenv(variable, "0")
    assert bisect(open_run(pair.a), open_run(pair.b)).to_json_dict() == expect
    assert calls == before == PATHS[()]
