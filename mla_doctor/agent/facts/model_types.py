"""The MLA model types as the installed release states them: the `model_type in (...)` tuples of its own
`is_deepseek_mla` (issue 28), read by syntax tree, nothing imported.

A release the tool was built without (0.34.0 added `mistral_large_4`) is classified from this list, never from
the tool's table; the table keeps only what code cannot say.
"""
from __future__ import annotations

import ast

from ..common import read_regular
from .syntax import chain

# where each release line defines it (the first file holding a def that compares model_type wins: from 0.15
# config/model.py's is_deepseek_mla only forwards to the convertor's)
CANDIDATES = ("transformers_utils/model_arch_config_convertor.py", "config/model.py", "config/__init__.py",
              "config.py")
FUNCTION = "is_deepseek_mla"


def _strings(node):
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        vals = [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
        return vals if len(vals) == len(node.elts) else None
    return None


def _read(vdir, rel):
    import os

    path = os.path.join(vdir, rel)
    if not os.path.isfile(path):
        return None
    try:
        return ast.parse(read_regular(path).decode("utf-8", "replace"))
    except (OSError, SyntaxError, ValueError):
        return None


def mla_model_types(vdir):
    """{file, line, symbol, types, eagle_targets, eagle_line} from the first candidate file whose
    `is_deepseek_mla` compares `model_type` against a literal list; None when no such def is found."""
    for rel in CANDIDATES:
        tree = _read(vdir, rel)
        if tree is None:
            continue
        for cls in [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]:
            for fn in cls.body:
                if not (isinstance(fn, ast.FunctionDef) and fn.name == FUNCTION):
                    continue
                types, eagle, line, eline = [], [], None, None
                for n in ast.walk(fn):
                    if not (isinstance(n, ast.Compare) and len(n.ops) == 1 and isinstance(n.ops[0], ast.In)):
                        continue
                    left = chain(n.left) or []
                    vals = _strings(n.comparators[0])
                    if not left or left[-1] != "model_type" or vals is None:
                        continue
                    # `hf_text_config.model.model_type in (...)`: an EAGLE draft's target types
                    if "model" in left[:-1]:
                        eagle.extend(v for v in vals if v not in eagle)
                        eline = eline or n.lineno
                    else:
                        types.extend(v for v in vals if v not in types)
                        line = line or n.lineno
                if types:
                    return {"file": rel, "line": line, "def_line": fn.lineno,
                            "symbol": "%s.%s" % (cls.name, FUNCTION), "types": types,
                            "eagle_targets": eagle, "eagle_line": eline}
    return None


ATTENTION_CONFIG = "config/attention.py"
SPLIT_FILE = "model_executor/layers/attention/mla_attention.py"


def _constant(node):
    """A field's literal default: `x: bool = True`, `x: int = Field(default=1024, ge=1)`; else a sentinel."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Call) and (chain(node.func) or [""])[-1] == "Field":
        for k in node.keywords:
            if k.arg == "default" and isinstance(k.value, ast.Constant):
                return k.value.value
    return _NONE


_NONE = object()


def _source(vdir, rel, node):
    """The source text of an expression (ast.unparse is 3.9+: the agent runs on 3.8)."""
    import os

    try:
        lines = read_regular(os.path.join(vdir, rel)).decode("utf-8", "replace").splitlines()
    except OSError:
        return ""
    if node.lineno != getattr(node, "end_lineno", node.lineno):
        return " ".join(ln.strip() for ln in lines[node.lineno - 1:node.end_lineno])
    return lines[node.lineno - 1][node.col_offset:node.end_col_offset]


def routing_code(vdir):
    """What changes routing, as the installed release states it (issue 28: 0.34's default-on
    `sparse_mla_shard_q` sends a sparse prefill under TP through forward_mqa): the literal defaults of
    AttentionConfig's fields ({name: {value, line}}, config/attention.py) and the `return False` gates of
    MLAAttention._use_sparse_mha ([{test, line}]). None for what the release does not have."""
    out = {"attention_config": None, "sparse_mha_gates": None}
    tree = _read(vdir, ATTENTION_CONFIG)
    if tree is not None:
        for cls in ast.walk(tree):
            if isinstance(cls, ast.ClassDef) and cls.name == "AttentionConfig":
                fields = {}
                for n in cls.body:
                    if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and n.value is not None:
                        v = _constant(n.value)
                        if v is not _NONE:
                            fields[n.target.id] = {"value": v, "line": n.lineno}
                out["attention_config"] = {"file": ATTENTION_CONFIG, "fields": fields}
    tree = _read(vdir, SPLIT_FILE)
    if tree is not None:
        for fn in ast.walk(tree):
            if isinstance(fn, ast.FunctionDef) and fn.name == "_use_sparse_mha":
                gates = []
                for st in fn.body:
                    if isinstance(st, ast.If) and len(st.body) == 1 and isinstance(st.body[0], ast.Return) \
                            and isinstance(st.body[0].value, ast.Constant) and st.body[0].value.value is False:
                        gates.append({"test": _source(vdir, SPLIT_FILE, st.test), "line": st.lineno})
                out["sparse_mha_gates"] = {"file": SPLIT_FILE, "def_line": fn.lineno, "gates": gates}
                break
    out["mla_kind"] = _mla_kind(vdir)
    return out


SELECTOR = "v1/attention/selector.py"
KINDS = "v1/kv_cache_interface.py"


def _mla_kind(vdir):
    """The KV-cache group kind an MLA layer belongs to (`get_attn_spec_kind`: `if use_mla: ... return
    KVCacheSpecKind.MLA_ATTENTION`), as `--attention-config`'s `backend_per_kind` keys it: {value, sliding,
    file, line}; None before per-kind backends (< 0.33)."""
    tree = _read(vdir, SELECTOR)
    kinds = _read(vdir, KINDS)
    if tree is None or kinds is None:
        return None
    values = {}
    for cls in ast.walk(kinds):
        if isinstance(cls, ast.ClassDef) and cls.name == "KVCacheSpecKind":
            for n in cls.body:
                if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name) \
                        and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str):
                    values[n.targets[0].id] = n.value.value
    for fn in ast.walk(tree):
        if not (isinstance(fn, ast.FunctionDef) and fn.name == "get_attn_spec_kind"):
            continue
        for st in ast.walk(fn):
            if isinstance(st, ast.If) and isinstance(st.test, ast.Name) and st.test.id == "use_mla":
                rets = [(r.value, r.lineno) for r in ast.walk(st) if isinstance(r, ast.Return)
                        and isinstance(r.value, ast.Attribute)]
                names = [(r.attr, line) for r, line in rets]
                plain = [(n, line) for n, line in names if "SLIDING" not in n]
                slide = [n for n, _line in names if "SLIDING" in n]
                if plain and plain[-1][0] in values:
                    return {"value": values[plain[-1][0]], "sliding": values.get(slide[0]) if slide else None,
                            "file": SELECTOR, "line": plain[-1][1]}
    return None
