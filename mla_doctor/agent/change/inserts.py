"""Instrumentation rendered in memory: code blocks inserted by syntax tree at a function's entry,
after an assignment, or at module level, between run markers. Nothing here touches disk.
"""
from __future__ import annotations

import ast
import re

from ..facts.targets import MARK_BEGIN, MARK_END, find_function


def _assign_names(stmt):
    """Names bound by an assignment (through tuples), not names used inside a subscript target."""
    if isinstance(stmt, ast.Assign):
        todo = list(stmt.targets)
    elif isinstance(stmt, (ast.AnnAssign, ast.AugAssign)):
        todo = [stmt.target]
    else:
        return []
    names = []
    while todo:
        t = todo.pop()
        if isinstance(t, ast.Name):
            names.append(t.id)
        elif isinstance(t, (ast.Tuple, ast.List)):
            todo.extend(t.elts)
        elif isinstance(t, ast.Starred):
            todo.append(t.value)
    return names


def _walk_no_defs(node):
    """ast.walk that does not descend into nested functions, lambdas or classes."""
    todo = [node]
    while todo:
        n = todo.pop()
        yield n
        for c in ast.iter_child_nodes(n):
            if not isinstance(c, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
                todo.append(c)


def insertion_point(func, where):
    """(index in the line list to insert at, the statement whose indentation the block takes)."""
    body = func.body
    if where == "entry":
        first = body[0]
        is_doc = (isinstance(first, ast.Expr) and isinstance(getattr(first, "value", None), ast.Constant)
                  and isinstance(first.value.value, str))
        if is_doc and len(body) > 1:
            return body[1].lineno - 1, body[1]
        if is_doc:
            return first.end_lineno, first
        return first.lineno - 1, first
    if where.startswith("after_assign:"):
        # After the last top-level statement of the body that assigns NAME (directly or in a branch):
        # the value is final there whichever branch ran (if/else both assigning, a later override).
        name = where.split(":", 1)[1]
        found = None
        for stmt in body:
            if any(isinstance(n, (ast.Assign, ast.AnnAssign, ast.AugAssign)) and name in _assign_names(n)
                   for n in _walk_no_defs(stmt)):
                found = stmt
        if found is None:
            return None
        return found.end_lineno, found
    raise ValueError("unknown insertion point %r" % where)


def _module_insert_at(tree):
    """After the module docstring and `from __future__` imports (which must stay first)."""
    at = None
    for i, stmt in enumerate(tree.body):
        is_doc = i == 0 and isinstance(stmt, ast.Expr) and isinstance(getattr(stmt, "value", None), ast.Constant) \
            and isinstance(stmt.value.value, str)
        if is_doc or (isinstance(stmt, ast.ImportFrom) and stmt.module == "__future__"):
            at = stmt.end_lineno
            continue
        return at if at is not None else stmt.lineno - 1
    return at or 0


SOURCE_LINE_RE = re.compile(r"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+\Z")


def _starts_line(lines, node):
    """Only whitespace before the statement on its first line (not `def f(): stmt`, not `a; stmt`)."""
    return not lines[node.lineno - 1].encode("utf-8")[:node.col_offset].strip()


def apply_inserts(text, inserts, run_id, path="<patched>"):
    """Insert code blocks by syntax tree; returns (new_text, missing) without touching disk."""
    tree = ast.parse(text, filename=path)
    # lines as the parser counts them: str.splitlines would also split at \f, \v, \x1c-\x1e, \x85, \u2028...
    lines = SOURCE_LINE_RE.findall(text)
    planned = []
    missing = []
    for ins in inserts:
        if ins.get("where") == "module":
            planned.append((_module_insert_at(tree), ["# >>> mla-doctor run %s >>>\n" % run_id] + [
                (ln.rstrip() + "\n") for ln in ins["code"].rstrip("\n").split("\n")] + [
                "# <<< mla-doctor run %s <<<\n" % run_id]))
            continue
        func = find_function(tree, ins["function"])
        if func is None:
            missing.append(ins["function"])
            continue
        pt = insertion_point(func, ins.get("where", "entry"))
        if pt is None:
            missing.append("%s (%s)" % (ins["function"], ins.get("where")))
            continue
        at, anchor = pt
        # `def f(): return x` (also after a multi-line signature), or an entry sharing its line: no safe place
        if not _starts_line(lines, func.body[0]) or (ins.get("where", "entry") == "entry"
                                                      and not _starts_line(lines, anchor)):
            missing.append("%s (body on the def line: no line of its own to insert at)" % ins["function"])
            continue
        first = lines[anchor.lineno - 1]
        indent = first[: len(first) - len(first.lstrip())]
        block = [indent + (MARK_BEGIN % run_id) + "\n"]
        for code_line in ins["code"].rstrip("\n").split("\n"):
            block.append((indent + code_line).rstrip() + "\n")
        block.append(indent + (MARK_END % run_id) + "\n")
        planned.append((at, block))
    if missing:
        return None, missing
    for at, block in sorted(planned, key=lambda x: -x[0]):
        if at > 0 and not lines[at - 1].endswith(("\n", "\r")):
            lines[at - 1] += "\n"
        lines[at:at] = block
    return "".join(lines), []
