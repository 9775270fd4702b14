"""Codemod: an agent name used across modules is public (no leading underscore).

    python tools/codemod_public_names.py            # rewrite the tree in place
    python tools/codemod_public_names.py --check    # list what it would rename; exit 1 if anything

A name defined at the top of a module of `mla_doctor/agent/` with a leading underscore, and imported (or read as
`module._name`) by another module of the package (or by the controller), is renamed to its public spelling
(`_read_json` -> `read_json`, or the spelling in OVERRIDES): its definition, every use in its own module, and
every reference in mla_doctor/, tests/, tools/ and bench/ — `from X import _name`, `alias._name` where alias is
the module, `setattr(alias, "_name", ...)` and its get/has/del kin, "mla_doctor.agent.x._name" strings, and
comments and docstrings that name it. Token-based: nothing but those tokens changes (layout, quotes, comments).

First, an import of a module or name that #17 moved (MOVED_MODULES, MOVED_NAMES: change/daemon.py -> daemon.py,
change/lease.py -> lease.py, change/watchdog.py -> lifecycle/, runtimes/lifecycle.py -> lifecycle/server.py) is
pointed at its new place.

Idempotent: once applied, nothing is left to rename. Re-run after merging a branch written against the old
names: a reference to `_name` in a module that now defines only the public name is rewritten too. A new name
that would collide with one already used in a file it lands in is refused (exit 2, naming the file): add an
OVERRIDES entry and run again.
"""
from __future__ import annotations

import argparse
import ast
import io
import re
import sys
import tokenize
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
ROOT = HERE  # the checkout rewritten (--root)
AGENT = "mla_doctor.agent"
SCAN = ("mla_doctor", "tests", "tools", "bench")
# old name -> public name, where stripping the underscore would collide with a name the files already use
OVERRIDES: dict[str, str] = {
    "_now": "time_now",  # `now` is a local in many a function
    "_run_dir": "plan_run_dir",  # `run_dir` is everyone's variable: this is the run directory a plan names
    "_run": "run_argv",
    "_sha": "sha256_hex",
    "_which": "find_executable",
    "_returns": "returned_exprs",  # what a function body returns (and under which `if`)
}
ATTR_CALLS = {"setattr", "getattr", "hasattr", "delattr"}
# Modules and names #17 moved (the run lifecycle above change/ and runtimes/): an import of the old place, from a
# branch written before, is rewritten to the new one first (`from ..change.daemon import x` -> `from ..daemon ...`)
MOVED_MODULES = {
    "mla_doctor.agent.change.daemon": "mla_doctor.agent.daemon",
    "mla_doctor.agent.change.lease": "mla_doctor.agent.lease",
    "mla_doctor.agent.change.watchdog": "mla_doctor.agent.lifecycle.watchdog",
    "mla_doctor.agent.runtimes.lifecycle": "mla_doctor.agent.lifecycle.server",
}
MOVED_NAMES = {
    ("mla_doctor.agent.runtimes.lifecycle", "restore_server"): "mla_doctor.agent.runtimes.registry",
    ("mla_doctor.agent.change.revert", "op_revert"): "mla_doctor.agent.lifecycle.revert",
    ("mla_doctor.agent.change.patch", "op_patch"): "mla_doctor.agent.lifecycle.patch",
}


class Collision(Exception):
    """A rewrite the tool will not guess: nothing is written."""


def public(old: str) -> str:
    return OVERRIDES.get(old) or old.lstrip("_")


def files() -> list[Path]:
    out = []
    for top in SCAN:
        for p in sorted((ROOT / top).rglob("*.py")):
            if "__pycache__" not in p.parts and ".venv" not in p.parts:
                out.append(p)
    return out


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


class Source:
    """One file: its text, tree, module name, and what it binds from agent modules."""

    def __init__(self, path: Path, text: str):
        self.path = path
        self.text = text
        self.tree = ast.parse(self.text, str(path))
        self.mod = module_name(path)
        self.is_pkg = path.name == "__init__.py"
        self.defined: set[str] = set()  # top-level definitions
        self.reexports: dict[str, tuple[str, str]] = {}  # top-level `from X import a as b`: b -> (X, a)
        self.name_imports: list[tuple[str, str]] = []  # (module, name) imported by name, anywhere
        self.aliases: dict[str, str] = {}  # local name -> agent module it is bound to
        for node in self.tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                self.defined.add(node.name)
            elif isinstance(node, ast.Assign):
                for t in node.targets:
                    self.defined.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
            elif isinstance(node, (ast.AnnAssign, ast.AugAssign)) and isinstance(node.target, ast.Name):
                self.defined.add(node.target.id)
        top = set(map(id, self.tree.body))
        for node in ast.walk(self.tree):
            if isinstance(node, ast.ImportFrom):
                base = self.resolve_from(node)
                for a in node.names:
                    if f"{base}.{a.name}" in MODULES:
                        self.aliases[a.asname or a.name] = f"{base}.{a.name}"
                    elif base in MODULES:
                        self.name_imports.append((base, a.name))
                        if id(node) in top:
                            self.reexports[a.asname or a.name] = (base, a.name)
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.asname and a.name in MODULES:
                        self.aliases[a.asname] = a.name

    def resolve_from(self, node: ast.ImportFrom) -> str:
        return resolve_from(self.mod, self.is_pkg, node)


