"""``repeat_check`` on compiled code (issue 41): a compiled module and a compiled function repeat
bitwise at level ops with their Inductor kernels recorded (forward and backward), and a custom op
inside a compiled region that differs between calls is the origin. A generated kernel whose result
differs between calls is tests/unit/test_capture_compiled.py's.

No ``use_deterministic_algorithms``: Inductor's C++ kernels are deterministic on a CPU, so the
only differences are the ones planted here.
"""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest
import torch

from detfp_guards import repeat_check

pytest.importorskip("torch._inductor")


def test_a_compiled_module_and_function_repeat_bitwise_with_their_kernels_recorded(tmp_path):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32), torch.nn.Linear(32, 4))
    got = repeat_check(torch.compile(m), torch.randn(8, 16), runs=2, level="ops", keep="all", out_dir=tmp_path / "m")
    assert got.ok, got.report
    shards = sorted((tmp_path / "m" / "run-0" / "records").rglob("*.parquet"))
    kinds = [k for f in shards for k in pq.read_table(f, columns=["kind"]).column("kind").to_pylist()]
    assert kinds.count("kernel") >= 2, sorted(set(kinds))  # forward and backward kernels

    def f(a, b):
        return torch.nn.functional.gelu(a @ b).sum(dim=0)

    fn = repeat_check(torch.compile(f), torch.randn(8, 16), torch.randn(16, 8), runs=2, level="ops", backward=False)
    assert fn.ok, fn.report


def test_a_custom_op_inside_a_compiled_region_that_differs_between_calls_is_the_origin():
    calls = [0]

    @torch.library.custom_op("detfp_test_repeat::nudge", mutates_args=())
    def nudge(t: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        return t + (1e-3 if calls[0] % 2 == 0 else 0.0)

    @nudge.register_fake
    def _(t):
        return torch.empty_like(t)

    g = torch.compile(lambda a: nudge(torch.relu(a) * 2).sin())
    got = repeat_check(g, torch.randn(8, 16), runs=2, level="ops", backward=False, keep="none")
    assert not got.ok
    d = got.divergence
    assert (d.verdict, d.kind, d.op) == ("origin", "op", "detfp_test_repeat::nudge.default"), got.report

