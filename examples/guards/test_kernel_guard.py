"""Kernel guard: one op over a grid of shapes and storage dtypes, every call bitwise reproducible.

The op is a MoE-style combine: expert outputs (stored in a low-precision dtype, float8 where
this torch has it) scaled and added into token rows with duplicate indices. On a GPU that
``index_add_`` adds with float atomics and this guard fails, naming the op, until
``torch.use_deterministic_algorithms(True)`` selects the deterministic kernel.
"""

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
STORAGE = [torch.float32, torch.bfloat16, torch.float16]
STORAGE += [getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)]
SHAPES = [(64, 32), (257, 48)]  # an odd row count: tails and remainders are where kernels differ


def combine(out, index, expert_out, scale):
    """Add each expert output row, dequantized and scaled, into its token's row."""
    return out.index_add_(0, index, expert_out.to(out.dtype) * scale)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("storage", STORAGE, ids=lambda d: str(d).removeprefix("torch."))
def test_combine_is_bitwise_reproducible(detfp_repeat, shape, storage):
    tokens, dim = shape
    g = torch.Generator().manual_seed(0)
    expert_out = torch.randn(4 * tokens, dim, generator=g).to(storage).to(DEVICE)
    index = torch.randint(0, tokens, (4 * tokens,), generator=g).to(DEVICE)  # top-4: duplicates
    out = torch.zeros(tokens, dim, device=DEVICE)
    detfp_repeat.assert_bitwise_reproducible(combine, out, index, expert_out, 0.5, backward=False)