def resolve_from(mod: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    pkg = mod.split(".") if is_pkg else mod.split(".")[:-1]
    pkg = pkg[: len(pkg) - node.level + 1]
    return ".".join(pkg + ([node.module] if node.module else []))


MODULES: set[str] = set()


def load(texts: dict[Path, str]) -> dict[str, Source]:
    MODULES.clear()
    MODULES.update(module_name(p) for p in texts if module_name(p).startswith(AGENT))
    return {module_name(p): Source(p, t) for p, t in texts.items()}


def spelled(mod: str, is_pkg: bool, target: str, relative: bool) -> str:
    """`target` as the `from` of an import in module `mod`: relative if the original was."""
    if not relative:
        return target
    pkg = mod.split(".") if is_pkg else mod.split(".")[:-1]
    t = target.split(".")
    k = 0
    while k < len(pkg) and k < len(t) - 1 and pkg[k] == t[k]:
        k += 1
    return "." * (len(pkg) - k + 1) + ".".join(t[k:])


def move_imports(path: Path, text: str) -> str:
    """The file with its imports of moved modules and names (MOVED_*) pointing at their new places."""
    mod, is_pkg = module_name(path), path.name == "__init__.py"
    lines = text.splitlines(keepends=True)
    for node in ast.walk(ast.parse(text, str(path))):
        if not isinstance(node, ast.ImportFrom):
            continue
        base = resolve_from(mod, is_pkg, node)
        places = {MOVED_NAMES.get((base, a.name), MOVED_MODULES.get(base)) for a in node.names}
        if places == {None}:
            continue
        if len(places) > 1:
            raise Collision("%s:%d: imports names that moved to different modules (%s): split it by hand"
                            % (path.relative_to(ROOT), node.lineno, ", ".join(sorted(map(str, places)))))
        new = spelled(mod, is_pkg, places.pop(), bool(node.level))
        line = lines[node.lineno - 1]
        m = re.compile(r"from\s+([.\w]+)\s+import\b").match(line, node.col_offset)
        if m is None:
            raise Collision("%s:%d: cannot read this import" % (path.relative_to(ROOT), node.lineno))
        lines[node.lineno - 1] = line[:m.start(1)] + new + line[m.end(1):]
    return "".join(lines)


def resolve(srcs: dict[str, Source], mod: str, name: str, depth: int = 0) -> tuple[str, str] | None:
    """(module that defines it, name) for `name` as read from agent module `mod`, following re-exports."""
    s = srcs.get(mod)
    if s is None or depth > 10:
        return None
    if name in s.defined:
        return mod, name
    if name in s.reexports:
        return resolve(srcs, *s.reexports[name], depth + 1)
    return None


def is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def plan(srcs: dict[str, Source]) -> dict[tuple[str, str], str]:
    """(defining module, old name) -> new name, for every private agent name used outside its module."""
    renames: dict[tuple[str, str], str] = {}
    for s in srcs.values():
        if not s.mod.startswith("mla_doctor."):  # tests/tools/bench may reach into privates: not a reason
            continue
        refs = [(m, n) for m, n in s.name_imports if is_private(n)]
        refs += [(s.aliases[a], n) for a, n in attribute_refs(s) if is_private(n)]
        for m, n in refs:
            key = resolve(srcs, m, n)
            if key and key[0] != s.mod:
                renames[key] = public(key[1])
    return renames


def attribute_refs(s: Source) -> list[tuple[str, str]]:
    """(alias, attribute) for every `alias.attr` where alias is bound to an agent module."""
    return [(n.value.id, n.attr) for n in ast.walk(s.tree)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in s.aliases]


def target(srcs, renames, mod: str, name: str) -> str | None:
    """The new spelling of `name` read from agent module `mod`, if it is (or was) renamed."""
    key = resolve(srcs, mod, name)
    if key in renames:
        return renames[key]
    if key is None and is_private(name) and mod in srcs and resolve(srcs, mod, public(name)):
        return public(name)  # written against the old name; the module now has the public one
    return None


def rewrite(srcs, renames, s: Source) -> str:
    """The file with its references renamed."""
    bare: dict[str, str] = {}  # old -> new for NAME tokens not after a dot
    attrs: dict[tuple[str, str], str] = {}  # (alias, old) -> new
    for (m, old), new in renames.items():
        if m == s.mod:
            bare[old] = new
    for m, n in s.name_imports:
        new = target(srcs, renames, m, n)
        if new:
            bare[n] = new
    for a, n in attribute_refs(s):
        new = target(srcs, renames, s.aliases[a], n)
        if new:
            attrs[(a, n)] = new
    strings: dict[tuple[int, int], str] = {}
    for node in ast.walk(s.tree):
        if isinstance(node, ast.Call) and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant):
            fn = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            a0, a1 = node.args[0], node.args[1]
            if fn in ATTR_CALLS and isinstance(a0, ast.Name) and a0.id in s.aliases and isinstance(a1.value, str):
                new = target(srcs, renames, s.aliases[a0.id], a1.value)
                if new:
                    strings[(a1.lineno, a1.col_offset)] = new
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith(AGENT + "."):
            mod, _, n = node.value.rpartition(".")
            new = target(srcs, renames, mod, n) if mod in MODULES else None
            if new:
                strings[(node.lineno, node.col_offset)] = "%s.%s" % (mod, new)
    if not (bare or attrs or strings):
        return s.text
    docstrings = {(n.body[0].value.lineno, n.body[0].value.col_offset) for n in ast.walk(s.tree)
                  if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body
                  and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)
                  and isinstance(n.body[0].value.value, str)}
    toks = list(tokenize.generate_tokens(io.StringIO(s.text).readline))
    used = {t.string for t in toks if t.type == tokenize.NAME}
    clash = sorted(new for old, new in bare.items() if new in used and new != old)
    if clash:
        raise Collision("%s: already uses %s (add OVERRIDES entries)" % (s.path.relative_to(ROOT), ", ".join(clash)))
    words = {old: new for old, new in list(bare.items()) + [(o, n) for (_a, o), n in attrs.items()]}
    word_re = re.compile(r"(?<![\w.])(%s)\b" % "|".join(map(re.escape, sorted(words, key=len, reverse=True))))
    lines = s.text.splitlines(keepends=True)
    edits = []  # (row, col, end col, new text); tokens never span a change of line here except strings
    for i, t in enumerate(toks):
        prev = toks[i - 1] if i else None
        after_dot = prev is not None and prev.type == tokenize.OP and prev.string == "."
        new = None
        if t.type == tokenize.NAME:
            if not after_dot and t.string in bare:
                new = bare[t.string]
            elif after_dot and i >= 2 and (toks[i - 2].string, t.string) in attrs:
                new = attrs[(toks[i - 2].string, t.string)]
        elif t.type == tokenize.STRING and t.start in strings:
            q = re.match(r"^[a-zA-Z]*(['\"]{1,3})", t.string).group(1)
            prefix = t.string[: t.string.index(q)]
            new = prefix + q + strings[t.start] + q
        elif (t.type == tokenize.COMMENT or (t.type == tokenize.STRING and t.start in docstrings)) and words:
            if word_re.search(t.string):
                new = word_re.sub(lambda mt: words[mt.group(1)], t.string)
        if new is not None and new != t.string:
            edits.append((t.start, t.end, new))
    offsets = [0]
    for line in lines:
        offsets.append(offsets[-1] + len(line))
    text = s.text
    for (r0, c0), (r1, c1), new in sorted(edits, reverse=True):
        a, b = offsets[r0 - 1] + c0, offsets[r1 - 1] + c1
        text = text[:a] + new + text[b:]
    return text


