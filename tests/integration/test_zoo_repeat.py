"""Repeat checks on the third-party zoo: Hugging Face models nobody here wrote.

GPT-2 (dropout on), Llama and Mixtral (routing, top-k experts, auxiliary loss) from small
configs, forward and backward of the causal LM loss, three calls from the same state at level
ops, without ``use_deterministic_algorithms``: on CPU these are deterministic, so a difference
would be a false one (capture reading uninitialized memory, state the check failed to
restore, RNG consumed differently between calls). Afterwards the state is what one plain call
leaves: the same gradients and RNG state as a model that ran once without the check.
"""

from __future__ import annotations

import copy
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from detfp_guards import repeat_check

pytest.importorskip("transformers")

_ZOO = Path(__file__).resolve().parents[1] / "fixtures" / "zoo" / "zoo_train.py"


def _zoo_module():
    # The script imports trainkit from its own folder, as it does when run as a script.
    if str(_ZOO.parent) not in sys.path:
        sys.path.insert(0, str(_ZOO.parent))
    spec = importlib.util.spec_from_file_location("detfp_zoo_train_for_repeat", _ZOO)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize(("model", "dropout"), [("gpt2", 0.1), ("llama", 0.0), ("mixtral", 0.0)])
def test_hugging_face_models_repeat_bitwise(tmp_path, model, dropout):
    zoo = _zoo_module()
    torch.manual_seed(0)
    net, _ = zoo.build_model({"model": model, "dropout": dropout})
    net.train()
    twin = copy.deepcopy(net)
    ids = torch.randint(0, zoo.VOCAB, (zoo.BATCH, zoo.SEQ), generator=torch.Generator().manual_seed(1))

    def loss(m):
        return m(input_ids=ids, labels=ids).loss

    rng = torch.get_rng_state()
    res = repeat_check(lambda: loss(net), level="ops", out_dir=tmp_path)
    assert res.ok, res.report
    assert res.runs == 3 and res.backward
    after = torch.get_rng_state()
    # The same state as one plain call: gradients and the RNG stream (dropout draws).
    torch.set_rng_state(rng)
    loss(twin).backward()
    assert torch.equal(after, torch.get_rng_state())
    for (name, p), q in zip(net.named_parameters(), twin.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            assert torch.equal(p.grad, q.grad), name
