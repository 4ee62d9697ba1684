"""One self-contained HTML page of a bisect: for CI artifacts and for sharing.

``render_html(result, ...)`` is a pure function returning the page as a string: the status and
diagnosis, the commands to reproduce and to recapture the divergent step deeper (``recipes``),
the pictures inline as SVG (``gallery``, optional), the per-rank table (sortable by clicking a
column, filterable by text), the environment diff, the discriminator, the window, and the JSON
report itself (``<script type="application/json" id="detfp-report">``, the ``--json`` object).

Self-contained: no network, no external script, style sheet or font; a Content-Security-Policy
forbids any fetch. Byte-stable: no timestamps, everything sorted, SVG ids fixed and prefixed per
picture so inline figures never share an id. The script (sorting, filtering) is plain ES2015.
"""

from __future__ import annotations

import html
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import polars as pl

from detfp_analyze.bisect import components
from detfp_analyze.bisect.result import BisectResult, Divergence, RankResult, check_verdict
from detfp_analyze.bisect.vocab import Status
from detfp_analyze.ranks import format_ranks
from detfp_analyze.render.recipes import Recipe
from detfp_analyze.render.report import capture_text, status_line
from detfp_format import strictjson

if TYPE_CHECKING:
    from detfp_analyze.io.reader import Run

__all__ = ["Figure", "html_report", "render_html", "svg_for_html"]


@dataclass(frozen=True)
class Figure:
    """A picture for the page: ``name`` (anchor), ``caption`` and the SVG text."""

    name: str
    caption: str
    svg: str


def _e(x: Any) -> str:
    return html.escape("" if x is None else str(x), quote=True)


def svg_for_html(svg: str, prefix: str) -> str:
    """SVG text ready to inline: XML prolog, doctype and metadata dropped, every id prefixed with ``prefix``."""
    body = svg[svg.index("<svg") :]
    body = re.sub(r"<metadata>.*?</metadata>\s*", "", body, flags=re.S)  # RDF boilerplate, not a picture
    body = re.sub(r'\bid="', f'id="{prefix}-', body)
    body = body.replace("url(#", f"url(#{prefix}-").replace('href="#', f'href="#{prefix}-')
    return body.strip()


_CSS = """
:root{--fg:#1d1d1f;--muted:#5f6368;--line:#d9d9de;--bg:#fff;--soft:#f5f6f8;--bad:#c0152f;--ok:#2f7d32}
*{box-sizing:border-box}
body{margin:0;font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,Helvetica,Arial,sans-serif;color:var(--fg);background:var(--bg)}
header{padding:18px 28px;border-bottom:1px solid var(--line);background:var(--soft)}
h1{margin:0 0 6px;font-size:20px}
h2{font-size:17px;margin:26px 0 10px;padding-bottom:4px;border-bottom:1px solid var(--line)}
main{padding:0 28px 40px;max-width:1400px}
nav{margin-top:8px;font-size:13px}nav a{margin-right:14px;color:#1a5fb4;text-decoration:none}
code,pre{font:12.5px/1.4 ui-monospace,SFMono-Regular,Menlo,Consolas,monospace}
pre{background:var(--soft);border:1px solid var(--line);padding:8px 10px;overflow-x:auto;white-space:pre-wrap;word-break:break-all}
.status{display:inline-block;font-weight:600;padding:3px 10px;border-radius:12px;color:#fff}
.status.diverged{background:var(--bad)}.status.identical{background:var(--ok)}.status.rng_only{background:#b8860b}
.status.ended_early{background:#b8860b}
#headline{font-size:15px;font-weight:600}
.muted{color:var(--muted)}
table{border-collapse:collapse;font-size:12.5px;margin:6px 0}
th,td{border:1px solid var(--line);padding:3px 7px;text-align:left;vertical-align:top}
th{background:var(--soft);position:sticky;top:0}
table.sortable th{cursor:pointer;user-select:none;white-space:nowrap}
th[aria-sort=ascending]::after{content:" \\25B2"}th[aria-sort=descending]::after{content:" \\25BC"}
td.num{text-align:right;font-variant-numeric:tabular-nums}
.v{display:inline-block;padding:0 6px;border-radius:8px;font-size:12px}
.v-origin{background:#c0152f;color:#fff}.v-source{background:#e6ab02}.v-receiver{background:#9ecae1}
.v-structural{background:#2c7fb8;color:#fff}.v-unobserved_producer{background:#756bb1;color:#fff}
.v-metric_only{background:#c9a6d9}.v-identical{background:#e3eee3}
figure{margin:12px 0 24px}figure svg{max-width:100%;height:auto}figcaption{color:var(--muted);font-size:13px}
.scroll{max-height:620px;overflow:auto;border:1px solid var(--line)}
input[type=search]{font:inherit;padding:4px 8px;width:320px;margin:4px 0}
dl.kv{display:grid;grid-template-columns:max-content 1fr;gap:2px 14px;margin:6px 0}dl.kv dt{color:var(--muted)}dl.kv dd{margin:0}
"""

