"""`bisect --html`: one self-contained, byte-stable page, rendered in a real headless Chromium.

The browser test opens the page the CLI wrote, takes a screenshot, checks that the page logged
no console error, exception or blocked fetch, that the key elements are in the rendered DOM, and
that sorting and filtering the rank table work. Chromium comes from the system packages: when it
is missing the test installs it (``apt-get install -y chromium``, see tests/fixtures/browser.py) or fails
naming that command; DETFP_SKIP_BROWSER=1 skips it explicitly. DETFP_SCREENSHOT_DIR=DIR keeps the
screenshots for a human to look at.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil

import pytest

from detfp_analyze.bisect import bisect
from detfp_analyze.render.html import html_report, render_html
from tests.fixtures.browser import Browser, ensure_chromium
from tests.unit.test_pictures import _layout_2432, _result_2432

pytest.importorskip("matplotlib")


def test_page_is_self_contained_and_carries_the_json_report(report_page, layout_pair):
    text = report_page.read_text()
    assert text.startswith("<!DOCTYPE html>")
    assert "Content-Security-Policy" in text and "default-src 'none'" in text
    assert not re.search(r"<script[^>]+src=|<link\b|@import|url\((?!#)", text)  # nothing fetched
    assert set(re.findall(r"https?://[^\s\"'<>]+", text)) <= {
        "http://www.w3.org/2000/svg",
        "http://www.w3.org/1999/xlink",
    }
    embedded = re.search(r'<script type="application/json" id="detfp-report">(.*?)</script>', text, re.S)
    res = bisect(layout_pair.a, layout_pair.b)
    assert json.loads(embedded.group(1)) == json.loads(json.dumps(res.to_json_dict()))
    ids = re.findall(r'\bid="([^"]+)"', text)
    assert len(ids) == len(set(ids)), "inline SVGs must not share ids"
    assert text.count("<svg") == 4


def test_page_is_byte_stable(report_page, layout_pair):
    res = bisect(layout_pair.a, layout_pair.b)
    assert html_report(res, layout_pair.a, layout_pair.b) == report_page.read_text()


def test_page_without_matplotlib_says_how_to_get_pictures(layout_pair, monkeypatch):
    import detfp_analyze.render.gallery as pictures
    from detfp_analyze.errors import OptionalDependencyError

    def missing(*a, **k):
        raise OptionalDependencyError("matplotlib is not installed; install it with: pip install 'detfp[plot]'")

    monkeypatch.setattr(pictures, "bisect_pictures", missing)
    text = html_report(bisect(layout_pair.a, layout_pair.b), layout_pair.a, layout_pair.b)
    assert "<svg" not in text
    assert "no pictures: matplotlib is not installed; install it with: pip install &#x27;detfp[plot]&#x27;" in text


@pytest.fixture(scope="module")
def chromium():
    if os.environ.get("DETFP_SKIP_BROWSER") == "1":
        pytest.skip("DETFP_SKIP_BROWSER=1: the browser test was skipped on request")
    try:
        return ensure_chromium()
    except RuntimeError as exc:
        pytest.fail(str(exc))


def _keep(name: str, png: bytes) -> None:
    keep = os.environ.get("DETFP_SCREENSHOT_DIR")
    if keep:
        os.makedirs(keep, exist_ok=True)
        with open(os.path.join(keep, name), "wb") as f:
            f.write(png)


def _red_pixels(png: bytes) -> int:
    """Pixels of the 'diverged' badge colour (#c0152f) in a screenshot."""
    import matplotlib.image as mi
    import numpy as np

    img = (mi.imread(io.BytesIO(png), format="png")[..., :3] * 255).round().astype(int)
    return int((np.abs(img - np.array([0xC0, 0x15, 0x2F])).sum(axis=-1) < 12).sum())


def test_report_in_headless_chromium(chromium, report_page, tmp_path):
    big = tmp_path / "big.html"  # the 2,432-rank result's page, without pictures
    big.write_text(render_html(_result_2432(), layout=_layout_2432()))
    with Browser(chromium, tmp_path / "profile") as browser:
        page = browser.open(report_page.resolve().as_uri(), width=1280, height=900)
        shot = page.screenshot()
        _keep("report.png", shot)
        _keep("report-full.png", page.screenshot(full_page=True))
        assert shot[:8] == b"\x89PNG\r\n\x1a\n" and _red_pixels(shot) > 500  # the badge is on screen
        dom = page.evaluate(
            """({
            status: document.getElementById('status').textContent,
            statusClass: document.getElementById('status').className,
            headline: document.getElementById('headline').textContent,
            rows: document.querySelectorAll('#rank-table tbody tr').length,
            heads: Array.from(document.querySelectorAll('#rank-table thead th')).map(th => th.textContent),
            figures: Array.from(document.querySelectorAll('#pictures figure svg')).map(s => Math.round(s.getBoundingClientRect().width)),
            commands: Array.from(document.querySelectorAll('#commands pre')).map(p => p.textContent),
            sections: Array.from(document.querySelectorAll('main section h2')).map(h => h.textContent),
            report: JSON.parse(document.getElementById('detfp-report').textContent).diagnosis.pattern
        })"""
        )
        assert dom["status"] == "diverged, first at step 1; pattern single_rank; cause rank_local"
        assert dom["statusClass"] == "status diverged"
        assert dom["headline"].startswith("Only rank 29 starts the difference")
        assert dom["rows"] == 48
        assert dom["heads"][:5] == ["rank", "pp", "dp", "tp", "status"]
        assert len(dom["figures"]) == 4 and min(dom["figures"]) > 300
        assert dom["commands"][0].startswith("detfp-analyze bisect ")
        assert any("--depth kernel" in c for c in dom["commands"])
        assert dom["sections"] == ["Diagnosis", "Commands", "Pictures", "Ranks", "Environment", "Discriminator"]
        assert dom["report"] == "single_rank"
        # Sorting: verdict ascending puts the origin first; rank twice sorts descending.
        first = page.evaluate(
            """(() => {
            const ths = document.querySelectorAll('#rank-table thead th');
            const head = t => Array.from(ths).find(th => th.textContent === t);
            const top = () => document.querySelector('#rank-table tbody tr').cells;
            head('verdict').click(); const v = [top()[0].textContent, top()[6].textContent];
            head('rank').click(); head('rank').click(); const r = top()[0].textContent;
            return {v: v, r: r, sort: head('rank').getAttribute('aria-sort')};
        })()"""
        )
        assert first == {"v": ["29", "origin"], "r": "47", "sort": "descending"}
        shown = page.evaluate(
            """(() => { const i = document.querySelector('input[data-filter]'); i.value = 'origin';
            i.dispatchEvent(new Event('input')); return document.getElementById('rank-count').textContent; })()"""
        )
        assert shown == "1"
        assert page.errors() == []
        page2 = browser.open(big.resolve().as_uri())
        assert page2.evaluate("document.querySelectorAll('#rank-table tbody tr').length") == 2432
        assert page2.evaluate("document.getElementById('pictures').textContent") == "Pictures"
        assert page2.errors() == []
    assert shutil.which("true")  # the browser process is gone; nothing left running


def test_page_of_identical_runs(layout_pair, layout_twin):
    res = bisect(layout_pair.a, layout_twin)
    text = html_report(res, layout_pair.a, layout_twin, pictures=False)
    assert '<span id="status" class="status identical">identical</span>' in text
    assert "pictures were not requested" in text and "<svg" not in text
    assert "No discriminator: there is no origin op to discriminate." in text
    assert text.count("<h3>") == 2  # ranks by outcome, and one command: reproduce
