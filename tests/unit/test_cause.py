"""The cause weighing as pure functions (``bisect/cause.py``, ``settings.py``, ``advice.py``): the
ranking, and the decisions the real captures of ``tests/integration/test_diagnosis.py`` do not
reach (a setting that cannot explain a source, a hazard followed by an independent origin, two
runs that end alike, the gate's ``status``)."""

from __future__ import annotations

from dataclasses import replace

from detfp_analyze.bisect.cause import Clues, HazardRead, confirm_hazards, trim_endings, weigh
from detfp_analyze.bisect.diagnose import diagnose
from detfp_analyze.bisect.result import (
    BisectResult,
    Capture,
    Divergence,
    Ending,
    RankResult,
    ResumeInfo,
    ValueDiff,
    Window,
)
from detfp_analyze.bisect.settings import explains, settings
from detfp_analyze.gate.expectations import Expectation, evaluate
from detfp_analyze.io.envdiff import EnvDiff


def div(verdict: str = "origin", kind: str = "op", op: str = "aten::mm.default", **kw) -> Divergence:
    base = dict(step=1, microbatch=-1, phase="backward", module="l1", kind=kind, op=op, occurrence=0, role="output",
                arg="out", presence="both", verdict=verdict, diff_kind="values", hazards=(), seq_a=5, seq_b=5)  # fmt: skip
    return Divergence(**{**base, **kw})


def ranks(*firsts: Divergence | None, **kw) -> tuple[RankResult, ...]:
    return tuple(
        RankResult(r, "diverged", d.step, record_step=d.step, first=d, **kw) if d else RankResult(r, "identical", None)
        for r, d in enumerate(firsts)
    )


def cause_of(rs, clues=Clues(), status="diverged", reads=None):  # noqa: B008 - a frozen default
    return weigh(diagnose(rs, {}), rs, clues, status, reads)


THREADS = EnvDiff("determinism.num_threads", 1, 2)


def test_settings_keep_what_changes_numbers_in_group_order():
    diffs = [EnvDiff("host.hostname", "a", "b"), EnvDiff("versions.torch", "2.9", "2.10"), THREADS,
             EnvDiff("env.NCCL_ALGO", None, "Tree"), EnvDiff("git.commit", "x", "y"),
             EnvDiff("env.TORCHINDUCTOR_CACHE_DIR", "/a", "/b"), EnvDiff("determinism.num_interop_threads", 1, 2),
             EnvDiff("env.TORCH_NCCL_ASYNC_ERROR_HANDLING", None, "1"), EnvDiff("env.TORCHELASTIC_RUN_ID", None, "x"),
             EnvDiff("env.NCCL_DEBUG", None, "INFO")]  # fmt: skip
    got = [(s.key, s.group) for s in settings(diffs)]
    assert got == [("determinism.num_threads", "threads"), ("env.NCCL_ALGO", "collectives"),
                   ("versions.torch", "libraries")]  # fmt: skip


def test_a_setting_is_named_first_only_for_a_divergence_it_can_explain():
    clues = Clues(settings=settings([THREADS]))
    op = cause_of(ranks(div(), div()), clues)
    assert op.cause == "setting" and op.headline.startswith("determinism.num_threads differs (1 -> 2)")
    # A batch that differs is the data, whatever the thread count: the setting comes after it.
    data = cause_of(ranks(div("source", "batch", "Net", phase="forward", module="")), clues)
    assert (
        data.cause == "data"
        and "Also differs, without explaining this difference: determinism.num_threads" in data.explanation
    )
    args = div(diff_kind="arguments", diff=ValueDiff("arguments", args_changes=("lr 0.1 -> 0.2",)))
    assert not explains(settings([THREADS])[0], args, "single_process")
    assert cause_of(ranks(args), clues).cause == "argument"


def test_the_one_process_caveat_is_said_for_an_op_only():
    one = cause_of(ranks(div()))
    assert one.cause == "op" and "one process cannot tell which" in one.headline
    rng = cause_of(ranks(div("source", "rng_state", "cpu", phase="step", module="")))
    assert rng.cause == "rng" and "one process" not in rng.explanation
    assert not any("kernel" in s for s in rng.next_steps)


def test_a_hazard_followed_by_an_independent_origin_stays_a_false_root():
    read = {0: HazardRead((1,), (1,), "args[0]")}
    first = div(hazards=("uninitialized",), op="aten::index_add_.default")
    carried = ranks(first, next_clean=div("unobserved_producer", op="aten::index.Tensor"))
    assert confirm_hazards(carried, read)[0].hazard_confirmed
    independent = ranks(first, next_clean=div(op="aten::addmm.default"))
    assert not confirm_hazards(independent, read)[0].hazard_confirmed  # a clean origin of its own
    # FSDP2's all-gather copy-in buffer: flagged in both runs every step, but the next difference is
    # a receiver of a peer's batch in a later step: the garbage matched again, a false root.
    peer = ranks(first, next_clean=div("receiver", op="aten::copy_.default", step=2))
    assert not confirm_hazards(peer, read)[0].hazard_confirmed
    later = ranks(first, next_clean=div("unobserved_producer", op="aten::index.Tensor", step=2))
    assert not confirm_hazards(later, read)[0].hazard_confirmed
    assert not confirm_hazards(carried, {0: HazardRead((1,), (), "")})[0].hazard_confirmed  # run B never read it
    confirmed = confirm_hazards(carried, read)
    d = cause_of(confirmed, reads=read)
    assert d.cause == "uninitialized" and "aten::index_add_.default in l1 reads its input args[0]" in d.headline