_JS = """
(function () {
  "use strict";
  function key(cell, numeric) {
    var raw = cell.getAttribute("data-sort");
    var text = raw === null ? cell.textContent.trim() : raw;
    if (!numeric) { return text.toLowerCase(); }
    var n = parseFloat(text);
    return isNaN(n) ? Infinity : n;
  }
  function sortBy(table, th) {
    var ths = Array.prototype.slice.call(table.tHead.rows[0].cells);
    var col = ths.indexOf(th);
    var numeric = th.getAttribute("data-type") === "number";
    var asc = th.getAttribute("aria-sort") !== "ascending";
    var body = table.tBodies[0];
    var rows = Array.prototype.slice.call(body.rows);
    rows.sort(function (a, b) {
      var x = key(a.cells[col], numeric), y = key(b.cells[col], numeric);
      var c = x < y ? -1 : x > y ? 1 : 0;
      return asc ? c : -c;
    });
    ths.forEach(function (h) { h.removeAttribute("aria-sort"); });
    th.setAttribute("aria-sort", asc ? "ascending" : "descending");
    rows.forEach(function (r) { body.appendChild(r); });
  }
  Array.prototype.forEach.call(document.querySelectorAll("table.sortable"), function (table) {
    Array.prototype.forEach.call(table.tHead.rows[0].cells, function (th) {
      th.addEventListener("click", function () { sortBy(table, th); });
    });
  });
  Array.prototype.forEach.call(document.querySelectorAll("input[data-filter]"), function (input) {
    var table = document.getElementById(input.getAttribute("data-filter"));
    var count = document.getElementById(input.getAttribute("data-count"));
    input.addEventListener("input", function () {
      var q = input.value.trim().toLowerCase(), shown = 0;
      Array.prototype.forEach.call(table.tBodies[0].rows, function (r) {
        var hit = q === "" || r.textContent.toLowerCase().indexOf(q) >= 0;
        r.hidden = !hit;
        if (hit) { shown += 1; }
      });
      count.textContent = String(shown);
    });
  });
}());
"""
_CSP = "default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'; img-src data:"


def verdict_classes() -> frozenset[str]:
    """Verdicts the page's style sheet colours (``.v-<verdict>``)."""
    return frozenset(re.findall(r"\.v-(\w+)\{", _CSS))


def _verdict(v: str | None) -> str:
    if v is None:
        return ""
    if check_verdict(v) not in verdict_classes():
        raise ValueError(
            f"verdict {v!r} has no colour in the HTML report; add .v-{v} to detfp_analyze.render.html._CSS"
        )
    return f'<span class="v v-{_e(v)}">{_e(v)}</span>'


def _table(
    headers: Sequence[tuple[str, str]], rows: Iterable[Sequence[str]], *, id_: str = "", sortable: bool = False
) -> str:
    """``headers``: (title, "number"|"text"); ``rows``: cells already escaped (td markup added here)."""
    attrs = (f' id="{id_}"' if id_ else "") + (' class="sortable"' if sortable else "")
    head = "".join(f'<th data-type="{t}">{_e(h)}</th>' for h, t in headers)
    body = []
    for row in rows:
        cells = "".join(
            f'<td class="num">{c}</td>' if t == "number" else f"<td>{c}</td>"
            for c, (_, t) in zip(row, headers, strict=True)
        )
        body.append(f"<tr>{cells}</tr>")
    return f"<table{attrs}><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _where(d: Divergence | None) -> tuple[str, str, str, str]:
    if d is None:
        return "", "", "", ""
    module = "" if d.module is None else (d.module or "<root>")
    op = "" if d.op is None else f"{d.kind}:{d.op}"
    if d.kind == "state":  # the state a run starts from: before the step, not a call in it
        return f"before step {d.step}", module, op, d.arg
    return d.phase, module, op, f"{d.role} {d.arg}".strip()


