"""The symbol index of named source files: definitions by qualified name (ast, or an indentation-based
fallback for syntax this interpreter cannot parse) and pattern matches as [line, text].
"""
from __future__ import annotations

import ast
import gc
import hashlib
import os
import re
import sys

from ..common import ScanBudget, read_static, unread_why


def _index_defs(tree):
    """Classes and functions by qualified name; visits statement bodies only (10x faster than NodeVisitor)."""
    defs, classes = {}, {}
    todo = [(tree.body, "")]
    while todo:
        body, prefix = todo.pop()
        for node in body:
            if isinstance(node, ast.ClassDef):
                q = prefix + node.name
                bases = []
                for b in node.bases:
                    seg = b
                    while isinstance(seg, ast.Subscript):
                        seg = seg.value
                    if isinstance(seg, ast.Name):
                        bases.append(seg.id)
                    elif isinstance(seg, ast.Attribute):
                        bases.append(seg.attr)
                classes[q] = {"line": node.lineno, "bases": bases}
                todo.append((node.body, q + "."))
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                q = prefix + node.name
                if q not in defs or node.lineno < defs[q]:
                    defs[q] = node.lineno  # the def line (not a decorator's), as grep -n shows it
                todo.append((node.body, q + "."))
            else:
                for field in ("body", "orelse", "finalbody", "handlers"):
                    sub = getattr(node, field, None)
                    if isinstance(sub, list) and sub and isinstance(sub[0], ast.AST):
                        todo.append((sub, prefix))
    return defs, classes


_DEF_RE = re.compile(r"^(?P<ind>[ \t]*)(?:async[ \t]+)?(?P<kw>def|class)[ \t]+(?P<name>\w+)")


def _regex_index(text):
    """Indentation-based fallback when this interpreter cannot parse the file (newer syntax)."""
    defs, classes, stack = {}, {}, []
    for i, line in enumerate(text.splitlines(), 1):
        m = _DEF_RE.match(line)
        if not m:
            continue
        ind = len(m.group("ind").expandtabs())
        while stack and stack[-1][0] >= ind:
            stack.pop()
        q = ".".join([s[1] for s in stack] + [m.group("name")])
        if m.group("kw") == "class":
            classes[q] = {"line": i, "bases": []}
        else:
            defs.setdefault(q, i)
        stack.append((ind, m.group("name")))
    return defs, classes


def _pattern_matches(text, patterns):
    """pattern id -> [[line, text], ...] (at most 50, one per line) for the patterns that match; line numbers
    are counted only up to a match, so a file where nothing matches costs one search per pattern."""
    matches = {}
    for pid, rx in patterns.items():
        try:
            r = re.compile(rx, re.MULTILINE)
        except re.error as e:
            matches[pid] = {"error": str(e)}
            continue
        found, last, line, pos = [], -1, 1, 0
        for m in r.finditer(text):
            start = m.start()
            line += text.count("\n", pos, start)
            pos = start
            if line != last:
                begin = text.rfind("\n", 0, start) + 1
                end = text.find("\n", start)
                found.append([line, text[begin: end if end >= 0 else len(text)].strip()[:240]])
                last = line
            if len(found) >= 50:
                break
        if found:
            matches[pid] = found
    return matches


def index_file(path, patterns, known=None, budget=None, base=None):
    """Definitions (qualified name -> line) and pattern matches ([line, text]) of one source file. Where the
    controller holds the parse of this very content (`known`: digest prefixes, remote/parse_cache.py), the
    definitions are left to it: parser "cached", no syntax tree built."""
    try:  # the install is the service user's: never through a symlink, never a huge or sparse file
        data = read_static(path, budget, base=base)
    except OSError as e:
        return {"exists": os.path.lexists(path), "error": unread_why(e)}
    text = data.decode("utf-8", "replace")
    out = {"exists": True, "sha256": hashlib.sha256(data).hexdigest(), "lines": text.count("\n") + 1}
    if known and out["sha256"][:16] in known:
        out["parser"] = "cached"
        out["matches"] = _pattern_matches(text, patterns) if patterns else {}
        return out
    try:
        defs, classes = _index_defs(ast.parse(text, filename=path))
        out.update(parser="ast", defs=defs, classes=classes)
    except (SyntaxError, ValueError) as e:
        defs, classes = _regex_index(text)
        out.update(parser="regex", parse_error=str(e), defs=defs, classes=classes)
    out["matches"] = _pattern_matches(text, patterns) if patterns else {}
    return out


