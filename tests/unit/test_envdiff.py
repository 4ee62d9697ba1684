"""Manifest diff: per-rank facts, run-wide facts, blocking keys and the `env` command."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from detfp_analyze.cli import app
from detfp_analyze.errors import IncomparableError
from detfp_analyze.io.envdiff import EnvDiff, check_comparable, env_diff, flatten_manifest, manifest_diff
from tests.fixtures.pairs import build_pair
from tests.fixtures.shards import default_manifest


def _m(rank: int, **over) -> dict:
    m = default_manifest(rank, 2)
    for k, v in over.items():
        m[k] = v
    return m


def test_flatten_skips_launch_facts():
    flat = flatten_manifest(_m(0, command=["x"]))
    assert "rank" not in flat and "segment" not in flat and "command" not in flat and "start_step" not in flat
    assert flat["determinism.num_threads"] == 1
    assert flat["env.CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"


def test_run_wide_and_per_rank_differences_sorted():
    det = dict(default_manifest(0, 2)["determinism"], num_threads=4)
    a = {0: _m(0), 1: _m(1, host={**_m(1)["host"], "hostname": "n1"})}
    b = {0: _m(0, determinism=det), 1: _m(1, determinism=det, host={**_m(1)["host"], "hostname": "n2"})}
    diffs = manifest_diff(a, b)
    assert diffs == (
        EnvDiff("determinism.num_threads", 1, 4, None, False),
        EnvDiff("host.hostname", "n1", "n2", 1, False),
    )


def test_env_var_absent_on_one_side_and_blocking_layout():
    a = {0: _m(0)}
    b = {0: _m(0, env={"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NCCL_ALGO": "Tree"}, parallel={"tp_size": 2})}
    diffs = manifest_diff(a, b)
    assert [(d.key, d.a, d.b, d.blocking) for d in diffs] == [
        ("env.NCCL_ALGO", None, "Tree", False),
        ("parallel.tp_size", None, 2, True),
    ]
    with pytest.raises(IncomparableError, match=r"^A vs B: parallel"):
        check_comparable(diffs)
    check_comparable(diffs, force=True)


def test_values_shared_by_every_rank_are_compared_as_per_rank_ones():
    # A run index shares one value object between ranks: compared once, the same diffs.
    shared_a, shared_b, same = ["a", 1, 2.0], ["a", 1, 2], {"k": [1, 2]}
    a = {r: _m(r, versions=shared_a, extra=same) for r in range(3)}
    b = {r: _m(r, versions=shared_b, extra=same) for r in range(3)}
    copied_b = {r: _m(r, versions=list(shared_b), extra=dict(same)) for r in range(3)}
    assert manifest_diff(a, b) == manifest_diff(a, copied_b) == (EnvDiff("versions", shared_a, shared_b, None, False),)
    assert manifest_diff(a, {r: _m(r, versions=shared_a, extra=same) for r in range(3)}) == ()


def test_value_types_are_not_conflated():
    diffs = manifest_diff({0: _m(0, capture={"level": 1})}, {0: _m(0, capture={"level": True})})
    assert [d.key for d in diffs] == ["capture.level"]


def test_env_diff_on_runs_and_cli(tmp_path):
    a, b = build_pair(tmp_path, world=2, manifest_b={"env": {"NCCL_ALGO": "Ring"}})
    diffs = env_diff(a, b)
    assert [(d.key, d.a, d.b) for d in diffs] == [
        ("env.CUBLAS_WORKSPACE_CONFIG", ":4096:8", None),
        ("env.NCCL_ALGO", None, "Ring"),
    ]
    runner = CliRunner()
    out = runner.invoke(app, ["env", str(tmp_path / "a"), str(tmp_path / "b")])
    assert out.exit_code == 1
    assert '  env.NCCL_ALGO: null -> "Ring"' in out.output
    out = runner.invoke(app, ["env", str(tmp_path / "a"), str(tmp_path / "a"), "--json"])
    assert out.exit_code == 0
    assert json.loads(out.output)["env_diff"] == []
    out = runner.invoke(app, ["env", str(tmp_path / "a"), str(tmp_path / "missing")])
    assert out.exit_code == 2


def test_the_comparison_key_agrees_with_the_canonical_text():
    # _same_key stands in for _canon in manifest_diff: equal exactly when the texts are.
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from detfp_analyze.io.envdiff import _canon, _same_key

    scalars = st.one_of(
        st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True), st.text(max_size=4),
        st.sampled_from(["1", "true", "null", "1.0", ""]),
    )  # fmt: skip
    values = st.recursive(
        scalars, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=2), c, max_size=3)
    )

    @settings(max_examples=400, deadline=None)
    @given(values, values)
    def check(x, y):
        assert (_same_key(x) == _same_key(y)) == (_canon(x) == _canon(y))

    check()
    pairs = [(1, 1.0), (1, True), (0, False), (None, "null"), ("1", 1), (float("nan"), float("nan"))]
    # Lists of texts, integers and nulls are keyed by their element types and values (a group's
    # members): a float, a bool or a nested value in the same place must still tell them apart.
    pairs += [([1, 2], [1.0, 2]), ([1], [True]), ([None], ["null"]), ([1, "1"], [1, 1]), ([0, 1], [0, 1])]
    pairs += [([float("nan")], [float("nan")]), ([[1]], [1]), ([], [[]]), ([1, 2], "[1, 2]"), ([], {})]
    for x, y in pairs:
        assert (_same_key(x) == _same_key(y)) == (_canon(x) == _canon(y)), (x, y)


def test_setting_changes_are_sorted_by_rank_then_step():
    # Two or more events: sorting them once raised TypeError (the dataclass had no order).
    import polars as pl

    from detfp_analyze.io.envdiff import SettingChange, setting_changes

    class Events:  # the one read setting_changes makes of a run
        def scan(self, table: str) -> pl.LazyFrame:
            assert table == "events"
            return pl.LazyFrame(
                {
                    "rank": [1, 0, 0, 0],
                    "step": [0, 5, 2, 1],
                    "type": ["setting_changed", "setting_changed", "setting_changed", "step_begin"],
                    "detail": ["num_threads: 1 -> 2", "tf32: off -> on", None, ""],
                }
            )

    assert setting_changes(Events()) == (
        SettingChange(0, 2, ""),
        SettingChange(0, 5, "tf32: off -> on"),
        SettingChange(1, 0, "num_threads: 1 -> 2"),
    )
