"""The public surfaces of both packages resolve, and stay small and explicit.

``detfp_analyze``'s surface is pinned: its names, each function's parameters (names, keyword-only
or not, defaults) and the fields of its result types (the JSON report's contract: a renamed or
removed field bumps ``REPORT_VERSION``). A change here is an API change: update the pin on purpose.
"""

from __future__ import annotations

import dataclasses
import inspect
import subprocess
import sys

import pytest

import detfp_analyze

#: name -> its parameters as ``name``, ``*name`` (keyword-only) and ``=default``.
FUNCTIONS = {
    "bisect": "run_a, run_b, *ranks=None, *steps=None, *level='op', *force=False, *ignore_env=(), *progress=None, "
    "*engine=None, *reads=None, *allow_incomplete=False",
    "certify": "run, *checks=None",
    "connect": "a, b=None, *allow_missing_ranks=False, *allow_incomplete=False, *allow_file_access=False, "
    "*database=':memory:'",
    "divergence_heatmap": "frame, *value=None, *max_rows=128, *title=None, *width=8.0, *height=5.0",
    "env_diff": "run_a, run_b, *ranks=None",
    "open_run": "path, *allow_missing_ranks=False, *allow_incomplete=False, *filesystem=None, *use_index=True",
    "render_text": "result",
    "summarize": "run",
}
#: result type -> its fields, in order.
RESULTS = {
    "BisectResult": ("label_a", "label_b", "status", "env_diff", "first_step", "ranks", "diagnosis", "diff",
                     "diff_rank", "window", "resume", "discriminator", "notes", "complete", "endings"),
    "RankResult": ("rank", "status", "step", "metric_step", "metric_name", "metric_a", "metric_b", "record_step",
                   "first", "next_clean", "hazard_confirmed"),
    "Divergence": ("step", "microbatch", "phase", "module", "kind", "op", "occurrence", "role", "arg", "presence",
                   "verdict", "diff_kind", "hazards", "seq_a", "seq_b", "dtype", "shape", "consumer", "contradiction",
                   "upstream", "group", "group_ranks", "peers_differing", "kernels", "diff", "explanation",
                   "depends_on", "component", "components", "fused"),
    "Diagnosis": ("pattern", "origin_ranks", "explanation", "op", "shared_coordinates", "verdict_counts", "cause",
                  "headline", "next_steps"),
    "CertifyResult": ("label", "status", "problems", "ranks", "steps", "notes"),
    "Problem": ("kind", "rank", "step", "module", "detail"),
    "RunSummary": ("label", "world_size", "ranks", "missing_ranks", "segments", "first_step", "last_step", "levels",
                   "tables", "kinds", "statuses", "hazards", "events", "metrics", "environment", "completeness"),
    "EnvDiff": ("key", "a", "b", "rank", "blocking"),
}  # fmt: skip
#: The other public classes, by the module that defines them.
CLASSES = {"DetfpError": "detfp_format.errors", "Run": "detfp_analyze.io.run"}


def _params(fn) -> str:
    out = []
    for p in inspect.signature(fn).parameters.values():
        name = ("*" if p.kind is p.KEYWORD_ONLY else "") + p.name
        out.append(name if p.default is inspect.Parameter.empty else f"{name}={p.default!r}")
    return ", ".join(out)


def test_the_public_names_are_pinned():
    assert sorted(detfp_analyze.__all__) == sorted([*FUNCTIONS, *RESULTS, *CLASSES, "REPORT_VERSION"])
    assert dir(detfp_analyze) == sorted(detfp_analyze.__all__)


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_each_public_function_keeps_its_parameters(name):
    fn = getattr(detfp_analyze, name)
    assert inspect.isfunction(fn) and fn.__doc__, name
    assert _params(fn) == FUNCTIONS[name]


@pytest.mark.parametrize("name", sorted(RESULTS))
def test_each_result_type_is_frozen_and_keeps_its_fields(name):
    cls = getattr(detfp_analyze, name)
    assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen, name
    assert tuple(f.name for f in dataclasses.fields(cls)) == RESULTS[name], (
        f"{name}'s fields changed: a renamed or removed field bumps REPORT_VERSION; then update this pin"
    )


def test_the_other_classes_and_the_report_version():
    for name, module in CLASSES.items():
        assert inspect.isclass(getattr(detfp_analyze, name)) and getattr(detfp_analyze, name).__module__ == module
    assert issubclass(detfp_analyze.DetfpError, Exception)
    assert detfp_analyze.REPORT_VERSION == 3


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


def test_bisect_stays_the_function_after_its_subpackage_is_imported():
    # The subpackage ``detfp_analyze.bisect`` and the function share a name: importing a submodule
    # binds it on its package, so the function must win however the package was first imported.
    code = (
        "import detfp_analyze.bisect.walk, detfp_analyze.single.certify, detfp_analyze, inspect\n"
        "print(inspect.isfunction(detfp_analyze.bisect), inspect.isfunction(detfp_analyze.certify))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", "True"]


def test_the_other_packages_public_names():
    import detfp_format
    import detfp_guards

    assert detfp_format.__all__ == ["DetfpError", "FormatError", "RunExistsError", "SchemaError", "SelectorError"]
    assert all(issubclass(getattr(detfp_format, n), detfp_format.FormatError) for n in detfp_format.__all__[2:])
    # The one root of every package's errors (test_error_root.py walks them all).
    assert issubclass(detfp_format.FormatError, detfp_format.DetfpError)
    assert detfp_analyze.DetfpError is detfp_format.DetfpError
    assert detfp_guards.__all__ == ["NotReproducibleError", "RepeatResult", "assert_bitwise_reproducible", "repeat_check"]
    code = "import detfp_capture as d; print(sorted(d.__all__))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['CaptureError', 'DigestError', 'Fingerprint', 'Moments', 'Session', 'fingerprint']"
    from detfp_capture.errors import CaptureError, RunExistsError

    # The capture's RunExistsError is both a CaptureError and the format's error.
    assert issubclass(RunExistsError, CaptureError) and issubclass(RunExistsError, detfp_format.RunExistsError)