def test_runs_that_end_alike_did_not_end_early_and_an_end_is_never_structural():
    cut = div("structural", op="aten::ones_like.default", presence="a_only", step=3)
    e = Ending("B", 3, (0,), "step 3 raised RuntimeError: boom; its records stop there")
    kept, notes = trim_endings(ranks(cut), (e,))
    assert kept[0].status == "identical" and "run B's records of step 3 stop before aten::ones_like" in notes[0]
    d = cause_of(kept, Clues(endings=(e,), window=(0, 3)), status="identical")
    assert d.cause == "ended_early" and d.headline.startswith("Run B ended at step 3: step 3 raised RuntimeError")
    # A value that differs before the end is the cause; the end is said after it.
    real = ranks(div(step=1))
    d = cause_of(real, Clues(endings=(e,), window=(0, 3)))
    assert d.cause == "op" and d.explanation.endswith("Run B ended at step 3 (step 3 raised RuntimeError: boom; its "
                                                      "records stop there).")  # fmt: skip


def test_recapture_hints_follow_the_capture_form():
    at_boundaries = div(kind="module_output", op="Linear")
    session = cause_of(ranks(at_boundaries, at_boundaries), Clues(capture_a=Capture("boundaries", "session")))
    assert session.next_steps[-1].endswith('Session("NEW_DIR", level="ops", steps="1") in the script')
    launcher = cause_of(ranks(at_boundaries, at_boundaries), Clues(capture_a=Capture("boundaries", "launcher")))
    assert "python -m detfp_capture --out NEW_DIR --level ops --steps 1 -- <the same script>" in launcher.next_steps[-1]


def _result(status: str, rs: tuple[RankResult, ...]) -> BisectResult:
    diag = diagnose(rs, {})
    return BisectResult("a", "b", status, (), 0, rs, diag, None, None, Window((0, 2), (0, 2), (0, 2), (0,)),
                        ResumeInfo(False, 0, 0, 0), None)  # fmt: skip


def test_the_gate_expects_a_status():
    rng = ranks(div("source", "rng_state", "cpu", phase="step", module="", step=0))
    only = Expectation(1, "reseeded; dropout 0", status="rng_only")
    assert evaluate(_result("rng_only", rng), [only]).passed
    assert not evaluate(_result("diverged", rng), [only]).passed  # values differ too: not expected
    narrow = replace(only, kind="batch")
    assert not evaluate(_result("rng_only", rng), [narrow]).passed  # with other fields, both must match


def test_a_dtype_change_is_autocasts_or_a_casts_never_a_thread_counts():
    """Issue 42: a dtype difference is its own kind; only autocast (or a library) explains it."""
    vd = ValueDiff("dtype", dtype_a="torch.bfloat16", dtype_b="torch.float16", detail="the dtype differs")
    d = div(diff_kind="dtype", diff=vd, kind="module_output", op="Conv2d", module="patch", phase="forward", step=0)
    plain = cause_of(ranks(d, d))
    assert plain.cause == "dtype" and plain.headline.startswith(
        "The dtype of the output of patch (Conv2d, forward, step 0) differs on every rank (0-1) (bfloat16 -> float16)"
    )
    threads = cause_of(ranks(d, d), Clues(settings=settings([THREADS])))
    assert threads.cause == "dtype" and "without explaining this difference: determinism.num_threads" in threads.explanation
    auto = settings([EnvDiff("determinism.autocast.cpu.dtype", "torch.bfloat16", "torch.float16")])
    assert [s.group for s in auto] == ["autocast"]
    named = cause_of(ranks(d, d), Clues(settings=(*settings([THREADS]), *auto)))
    assert named.cause == "setting" and named.headline.startswith("determinism.autocast.cpu.dtype differs")
    assert named.headline.endswith("(its dtype: bfloat16 -> float16).")
    shape = div(diff_kind="shape", diff=ValueDiff("shape", shape_a=(8, 10), shape_b=(8, 12)))
    assert cause_of(ranks(shape)).headline.startswith("The shape of aten::mm.default in l1 (backward, step 1) differs "
                                                      "in this process ([8x10] -> [8x12])")  # fmt: skip


