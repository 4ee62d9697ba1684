"""The catalogue of numerics settings (``detfp_capture.numerics``) covers torch's backend flags, and
a session records the settings in force and every change with its step (issue 42).

* every public name of ``torch.backends.*`` (module functions and constants, the flags a module
  object holds, the names its attributes answer through ``__getattr__``, the python_native DSL
  switches) is classified: a new flag in a new torch fails here until it is recorded or said
  not to be a setting;
* the snapshot is plain JSON and follows the flags it reads (mkldnn off, TF32, autocast);
* a session writes the first step's settings, the autocast state of its forward, and one
  ``setting_changed`` event per key a later step changes (with the manifest's
  ``settings_changed_at``), which ``bisect`` applies at the step a divergence starts.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import pkgutil
import textwrap
import types

import polars as pl
import pytest
import torch
import torch.backends as backends

from detfp_analyze.bisect.settings import changed, parse_change, settings
from detfp_analyze.io.envdiff import EnvDiff
from detfp_analyze.io.reader import open_run
from detfp_capture import Session
from detfp_capture.numerics import BACKEND_NAMES, NOT_A_SETTING, SETTINGS, Catalogue


def _getattr_names(cls: type) -> set[str]:
    """The names a class's ``__getattr__`` answers (string constants it compares a name with)."""
    fn = cls.__dict__.get("__getattr__")
    if fn is None:
        return set()
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    return {
        c.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Compare)
        for c in node.comparators
        if isinstance(c, ast.Constant) and isinstance(c.value, str)
    }


def _descriptors(cls: type) -> set[str]:
    """Flags a module class or object class holds as data descriptors (``ContextProp`` and kin)."""
    return {n for n, v in vars(cls).items() if not n.startswith("_") and hasattr(v, "__get__") and hasattr(v, "__set__")}


def _owned(obj: object) -> bool:
    return type(obj).__module__.startswith("torch.backends")


def backend_names() -> set[str]:
    """Every public name of torch.backends and its submodules, as ``module.name``."""
    out: set[str] = set()

    def module_names(prefix: str, mod: types.ModuleType) -> None:
        under = getattr(mod, "m", mod) if isinstance(getattr(mod, "m", None), types.ModuleType) else mod
        for n in dir(under):
            if n.startswith("_"):
                continue
            obj = getattr(under, n)
            if isinstance(obj, types.ModuleType):
                continue
            if (inspect.isfunction(obj) or inspect.isclass(obj)) and obj.__module__ != under.__name__:
                continue  # imported from elsewhere (contextmanager, torch's own classes)
            out.add(prefix + n)
            if _owned(obj) and not inspect.isclass(obj):  # an object answering flags (cuda.matmul)
                out.update(f"{prefix}{n}.{a}" for a in _descriptors(type(obj)) | _getattr_names(type(obj)))
        for n in _descriptors(type(mod)):
            out.add(prefix + n)
        for n, v in vars(type(mod)).items():
            if not n.startswith("_") and _owned(v) and not hasattr(v, "__get__"):
                out.add(prefix + n)  # a namespace object held by the module class (mkldnn.conv)
                out.update(f"{prefix}{n}.{a}" for a in _descriptors(type(v)) | _getattr_names(type(v)))

    module_names("", backends)
    for info in pkgutil.iter_modules(backends.__path__):
        if info.name.startswith("_"):
            continue
        mod = importlib.import_module(f"torch.backends.{info.name}")
        module_names(f"{info.name}.", mod)
    pn = importlib.import_module("torch.backends.python_native")
    for dsl in pn.all_dsls:  # DSL switches, answered by the module's __getattr__
        out.add(f"python_native.{dsl}")
        out.update(f"python_native.{dsl}.{a}" for a in _descriptors(type(getattr(pn, dsl))))
    return out


def test_every_backend_flag_of_this_torch_is_classified():
    found = backend_names()
    missing = sorted(found - set(BACKEND_NAMES))
    assert not missing, (
        f"torch.backends names not classified in detfp_capture/numerics.py BACKEND_NAMES: {missing}; record each "
        f"that changes which kernel runs or at what precision (a SETTINGS key), or say why not ({NOT_A_SETTING!r})"
    )
    # The flags everyone knows are recorded, not waved through.
    for name in ("mkldnn.enabled", "cudnn.benchmark", "cuda.matmul.allow_tf32", "opt_einsum.enabled", "nnpack.flags"):
        assert not BACKEND_NAMES[name].startswith(NOT_A_SETTING), name
    assert {"mkldnn.enabled", "cuda.matmul.allow_fp16_reduced_precision_reduction", "mkldnn.conv.fp32_precision"} <= found


def test_a_new_flag_fails_until_classified(monkeypatch):
    # As a new torch would add one: a flag on the mkldnn module class.
    mod = importlib.import_module("torch.backends.mkldnn")
    monkeypatch.setattr(type(mod), "tile_order", backends.ContextProp(lambda: 0, lambda v: None), raising=False)
    assert "mkldnn.tile_order" in backend_names() - set(BACKEND_NAMES)