def _difference(d: Divergence | None) -> str:
    """The rank table's difference cell: the kind, and which parts of a tensor subclass differ."""
    if d is None:
        return ""
    note = components.note(d)
    return f"{d.diff_kind}: {note}" if note else d.diff_kind


def _rank_rows(result: BisectResult, coords: dict[int, dict[str, Any]], names: list[str]) -> list[list[str]]:
    rows = []
    for r in result.ranks:
        d = r.effective
        phase, module, op, arg = _where(d)
        metric = "" if r.metric_step is None else f"{r.metric_name} @ {r.metric_step}"
        c = coords.get(r.rank, {})
        rows.append(
            [
                _e(r.rank),
                *(_e(c.get(n)) for n in names),
                _e(r.status),
                _e(d.step if d is not None else r.step),
                _verdict(r.verdict if d is None else d.verdict),
                _e(phase),
                f"<code>{_e(module)}</code>",
                f"<code>{_e(op)}</code>",
                _e(arg),
                _e(_difference(d)),
                _e(", ".join(r.first.hazards) if r.first is not None else ""),
                _e(metric),
                _e(d.explanation if d is not None else ""),
            ]
        )
    return rows


def _folded(ranks: Sequence[RankResult]) -> list[tuple[str, RankResult]]:
    groups: dict[tuple, list[RankResult]] = {}
    for r in ranks:
        d = r.effective
        key = (r.status, d.step if d else r.step, r.verdict if d is None else d.verdict, _where(d))
        groups.setdefault(key, []).append(r)
    out = [(format_ranks([x.rank for x in rs]), rs[0]) for rs in groups.values()]
    return sorted(out, key=lambda g: (g[1].status == Status.IDENTICAL, g[1].rank))


def _diagnosis(result: BisectResult) -> str:
    dg, parts = result.diagnosis, []
    kv = [("cause", f"<code>{_e(dg.cause)}</code>"), ("pattern", f"<code>{_e(dg.pattern)}</code>")]
    if dg.origin_ranks:
        kv.append(("origin ranks", _e(format_ranks(dg.origin_ranks))))
    if dg.op:
        kv.append(("op", f"<code>{_e(dg.op)}</code>"))
    if dg.shared_coordinates:
        kv.append(("shared coordinates", _e(", ".join(f"{k}={v}" for k, v in sorted(dg.shared_coordinates.items())))))
    if dg.verdict_counts:
        kv.append(("verdicts", " ".join(f"{_verdict(v)} {n}" for v, n in sorted(dg.verdict_counts.items()))))
    if result.diff is not None:
        df = result.diff
        part = f" in component {df.component}" if df.component else ""
        kv.append(("difference", _e(f"rank {result.diff_rank}: {df.kind}{part} ({df.confirmed}) {df.detail}".strip())))
    w = result.window
    span = lambda s: "-" if s is None else f"{s[0]}-{s[1]}"  # noqa: E731
    kv.append(
        ("window", _e(f"steps {span(w.steps)} (A {span(w.steps_a)}, B {span(w.steps_b)}); {capture_text(result)}"))
    )
    kv.append(("ranks compared", _e(f"{len(w.ranks)} ({format_ranks(w.ranks) or '-'})")))
    if result.resume.note:
        kv.append(("resume", _e(result.resume.note)))
    head = dg.headline or dg.explanation
    rest = dg.explanation[len(dg.headline) :].strip() if dg.headline and dg.explanation.startswith(dg.headline) else ""
    parts.append(f'<p id="headline">{_e(head)}</p>')
    if rest:
        parts.append(f'<p id="explanation">{_e(rest)}</p>')
    if dg.next_steps:
        parts.append('<ol id="next-steps">' + "".join(f"<li>{_e(x)}</li>" for x in dg.next_steps) + "</ol>")
    parts.append('<dl class="kv">' + "".join(f"<dt>{k}</dt><dd>{v}</dd>" for k, v in kv) + "</dl>")
    folded = _folded(result.ranks)
    rows = []
    for who, r in folded:
        d = r.effective
        rows.append([_e(who), _e(r.status), _e(d.step if d else r.step), _verdict(r.verdict if d is None else d.verdict),
                     "<code>" + _e(" ".join(x for x in _where(d) if x)) + "</code>"])  # fmt: skip
    heads = [("ranks", "text"), ("status", "text"), ("step", "number"), ("verdict", "text"), ("where", "text")]
    parts.append("<h3>Ranks by outcome</h3>" + _table(heads, rows, id_="outcomes"))
    return "".join(parts)


