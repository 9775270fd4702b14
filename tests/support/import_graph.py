"""The package's import graph as a reader sees it: every `import` of a module counts, at module level and inside a
function alike (a deferred import hides a cycle from Python's import machinery, not from the code's design).

`graph(pkg_dir)` -> {module: {modules it imports}}; `cycles(graph)` -> each strongly connected component of more
than one module, sorted. A package's `__init__` importing its own submodules is its face, not a cycle."""
from __future__ import annotations

import ast
from pathlib import Path


def modules(pkg_dir: Path) -> dict[str, Path]:
    """Dotted name -> file, for every module under `pkg_dir` (a package's `__init__` named as the package)."""
    out = {}
    for p in sorted(pkg_dir.rglob("*.py")):
        if "__pycache__" in p.parts:
            continue
        parts = list(p.relative_to(pkg_dir.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = p
    return out


def imports_of(path: Path, mod: str, known: dict[str, Path], top_only: bool = False) -> set[str]:
    """The modules of `known` that `mod` imports (`from a import b` counts a.b when b is a module, else a)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    nodes = tree.body if top_only else ast.walk(tree)
    pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    found = set()
    for n in nodes:
        if isinstance(n, ast.Import):
            found.update(a.name for a in n.names)
        elif isinstance(n, ast.ImportFrom):
            base = n.module or ""
            if n.level:
                up = pkg.split(".")
                base = ".".join(up[: len(up) - n.level + 1] + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in n.names)
    out = set()
    for m in found:
        while m and m not in known:  # `import a.b.c` of a name inside a module: the module it is in
            m = m.rpartition(".")[0]
        if m:
            out.add(m)
    return out


def graph(pkg_dir: Path, top_only: bool = False) -> dict[str, set[str]]:
    known = modules(pkg_dir)
    return {m: {d for d in imports_of(p, m, known, top_only) if d != m and not d.startswith(m + ".")}
            for m, p in known.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan, iterative: no recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out = []
    for root in sorted(g):
        if root in index:
            continue
        work = [(root, iter(sorted(g.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(g.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return sorted(out)


def describe(g: dict[str, set[str]], comp: list[str]) -> str:
    """One cycle of the component, as `a -> b -> a`, for the failure message."""
    members = set(comp)
    path = [comp[0]]
    while True:
        nxt = sorted(d for d in g[path[-1]] if d in members)
        back = [d for d in nxt if d in path]
        if back:
            return " -> ".join(path[path.index(back[0]):] + [back[0]])
        path.append(nxt[0])
