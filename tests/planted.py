"""Planted nondeterminism for the repeat-check tests (CPU): ops whose order changes on every call.

On a GPU, float atomics (``index_add_``/``scatter_add_`` with duplicate indices, embedding
backward) add in whatever order threads arrive. On CPU those kernels are sequential, so each
planted op reproduces the effect inside one custom op: the dispatcher (and so the capture) sees
one call whose inputs are identical between calls and whose output is not. The order comes
from a per-process call counter, never from torch's RNG, which ``repeat_check`` restores.
Imported once per process (custom op names are global), by the tests and by the files that
the pytest-plugin tests write.
"""

from __future__ import annotations

import itertools

import torch

__all__ = [
    "PermutedSum",
    "ShuffledEmbedding",
    "permuted_sum",
    "shuffled_index_add",
    "shuffled_rows",
    "warm_capture",
]

_CALLS = itertools.count(1)


def _order(n: int) -> torch.Tensor:
    return torch.randperm(n, generator=torch.Generator().manual_seed(next(_CALLS)))


@torch.library.custom_op("detfp_planted::permuted_sum", mutates_args=())
def permuted_sum(x: torch.Tensor) -> torch.Tensor:
    """``x.sum(-1)``, adding the elements in an order that changes on every call."""
    return x.index_select(-1, _order(x.shape[-1])).sum(-1)


def _sum_setup(ctx, inputs, output):
    ctx.shape = inputs[0].shape


def _sum_backward(ctx, grad):
    return grad.unsqueeze(-1).expand(ctx.shape).contiguous()


permuted_sum.register_autograd(_sum_backward, setup_context=_sum_setup)


@torch.library.custom_op("detfp_planted::shuffled_index_add", mutates_args=())
def shuffled_index_add(base: torch.Tensor, index: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """``base.index_add(0, index, source)`` with the additions in an order that changes on every call."""
    order = _order(index.numel())
    return base.index_add(0, index[order], source[order])


@torch.library.custom_op("detfp_planted::shuffled_rows", mutates_args=())
def shuffled_rows(x: torch.Tensor) -> torch.Tensor:
    """The rows of ``x`` in an order that changes on every call (an unstable sort's ties)."""
    return x[_order(x.shape[0])]


class _Embedding(torch.autograd.Function):
    """A lookup whose backward sums repeated tokens with ``shuffled_index_add`` (GPU embedding backward)."""

    @staticmethod
    def forward(ctx, weight, tokens):
        ctx.save_for_backward(tokens)
        ctx.rows = weight.shape[0]
        return weight.index_select(0, tokens.reshape(-1)).reshape(*tokens.shape, weight.shape[1])

    @staticmethod
    def backward(ctx, grad):
        (tokens,) = ctx.saved_tensors
        flat = grad.reshape(-1, grad.shape[-1])
        base = flat.new_zeros(ctx.rows, grad.shape[-1])
        return shuffled_index_add(base, tokens.reshape(-1), flat), None


class ShuffledEmbedding(torch.nn.Module):
    """An embedding whose forward is deterministic and whose backward is not."""

    def __init__(self, rows: int, dim: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(rows, dim))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return _Embedding.apply(self.weight, tokens)


class PermutedSum(torch.nn.Module):
    """Linear, then a sum over features in an order that changes on every call."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return permuted_sum(self.proj(x))


def warm_capture() -> None:
    """Import what a repeat check imports lazily (dynamo, the profiler, the analysis), with a failing
    check and its detail pass. Call it before a pytester inline run: pytester drops the modules first
    imported inside the run from sys.modules afterwards, and torch refuses to register the operator
    libraries of such a module a second time when it is imported again."""
    from detfp_capture import repeat_check

    x = torch.randn(4, 64)
    if repeat_check(lambda: permuted_sum(x), runs=2).ok:
        raise AssertionError("the planted op added in the same order twice")
