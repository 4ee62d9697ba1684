"""Module guard: a transformer block's forward and backward, bitwise reproducible call after call.

Two ways to write it: the ``detfp_repeat`` fixture around one call (its output's backward is
run too, with fixed seeded gradients), or the marker around a whole test body (here a training
step, optimizer included). Dropout draws from torch's RNG, which every repeat starts from anew.
"""

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def block():
    # Built once per test in a fixture: every repeat starts from these weights.
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(64, 4, 256, dropout=0.1, batch_first=True, norm_first=True)
    return layer.to(DEVICE)


def test_block_forward_backward(detfp_repeat, block):
    x = torch.randn(2, 32, 64, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    mask = torch.nn.Transformer.generate_square_subsequent_mask(32, device=DEVICE)
    res = detfp_repeat.assert_bitwise_reproducible(block, x, src_mask=mask, is_causal=True)
    assert res.backward  # the backward ran and was compared too


@pytest.mark.detfp_repeat(runs=3)
def test_block_training_step(block):
    opt = torch.optim.AdamW(block.parameters(), lr=1e-3)
    x = torch.randn(2, 32, 64, device=DEVICE)  # torch's RNG: the same in every repeat
    block(x).square().mean().backward()
    opt.step()
