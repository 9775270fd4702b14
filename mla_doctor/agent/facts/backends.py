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
from .resolve import returned_exprs


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
