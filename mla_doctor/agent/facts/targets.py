"""Instrumentation targets resolved read-only: file globs and `*.method` wildcards expanded into
concrete (file, Class.method, line) with the file's hash, by syntax tree.
"""
from __future__ import annotations

import ast
import glob
import os
import re

from ..common import read_regular, sha256_hex

# The marks around every block a run inserts (written by change/inserts.py, told from other edits by integrity.py).
MARK_BEGIN = "# >>> mla-doctor run %s >>>"
MARK_END = "# <<< mla-doctor run %s <<<"
MARK_RE = re.compile(r"# >>> mla-doctor run ([A-Za-z0-9_.-]+) >>>")


def find_function(tree, qualname):
    parts = qualname.split(".")
    body = tree.body
    node = None
    for i, name in enumerate(parts):
        node = None
        for n in body:
            want_cls = i < len(parts) - 1
            if want_cls and isinstance(n, ast.ClassDef) and n.name == name:
                node = n
                break
            if not want_cls and isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name:
                node = n
                break
        if node is None:
            return None
        body = node.body
    return node


def resolve_targets(vdir, targets):
    """Expand file globs and `*.method` wildcards into concrete (file, Class.method) with file hashes."""
    trees = {}
    out = []
    for t in targets:
        files = []
        for pat in t.get("files") or []:
            for p in sorted(glob.glob(os.path.join(vdir, pat))):
                if p not in files and os.path.isfile(p):
                    files.append(p)
        matches = []
        fn = t.get("function") or ""
        for path in files:
            if path not in trees:
                try:
                    data = read_regular(path)
                    trees[path] = (ast.parse(data.decode("utf-8")), sha256_hex(data))
                except (OSError, SyntaxError, ValueError) as e:
                    trees[path] = (None, str(e))
            tree, sha = trees[path]
            if tree is None:
                continue
            rel = os.path.relpath(path, vdir).replace(os.sep, "/")
            if fn.startswith("*."):
                meth = fn[2:]
                for node in tree.body:
                    if isinstance(node, ast.ClassDef):
                        for sub in node.body:
                            if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)) and sub.name == meth:
                                matches.append({"rel": rel, "function": node.name + "." + meth, "line": sub.lineno,
                                                "sha256": sha})
            else:
                node = find_function(tree, fn)
                if node is not None:
                    matches.append({"rel": rel, "function": fn, "line": node.lineno, "sha256": sha})
        out.append({"key": t.get("key"), "files_found": [os.path.relpath(p, vdir) for p in files],
                    "matches": matches})
    return out
