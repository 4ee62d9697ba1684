"""One options dataclass (issue 44): ``detfp_capture._options.CaptureOptions`` spells every capture
option once, and the three surfaces that take options agree with it: the Session's signature and
docstring, the launcher's command line (and the flags it hands a process it follows), and
``_config.make_config`` (what ``CaptureConfig`` carries). Before, each surface spelled the options
itself (session.py, _config.py, the launcher's parser), and a new option could miss one."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
from typing import Any

import pytest

from detfp_capture import Session
from detfp_capture import _options as options_mod
from detfp_capture._config import CaptureConfig, make_config
from detfp_capture._launch.cli import build_parser, followed_options
from detfp_capture._options import CaptureOptions, Flag, option_fields
from detfp_capture.errors import ConfigError

FIELDS = {f.name: f for f in option_fields()}


def test_the_session_signature_is_the_options():
    params = inspect.signature(Session).parameters
    assert list(params) == ["out_dir", *FIELDS, "extension"]
    assert params["level"].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    for name, f in FIELDS.items():
        assert params[name].default == f.default, name
    for name, f in FIELDS.items():  # the docstring lists each with its help, from the one place
        assert f"        {name}: {f.metadata['help']}." in (Session.__doc__ or ""), name


def test_the_launchers_flags_are_the_options():
    parser = build_parser()
    actions = {a.dest: a for a in parser._actions}
    on_the_command_line = {n for n, f in FIELDS.items() if f.metadata["flag"] is not None}
    assert set(actions) - {"help", "out", "followed"} == on_the_command_line
    assert {n for n, f in FIELDS.items() if f.metadata["flag"] is None} == {"parallel", "group_names"}  # mappings
    for name in on_the_command_line:
        f, a = FIELDS[name], actions[name]
        assert a.option_strings == ["--" + name.replace("_", "-")]
        assert a.help == f.metadata.get("cli_help", f.metadata["help"])
        if f.metadata["flag"] in (Flag.TENSOR, Flag.TENSOR_CHUNKS):
            continue  # not given: None on the command line, False (off) for the Session
        assert a.default == f.metadata.get("cli_default", f.default), name


def test_make_config_carries_the_options_marked_config():
    configured = {n for n, f in FIELDS.items() if f.metadata["config"]}
    assert {f.name for f in dataclasses.fields(CaptureConfig)} == configured
    cfg = make_config(CaptureOptions(level="ops", steps="1-2", rows=4, flush_steps=3, start_step=1))
    assert (cfg.level, cfg.steps.text, cfg.rows.arg, cfg.flush_steps, cfg.start_step) == ("ops", "1-2", 4, 3, 1)
    with pytest.raises(ConfigError, match="overwrite='yes': expected True or False"):
        make_config(CaptureOptions(overwrite="yes"))


def test_the_command_line_gives_the_session_the_same_options(tmp_path):
    argv = ["--out", "o", "--level", "ops", "--rows", "4", "--moments", "all", "--dumps", "fc", "--poison"]
    ns = build_parser().parse_args([*argv, "--flush-steps", "7", "--digest-version", "1"])
    got = options_mod.from_args(ns)
    assert set(got) == {n for n, f in FIELDS.items() if f.metadata["flag"] is not None}
    want = {"level": "ops", "rows": 4, "moments": True, "dumps": "fc", "poison": True, "flush_steps": 7}
    assert {k: got[k] for k in want} == want and got["start_step"] == 0 and got["digest_version"] == 1
    assert build_parser().parse_args(followed_options(ns)).rows == "4"


def test_a_new_option_appears_on_every_surface(monkeypatch):
    # One field more (as a new option would be): the Session, the launcher and the followed
    # process's flags take it with nothing else written.
    extra = dataclasses.make_dataclass(
        "Extended",
        [("trace_seed", int | None, dataclasses.field(default=None, metadata={"help": "a seed", "flag": Flag.INT,
                                                                             "config": False}))],
        bases=(CaptureOptions,),
        frozen=True,
    )  # fmt: skip
    monkeypatch.setattr(options_mod, "option_fields", lambda: dataclasses.fields(extra))
    sig = options_mod.session_signature([], [])
    assert sig.parameters["trace_seed"].default is None
    assert "        trace_seed: a seed.\n" in options_mod.options_doc()
    parser = argparse.ArgumentParser()
    options_mod.add_arguments(parser)
    ns = parser.parse_args(["--trace-seed", "5"])
    assert options_mod.from_args(ns)["trace_seed"] == 5 and options_mod.to_argv(ns)[-2:] == ["--trace-seed", "5"]


def test_an_unknown_option_names_itself(tmp_path):
    with pytest.raises(TypeError, match=r"unknown option\(s\) stpes; see help\(Session\)"):
        Session(tmp_path / "r", "metrics", stpes="1")
    opts: dict[str, Any] = {"steps": "x-"}
    with pytest.raises(ConfigError, match="steps"):
        Session(tmp_path / "r", "metrics", **opts)