def render_html(
    result: BisectResult,
    *,
    figures: Sequence[Figure] = (),
    figures_note: str = "",
    layout: pl.DataFrame | None = None,
    recipes: Sequence[Recipe] = (),
) -> str:
    """The whole page. ``draw``: pictures as SVG (``svg_for_html`` is applied here);
    ``figures_note``: shown when pictures are missing (e.g. matplotlib not installed);
    ``layout``: ``layout.rank_layout`` (adds the parallel coordinates to the rank table);
    ``recipes``: ``recipes.recipes(result, ...)``."""
    r = result
    title = f"detfp bisect: {r.label_a} vs {r.label_b}"
    status = status_line(r).removeprefix("status: ")
    coord_names = [
        c for c in (layout.columns if layout is not None else []) if c not in ("rank", "position", "group", "label")
    ]
    coords = {} if layout is None else {int(row["rank"]): row for row in layout.iter_rows(named=True)}
    sec: list[str] = []
    sec.append(f'<section id="diagnosis"><h2>Diagnosis</h2>{_diagnosis(r)}</section>')
    cmds = "".join(
        f"<h3>{_e(x.title)}</h3><pre><code>{_e(x.command)}</code></pre>" + (f'<p class="muted">{_e(x.note)}</p>' if x.note else "")
        for x in recipes
    )  # fmt: skip
    sec.append(f'<section id="commands"><h2>Commands</h2>{cmds or "<p>none</p>"}</section>')
    figs = "".join(
        f'<figure id="fig-{_e(f.name)}">{svg_for_html(f.svg, "fig-" + f.name)}<figcaption>{_e(f.caption)}</figcaption></figure>'
        for f in figures
    )
    note = f'<p class="muted" id="pictures-note">{_e(figures_note)}</p>' if figures_note else ""
    sec.append(f'<section id="pictures"><h2>Pictures</h2>{note}{figs}</section>')
    heads = [("rank", "number"), *((n, "number") for n in coord_names), ("status", "text"), ("step", "number"),
             ("verdict", "text"), ("phase", "text"), ("module", "text"), ("op", "text"), ("argument", "text"),
             ("difference", "text"), ("hazards", "text"), ("metric", "text"), ("explanation", "text")]  # fmt: skip
    table = _table(heads, _rank_rows(r, coords, coord_names), id_="rank-table", sortable=True)
    sec.append(
        f'<section id="ranks"><h2>Ranks</h2><p><input type="search" placeholder="filter rows (rank, verdict, module...)" '
        f'data-filter="rank-table" data-count="rank-count" aria-label="filter the rank table"> '
        f'<span id="rank-count">{len(r.ranks)}</span> of {len(r.ranks)} ranks shown; click a column to sort.</p>'
        f'<div class="scroll">{table}</div></section>'
    )
    if r.env_diff:
        env_rows = [[f"<code>{_e(d.key)}</code>", _e("all" if d.rank is None else d.rank),
                     f"<code>{_e(strictjson.dumps(d.a, sort_keys=True))}</code>", f"<code>{_e(strictjson.dumps(d.b, sort_keys=True))}</code>",
                     _e("yes" if d.blocking else "")] for d in r.env_diff]  # fmt: skip
        env = _table(
            [("key", "text"), ("rank", "text"), ("A", "text"), ("B", "text"), ("blocking", "text")],
            env_rows,
            id_="env-table",
        )
    else:
        env = "<p>The manifests agree: no environment difference.</p>"
    sec.append(f'<section id="environment"><h2>Environment</h2>{env}</section>')
    if r.discriminator is not None and r.discriminator.rows:
        ds = r.discriminator
        drows = [[_e(x.phase), f"<code>{_e(x.module or '<root>')}</code>", _e(x.dtype or "-"),
                  _e("x".join(map(str, x.shape)) if x.shape is not None else "-"), _e(x.divergent), _e(x.clean)]
                 for x in ds.rows]  # fmt: skip
        dh = [
            ("phase", "text"),
            ("module", "text"),
            ("dtype", "text"),
            ("shape", "text"),
            ("divergent", "number"),
            ("clean", "number"),
        ]
        disc = (
            f"<p>Every call of <code>{_e(ds.op)}</code> on rank(s) {_e(format_ranks(ds.ranks))} in step(s) "
            f"{_e(', '.join(map(str, ds.steps)))}: where the calls that differ sit.</p>"
            + _table(dh, drows, id_="discriminator-table")
        )
    else:
        disc = "<p>No discriminator: there is no origin op to discriminate.</p>"
    sec.append(f'<section id="discriminator"><h2>Discriminator</h2>{disc}</section>')
    if r.notes:
        sec.append(
            '<section id="notes"><h2>Notes</h2><ul>' + "".join(f"<li>{_e(n)}</li>" for n in r.notes) + "</ul></section>"
        )
    payload = strictjson.dumps(r.to_json_dict(), sort_keys=True).replace("</", "<\\/")
    nav = "".join(
        f'<a href="#{s}">{s}</a>'
        for s in ("diagnosis", "commands", "pictures", "ranks", "environment", "discriminator")
    )
    return (
        "<!DOCTYPE html>\n"
        f'<html lang="en"><head><meta charset="utf-8"><meta http-equiv="Content-Security-Policy" content="{_CSP}">'
        f'<meta name="viewport" content="width=device-width, initial-scale=1"><title>{_e(title)}</title>'
        f"<style>{_CSS}</style></head><body>"
        f"<header><h1>{_e(title)}</h1>"
        f'<p>A = <code id="run-a">{_e(r.label_a)}</code> &nbsp; B = <code id="run-b">{_e(r.label_b)}</code></p>'
        f'<p><span id="status" class="status {_e(r.status)}">{_e(status)}</span></p><nav>{nav}</nav></header>'
        f"<main>{''.join(sec)}</main>"
        f'<footer class="muted" style="padding:0 28px 24px">detfp report_version {r.to_json_dict()["report_version"]}; '
        "the JSON report is embedded in this page (script#detfp-report).</footer>"
        f'<script type="application/json" id="detfp-report">{payload}</script>'
        f"<script>{_JS}</script></body></html>\n"
    )


