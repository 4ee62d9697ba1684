"""Recipe guard: a few training steps of a tiny model, compared bit for bit with a golden trace.

``record`` trains the model with capture at level ``boundaries`` (metrics, module boundaries,
optimizer state): the golden is one such run, kept where CI finds it (``DETFP_GOLDEN``) and
replaced on purpose with ``detfp-analyze golden update``. Intended numerics changes go into the
expectations file (``DETFP_EXPECT``) with a reason until the golden is re-recorded.
"""

import os
from pathlib import Path

import pytest
import torch

from detfp_analyze.bisect import bisect
from detfp_analyze.gate.expectations import evaluate, load_expectations, render_gate
from detfp_analyze.io.reader import open_run
from detfp_analyze.render.report import render_text
from detfp_capture import Session

HERE = Path(__file__).parent
GOLDEN = Path(os.environ.get("DETFP_GOLDEN", HERE / "golden" / "recipe"))
EXPECT = Path(os.environ.get("DETFP_EXPECT", HERE / "golden" / "expect.toml"))
#: Facts that differ between the machine that recorded the golden and this one, harmlessly.
IGNORE_ENV = ("git.*", "host.hostname", "versions.detfp")


def record(out: Path, steps: int = 3) -> None:
    """Train the tiny model for ``steps`` steps with capture on into ``out``."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Embedding(64, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 64), torch.nn.Dropout(0.1)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(1)
    with Session(out, level="boundaries") as session:
        session.watch(model)
        session.watch_optimizer(opt)
        for step in range(steps):
            with session.step(step):
                tokens = torch.randint(0, 64, (8, 16), generator=data)
                loss = torch.nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
                session.metric("loss", loss)
                loss.backward()
                opt.step()
                opt.zero_grad()


def test_recipe_matches_the_golden_trace(tmp_path):
    if not GOLDEN.exists():
        pytest.skip(f"no golden trace at {GOLDEN}: record one, then: detfp-analyze golden update {GOLDEN} <run>")
    record(tmp_path / "new")
    result = bisect(open_run(str(GOLDEN)), open_run(str(tmp_path / "new")), ignore_env=IGNORE_ENV)
    gate = evaluate(result, load_expectations(EXPECT) if EXPECT.exists() else (), str(EXPECT))
    assert gate.passed, render_text(result) + render_gate(gate)
