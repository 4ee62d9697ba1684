"""The analysis compares and builds report vocabulary values through their enums, not bare strings.

``detfp_analyze.bisect.vocab`` defines each vocabulary once as a ``StrEnum``; a literal such as
``d.verdict == "origin"`` type-checks and runs while naming no member, so a renamed or removed
value would go unnoticed. This test reads every module of ``detfp_analyze`` and flags the
clear cases: a comparison of ``.verdict``, ``.status``, ``.pattern``, ``.cause``,
``.diff_kind`` or ``level`` with a literal of that vocabulary (``==``, ``!=``, ``in (...)``),
and a literal as the vocabulary argument of ``Diagnosis``, ``Advice``, ``ValueDiff`` or
``RankResult``. Write the member (``Verdict.ORIGIN``) instead; it formats as its value, so
reports do not change.
"""

from __future__ import annotations

import ast
from pathlib import Path

from detfp_analyze.bisect.vocab import Cause, DiffKind, Level, Pattern, Status, Verdict

ROOT = Path(__file__).resolve().parents[2]

#: Attribute (or variable) compared -> the vocabulary its values come from.
_COMPARED = {
    "verdict": Verdict,
    "status": Status,
    "pattern": Pattern,
    "cause": Cause,
    "diff_kind": DiffKind,
    "level": Level,
}
#: Constructor -> (index of the positional vocabulary argument, keyword, vocabulary).
_BUILT = {
    "Diagnosis": (0, "pattern", Pattern),
    "Advice": (0, "cause", Cause),
    "ValueDiff": (0, "kind", DiffKind),
    "RankResult": (1, "status", Status),
}


def _name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Name):
        return node.id
    return None


def _literals(node: ast.expr) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [x for e in node.elts for x in _literals(e)]
    return []


def bare_literals(source: str) -> list[tuple[int, str]]:
    """(line, literal) of each vocabulary value written as a bare string where a member belongs."""
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            vocab = _COMPARED.get(_name(node.left) or "")
            # A record's status ("ok", "error") shares the name; those values are no Status member.
            if vocab is not None:
                values = {m.value for m in vocab}
                out += [(node.lineno, s) for c in node.comparators for s in _literals(c) if s in values]
        elif isinstance(node, ast.Call):
            spec = _BUILT.get(_name(node.func) or "")
            if spec is None:
                continue
            pos, kw, vocab = spec
            values = {m.value for m in vocab}
            args = [node.args[pos]] if len(node.args) > pos else []
            args += [k.value for k in node.keywords if k.arg == kw]
            out += [(node.lineno, s) for a in args for s in _literals(a) if s in values]
    return sorted(out)


def test_no_bare_vocabulary_literals():
    found = []
    for path in sorted((ROOT / "detfp_analyze").rglob("*.py")):
        if path.name == "vocab.py":
            continue  # the definitions themselves
        found += [f"{path.relative_to(ROOT)}:{line}: {s!r}" for line, s in bare_literals(path.read_text())]
    assert found == []


def test_the_check_sees_what_it_forbids():
    src = (
        'if d.verdict == "origin" or r.status != "diverged" or diag.pattern in ("single_rank", "x"):\n'
        '    pass\nif level == "kernel" and rec.status == "ok":\n    pass\n'
        'Diagnosis("identical", ())\nAdvice(cause="rng", headline="")\nValueDiff("values")\n'
        'RankResult(0, "identical", None)\nok = d.verdict == Verdict.ORIGIN and d.kind == "op"\n'
    )
    assert bare_literals(src) == [
        (1, "diverged"),
        (1, "origin"),
        (1, "single_rank"),
        (3, "kernel"),
        (5, "identical"),
        (6, "rng"),
        (7, "values"),
        (8, "identical"),
    ]
