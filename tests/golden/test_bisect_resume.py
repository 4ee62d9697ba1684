"""Resume alignment: a run restored at a later step is compared on the common steps only,
boundary state (param, optimizer_state, rng_state) first."""

from __future__ import annotations

from detfp_analyze.bisect import bisect
from tests.fixtures.pairs import build_pair


def test_resume_that_lost_its_rng_state_is_a_source_at_the_boundary(tmp_path):
    # B resumed at step 2; its RNG state differs there, and (as a consequence) mm in l1 too.
    # The mm record comes earlier in the step than nothing else but the batch; the boundary
    # rule must still name the rng_state record first.
    edits = {(r, 2): {"change": ("rng",), "after": "mm.out"} for r in range(2)}
    a, b = build_pair(tmp_path, world=2, steps=range(4), steps_b=range(2, 4), edits_b=edits)
    res = bisect(a, b)
    assert res.resume.resumed
    assert (res.resume.start_a, res.resume.start_b, res.resume.first_common_step) == (0, 2, 2)
    assert res.window.steps == (2, 3)
    assert "resumed" in res.resume.note
    # Restored state only: the rng_state record of each rank. The step-end parameters downstream
    # of the changed mm differ too, but they carry the step's own computation, not the restore.
    assert res.resume.boundary_differing == 2 and res.resume.boundary_compared == 2
    assert res.discriminator is None  # a source has no op to discriminate
    for r in res.ranks:
        f = r.first
        assert (f.step, f.kind, f.verdict) == (2, "rng_state", "source")
    assert res.diagnosis.origin_ranks == (0, 1)


def test_boundary_state_first_even_when_later_in_the_stream(tmp_path):
    # The parameter record is the last of the step, the relu origin comes earlier: at the
    # resume boundary the parameter still wins.
    edits = {(0, 1): {"change": ("param",), "after": "relu.out"}}
    a, b = build_pair(tmp_path, world=1, steps=range(3), steps_b=range(1, 3), edits_b=edits)
    f = bisect(a, b).rank(0).first
    assert (f.step, f.kind, f.op, f.verdict) == (1, "param", "l1.weight", "source")


def test_clean_resume_is_identical_on_common_steps(tmp_path):
    a, b = build_pair(tmp_path, world=1, steps=range(3), steps_b=range(1, 3))
    res = bisect(a, b)
    assert res.status == "identical"
    assert res.resume.resumed and res.resume.boundary_differing == 0
    assert res.window.steps == (1, 2)