def index_tree(vdir, request):
    """Index the files a plan names (paths relative to the vllm package dir). With "pairs" ({file: [pattern
    id, ...]}) a file is searched only for the patterns named for it; without, for every pattern. The
    collector is off meanwhile: the syntax trees are many small objects and hold no cycles worth collecting."""
    files = {}
    patterns = request.get("patterns") or {}
    pairs = request.get("pairs")
    known = (request.get("known") or {}).get("%d.%d" % sys.version_info[:2]) or {}
    budget = ScanBudget()
    enabled = gc.isenabled()
    gc.disable()
    try:
        for rel in request.get("files") or []:
            full = os.path.join(vdir, rel)
            if os.path.islink(full) or os.path.isfile(full):  # a link: reported by index_file, not followed
                mine = patterns if pairs is None else {p: patterns[p] for p in pairs.get(rel) or () if p in patterns}
                files[rel] = index_file(full, mine, known.get(rel), budget, vdir)
            else:
                files[rel] = {"exists": False}
    finally:
        if enabled:
            gc.enable()
    return files


_RELEASE_RE = re.compile(r"(\d+(?:\.\d+)+)(.?)")


def _release_tuple(version):
    """The release of a version string as the controller's packaging reads it (0.32.0+cpu, 0.11.0rc1 ->
    release numbers, trailing zeros dropped), or None where this plain reading could differ from it (no
    version, a leading v or blank, an epoch "1!", a one-number version)."""
    m = _RELEASE_RE.match(version or "")
    if not m or m.group(2) == "!":
        return None
    rel = [int(x) for x in m.group(1).split(".")]
    while len(rel) > 1 and rel[-1] == 0:
        rel.pop()
    return tuple(rel)


def _defs_of(info, rel, known):
    """A file's definitions, or for a file left to the controller's cache the names it holds of them whose
    leaf is searched (all the three checks below can look up); any line number will do here."""
    if not isinstance(info, dict):
        return {}
    if info.get("parser") == "cached":
        return dict.fromkeys(((known.get(rel) or {}).get(info.get("sha256", "")[:16]) or ()), 1)
    return info.get("defs") or {}


def _resolved(index, path, sym, known):
    """The knowledge's entry is found without a tree-wide search: the same three checks, in the same terms,
    as the controller's static_facts._resolve makes before it reads scan.symbol_hits."""
    info = index.get(path) or {}
    defs = _defs_of(info, path, known)
    if info.get("exists") and defs.get(sym):
        return True
    if any(_defs_of(inf, f, known).get(sym) for f, inf in index.items() if f != path):
        return True
    leaf, depth = sym.rsplit(".", 1)[-1], sym.count(".")
    return bool(info.get("exists")) and any(q.rsplit(".", 1)[-1] == leaf and q.count(".") == depth for q in defs)


def symbols_to_search(symbols, needs, version, index, known=None):
    """The symbols whose `def` must be searched in every file: those of an entry of this release
    (diagnosis/symbol_needs.py's table) that the indexed files do not decide. Without a table, or for a
    version this cannot place, every symbol (what was always searched)."""
    try:
        return _to_search(symbols, needs, version, index,
                          (known or {}).get("%d.%d" % sys.version_info[:2]) or {})
    except (KeyError, IndexError, TypeError, ValueError, AttributeError):  # a malformed table: search all
        return list(symbols or [])


def _to_search(symbols, needs, version, index, known):
    rel = _release_tuple(version)
    if not needs or not symbols or rel is None or not isinstance(index, dict):
        return list(symbols or [])
    bounds = [tuple(b) for b in needs["bounds"]]
    k = 0
    for i, b in enumerate(bounds):
        if rel == b:
            k = 2 * i + 1
            break
        if rel < b:
            break
        k = 2 * i + 2
    needed = set()
    for n in needs["classes"][k]:
        path, sym = needs["entries"][n]
        if not _resolved(index, path, sym, known):
            needed.add(sym.rsplit(".", 1)[-1])
    return [s for s in symbols if s in needed]
