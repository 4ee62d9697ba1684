"""The public surfaces of both packages resolve, and stay small and explicit."""

from __future__ import annotations

import subprocess
import sys

import detfp_analyze


def test_every_analyze_export_resolves():
    for name in detfp_analyze.__all__:
        assert getattr(detfp_analyze, name) is not None, name


def test_unknown_attribute_is_an_attribute_error():
    try:
        detfp_analyze.no_such_name  # noqa: B018
    except AttributeError as exc:
        assert "no_such_name" in str(exc)
    else:
        raise AssertionError("expected AttributeError")


def test_every_capture_export_resolves_in_a_fresh_process():
    code = "import detfp_capture as d; [getattr(d, n) for n in d.__all__]; print(sorted(d.__all__))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "Session" in out and "fingerprint" in out


def test_analyze_exports_pull_in_no_torch():
    code = (
        "import sys, detfp_analyze as d; [getattr(d, n) for n in d.__all__ if n != 'divergence_heatmap'];"
        "print('torch' in sys.modules, 'matplotlib' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]
