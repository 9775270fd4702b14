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