def html_report(
    result: BisectResult,
    a: Run | str | os.PathLike[str],
    b: Run | str | os.PathLike[str],
    *,
    pictures: bool = True,
    max_rows: int = 256,
) -> str:
    """The page for ``result``, a bisect of runs ``a`` and ``b`` (Runs or directories): pictures
    drawn when matplotlib is installed (otherwise the page says how to get them), the rank layout
    and the commands from the runs' manifests."""
    from detfp_analyze.errors import OptionalDependencyError
    from detfp_analyze.io.reader import as_run
    from detfp_analyze.render.draw import figure_bytes
    from detfp_analyze.render.gallery import bisect_pictures
    from detfp_analyze.render.layout import rank_layout
    from detfp_analyze.render.recipes import recipes

    ra, rb = as_run(a), as_run(b)
    figs: list[Figure] = []
    note = "" if pictures else "pictures were not requested"
    layout = None
    if pictures:
        try:
            pics = bisect_pictures(result, ra, rb, max_rows=max_rows)
        except OptionalDependencyError as exc:
            note = f"no pictures: {exc}"
        else:
            layout = pics.layout
            figs = [Figure(p.name, p.caption, figure_bytes(p.figure, "svg").decode("utf-8")) for p in pics.figures]
            if pics.skipped:
                note = "; ".join(f"{name} left out: {why}" for name, why in pics.skipped)
    if layout is None:
        layout = rank_layout(ra, [x for x in result.window.ranks if x in ra.manifests])
    man_a = {r: ra.manifest(r) for r in ra.ranks}
    man_b = {r: rb.manifest(r) for r in rb.ranks}
    return render_html(result, figures=figs, figures_note=note, layout=layout, recipes=recipes(result, man_a, man_b))
