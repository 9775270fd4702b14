"""Every class of the installed tree that names an MLA (or sparse MLA) backend: `get_name()` returning an MLA
name, and the backend registry enum's members, each with its decode entry located by syntax tree (the impl's
`forward_mqa`/`_forward_decode`, own or inherited; for a model-private backend without an impl, the family
layer that names it as `backend_cls`). Backends no table has heard of are reported all the same.
"""
from __future__ import annotations

import ast
import os
import re

from ..common import read_regular
from .syntax import chain, returned_exprs


_BACKEND_DIRS = ("v1/attention/backends", "attention/backends", "models", "model_executor/layers/attention")


_GET_NAME_MLA = re.compile(rb"def get_name\([^)]*\)[^:]*:\s*(?:(?:\"\"\"|#)[^\n]*\n\s*)*return\s+[\"'][\w]*MLA")


def _str_return(fn):
    for n in ast.walk(fn):
        if isinstance(n, ast.Return) and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str):
            return n.value.value, n.lineno
    return None, None


def _is_mla_name(name):
    return bool(name) and "MLA" in name.upper()


def backends(r):
    """Every class whose get_name() returns an MLA backend name, with its impl's decode entry."""
    src = r.src
    out, seen = [], set()
    enum = _enum_backends(r)
    files = []
    for d in _BACKEND_DIRS:
        root = os.path.join(src.vdir, d)
        for dirpath, _dirs, names in os.walk(root):
            for f in sorted(names):
                if f.endswith(".py"):
                    files.append(os.path.relpath(os.path.join(dirpath, f), src.vdir).replace(os.sep, "/"))
    enum_classes = {(rel, cls) for rel, cls in enum.values()}
    for rel in sorted(set(files)):
        try:
            if not _GET_NAME_MLA.search(read_regular(os.path.join(src.vdir, rel))):
                continue  # parse only the files whose get_name returns an MLA name
        except OSError:
            continue
        m = src.mod(rel)
        if m is None:
            continue
        for node in ast.walk(m.tree):
            if not isinstance(node, ast.ClassDef):
                continue
            gn = next((n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "get_name"), None)
            if gn is None:
                continue
            name, line = _str_return(gn)
            if not _is_mla_name(name) or (name, rel) in seen:
                continue
            if name in enum and (rel, node.name) not in enum_classes:
                continue  # a base or helper class returning a registered name: the enum's class is the backend
            seen.add((name, rel))
            out.append(_backend_item(r, m, node, name, line, name in enum))
    # a base class returning a concrete backend's name (pre-0.11 MLACommonBackend -> "TRITON_MLA"), no impl of its own
    named = {b["name"] for b in out if b.get("decode")}
    out = [b for b in out if b.get("decode") or b["name"] not in named or b.get("kind") == "prefill"]
    for name, (rel, clsname) in sorted(enum.items()):
        if any(b["name"] == name for b in out) or not _is_mla_name(name):
            continue
        m = src.mod(rel) if rel else None
        node = None
        if m is not None:
            node = next((n for n in ast.walk(m.tree) if isinstance(n, ast.ClassDef) and n.name == clsname), None)
        if node is None:
            out.append({"name": name, "file": rel, "class": clsname, "enum": True, "decode": None,
                        "note": "the backend enum names a class not found in this tree"})
            continue
        out.append(_backend_item(r, m, node, name, None, True))
    return out


