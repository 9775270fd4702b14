"""The `if` tests an attention layer is built under, as the model-config keys they read (issue 28): Kimi K3.1
builds its DSA layer `if config.is_dsa_layer(layer_idx)` — a def of the config class that reads `dsa_config` — and
its dense one otherwise, so which layers a served model runs is the config's, read from the installed code.
By syntax tree, nothing imported (resolve.py calls these while it follows a model's `__init__`s)."""
from __future__ import annotations

import ast
import os

from ..common import read_regular
from .syntax import chain

CONFIGS = ("transformers_utils", "configs")  # the config classes' defs (is_dsa_layer ...)


def if_context(fn):
    """id(node) -> ((if test, negated), ...) for every node of a function under an `if` (outermost first)."""
    out = {}

    def visit(body, conds):
        for st in body:
            if isinstance(st, ast.If):
                for n in ast.walk(st.test):
                    out[id(n)] = conds
                visit(st.body, conds + ((st.test, False),))
                visit(st.orelse, conds + ((st.test, True),))
                continue
            for f in ("body", "orelse", "finalbody"):
                sub = getattr(st, f, None)
                if isinstance(sub, list) and sub and isinstance(sub[0], ast.AST):
                    visit(sub, conds)
            for h in getattr(st, "handlers", None) or []:
                visit(h.body, conds)
            for n in ast.walk(st):
                if id(n) not in out:
                    out[id(n)] = conds
    visit(fn.body, ())
    return out


def conditions(vdir, m, conds, memo):
    """[{test, negated, keys, file, line}]: the tests of `conds` that read the model's config (`m` the module
    holding them; `memo` caches the config methods' keys)."""
    out = []
    for test, negated in conds:
        keys = config_keys(vdir, test, memo)
        if keys:
            out.append({"test": m.text_of(test), "negated": negated, "keys": keys, "file": m.rel,
                        "line": test.lineno})
    return out


def config_keys(vdir, test, memo):
    """The config attributes a test reads: `config.k`, `getattr(config, "k")`, `hasattr(config, "k")`, and for
    `config.method(...)` the `self.k` its def in transformers_utils/configs/ reads."""
    keys = []
    for n in ast.walk(test):
        if isinstance(n, ast.Call):
            c = chain(n.func) or []
            if c and c[-1] in ("getattr", "hasattr") and len(n.args) >= 2 and \
                    (chain(n.args[0]) or [""])[-1].endswith("config") and isinstance(n.args[1], ast.Constant):
                keys.append(str(n.args[1].value))
            elif len(c) >= 2 and c[-2].endswith("config"):
                keys.extend(config_method_keys(vdir, c[-1], memo))
        elif isinstance(n, ast.Attribute):
            c = chain(n) or []
            if len(c) >= 2 and c[-2].endswith("config") and not c[-1].startswith("is_"):
                keys.append(c[-1])
    return list(dict.fromkeys(k for k in keys if not k.startswith("_")))


def config_method_keys(vdir, name, memo):
    """The `self.X` a config class's `def name(self, ...)` reads (any file of transformers_utils/configs/)."""
    if name not in memo:
        memo[name] = []
        cdir = os.path.join(vdir, *CONFIGS)
        try:
            files = sorted(f for f in os.listdir(cdir) if f.endswith(".py"))
        except OSError:
            files = []
        needle = ("def %s(" % name).encode()
        for f in files:
            try:
                data = read_regular(os.path.join(cdir, f))
            except OSError:
                continue
            if needle not in data:
                continue
            try:
                tree = ast.parse(data)
            except SyntaxError:
                continue
            for fn in ast.walk(tree):
                if isinstance(fn, ast.FunctionDef) and fn.name == name:
                    for a in ast.walk(fn):
                        c = chain(a) if isinstance(a, ast.Attribute) else None
                        if c and len(c) == 2 and c[0] == "self":
                            memo[name].append(c[1])
    return memo[name]
