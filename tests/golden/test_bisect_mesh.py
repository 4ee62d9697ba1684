"""A 2-D mesh (dp x tp, 4 ranks): one origin stays one origin, whichever groups carry it.

Inline pairs at level ``boundaries`` shaped like a Llama layer tensor parallel over ``tp``
({0, 1}, {2, 3}) and data parallel over ``dp`` ({0, 2}, {1, 3}): each step a batch per
replica, the row-parallel ``down_proj``'s reduce-scatter over ``tp``, a gradient the optimizer
reads, and the parameter after the step. The dp gradient reduction is not captured (FSDP2's
collectives were not, before torch 2.13's names were seen; any reduction issued from C++ is
not). Run B plants a split-K order in rank 2's ``down_proj`` at step 1: rank 2 changes the
reduce-scatter's input, rank 3 receives through the reduce-scatter, ranks 0 and 1 through the
uncaptured dp reduction, rank 1 from rank 3, itself a receiver.

The answer: rank 2 alone is the origin (``single_rank`` [2]); ranks 0, 1 and 3 are receivers.
It used to be origins on ranks 0, 1 and 2: the cross-rank test ran before rank 2's own start
was decided, and asked only whether a peer in the dp group *started* a difference, while rank
1's dp peer only received it. The first sentence names the code before the collective on rank
2, never the collective's reduction order.
"""

from __future__ import annotations

from pathlib import Path

from detfp_analyze.bisect import bisect
from detfp_analyze.bisect.vocab import Cause, Pattern, Verdict
from detfp_analyze.io.reader import open_run
from tests.fixtures.shards import hexdigest, write_run

STEPS = range(3)
PLANT_STEP, PLANT_RANK = 1, 2


def _tp(rank: int) -> list[int]:
    return [rank // 2 * 2, rank // 2 * 2 + 1]


def _dp(rank: int) -> list[int]:
    return [rank % 2, rank % 2 + 2]


def _records(rank: int, side: str) -> list[dict]:
    """One rank's records; in run B the plant's difference wherever it reaches."""
    out = []
    for s in STEPS:
        planted = side == "b" and s >= PLANT_STEP
        replica = rank // 2

        def d(label: str, differs: bool, s: int = s, replica: int = replica) -> str:
            return hexdigest((label, rank if label != "batch" else replica, s, "b" if differs else "a"))

        out += [
            dict(step=s, kind="batch", name="Llama", role="input", arg="args[0]", digest=d("batch", False)),
            dict(
                step=s,
                kind="collective",
                name="reduce_scatter_tensor@tp",
                module="layer.mlp.down_proj",
                role="input",
                arg="input",
                digest=d("rs.in", planted and rank == PLANT_RANK),
            ),
            dict(
                step=s,
                kind="collective",
                name="reduce_scatter_tensor@tp",
                module="layer.mlp.down_proj",
                role="output",
                arg="output",
                digest=d("rs.out", planted and rank in _tp(PLANT_RANK)),
            ),
            dict(
                step=s,
                kind="module_output",
                name="Llama",
                module="",
                role="output",
                arg="out",
                digest=d("root.out", planted and rank in _tp(PLANT_RANK)),
            ),
            # Every rank's gradient differs after the dp reduction capture did not see.
            dict(
                step=s,
                phase="optimizer",
                kind="grad",
                name="tok_embeddings.weight",
                role="input",
                arg="group[0]",
                digest=d("grad", planted),
            ),
            dict(step=s, phase="step", kind="param", name="tok_embeddings.weight", role="value", arg="param", digest=d("param", planted)),
        ]
    return out


def _pair(tmp: Path):
    runs = []
    for side in ("a", "b"):
        ranks = {r: {"records": _records(r, side)} for r in range(4)}
        overrides = {
            r: {"groups": {"dp": _dp(r), "tp": _tp(r)}, "parallel": {"dp": r // 2, "tp": r % 2}, "capture": {"level": "boundaries"}}
            for r in range(4)
        }
        runs.append(open_run(str(write_run(tmp / side, ranks, world_size=4, manifest_overrides=overrides))))
    return runs


def test_one_origin_on_a_2d_mesh_whatever_the_groups_carrying_it(tmp_path):
    a, b = _pair(tmp_path)
    res = bisect(a, b)
    d = res.diagnosis
    assert (res.first_step, d.pattern, d.origin_ranks) == (PLANT_STEP, Pattern.SINGLE_RANK, (PLANT_RANK,))
    verdicts = {rr.rank: (rr.effective.verdict, rr.effective.kind, rr.effective.role) for rr in res.ranks}
    assert verdicts == {
        0: (Verdict.RECEIVER, "grad", "input"),
        1: (Verdict.RECEIVER, "grad", "input"),
        2: (Verdict.ORIGIN, "collective", "input"),
        3: (Verdict.RECEIVER, "collective", "output"),
    }
    # Rank 0 receives from rank 2 through dp; rank 1 from rank 3 (a receiver itself) through dp.
    assert res.rank(0).effective.peers_differing == (2,)
    assert res.rank(1).effective.peers_differing == (3,)
    assert "gradient reduction" in res.rank(1).effective.explanation
    assert d.cause == Cause.RANK_LOCAL
    assert d.headline == (
        "Only rank 2 starts the difference, at the input of reduce_scatter_tensor@tp in layer.mlp.down_proj "
        "(forward, step 1), which the code before it on that rank made (its coordinates: dp=1, tp=0): look at what "
        "differs there (its input data, placement, topology, reduction order)."
    )


def test_the_answer_does_not_depend_on_which_rank_is_looked_at_first(tmp_path):
    """The same pair with the ranks' roles rotated in the mesh gives the same verdicts, moved."""
    a, b = _pair(tmp_path)
    first = {rr.rank: rr.effective.verdict for rr in bisect(a, b).ranks}
    again = {rr.rank: rr.effective.verdict for rr in bisect(a, b, ranks=[3, 2, 1, 0]).ranks}
    assert first == again