def _backend_item(r, m, node, name, line, in_enum):
    item = {"name": name, "file": m.rel, "class": node.name, "line": node.lineno, "get_name_line": line,
            "enum": in_enum, "decode": None, "kind": "prefill" if "/prefill/" in m.rel else "attention"}
    if item["kind"] == "prefill":
        item["note"] = "an MLA prefill backend (no decode entry)"
        return item
    gi = next((n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "get_impl_cls"), None)
    if gi is None:
        found = r.src.method(m, node, "get_impl_cls")
        gi = found[2] if found else None
        gm = found[0] if found else m
    else:
        gm = m
    impls = []
    if gi is not None:
        local = {}  # `from ... import Impl` inside get_impl_cls (a lazy import)
        for n in ast.walk(gi):
            if isinstance(n, ast.ImportFrom):
                target = r.src.rel_of(n.module or "", gm.rel, n.level)
                for a in n.names:
                    local[a.asname or a.name] = (target, a.name)
        for ret, _cond in returned_exprs(gi.body, gm):
            if isinstance(ret, ast.Name) and ret.id in local and local[ret.id][0]:
                impls.extend(it for it in r.src.lookup(local[ret.id][0], local[ret.id][1]) if it[0] == "class")
            else:
                impls.extend(it for it in r.src.class_expr(gm, ret, {}) if it[0] == "class")
    if not impls:
        item["decode"] = _layer_decode(r, item)
        item["note"] = ("no impl: run by the family layer %s" % item["decode"]["layer"] if item["decode"] else
                        "no get_impl_cls, and no family layer naming it as backend_cls")
        return item
    im, ic = impls[0][1], impls[0][2]
    item["impl"] = {"file": im.rel, "class": ic.name, "line": ic.lineno}
    for ent in ("forward_mqa", "_forward_decode", "forward"):
        found = r.src.method(im, ic, ent)
        if found:
            fm, owner, fn = found
            item["decode"] = {"file": fm.rel, "symbol": "%s.%s" % (owner.name, fn.name), "line": fn.lineno,
                              "inherited": owner.name != ic.name}
            break
    return item


def _enum_backends(r):
    """The backend registry enum (v1/attention/backends/registry.py): NAME -> (file, class)."""
    out = {}
    for rel in ("v1/attention/backends/registry.py", "attention/backends/registry.py"):
        m = r.src.mod(rel) if r.src.isfile(rel) else None
        if m is None:
            continue
        for node in ast.walk(m.tree):
            if not isinstance(node, ast.ClassDef) or "Enum" not in node.name:
                continue
            for st in node.body:
                if (isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Name)
                        and isinstance(st.value, ast.Constant) and isinstance(st.value.value, str)
                        and "." in st.value.value):
                    mod, _, cls = st.value.value.rpartition(".")
                    out[st.targets[0].id] = (r.src.rel_of(mod), cls)
    return out


def _layer_decode(r, item):
    """A model-private backend without get_impl_cls: the family layer holding `backend_cls = <it>` runs it; its
    forward_mqa (own or inherited) is the decode entry."""
    parts = item["file"].split("/")
    if len(parts) < 3 or parts[0] != "models":
        return None
    root = os.path.join(r.src.vdir, "models", parts[1])
    for dirpath, _dirs, names in os.walk(root):
        for f in sorted(names):
            if not f.endswith(".py"):
                continue
            rel = os.path.relpath(os.path.join(dirpath, f), r.src.vdir).replace(os.sep, "/")
            try:
                data = read_regular(os.path.join(r.src.vdir, rel))
            except OSError:
                continue
            if b"backend_cls" not in data or item["class"].encode() not in data:
                continue
            m = r.src.mod(rel)
            for node in ast.walk(m.tree) if m is not None else ():
                if not isinstance(node, ast.ClassDef):
                    continue
                for st in node.body:
                    if (isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Name)
                            and st.targets[0].id == "backend_cls" and isinstance(st.value, ast.Name)
                            and st.value.id == item["class"]):
                        found = r.src.method(m, node, "forward_mqa")
                        if found:
                            fm, owner, fn = found
                            return {"file": fm.rel, "symbol": "%s.%s" % (owner.name, fn.name), "line": fn.lineno,
                                    "inherited": owner.name != node.name,
                                    "layer": "%s (vllm/%s:%s)" % (node.name, m.rel, node.lineno)}
    return None