def main(argv: list[str] | None = None) -> int:
    global ROOT
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 if anything would be renamed")
    ap.add_argument("--root", type=Path, default=HERE, help="the checkout to rewrite (default: this one)")
    args = ap.parse_args(argv)
    ROOT = args.root.resolve()
    original = {p: p.read_text(encoding="utf-8") for p in files()}
    texts, clashes = {}, []
    for p, t in original.items():
        try:
            texts[p] = move_imports(p, t)
        except Collision as e:
            clashes.append(str(e))
            texts[p] = t
    srcs = load(texts)
    renames = plan(srcs)
    changed = {}
    for s in srcs.values():
        try:
            new = rewrite(srcs, renames, s)
        except Collision as e:
            clashes.append(str(e))
            continue
        if new != original[s.path]:
            ast.parse(new, str(s.path))  # never leave a file that does not parse
            changed[s.path] = new
    if clashes:
        print("codemod_public_names: nothing written:\n  " + "\n  ".join(clashes), file=sys.stderr)
        return 2
    for (m, old), new in sorted(renames.items()):
        print("%s.%s -> %s" % (m, old, new))
    for path in sorted(changed):
        print("  rewrote %s" % path.relative_to(ROOT))
    if args.check:
        return 1 if changed else 0
    for path, text in changed.items():
        path.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
