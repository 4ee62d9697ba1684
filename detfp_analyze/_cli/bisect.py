"""`detfp-analyze bisect A B`: where two runs stopped being bitwise identical, and why.

Text report (``report.render_text``) or ``--json`` (the versioned object documented in
docs/report.md); ``--html FILE`` also writes the self-contained page (``html.html_report``).
Exit 0 identical, 1 diverged, ``rng_only`` (only an RNG state differs) or ``ended_early`` (a run
ended before the other; with ``--allow-incomplete`` the steps both hold decide), 2 bad input (one
line on stderr); with ``--expect FILE`` (a golden-trace gate, ``gate.py``) 0 also when every
divergence is expected (``status = "rng_only"`` / ``"ended_early"`` expects those cases), and the
report gains a gate section (``gate`` in the JSON). A progress bar is drawn on stderr only when stderr is a
terminal, so logs stay byte-stable.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from detfp_analyze._cli import engine as _engine
from detfp_analyze._cli.common import (
    ALLOW_INCOMPLETE_HELP,
    EXIT_DIVERGED,
    EXIT_OK,
    echo,
    fail,
    handle_errors,
    one_line,
    write_output,
)
from detfp_analyze._cli.depth import Depth, OldLevel, resolve_depth
from detfp_analyze._cli.selection import parse_ranks, parse_steps, rank_values
from detfp_analyze.bisect import ReadPaths, bisect
from detfp_analyze.gate.expectations import evaluate, load_expectations, render_gate
from detfp_analyze.io.reader import open_run
from detfp_analyze.render import jsontext
from detfp_analyze.render.report import render_text

__all__ = ["command"]

_ALLOW_INCOMPLETE = (
    ALLOW_INCOMPLETE_HELP + " A run that ended before the other (status ended_early, exit 1) then passes when the "
    "steps both hold match."
)


class _Bar:
    """A rich progress bar on stderr, created on first use (only for long scans on a TTY)."""

    def __init__(self) -> None:
        self.progress: Any = None
        self.tasks: dict[str, Any] = {}

    def __call__(self, stage: str, done: int, total: int) -> None:
        if total <= 1:
            return
        if self.progress is None:
            from rich.console import Console
            from rich.progress import Progress

            self.progress = Progress(console=Console(stderr=True), transient=True)
            self.progress.start()
        if stage not in self.tasks:
            self.tasks[stage] = self.progress.add_task(stage, total=total)
        self.progress.update(self.tasks[stage], completed=done, total=total)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()


@handle_errors
def command(
    run_a: Annotated[str, typer.Argument(metavar="A", help="Run directory A (the reference).")],
    run_b: Annotated[str, typer.Argument(metavar="B", help="Run directory B.")],
    ranks: Annotated[
        str | None, typer.Option("--ranks", metavar="RANKS", help="Ranks to compare, e.g. 0,4-7 (default: all).")
    ] = None,
    steps: Annotated[
        str | None, typer.Option("--steps", metavar="STEPS", help="Inclusive step range, e.g. 3-5 or 4.")
    ] = None,
    depth: Depth = None,
    level: OldLevel = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the versioned JSON report (docs/report.md).")] = False,
    force: Annotated[
        bool, typer.Option("--force", help="Compare even if world size, layout or digest version differ.")
    ] = False,
    allow_missing_ranks: Annotated[
        bool, typer.Option("--allow-missing-ranks", help="Compare the ranks present even if some are missing.")
    ] = False,
    allow_incomplete: Annotated[bool, typer.Option("--allow-incomplete", help=_ALLOW_INCOMPLETE)] = False,
    ignore_env: Annotated[
        list[str] | None,
        typer.Option("--ignore-env", metavar="KEY", help="Leave manifest keys out of the diff (glob, repeatable)."),
    ] = None,
    expect: Annotated[
        str | None,
        typer.Option(
            "--expect",
            metavar="FILE",
            help="Expected divergences (TOML/JSON; status = 'rng_only' accepts an RNG-state-only difference, "
            "status = 'ended_early' a run that ended early): exit 0 if only they occur.",
        ),
    ] = None,
    html: Annotated[
        Path | None,
        typer.Option(
            "--html", metavar="FILE", help="Also write a self-contained HTML report (pictures need matplotlib)."
        ),
    ] = None,
    engine: _engine.EngineOption = "local",
    master: _engine.MasterOption = None,
    conf: _engine.ConfOption = None,
    no_step_sums: Annotated[
        bool,
        typer.Option(
            "--no-step-sums",
            help="Compare the metrics and rollups shards, not the step folds the commit lines state (slower; "
            "the same report: what is read is still checked against the folds).",
        ),
    ] = False,
    no_stored_rollups: Annotated[
        bool,
        typer.Option(
            "--no-stored-rollups",
            help="Read the records, not the stored rollups or step folds: the path of runs written without them "
            "(slower; the same report, for comparing both paths).",
        ),
    ] = False,
    no_index: Annotated[
        bool,
        typer.Option(
            "--no-index",
            help="Parse the manifests and commit logs, and neither read nor fill the run index (the reader's "
            "cache): the path of runs without one (slower; the same report).",
        ),
    ] = False,
) -> None:
    """Find, per rank, the first record where A and B differ: step, phase, module, op, kernel, verdict."""
    rank_sel = parse_ranks(ranks)
    step_range = parse_steps(steps)
    chosen = resolve_depth(depth, level)
    problem = _engine.check(engine, master, conf)
    if problem:
        fail(problem)
    expectations = None if expect is None else load_expectations(expect)
    opts = {"allow_missing_ranks": allow_missing_ranks, "allow_incomplete": allow_incomplete, "use_index": not no_index}
    a, b = open_run(run_a, **opts), open_run(run_b, **opts)
    rank_list = rank_values(rank_sel, max(a.world_size, b.world_size))
    # Spark starts only now: bad input has failed already, without a JVM.
    heavy = _engine.bisect_engine(master, conf) if engine == "spark" else None
    bar = _Bar() if sys.stderr.isatty() else None
    try:
        result = bisect(
            a,
            b,
            ranks=rank_list,
            steps=step_range,
            level=chosen,
            force=force,
            ignore_env=ignore_env or (),
            progress=bar,
            engine=heavy,
            reads=ReadPaths(step_sums=not no_step_sums, stored_rollups=not no_stored_rollups),
            allow_incomplete=allow_incomplete,
        )
    finally:
        if bar is not None:
            bar.close()
    gate = None if expectations is None else evaluate(result, expectations, expect or "")
    if html is not None:
        from detfp_analyze.render.html import html_report

        write_output(html, html_report(result, a, b), "--html")
        print(f"detfp-analyze: {one_line(f'wrote {html}')}", file=sys.stderr)  # stdout stays the report alone
    if as_json:
        doc = result.to_json_dict()
        if gate is not None:
            doc["gate"] = gate.to_json_dict()
        typer.echo(jsontext.dumps(doc))
    else:
        echo(render_text(result) + ("" if gate is None else render_gate(gate)))
    failed = result.diverged if gate is None else not gate.passed
    raise typer.Exit(EXIT_DIVERGED if failed else EXIT_OK)
