"""The classes of a real vLLM release's sources, read with ``ast`` (never imported): what the corpus tier checks
the knowledge's backends against — MLA ``*Impl`` classes with a decode entry, each backend class's ``get_name`` and
builder, and each metadata builder's CUDA-graph support level (``AttentionCGSupport``), inheritance resolved by
class name inside the release.

The index of one release is cached as JSON beside the other derived corpus data (``corpus.cached_json``), keyed by
this file's source, so the corpus tier parses each release once.
"""
from __future__ import annotations

import ast
import inspect
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

from tests.support import corpus

DECODE_METHODS = ("forward_mqa", "_forward_decode")
# methods whose `return` values are kept (as source text): enough to resolve a backend's name, builder and impl
_RETURNS = ("get_name", "get_builder_cls", "get_impl_cls", "get_cudagraph_support")
_CG_ATTRS = ("cudagraph_support", "_cudagraph_support")
# a module that defines none of these words holds no class the corpus checks care about (cheap pre-filter)
_WORDS = ("Impl", "Backend", "Builder", "cudagraph_support")


def _base_name(node: ast.expr) -> Optional[str]:
    if isinstance(node, ast.Subscript):  # MLACommonImpl[FlashMLAMetadata]
        node = node.value
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _class_record(node: ast.ClassDef, rel: str) -> dict:
    methods, returns, cg = [], {}, None
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            methods.append(item.name)
            if item.name in _RETURNS:
                returns[item.name] = [ast.unparse(r.value) for r in ast.walk(item)
                                      if isinstance(r, ast.Return) and r.value is not None]
        targets = (item.targets if isinstance(item, ast.Assign)
                   else [item.target] if isinstance(item, ast.AnnAssign) and item.value is not None else [])
        for t in targets:
            if isinstance(t, ast.Name) and t.id in _CG_ATTRS:
                cg = ast.unparse(item.value)
    return {"name": node.name, "file": rel, "line": node.lineno, "bases": [_base_name(b) for b in node.bases],
            "methods": methods, "returns": returns, "cg": cg}


def _imports(tree: ast.Module) -> Dict[str, str]:
    """``{name: module}`` of the module's ``from vllm.x import Name`` statements (to resolve base classes)."""
    out = {}
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and n.module and n.module.startswith("vllm.") and not n.level:
            for a in n.names:
                out[a.asname or a.name] = n.module[len("vllm."):]
    return out


