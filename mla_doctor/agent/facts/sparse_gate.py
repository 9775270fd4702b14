"""The test a model's code makes on `index_topk` to build its sparse (DSA) attention (issue 28): DeepSeek V3.2's
`self.is_v32 = hasattr(config, "index_topk")` (any value, null included, is sparse) or Mistral Large 4's
`use_sparse = getattr(config, "index_topk", None) is not None` (null is dense), read from the served
architecture's own files, never assumed. By syntax tree, nothing imported (resolve.py calls this per architecture)."""
from __future__ import annotations

import ast
import os

from ..common import read_regular
from .syntax import chain

KEY = "index_topk"
MAX_FILES = 64  # a family package's files (Mistral's: ~20): enough, and bounded
MAX_SIZE = 4 * 1024 * 1024


def _is_config(e):
    return (chain(e) or [""])[-1].endswith("config")


def _call(n, name):
    """`name(<...config>, "index_topk", ...)`"""
    return (isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == name and len(n.args) >= 2
            and _is_config(n.args[0]) and isinstance(n.args[1], ast.Constant) and n.args[1].value == KEY)


def _is_none(e):
    return isinstance(e, ast.Constant) and e.value is None


def gates_in(tree):
    """[(line, kind, text)] of the index_topk tests in one module: kind "present" (hasattr: the key, any value)
    or "not_none" (getattr(..., None) is not None, or config.index_topk is not None: null is dense)."""
    out = []
    for n in ast.walk(tree):
        if _call(n, "hasattr"):
            out.append((n.lineno, "present", 'hasattr(config, "%s")' % KEY))
        elif isinstance(n, ast.Compare) and len(n.ops) == 1 and isinstance(n.ops[0], ast.IsNot) \
                and _is_none(n.comparators[0]):
            left = n.left
            if _call(left, "getattr") and (len(left.args) < 3 or _is_none(left.args[2])):
                out.append((n.lineno, "not_none", 'getattr(config, "%s", None) is not None' % KEY))
            elif isinstance(left, ast.Attribute) and left.attr == KEY and _is_config(left.value):
                out.append((n.lineno, "not_none", "config.%s is not None" % KEY))
    return sorted(out)


def _files(vdir, rels):
    """The given files, each family package's (models/<family>/...) whole tree, first given first."""
    seen = []
    for rel in rels:
        if not rel:
            continue
        if rel not in seen:
            seen.append(rel)
        parts = rel.split("/")
        if parts[0] == "models" and len(parts) > 2:  # a model-private family: its package holds the gate
            root = os.path.join(vdir, parts[0], parts[1])
            for d, subs, names in os.walk(root):
                subs.sort()
                for f in sorted(names):
                    if f.endswith(".py"):
                        r = os.path.relpath(os.path.join(d, f), vdir).replace(os.sep, "/")
                        if r not in seen:
                            seen.append(r)
    return seen[:MAX_FILES]


def sparse_gate(vdir, rels):
    """{kind, text, file, line, others} of the first index_topk test in the architecture's files (`rels`: its
    module, its model and layer classes' files, in that order; a family package's tree too), or None when none
    tests it. `others`: the further tests, "file:line kind" (a family whose files disagree says so)."""
    found = []
    for rel in _files(vdir, rels):
        try:
            data = read_regular(os.path.join(vdir, rel), max_size=MAX_SIZE)
        except OSError:
            continue
        if KEY.encode() not in data:
            continue
        try:
            tree = ast.parse(data)
        except (SyntaxError, ValueError):
            continue
        found += [(rel, line, kind, text) for line, kind, text in gates_in(tree)]
    if not found:
        return None
    rel, line, kind, text = found[0]
    return {"kind": kind, "text": text, "file": rel, "line": line,
            "others": ["vllm/%s:%s %s" % (r, ln, k) for r, ln, k, _ in found[1:] if k != kind][:8]}
