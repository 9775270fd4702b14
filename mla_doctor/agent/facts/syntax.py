"""Syntax-tree helpers both the attention-path resolver (resolve.py) and the backend finder (backends.py) read
with: they live here so neither module imports the other's internals (no import cycle)."""
from __future__ import annotations

import ast


def returned_exprs(body, m, cond=None):
    """(returned expression, the enclosing `if` line) of a function body."""
    out = []
    for node in body:
        if isinstance(node, ast.Return) and node.value is not None:
            out.append((node.value, cond))
        elif isinstance(node, ast.If):
            t = m.text_of(node)
            out.extend(returned_exprs(node.body, m, t))
            out.extend(returned_exprs(node.orelse, m, ("else of: " + t) if node.orelse else cond))
        elif isinstance(node, (ast.For, ast.While, ast.With, ast.Try)):
            for f in ("body", "orelse", "finalbody"):
                out.extend(returned_exprs(getattr(node, f, []) or [], m, cond))
            for h in getattr(node, "handlers", []) or []:
                out.extend(returned_exprs(h.body, m, cond))
    return out


def chain(expr):
    """`self.impl.forward_mqa` -> ["self", "impl", "forward_mqa"] (None when not a plain dotted name)."""
    parts = []
    while isinstance(expr, ast.Attribute):
        parts.append(expr.attr)
        expr = expr.value
    if isinstance(expr, ast.Name):
        parts.append(expr.id)
        return parts[::-1]
    return None
