"""The record path's one seam (``_recorder/seam.py``): a Recorder records through the path it
holds, the native one is configured by one explicit call and by nothing at import, and no module
of the record path chooses between Python and C on its own."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from detfp_capture import Session
from detfp_capture._config import CaptureConfig
from detfp_capture._recorder import seam
from detfp_capture._recorder import slot as slot_mod
from detfp_capture._recorder.recorder import Recorder
from detfp_capture._recorder.seam import NativePath, Piece, PythonPath, RecordPath, record_path, recording_through
from detfp_capture.errors import ConfigError
from tests import native_half

ROOT = Path(__file__).resolve().parents[2]
native = native_half.needs(slot_mod.NATIVE, native_half.RECORD)

#: The modules that hold the record path's two implementations' Python side.
PATH_MODULES = [
    "_recorder/hot.py", "_recorder/args.py", "_recorder/records.py", "_recorder/flush.py", "_recorder/roots.py",
    "_recorder/deferred.py", "_recorder/recorder.py", "_sources/dispatch.py", "_sources/ops.py",
]  # fmt: skip


def _child(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True, timeout=120
    )


def _members(path: object) -> set[str]:
    return {n for n in seam.RecordPath.__dict__ if not n.startswith("_") and hasattr(path, n)}


def test_both_paths_have_every_method_of_the_interface():
    wanted = {n for n in RecordPath.__dict__ if not n.startswith("_")}
    assert wanted >= {"append_plain", "record_op", "gather", "resolve_rows", "op_pre", "roots"}
    assert _members(PythonPath()) == wanted
    if slot_mod.NATIVE:
        assert _members(NativePath()) == wanted


def test_a_recorder_records_through_the_path_it_is_given(tmp_path):
    py = PythonPath()
    rec = Recorder(CaptureConfig(level="boundaries"), None, rank=0, on_fail=None, path=py)
    assert rec.path is py and rec.waiting.roots is None
    assert type(Recorder(CaptureConfig(level="boundaries"), None, rank=0, on_fail=None).path) is type(record_path())
    # A Session's recorder: the path given around it, else the default.
    with recording_through(py), Session(str(tmp_path / "a"), level="boundaries") as s:
        assert s._rec.path is py
    with Session(str(tmp_path / "b"), level="boundaries") as s:
        assert s._rec.path is not py and s._rec.path.native == slot_mod.NATIVE


def test_the_default_path_follows_the_build_and_the_switch():
    assert isinstance(record_path(), NativePath if slot_mod.NATIVE else PythonPath)
    assert isinstance(record_path(native=False), PythonPath)
    code = (
        "from detfp_capture._recorder import seam\n"
        "assert isinstance(seam.record_path(), seam.PythonPath)\n"
        "try:\n    seam.record_path(native=True)\nexcept seam.ConfigError as e:\n    print(e)\n"
    )
    out = _child(code, DETFP_NATIVE="0")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith("the native record path is not built or is off (DETFP_NATIVE=0)")
    assert issubclass(seam.ConfigError, ConfigError)


@native
def test_importing_the_capture_configures_nothing_native():
    # Every module of the record path imported (and a Session module): the C twins are still
    # unconfigured until the one call, which configures every part at once.
    code = (
        "import detfp_capture, detfp_capture.session\n"
        "from detfp_capture._sources import dispatch, ops, modules, steps, backward\n"
        "from detfp_capture._recorder import hot, args, roots, records, flush, recorder, seam, _hostpath\n"
        "def refused(fn, *a):\n"
        "    try:\n        fn(*a)\n    except RuntimeError as e:\n        return 'not' in str(e)\n"
        "    return False\n"
        "e = frozenset()\n"
        "checks = [(_hostpath.args_key, ()), (_hostpath.gather, (), {}, e, e), (_hostpath.append_plain, None, None, [], 0, 0),\n"
        "          (_hostpath.roots_fill, [], [], None, 0, 0), (_hostpath.op_pre, None, None, (), {})]\n"
        "print([refused(*c) for c in checks])\n"
        "seam.configure_native()\n"
        "print(refused(_hostpath.args_key, ()), refused(_hostpath.gather, (), {}, e, e))\n"
    )
    out = _child(code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["[True, True, True, True, True]", "False False"]


def _module_level_choices(path: Path) -> list[str]:
    """Module-level statements of ``path`` that name ``NATIVE`` or call a ``_hostpath.configure*``."""
    found = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            continue
        for sub in ast.walk(node):
            if isinstance(sub, ast.Name) and sub.id == "NATIVE":
                found.append(f"{path.name}:{node.lineno} NATIVE")
            if isinstance(sub, ast.Attribute) and sub.attr.startswith("configure") and ast.unparse(sub.value) == "_hostpath":
                found.append(f"{path.name}:{node.lineno} {ast.unparse(sub)}")
    return found


def test_no_module_of_the_record_path_chooses_python_or_c_itself():
    pkg = ROOT / "detfp_capture"
    assert [c for m in PATH_MODULES for c in _module_level_choices(pkg / m)] == []
    # Outside the seam, only the Slot's module (the class of both paths) reads the switch.
    readers = sorted(
        str(p.relative_to(pkg)) for p in pkg.rglob("*.py") if "NATIVE" in {n.id for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, ast.Name)}
    )
    assert readers == ["_recorder/hostconfig.py", "_recorder/seam.py", "_recorder/slot.py"]


def test_the_scan_finds_a_module_level_choice(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("if NATIVE:\n    _hostpath.configure_args(1)\n    f = _hostpath.f\n")
    assert _module_level_choices(bad) == ["bad.py:1 NATIVE", "bad.py:1 _hostpath.configure_args"]


@native
def test_a_native_path_leaves_the_named_pieces_to_python():
    from detfp_capture._recorder import _hostpath, args, flush, hot, records

    whole = NativePath()
    assert whole.op_pre is _hostpath.op_pre and whole.record_op is _hostpath.record_op and whole.roots is not None
    part = NativePath(python={Piece.APPENDS, Piece.COLUMNS, Piece.RESOLVE, Piece.ROOTS})
    assert part.op_pre is None  # the C op entries would call the C appends
    assert (part.gather, part.record_op, part.record_plain, part.append_plain) == (
        args.gather, hot.record_op_py, hot.record_plain_py, hot.append_plain_py,
    )  # fmt: skip
    assert (part.by_identity, part.args_key, part.resolve_rows) == (
        records.by_identity, args.args_key, flush.resolve_rows_py,
    )  # fmt: skip
    assert part.roots is None
    with pytest.raises(ValueError):
        NativePath(python={"appends"})  # type: ignore[arg-type]
