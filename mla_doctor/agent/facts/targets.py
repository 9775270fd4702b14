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


# the playbook's decode globs (playbooks/instrument-mla.yaml) cover the shared backend trees; a backend defined in
# a family's package (0.34's opt-in KIMI_K3_KV_BALANCED_MLA under models/kimi_k3/) is probed from the resolution
_PLAYBOOK_DECODE = ("v1/attention/backends/mla/", "model_executor/layers/attention/", "attention/backends/")


def backend_probe_targets(vdir, found, have, families=None):
    """The decode entry of every MLA attention backend (`found`: backends.backends) whose impl lives outside the
    playbook's globs: the served model can take it (opt-in by --attention-backend, or named by its family's
    layer). `families`: the served families' package prefixes (models/kimi_k3/): another family's private
    backend is left out. `have`: the targets already listed (never twice)."""
    seen = {(t["file"], t["class"], t["method"]) for t in have}
    out = []
    for b in found:
        d = b.get("decode") if isinstance(b, dict) else None
        if b.get("kind") != "attention" or not isinstance(d, dict) or not d.get("file") \
                or d["file"].startswith(_PLAYBOOK_DECODE):
            continue
        cls_name, _, meth = str(d.get("symbol")).rpartition(".")
        if not cls_name or (d["file"], cls_name, meth) in seen:
            continue
        if families is not None and d["file"].startswith("models/") and not d["file"].startswith(families):
            continue
        try:
            sha = sha256_hex(read_regular(os.path.join(vdir, d["file"])))
        except OSError:
            continue
        seen.add((d["file"], cls_name, meth))
        out.append({"file": d["file"], "class": cls_name, "method": meth, "line": d.get("line"), "sha256": sha,
                    "role": "decode", "family": d["file"].split("/")[1] if d["file"].startswith("models/") else None,
                    "architecture": None, "platform": "any",
                    "call": "impl.%s" % meth, "call_site": None, "backend": b.get("name")})
    return out
