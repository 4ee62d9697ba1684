"""summarize / format_summary golden output and the `detfp-analyze summary` command's exit codes."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from detfp_analyze.cli import app
from detfp_analyze.io.reader import open_run
from detfp_analyze.single.summary import format_summary, summarize, summary_dict
from tests.fixtures.shards import write_run

GOLDEN = """\
run: {label}
world size: 3
ranks: 0-1 (missing: 2)
completeness:
  ranks 0-1  complete
segments:
  0  ranks 0-1, start step -
  1  ranks 0, start step 2
steps: 0-2
capture levels: modules, ops
rows per table:
  records  5
  metrics  2
  events   2
  kernels  1
  dumps    0
  args     0
records per kind:
  collective  1
  op          4
records per status:
  error  1
  ok     4
records with hazard:
  pointer_like   1
  uninitialized  2
events per type:
  hazard    1
  step_end  1
metrics: grad_norm, loss
environment:
  determinism.cuda_matmul_allow_tf32     false
  determinism.cudnn_allow_tf32           false
  determinism.cudnn_benchmark            false (ranks 0); true (ranks 1)
  determinism.cudnn_deterministic        true
  determinism.deterministic_algorithms   true
  determinism.deterministic_warn_only    false
  determinism.fill_uninitialized_memory  true
  determinism.float32_matmul_precision   highest
  determinism.num_interop_threads        1
  determinism.num_threads                1
  env.CUBLAS_WORKSPACE_CONFIG            :4096:8
  env.NCCL_ALGO                          (unset) (ranks 0); Ring (ranks 1)
  git.commit                             null
  git.dirty                              null
  git.root                               null
  host.cpu                               testcpu
  host.device_count                      0
  host.devices                           []
  versions.cuda                          null
  versions.cudnn                         null
  versions.detfp                         0.1.0
  versions.nccl                          null
  versions.os                            Linux
  versions.python                        3.11.7
  versions.torch                         2.13.0
"""


def _golden_run(tmp_path):
    p = tmp_path / "run"
    env1 = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NCCL_ALGO": "Ring"}
    det1 = dict(summary_default_det(), cudnn_benchmark=True)
    write_run(
        p,
        {
            0: {
                "records": [dict(step=0), dict(step=1, hazards=["uninitialized", "pointer_like"]),
                            dict(step=1, status="error", error="boom")],
                "metrics": [dict(step=0, value=1.0), dict(step=0, name="grad_norm", value=2.0)],
                "events": [dict(step=1, type="hazard", name="uninitialized")],
                "kernels": [dict(step=1, kernel="gemm")],
            },
            1: {"records": [dict(step=0, kind="collective", name="all_reduce")], "events": [dict(step=0)]},
        },
        world_size=3,
        manifest_overrides={1: {"env": env1, "determinism": det1, "capture": {"level": "modules"}}},
    )  # fmt: skip
    # Rank 0 resumed from step 2: its segment-0 row at step 2 is superseded by the new launch.
    write_run(p, {0: {"records": [dict(step=2, hazards=["uninitialized"])]}}, world_size=3, segment=1, start_step=2)
    return p


def summary_default_det():
    from tests.fixtures.shards import default_manifest

    return default_manifest(0, 1)["determinism"]


def test_summary_golden_text(tmp_path):
    p = _golden_run(tmp_path)
    s = summarize(open_run(str(p), allow_missing_ranks=True))
    assert format_summary(s) == GOLDEN.format(label=p)
    d = summary_dict(s)
    assert d["tables"]["records"] == 5 and d["segments"][1] == {"segment": 1, "ranks": "0", "start_steps": [2]}
    json.dumps(d)


def test_summary_of_an_empty_run(tmp_path):
    p = write_run(tmp_path / "e", {0: {}})
    text = format_summary(summarize(open_run(p)))
    assert "steps: none\n" in text and "records per kind: none\n" in text and "metrics: none\n" in text


def test_cli_summary_text_json_and_exit_codes(tmp_path):
    p = _golden_run(tmp_path)
    runner = CliRunner()
    res = runner.invoke(app, ["summary", str(p)])
    assert res.exit_code == 2
    assert res.output.strip() == (
        f"detfp-analyze: {p}: missing rank(s) 2 of world size 3 (no manifest); pass allow_missing_ranks=True "
        "(--allow-missing-ranks) to analyze the ranks present"
    )
    res = runner.invoke(app, ["summary", "--allow-missing-ranks", str(p)])
    assert res.exit_code == 0 and res.output == GOLDEN.format(label=p)
    res = runner.invoke(app, ["summary", "--allow-missing-ranks", "--json", str(p)])
    assert res.exit_code == 0 and json.loads(res.output)["kinds"] == {"collective": 1, "op": 4}
    res = runner.invoke(app, ["summary", str(tmp_path / "nope")])
    assert res.exit_code == 2 and "no such directory" in res.output and len(res.output.strip().splitlines()) == 1
