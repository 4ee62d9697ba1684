"""Importing the analysis side (package, CLI, reader, summary, the picture, page and timeline
modules, bisect's pipeline, the Spark engine's package and the commands that take ``--engine``)
loads neither torch nor matplotlib nor pyspark: matplotlib only when a picture is drawn, pyspark
only when ``--engine spark`` runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

_CODE = """
import sys
import detfp_analyze, detfp_analyze.cli, detfp_analyze.io.reader, detfp_analyze.single.summary
import detfp_analyze.render.frames, detfp_analyze.render.draw, detfp_analyze.render.gallery, detfp_analyze.render.heatmap
import detfp_analyze.render.html, detfp_analyze.render.recipes, detfp_analyze.render.perfetto, detfp_analyze.render.layout
import detfp_analyze._cli.reference
import detfp_analyze.bisect.pipeline, detfp_analyze.spark
from detfp_analyze._cli import bisect, sql, engine
import detfp_format.contract, detfp_format.arrowschema, detfp_format.writer
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "matplotlib", "pyspark", "py4j"))
print(",".join(heavy))
"""


def test_analysis_imports_no_torch_no_matplotlib_and_no_pyspark():
    out = subprocess.run([sys.executable, "-c", _CODE], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ""


def test_cli_help_runs_without_torch():
    code = "import sys; from detfp_analyze.cli import app; sys.argv = ['detfp-analyze', '--help']\n"
    code += "try:\n    app()\nexcept SystemExit:\n    pass\nprint('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "False"


def test_bisect_of_committed_runs_runs_without_pyarrow_numpy_and_pydantic(tmp_path):
    # Start-up time of `detfp-analyze bisect` (docs/measurements/bisect-walk-cost.md): a run whose
    # shards its commit lines state (the capture's default) is opened and bisected by polars alone,
    # and parsing the command line loads no pydantic (Typer 0.29 imports it for every parameter).
    from detfp_analyze.testing.synth import Plant, SynthSpec, write_pair

    a, b = tmp_path / "a", tmp_path / "b"
    write_pair(a, b, SynthSpec(ranks=2, steps=2, records=40), Plant(rank=1, step=1, index=5))
    code = (
        "import sys; from detfp_analyze.cli import main\n"
        f"sys.argv = ['detfp-analyze', 'bisect', {str(a)!r}, {str(b)!r}, '--json']\n"
        "try:\n    main()\nexcept SystemExit as e:\n    code = e.code\n"
        "print(code, sorted({m.split('.')[0] for m in sys.modules} & {'pyarrow', 'numpy', 'pandas', 'pydantic', 'torch'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "1 []"
