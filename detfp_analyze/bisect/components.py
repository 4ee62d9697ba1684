"""The parts of a tensor subclass in a report: which part of a divergent record's tensor differs.

A tensor subclass (an MX or NVFP4 quantized tensor, a DTensor) is recorded as its parts, each
under ``<arg>::<component>``, before its whole under ``<arg>`` (docs/trace-format.md, "Tensor
subclasses"). A rank's first divergent record is then the first part that differs; ``parts_of``
reads, from the records of its call, every part of the same whole and how it compares
(``Divergence.components``), and ``note`` says it in one line for the text and HTML reports:
``scale of blocks.1.fc2.weight differs, qdata equal``.
"""

from __future__ import annotations

from detfp_analyze import rule
from detfp_analyze.bisect.records import Extract
from detfp_analyze.bisect.result import Component, Divergence
from detfp_format.contract import COMPONENT_SEP, split_component

__all__ = ["note", "parts_of"]

#: Kinds named by their record's name (a parameter FQN), not by an argument of a call.
_NAMED_KINDS = ("param", "grad", "optimizer_state", "probe", "state")


def parts_of(ex: Extract) -> tuple[Component, ...]:
    """The innermost parts of the tensor subclass ``ex.record`` belongs to (a part of it, or the
    whole), from the records of its call, in record order; empty for a plain tensor's record or a
    whole recorded without parts (a trace written before parts were)."""
    rec = ex.record
    prefix = split_component(rec.arg)[0] + COMPONENT_SEP
    parts = sorted(
        (r for r in ex.call if r.role == rec.role and r.arg.startswith(prefix)),
        key=lambda r: (r.pos_a if r.pos_a is not None else r.pos_b, r.arg),
    )
    names = [r.arg[len(prefix) :] for r in parts]
    # A nested subclass's own whole (``_local_tensor`` of ``_local_tensor::scale``) says nothing
    # its parts do not: only the innermost parts are listed.
    return tuple(
        Component(n, r.state)
        for n, r in zip(names, parts, strict=True)
        if not any(m.startswith(n + COMPONENT_SEP) for m in names)
    )


def note(d: Divergence) -> str | None:
    """``scale of blocks.1.fc2.weight differs, qdata equal``; None when ``d`` is not a record of
    a tensor subclass whose parts were recorded."""
    if not d.components:
        return None
    whole = split_component(d.arg)[0]
    label = d.op if d.kind in _NAMED_KINDS and d.op else f"{d.role} {whole}"
    differ = [c.name for c in d.components if c.state not in (rule.SAME, rule.UNKNOWN)]
    same = [c.name for c in d.components if c.state == rule.SAME]
    unknown = [c.name for c in d.components if c.state == rule.UNKNOWN]
    if differ:
        head = f"{', '.join(differ)} of {label} {'differs' if len(differ) == 1 else 'differ'}"
    else:
        head = f"{label} differs with every part equal: its layout (non-tensor parts) differs"
    tail = [f"{', '.join(same)} equal"] if same and differ else []
    tail += [f"{', '.join(unknown)} without evidence"] if unknown else []
    return ", ".join([head, *tail])
