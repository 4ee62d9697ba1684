"""One source of verdicts, patterns and difference kinds (``detfp_analyze.bisect.result``): every
consumer handles every value, and an unknown one fails loudly instead of being shown as another.

Adding a verdict to ``VERDICTS`` makes these tests name each consumer still missing it: the
report text, the HTML page (its colour), the pictures (state, colour, legend), the timeline,
the gate's vocabulary and docs/report.md.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import polars as pl
import pytest

from detfp_analyze.bisect.diagnose import diagnose
from detfp_analyze.bisect.result import (
    CAUSES,
    DIFF_KINDS,
    PATTERNS,
    STATUSES,
    VERDICTS,
    BisectResult,
    Diagnosis,
    Divergence,
    RankResult,
    ResumeInfo,
    Window,
    check_cause,
    check_pattern,
    check_status,
    check_verdict,
)
from detfp_analyze.gate import expectations as gate
from detfp_analyze.render import html, perfetto, report
from detfp_analyze.render.frames import STATE_COLORS, STATE_HELP, STATES, UnknownStateError, rank_step_frame, state_of
from detfp_analyze.render.heatmap import bisect_frame, divergence_heatmap

REPORT_DOC = (Path(__file__).resolve().parents[2] / "docs" / "report.md").read_text()


def doc_rows(heading: str) -> list[str]:
    """The first-column values of the table under ``heading`` in docs/report.md."""
    section = REPORT_DOC.split(heading, 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `(\w+)` \|", section, flags=re.M)


def div(verdict: str, diff_kind: str = "values") -> Divergence:
    return Divergence(1, -1, "forward", "m", "op", "aten::mm.default", 0, "output", "out", "both", verdict,
                      diff_kind, (), 5, 5)  # fmt: skip


def result_with(verdict: str, pattern: str = "no_origin") -> BisectResult:
    """Rank 0 diverged with ``verdict`` (metric_only: only its metrics differ), rank 1 identical."""
    if verdict == "metric_only":
        r0 = RankResult(0, "diverged", 1, metric_step=1, metric_name="loss", metric_a=1.0, metric_b=2.0)
    else:
        r0 = RankResult(0, "diverged", 1, record_step=1, first=div(verdict))
    ranks = (r0, RankResult(1, "identical", None))
    diag = Diagnosis(pattern, (), f"pattern {pattern}", None, {}, {verdict: 1})
    return BisectResult("a", "b", "diverged", (), 1, ranks, diag, None, None, Window((0, 2), (0, 2), (0, 2), (0, 1)),
                        ResumeInfo(False, 0, 0, 0), None)  # fmt: skip


@pytest.mark.parametrize("verdict", VERDICTS)
def test_every_consumer_shows_every_verdict(verdict):
    res = result_with(verdict)
    assert f" {verdict}" in report.render_text(res)
    page = html.render_html(res)
    assert f'class="v v-{verdict}"' in page and verdict in html.verdict_classes()
    assert state_of(verdict) == verdict and STATE_COLORS[verdict] and STATE_HELP[verdict]
    assert verdict in rank_step_frame(res)["state"].to_list()
    assert verdict in bisect_frame(res)["state"].to_list()
    if verdict != "metric_only":  # a metric split names no record for the timeline to mark
        assert perfetto._firsts(res)[0]["verdict"] == verdict
    assert verdict in gate._KNOWN["verdict"]
    assert verdict in doc_rows("## Verdicts")


@pytest.mark.parametrize("pattern", PATTERNS)
def test_every_pattern_is_documented_and_rendered(pattern):
    assert pattern in doc_rows("## Patterns")
    text = report.render_text(result_with("origin", pattern))
    assert f"; pattern {pattern}\n" in text


@pytest.mark.parametrize("cause", CAUSES)
def test_every_cause_is_documented_and_rendered(cause):
    assert cause in doc_rows("## Causes")
    res = result_with("origin")
    head = f"the headline of {cause}."
    diag = dataclasses.replace(res.diagnosis, cause=cause, headline=head, explanation=head, next_steps=("do it",))
    res = dataclasses.replace(res, diagnosis=diag)
    text = report.render_text(res)
    assert f"diagnosis: {head}\n  cause {cause}; pattern no_origin\n  next: do it\n" in text
    page = html.render_html(res)
    assert f'<p id="headline">{head}</p>' in page and f"<code>{cause}</code>" in page
    assert "<li>do it</li>" in page


@pytest.mark.parametrize("status", STATUSES)
def test_every_status_is_documented_rendered_and_gated(status):
    exits = REPORT_DOC.split("| exit | bisect | env |", 1)[1].split("\n\n", 1)[0]
    assert f"`{status}`" in exits
    res = dataclasses.replace(result_with("source"), status=status)
    assert report.status_line(res).startswith(f"status: {status}")
    assert f'class="status {status}"' in html.render_html(res) and f".status.{status}{{" in html._CSS
    assert status in gate._KNOWN["status"]


def test_diff_kinds_and_the_vocabulary_are_documented():
    assert doc_rows("## Difference kinds") == list(DIFF_KINDS)
    assert doc_rows("## Verdicts") == list(VERDICTS)
    assert sorted(doc_rows("## Patterns")) == sorted(PATTERNS)
    assert doc_rows("## Causes") == list(CAUSES)
    assert set(VERDICTS) <= set(STATES) == set(STATE_COLORS) == set(STATE_HELP)


def test_an_unknown_value_fails_loudly_everywhere():
    with pytest.raises(ValueError, match=r"verdict 'gremlin' is not one of origin, unobserved_producer"):
        check_verdict("gremlin")
    with pytest.raises(ValueError, match=r"verdict 'gremlin' is not one of"):
        div("gremlin")
    with pytest.raises(ValueError, match=r"difference kind 'gremlin' is not one of values"):
        div("origin", "gremlin")
    with pytest.raises(ValueError, match=r"pattern 'gremlin' is not one of identical"):
        check_pattern("gremlin")
    with pytest.raises(ValueError, match=r"pattern 'gremlin'"):
        Diagnosis("gremlin", (), "")
    with pytest.raises(ValueError, match=r"cause 'gremlin' is not one of none, ended_early"):
        check_cause("gremlin")
    with pytest.raises(ValueError, match=r"cause 'gremlin'"):
        Diagnosis("no_origin", (), "", cause="gremlin")
    with pytest.raises(ValueError, match=r"status 'gremlin' is not one of identical, diverged, rng_only"):
        check_status("gremlin")
    with pytest.raises(ValueError, match=r"verdict 'gremlin'"):
        Diagnosis("no_origin", (), "", verdict_counts={"gremlin": 1})
    # Consumers with a table per verdict refuse a value missing from it (a state that is not a verdict too).
    for bad in ("gremlin", "differs"):
        with pytest.raises(UnknownStateError, match="has no picture state"):
            state_of(bad, 3)
    with pytest.raises(ValueError, match="verdict 'gremlin'"):
        html._verdict("gremlin")


def test_the_heatmap_colours_every_state_and_refuses_an_unknown_one():
    pytest.importorskip("matplotlib")
    frame = pl.DataFrame({"rank": list(range(len(STATES))), "step": [0] * len(STATES), "state": list(STATES)})
    img = divergence_heatmap(frame).axes[0].images[0].get_array()
    assert [int(x) for x in img[:, 0]] == list(range(len(STATES)))  # each state its own colour index
    with pytest.raises(UnknownStateError, match="'gremlin' is not one of absent"):
        divergence_heatmap(frame.with_columns(pl.lit("gremlin").alias("state")))


def test_the_timeline_refuses_an_unknown_verdict():
    res = result_with("origin")
    bad = object.__new__(Divergence)  # past the constructor's own check, as a stale pickle would be
    for f in dataclasses.fields(Divergence):
        object.__setattr__(bad, f.name, getattr(res.ranks[0].first, f.name))
    object.__setattr__(bad, "verdict", "gremlin")
    res = dataclasses.replace(res, ranks=(dataclasses.replace(res.ranks[0], first=bad), res.ranks[1]))
    with pytest.raises(ValueError, match="verdict 'gremlin'"):
        perfetto._firsts(res)


def test_diagnose_only_produces_known_patterns():
    ranks = (RankResult(0, "diverged", 1, record_step=1, first=div("origin")), RankResult(1, "identical", None))
    assert diagnose(ranks, {}).pattern in PATTERNS
    assert diagnose((RankResult(0, "identical", None),), {}).pattern == "identical"