def test_the_snapshot_is_json_and_follows_the_flags():
    cat = Catalogue()
    base = cat.snapshot()
    assert json.loads(json.dumps(base)) == base
    assert [k for k, _ in SETTINGS] == list(base)[: len(SETTINGS)]
    assert base["backends.mkldnn.enabled"] is True and base["num_threads"] == torch.get_num_threads()
    assert base["autocast.cpu.enabled"] is False and base["autocast.cpu.dtype"] is None
    torch.backends.mkldnn.enabled = False
    try:
        assert cat.snapshot()["backends.mkldnn.enabled"] is False
    finally:
        torch.backends.mkldnn.enabled = True
    with torch.autocast("cpu", dtype=torch.float16):
        got = cat.snapshot()
    assert (got["autocast.cpu.enabled"], got["autocast.cpu.dtype"]) == (True, "torch.float16")
    assert cat.raw() == cat.raw()  # what a step begin compares


def _train(out, level: str, change_at: int | None, autocast_at: int | None, steps: int = 4) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(2, 1, 8, 8, generator=torch.Generator().manual_seed(1))
    with Session(out, level) as s:
        s.watch(model)
        s.watch_optimizer(opt)
        for i in range(steps):
            if i == change_at:
                torch.backends.mkldnn.enabled = False
            with s.step(i):
                dtype = torch.float16 if autocast_at is not None and i >= autocast_at else torch.bfloat16
                with torch.autocast("cpu", dtype=dtype):
                    y = model(x)
                loss = y.float().square().mean()
                s.metric("loss", loss)
                loss.backward()
                opt.step()
                opt.zero_grad()


@pytest.fixture
def mkldnn_restored():
    before = torch.backends.mkldnn.enabled
    yield
    torch.backends.mkldnn.enabled = before


def test_a_session_records_the_settings_and_each_change_with_its_step(tmp_path, mkldnn_restored):
    _train(tmp_path / "a", "boundaries", None, None)
    _train(tmp_path / "b", "boundaries", 2, 3)
    a, b = open_run(tmp_path / "a"), open_run(tmp_path / "b")
    ma, mb = a.manifest(0), b.manifest(0)
    assert ma["determinism"]["autocast.cpu.dtype"] == "torch.bfloat16" and ma["determinism"]["autocast.cpu.enabled"]
    assert mb["determinism"]["backends.mkldnn.enabled"] is True and mb["settings_changed_at"] == 2
    assert "settings_changed_at" not in ma
    ev = b.scan("events").filter(pl.col("type") == "setting_changed").select("step", "name", "detail").collect()
    assert ev.rows() == [
        (2, "backends.mkldnn.enabled", "before step 2: backends.mkldnn.enabled: true -> false"),
        (3, "autocast.cpu.dtype", 'in step 3: autocast.cpu.dtype: "torch.bfloat16" -> "torch.float16"'),
    ]
    from detfp_analyze.bisect import bisect

    # This conv rounds the same without oneDNN; the autocast dtype of step 3's forward changes its output.
    res = bisect(a, b)
    dg = res.diagnosis
    assert dg.cause == "setting" and res.first_step == 3, dg.explanation
    assert dg.headline.startswith('determinism.autocast.cpu.dtype differs from step 3 ("torch.bfloat16" -> '
                                  '"torch.float16") and most likely caused this'), dg.headline  # fmt: skip
    assert dg.headline.endswith("(its dtype: bfloat16 -> float16).")
    want = "Also differs, without explaining this difference: determinism.backends.mkldnn.enabled differs from step 2"
    assert want in dg.explanation


def test_changes_apply_up_to_the_divergent_step():
    base = settings([EnvDiff("determinism.num_threads", 1, 2)])
    c = parse_change("B", 0, 3, "backends.mkldnn.enabled", "before step 3: backends.mkldnn.enabled: true -> false")
    back = parse_change("B", 0, 2, "num_threads", "before step 2: num_threads: 2 -> 1")
    assert c is not None and (c.key, c.old, c.new, c.step) == ("determinism.backends.mkldnn.enabled", True, False, 3)
    start = {"determinism.backends.mkldnn.enabled": True, "determinism.num_threads": 1}
    got = changed(base, [c, back], lambda side, r, k: {**start, "determinism.num_threads": 1 if side == "A" else 2}[k],
                  [0], 3)  # fmt: skip
    assert [(s.key, s.a, s.b, s.since) for s in got] == [("determinism.backends.mkldnn.enabled", True, False, 3)]
    early = changed(base, [c, back], lambda side, r, k: {**start, "determinism.num_threads": 1 if side == "A" else 2}[k],
                    [0], 1)  # fmt: skip
    assert [(s.key, s.since) for s in early] == [("determinism.num_threads", None)]
    # An event of an earlier release (several keys, Python values) is left alone.
    assert parse_change("A", 0, 1, "cudnn_benchmark", "before step 1: cudnn_benchmark: False -> True, x: 1 -> 2") is None