def scan_tree(vllm_dir: Path) -> dict:
    """Every class (top level and nested) of the ``vllm/`` tree that may matter, as plain records, and each such
    module's imports of names from other vllm modules."""
    out, imports = [], {}
    for path in sorted(vllm_dir.rglob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        if not any(w in text for w in _WORDS):
            continue
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        rel = path.relative_to(vllm_dir).as_posix()
        out.extend(_class_record(n, rel) for n in ast.walk(tree) if isinstance(n, ast.ClassDef))
        imports[rel] = _imports(tree)
    return {"classes": out, "imports": imports}


# the cache key: the scanning code only (a change to the lookups below needs no rescan)
_SRC = "".join(inspect.getsource(f) for f in (_base_name, _class_record, _imports, scan_tree)) + repr(
    (_RETURNS, _CG_ATTRS, _WORDS))


class Release:
    """The class index of one release, with name-based inheritance lookups."""

    def __init__(self, dist: str, version: str):
        self.dist, self.version = dist, version
        self.vllm = corpus.ensure(dist, version) / "vllm"
        doc = corpus.cached_json("vllm-classes", dist, version, _SRC, lambda: scan_tree(self.vllm))
        self.by_name: Dict[str, List[dict]] = {}
        for r in doc["classes"]:
            self.by_name.setdefault(r["name"], []).append(r)
        self.records, self.imports = doc["classes"], doc["imports"]

    def lookup(self, name: Optional[str], near: str = "") -> Optional[dict]:
        """The class called ``name`` as module ``near`` sees it: its own, else the module it imports the name
        from, else any (names repeat across modules: V0 and V1 both have an ``AttentionMetadataBuilder``)."""
        cands = self.by_name.get(name or "") or []
        mod = self.imports.get(near, {}).get(name or "", "").replace(".", "/")
        want = (near, mod + ".py", mod + "/__init__.py")
        return sorted(cands, key=lambda r: next((i for i, w in enumerate(want) if r["file"] == w), 9))[0] \
            if cands else None

    def mro(self, rec: dict) -> Iterator[dict]:
        """``rec`` and its bases depth-first, left to right, each class once (Python's MRO for the trees here)."""
        seen, stack = set(), [rec]
        while stack:
            r = stack.pop(0)
            key = (r["name"], r["file"])
            if key in seen:
                continue
            seen.add(key)
            yield r
            bases = [self.lookup(b, r["file"]) for b in r["bases"]]
            stack[0:0] = [b for b in bases if b is not None]

    def defining(self, rec: dict, method: str) -> Optional[dict]:
        """The class whose ``method`` ``rec`` uses (itself or the first base that defines it)."""
        return next((r for r in self.mro(rec) if method in r["methods"]), None)

    def returns(self, rec: dict, method: str) -> List[str]:
        d = self.defining(rec, method)
        return (d or {}).get("returns", {}).get(method, [])

    def impls_with_decode(self) -> List[Tuple[dict, str, dict]]:
        """``(class, decode method, defining class)`` for every ``*Impl`` that defines or inherits a decode entry."""
        out = []
        for r in self.records:
            if not r["name"].endswith("Impl"):
                continue
            for m in DECODE_METHODS:
                d = self.defining(r, m)
                if d is not None:
                    out.append((r, m, d))
                    break
        return out

    def _cg_attr(self, builder: dict) -> Tuple[Optional[str], Optional[dict]]:
        r = next((r for r in self.mro(builder) if r["cg"]), None)
        return (r["cg"].rsplit(".", 1)[-1], r) if r else (None, None)

    def cudagraph_support(self, builder: dict) -> Tuple[Optional[str], List[str], Optional[dict]]:
        """What a metadata builder declares as ``AttentionCGSupport``: (the level it reports by default, every
        level it can report, the class that decides). The default is its own or inherited class attribute, or the
        one level its ``get_cudagraph_support`` returns; a method returning several levels by configuration
        has the class attribute it falls back to as default (None when it has none). ``(None, [], None)``
        when nothing in its bases declares a level (releases before the levels existed)."""
        for r in self.mro(builder):
            rets = r["returns"].get("get_cudagraph_support")
            if rets and not all(x == "cls._cudagraph_support" for x in rets):
                vals = {x.rsplit(".", 1)[-1] for x in rets if x.startswith("AttentionCGSupport.")}
                default = None
                if "cls._cudagraph_support" in rets:
                    default, _ = self._cg_attr(builder)
                    vals.add(default)
                elif len(vals) == 1:
                    default = next(iter(vals))
                return default, sorted(v for v in vals if v), r
            if r["cg"]:
                level = r["cg"].rsplit(".", 1)[-1]
                return level, [level], r
        return None, [], None

    def backend_class(self, file: str, get_name: str, impl: str, method: str) -> List[dict]:
        """The ``*Backend`` classes whose ``get_name()`` returns ``get_name`` and whose ``get_impl_cls()`` returns
        ``impl`` — or a class of ``file`` that uses ``impl``'s ``method`` (a knowledge entry with ``def_file``)."""
        accept = {impl} | {r["name"] for r in self.records if r["file"] == file
                           and (self.defining(r, method) or {}).get("name") == impl}
        out = []
        for r in self.records:
            if not r["name"].endswith("Backend"):
                continue
            if get_name not in [x.strip("'\"") for x in self.returns(r, "get_name")]:
                continue
            if accept & set(self.returns(r, "get_impl_cls")):
                out.append(r)
        return out

    def builder_of(self, backend: dict) -> Optional[dict]:
        names = self.returns(backend, "get_builder_cls")
        d = self.defining(backend, "get_builder_cls")
        return self.lookup(names[0], d["file"]) if names and d else None