def test_an_autocast_cast_whose_dtype_argument_differs_is_the_autocast_setting_at_level_ops():
    """At level ops an autocast dtype change shows first at the cast (aten::_to_copy's dtype
    argument): the setting names it; another argument's change stays the call site's."""
    cast = ValueDiff("arguments", args_changes=("dtype torch.bfloat16 -> torch.float16",))
    d = div(diff_kind="arguments", diff=cast, op="aten::_to_copy.default", phase="forward", module="patch", step=0)
    auto = settings([EnvDiff("determinism.autocast.cpu.dtype", "torch.bfloat16", "torch.float16")])
    got = cause_of(ranks(d, d), Clues(settings=auto))
    assert got.cause == "setting" and got.headline.startswith("determinism.autocast.cpu.dtype differs"), got.headline
    assert cause_of(ranks(d, d)).cause == "argument"  # no setting differs: the call site passed another dtype
    assert cause_of(ranks(d, d), Clues(settings=settings([THREADS]))).cause == "argument"
    lr = replace(d, diff=ValueDiff("arguments", args_changes=("dtype torch.bfloat16 -> torch.float16", "lr 1 -> 2")))
    assert cause_of(ranks(lr, lr), Clues(settings=auto)).cause == "argument"


def test_forward_calls_that_differ_name_the_accumulation_and_a_setting_note_is_said_once():
    from detfp_analyze.bisect.cause import ForwardCalls

    d = div(step=0)
    got = cause_of(ranks(d, d), Clues(calls=ForwardCalls(0, 0, 2, 4, labelled=False)))
    assert got.cause == "control_flow" and got.headline.startswith("Control flow differs: forward calls per step: A 2, "
                                                                   "B 4 (step 0) on every rank (0-1)")  # fmt: skip
    assert any("session.microbatch(i)" in s for s in got.next_steps)
    labelled = cause_of(ranks(d, d), Clues(calls=ForwardCalls(0, 0, 2, 4, labelled=True)))
    assert not any("session.microbatch(i)" in s for s in labelled.next_steps)
    assert cause_of(ranks(d, d), Clues(calls=ForwardCalls(0, 0, 2, 2, labelled=False))).cause == "op"
    per_rank = tuple(EnvDiff("env.OMP_NUM_THREADS", "1", "2", r) for r in (0, 1))
    identical = weigh(diagnose(ranks(None, None), {}), ranks(None, None), Clues(settings=settings(per_rank)), "identical")
    assert identical.explanation.count("OMP_NUM_THREADS") == 1 and "without explaining" not in identical.explanation
    assert "A setting differs, and every value matched anyway: env.OMP_NUM_THREADS [ranks 0-1]" in identical.explanation


def test_a_subclass_whose_parts_all_match_differs_by_its_layout():
    from detfp_analyze.bisect.diffkind import classify

    side = {"status": "ok", "digest_hi": 1, "digest_lo": 2}
    v = classify("differs", side, {**side, "digest_lo": 3}, layout=True, dtypes=("torch.float32",) * 2)
    assert v.kind == "layout" and "its layout" in v.detail
    d = div(diff_kind="layout", diff=v, kind="param", op="fc.weight", phase="step")
    got = cause_of(ranks(d))
    assert got.cause == "layout" and "with every part equal: its layout changed" in got.headline
    dt = classify("differs", side, {**side, "digest_lo": 3}, dtypes=("torch.bfloat16", "torch.float16"))
    assert (dt.kind, dt.dtype_a, dt.dtype_b) == ("dtype", "torch.bfloat16", "torch.float16")


def _with_coords(rs, coords):
    return weigh(diagnose(rs, coords), rs, Clues(), "diverged")


def test_headlines_of_origins_by_the_side_of_a_collective_and_of_rank_subsets():
    """The first sentence of an origin on some ranks: the verb agrees with them ("Only rank 2
    starts", "Only ranks 2-3 start"), one rank's coordinates are its own ("its coordinates"),
    several ranks' those they share; an origin at a collective's input is the code before it
    on that rank (``rank_local``, or ``op`` on every rank), never the reduction order; only an
    origin at its output, every rank's input matching, is the collective's."""
    coords = {r: {"dp": r // 2, "tp": r % 2} for r in range(4)}
    rs_in = div(kind="collective", op="reduce_scatter_tensor@tp", role="input", arg="input", phase="forward", module="mlp")
    one = _with_coords(ranks(None, None, rs_in, div("receiver")), coords)
    assert one.cause == "rank_local"
    assert one.headline == (
        "Only rank 2 starts the difference, at the input of reduce_scatter_tensor@tp in mlp (forward, step 1), which "
        "the code before it on that rank made (its coordinates: dp=1, tp=0): look at what differs there (its input "
        "data, placement, topology, reduction order)."
    )
    two = _with_coords(ranks(div("receiver"), div("receiver"), div(), div()), coords)
    assert two.cause == "rank_local"
    assert two.headline.startswith(
        "Only ranks 2-3 start the difference, at aten::mm.default in l1 (backward, step 1) with matching inputs "
        "(they share dp=1): "
    )
    every = cause_of(ranks(rs_in, rs_in))
    assert every.cause == "op" and every.headline.startswith(
        "The input of reduce_scatter_tensor@tp in mlp (forward, step 1) is the first difference on every rank (0-1), "
        "made on each rank by the code before it"
    )
    rs_out = replace(rs_in, role="output", arg="output")
    out = cause_of(ranks(rs_out, rs_out))
    assert out.cause == "collective" and out.headline.startswith(
        "The output of reduce_scatter_tensor@tp in mlp (forward, step 1) is the first difference, and every rank of "
        "its group had matching inputs"
    )
