"""Backward attribution at level ops: autograd nodes tagged with the module that created them.

Each module's forward ends (``ModuleHooks.post``) with a walk back from its outputs to its inputs
that writes the module's path into the ``metadata`` of every autograd node created inside it
(innermost module wins). An op or collective that runs while autograd executes such a node is
then attributed to that module (``Scope.op_where``), phase ``backward``. A submodule's region
was tagged when the submodule returned, so an enclosing module's walk jumps over it instead of
walking it again: the cost no longer grows with the nesting depth, and the tags are the same
(``tests/unit/test_capture.py`` checks them node by node against the plain walk).
"""

from __future__ import annotations

from typing import Any

import torch

from detfp_capture._sources.context import NODE_KEY

__all__ = ["mark_graph", "walks"]

#: On a module's output node: the nodes its tagging walk stopped at (see mark_graph).
_FRONTIER = "detfp_frontier"

#: Serial of the last tagging walk: a module's own walk may jump only over regions walked
#: since its forward began (see mark_graph).
_WALKS = [0]


def mark_graph(outputs: list[torch.Tensor], inputs: list[torch.Tensor], path: str, since: int = -1) -> None:
    """Tag the autograd nodes created inside a module with its path (innermost wins).

    Walks back from the outputs' nodes and stops at the inputs' nodes and at nodes of other
    modules. A submodule's region has been walked already, when its own forward ended; walking
    it again from every enclosing module made the cost grow with the nesting depth. So a
    single-output region keeps, on its output node, where its walk stopped (its frontier:
    exactly the nodes reachable from that node that the walk did not go through), and an
    enclosing walk that reaches the node continues from there. The tags are the same: every
    node in the region is owned by the submodule or one of its own, which an enclosing walk
    goes through without tagging. Only regions walked since this module's forward began
    (``since``, a serial of ``_WALKS``) are jumped over: they were created after this module's
    inputs, so none of its stop nodes lies inside them. An older region (a submodule called
    before, by other code) is walked through as before.
    """
    _WALKS[0] += 1
    serial = _WALKS[0]
    stop = {id(t.grad_fn) for t in inputs if t.grad_fn is not None}
    # Autograd nodes as Any: their ``metadata`` is a dict attribute, which torch's stubs declare
    # as a method.
    entries: list[Any] = [t.grad_fn for t in outputs if t.grad_fn is not None]
    stack: list[Any] = list(entries)
    # Whether this walk tags (and so goes through) the single output node: see the end.
    fresh_entry = len(entries) == 1 and NODE_KEY not in entries[0].metadata
    inner = path + "." if path else ""
    seen: set[int] = set()
    frontier: list[Any] = []
    while stack:
        n = stack.pop()
        if n is None:
            continue
        i = id(n)
        if i in seen:
            continue
        seen.add(i)
        if i in stop:
            frontier.append(n)
            continue
        md = n.metadata
        owner = md.get(NODE_KEY)
        if owner is None:
            md[NODE_KEY] = path
        elif not owner.startswith(inner):
            frontier.append(n)
            continue  # a node of an earlier sibling or an enclosing scope: the module's region ends here
        else:
            jump = md.get(_FRONTIER)
            if jump is not None and jump[0] > since:
                stack.extend(jump[1])
                continue
        for nxt, _ in n.next_functions:
            stack.append(nxt)
    if fresh_entry and id(entries[0]) not in stop:
        # Only a node this walk tagged: one it stopped at (an input passed through, a node of
        # another module) or one a submodule tagged (with its own frontier) leads elsewhere.
        entries[0].metadata[_FRONTIER] = (serial, frontier)


def walks() -> int:
    """Serial of the last tagging walk (a module records it when its forward begins)."""
    return _WALKS[0]