def _backend_of_class(src, m, expr):
    """The backend a class expression stands for: {name, class, file, line, get_name_line}, or None."""
    for it in src.class_expr(m, expr, {}):
        if it[0] != "class":
            continue
        found = src.method(it[1], it[2], "get_name")
        name, line = _str_return(found[2]) if found else (None, None)
        if name:
            return {"name": name, "class": it[2].name, "file": it[1].rel, "line": it[2].lineno,
                    "get_name_file": found[0].rel, "get_name_line": line}
    return None


def _named_backend(src, m, cls):
    """(how, mod, expression, line) of the backend a class names: `backend_cls = X` or `get_attn_backend()`
    returning X (or `self.<attr>`, then that class attribute), the most derived class of the MRO first."""
    for mm, c in src.mro(m, cls):
        for n in c.body:
            if (isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name)
                    and n.targets[0].id == "backend_cls"):
                return "backend_cls", mm, n.value, n.lineno
            if isinstance(n, ast.FunctionDef) and n.name == "get_attn_backend":
                for ret, _cond in returned_exprs(n.body, mm):
                    if isinstance(ret, ast.Attribute) and isinstance(ret.value, ast.Name) and ret.value.id == "self":
                        got = _attr_assign(src, m, cls, ret.attr)
                        if got:
                            return "get_attn_backend -> self.%s" % ret.attr, got[0], got[1], got[2]
                        continue
                    return "get_attn_backend", mm, ret, ret.lineno
    return None


def _attr_assign(src, m, cls, name):
    """A class-level `name = Expr` (own or inherited, the most derived first): (mod, expr, line)."""
    for mm, c in src.mro(m, cls):
        for n in c.body:
            if (isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name)
                    and n.targets[0].id == name):
                return mm, n.value, n.lineno
    return None


def layer_backends(src, m, cls):
    """The family layer's own backend, read from its code: {"backend": {name, class, file, line, get_name_line,
    named_by, named_at} or None, "other_backends": [...]}. Others: `*_backend_cls = X` class attributes (the SWA
    cache's) and the classes its `__init__` swaps in (`self.indexer.k_cache.__class__ = C`, DeepSeek V4 on CPU)
    that name a backend through `get_attn_backend()`."""
    out = {"backend": None, "other_backends": []}
    got = _named_backend(src, m, cls)
    if got:
        be = _backend_of_class(src, got[1], got[2])
        if be:
            out["backend"] = dict(be, named_by=got[0], named_at="%s:%s" % (got[1].rel, got[3]))
    seen = {(out["backend"] or {}).get("class")}
    for mm, c in src.mro(m, cls):
        for n in c.body:
            if (isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name)
                    and n.targets[0].id.endswith("_backend_cls")):
                be = _backend_of_class(src, mm, n.value)
                if be and be["class"] not in seen:
                    seen.add(be["class"])
                    out["other_backends"].append(dict(be, named_by=n.targets[0].id,
                                                      named_at="%s:%s" % (mm.rel, n.lineno)))
            if not (isinstance(n, ast.FunctionDef) and n.name == "__init__"):
                continue
            for st in ast.walk(n):
                t = st.targets[0] if isinstance(st, ast.Assign) and len(st.targets) == 1 else None
                if not (isinstance(t, ast.Attribute) and t.attr == "__class__"):
                    continue
                for it in src.class_expr(mm, st.value, {}):
                    nb = _named_backend(src, it[1], it[2]) if it[0] == "class" else None
                    be = _backend_of_class(src, nb[1], nb[2]) if nb else None
                    if be and be["class"] not in seen:
                        seen.add(be["class"])
                        target = ".".join((chain(t.value) or ["?"]) + ["__class__"])
                        out["other_backends"].append(dict(
                            be, named_by="%s (%s = %s, %s:%s)" % (nb[0], target, it[2].name, mm.rel, st.lineno),
                            named_at="%s:%s" % (nb[1].rel, nb[3])))
                    break
    return out

