"""pytest plugin of detfp (entry point ``pytest11``: ``detfp``): bitwise reproducibility guards in tests.

- Fixture ``detfp_repeat``: ``detfp_repeat(fn, *args, ...)`` is ``repeat_check`` and
  ``detfp_repeat.assert_bitwise_reproducible(fn, *args, runs=3, ...)`` fails the test with the
  repeat check's report (bisect's: module, op, verdict, difference kind and ULP size). Each call
  writes its runs under the test's own directory: pytest's ``tmp_path`` (``detfp/check-N``),
  or ``--detfp-traces DIR`` (``DIR/<worker>/<test>/check-N``, one folder per xdist worker, so
  parallel workers never share one, and a CI job can upload DIR as an artifact).
- Marker ``@pytest.mark.detfp_repeat(runs=5, level="ops", ...)``: the test body itself runs
  ``runs`` times from the same state (fixture values and what they hold are restored between
  runs) and the test fails unless every run is bitwise identical. ``backward`` defaults to
  False here: a test body returns nothing to backpropagate.
- ``--detfp-keep failed|all``: whose traces stay (default: only failing checks').

Loading the plugin imports neither torch nor the capture: pytest loads it in every session of a
project that has detfp installed, including analysis-only installs without torch; the fixture and
the marker import the capture when first used and say how to install it when it is missing.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import os
import re
from pathlib import Path
from typing import Any

import pytest

__all__ = ["RepeatChecker"]

#: Options the marker accepts (everything else would be passed on to the test function).
MARKER_OPTIONS = frozenset({"runs", "level", "backward", "leave", "warmup", "kernels", "detail", "state", "keep"})
_MARKER_HELP = (
    "detfp_repeat(runs=3, level='ops', backward=False, warmup=0, kernels=False, detail=True, state=(), keep=None): "
    "run the test body `runs` times from the same state and fail unless every run is bitwise identical (detfp)"
)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("detfp", "detfp bitwise reproducibility checks")
    group.addoption(
        "--detfp-traces",
        metavar="DIR",
        default=None,
        help="write repeat-check traces under DIR/<xdist worker>/<test>/ instead of the test's tmp_path",
    )
    group.addoption(
        "--detfp-keep",
        choices=("failed", "all"),
        default="failed",
        help="which repeat-check traces stay on disk: only those of failing checks (default) or all",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", _MARKER_HELP)


def pytest_report_header(config: pytest.Config) -> str | None:
    where = config.getoption("--detfp-traces")
    return (
        None if where is None else f"detfp: repeat-check traces under {where} (keep {config.getoption('--detfp-keep')})"
    )


def pytest_itemcollected(item: pytest.Item) -> None:
    # A marked test needs the fixture (its trace directory) even when its body does not ask for it.
    if item.get_closest_marker("detfp_repeat") is not None:
        names = getattr(item, "fixturenames", None)
        if names is not None and "detfp_repeat" not in names:
            names.append("detfp_repeat")


def _worker(config: pytest.Config) -> str:
    info = getattr(config, "workerinput", None)  # set by pytest-xdist in its workers
    if isinstance(info, dict) and info.get("workerid"):
        return str(info["workerid"])
    return os.environ.get("PYTEST_XDIST_WORKER") or "main"


def _test_dir_name(nodeid: str) -> str:
    """A file-system-safe, unique folder name for a test id (kept readable, hashed when long)."""
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", nodeid).strip("_.") or "test"
    if len(name) > 100:
        name = name[:80] + "-" + hashlib.blake2b(nodeid.encode(), digest_size=6).hexdigest()
    return name


def _repeat_module() -> Any:
    try:
        from detfp_guards import repeat
    except ImportError as exc:  # torch missing: an analysis-only install
        pytest.fail(f"detfp_repeat needs the capture side ({exc}); install it with: pip install 'detfp[capture]'")
    return repeat


class RepeatChecker:
    """The ``detfp_repeat`` fixture: ``repeat_check`` with this test's trace directory and keep policy."""

    def __init__(self, base: Path, keep: str, node: Any = None) -> None:
        #: Where this test's checks write (``check-1``, ``check-2``, ... and ``repeat`` for the marker).
        self.base = base
        self.keep = keep
        self._node = node
        self._n = 0

    def _next(self) -> Path:
        self._n += 1
        return self.base / f"check-{self._n}"

    def __call__(self, fn: Any, *args: Any, **options: Any) -> Any:
        """``repeat_check(fn, *args, **options)`` writing under this test's directory."""
        repeat = _repeat_module()
        options.setdefault("keep", self.keep)
        out = options.pop("out_dir", None) or self._next()
        result = repeat.repeat_check(fn, *args, out_dir=out, **options)
        if not result.ok and self._node is not None and result.traces is not None:
            # Shown by --junitxml as test properties: where to look from a CI report.
            self._node.user_properties.append(("detfp_traces", " ".join(map(str, result.traces))))
        return result

    def assert_bitwise_reproducible(self, fn: Any, *args: Any, runs: int = 3, **options: Any) -> Any:
        """Fail (``NotReproducibleError``, an AssertionError) with the report unless every run is identical."""
        __tracebackhide__ = True
        result = self(fn, *args, runs=runs, **options)
        if not result.ok:
            raise _repeat_module().NotReproducibleError(result)
        return result


@pytest.fixture
def detfp_repeat(request: pytest.FixtureRequest) -> RepeatChecker:
    """Repeat checks whose traces go under this test's directory (see the module docstring)."""
    config = request.config
    root = config.getoption("--detfp-traces")
    if root is not None:
        base = Path(root) / _worker(config) / _test_dir_name(request.node.nodeid)
    else:
        # pytest's tmp_path is already per test and, under xdist, per worker (basetemp/popen-gwN).
        base = request.getfixturevalue("tmp_path") / "detfp"
    return RepeatChecker(base, config.getoption("--detfp-keep"), request.node)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    marker = pyfuncitem.get_closest_marker("detfp_repeat")
    if marker is None:
        return None
    if marker.args:
        pytest.fail("@pytest.mark.detfp_repeat takes keyword options only, e.g. detfp_repeat(runs=5)", pytrace=False)
    unknown = sorted(set(marker.kwargs) - MARKER_OPTIONS)
    if unknown:
        pytest.fail(
            f"@pytest.mark.detfp_repeat: unknown option(s) {', '.join(unknown)}; use {', '.join(sorted(MARKER_OPTIONS))}",
            pytrace=False,
        )
    fn = pyfuncitem.obj
    if inspect.iscoroutinefunction(fn):
        pytest.fail("@pytest.mark.detfp_repeat cannot repeat an async test body", pytrace=False)
    checker = pyfuncitem.funcargs["detfp_repeat"]
    if not isinstance(checker, RepeatChecker):  # a conftest may override the fixture by name
        pytest.fail("@pytest.mark.detfp_repeat needs the plugin's detfp_repeat fixture, not an override", pytrace=False)
    funcargs = pyfuncitem.funcargs
    names = pyfuncitem._fixtureinfo.argnames  # what pytest itself passes to the test function
    body = functools.partial(fn, **{name: funcargs[name] for name in names})
    options = {"backward": False, **marker.kwargs}
    result = checker(body, out_dir=checker.base / "repeat", **options)
    if not result.ok:
        pytest.fail(result.report, pytrace=False)
    return True
