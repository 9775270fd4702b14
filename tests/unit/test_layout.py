"""The package layout is an architecture: which layer may import which, no cycles, small modules.

Layers, top to bottom (docs/layout.md): cli -> fleet -> host -> diagnosis / remote / ssh, and reports (which
render the report's stored answer and import the base only), over the base (errors, exit codes, results,
yamlfile, paths, cancel). cli reaches diagnosis only in
`explain` (offline); a fleet reaches a host only through `host.execute`. The host agent (`agent/`) is stdlib-only and
imports nothing of the controller; only `remote/` (which ships it) reads it.
"""
from __future__ import annotations

import ast
from pathlib import Path

from tests.support import import_graph

PKG = Path(__file__).resolve().parents[2] / "mla_doctor"
BASE = {"mla_doctor", "mla_doctor.errors", "mla_doctor.exit_codes", "mla_doctor.results", "mla_doctor.yamlfile",
        "mla_doctor.paths", "mla_doctor.safety", "mla_doctor.redact", "mla_doctor.user_cache", "mla_doctor.cancel",
        "mla_doctor.terminal", "mla_doctor.interrupts", "mla_doctor.threshold_text",
        "mla_doctor.report_sections", "mla_doctor.words"}
# layer -> the layers it may import (itself always allowed)
ALLOWED = {
    "base": set(),
    "agent": set(),
    "ssh": {"base"},
    "diagnosis": {"base"},
    "remote": {"base", "ssh", "agent"},
    # a writer renders what the report holds (its answer included): it diagnoses nothing, reads no knowledge
    "reports": {"base"},
    # one host's work: connect (ssh), the agent (remote), what it means (diagnosis)
    "host": {"base", "ssh", "remote", "diagnosis"},
    # a fleet runs each host through host.execute: it never opens a connection or reads the knowledge itself
    "fleet": {"base", "host"},
    # a thin front end: what it runs (fleet, host), how it shows it (reports)
    "cli": {"base", "reports", "host", "fleet"},
}
# The one exception by name: `mla-doctor explain` reads a pasted log offline, with no host to run.
EXTRA = {"mla_doctor.cli.explain": {"diagnosis"}}
MAX_LINES = 900


def _modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        rel = p.relative_to(PKG.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = p
    return out


def layer(mod: str) -> str:
    if mod == "mla_doctor.__main__":  # `python -m mla_doctor`: the command line
        return "cli"
    if mod in BASE:
        return "base"
    return mod.split(".")[1]


def _imports(path: Path, mod: str, top_only: bool = False) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    nodes = tree.body if top_only else list(ast.walk(tree))
    found = set()
    pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    for n in nodes:
        if isinstance(n, ast.Import):
            found.update(a.name for a in n.names if a.name.startswith("mla_doctor"))
        elif isinstance(n, ast.ImportFrom):
            base = n.module or ""
            if n.level:
                up = pkg.split(".")
                base = ".".join(up[: len(up) - n.level + 1] + ([base] if base else []))
            if base.startswith("mla_doctor"):
                found.add(base)
                found.update(f"{base}.{a.name}" for a in n.names)
    mods = _modules()
    return {m for m in found if m in mods}


def test_every_module_belongs_to_a_known_layer():
    assert {layer(m) for m in _modules()} <= set(ALLOWED), sorted({layer(m) for m in _modules()} - set(ALLOWED))


def test_layers_import_only_downwards():
    bad = []
    for mod, path in _modules().items():
        me = layer(mod)
        for dep in _imports(path, mod):
            other = layer(dep)
            if other != me and other not in ALLOWED[me] and other not in EXTRA.get(mod, ()):
                bad.append(f"{mod} ({me}) imports {dep} ({other})")
    assert not bad, "\n".join(bad)


def test_no_import_cycles_between_modules():
    """No cycle of any kind: an import inside a function counts as one at module level does (a deferred import
    hides a cycle from the interpreter, not from the design). The shared vocabulary goes to a module both sides
    import (log_names, attach/closing, facts/syntax, host/library)."""
    g = import_graph.graph(PKG)
    found = import_graph.cycles(g)
    assert not found, "\n".join(import_graph.describe(g, c) for c in found)


def test_the_cycle_check_reads_imports_inside_functions(tmp_path):
    """The check itself: a cycle closed only by an import inside a function (and one by a relative import
    inside a method) is found; the same package without that import has none."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from pkg import a\n")  # a package's face: not a cycle
    (pkg / "a.py").write_text("from pkg.b import thing\n")
    (pkg / "b.py").write_text("thing = 1\n\n\ndef late():\n    from pkg.a import x\n    return x\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "c.py").write_text("from . import d\n")
    (pkg / "sub" / "d.py").write_text("class K:\n    def m(self):\n        from .c import y\n        return y\n")
    g = import_graph.graph(pkg)
    assert import_graph.cycles(g) == [["pkg.a", "pkg.b"], ["pkg.sub.c", "pkg.sub.d"]]
    assert import_graph.describe(g, ["pkg.a", "pkg.b"]) == "pkg.a -> pkg.b -> pkg.a"
    (pkg / "b.py").write_text("thing = 1\n")
    (pkg / "sub" / "d.py").write_text("y = 2\n")
    assert import_graph.cycles(import_graph.graph(pkg)) == []


def test_the_agent_imports_nothing_of_the_controller():
    for mod, path in _modules().items():
        if layer(mod) == "agent":
            assert all(layer(d) == "agent" for d in _imports(path, mod)), mod


def test_one_default_run_root():
    hits = [str(p.relative_to(PKG)) for p in PKG.rglob("*.py") if '"/var/tmp/mla-doctor"' in p.read_text()]
    # the controller's constant, and the agent's own (it imports nothing of the controller)
    assert len(hits) <= 2 and "paths.py" in hits, hits


def test_no_module_over_the_size_limit():
    big = {str(p.relative_to(PKG)): n for p in PKG.rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not big, big


def test_the_agent_and_the_controller_share_the_default_run_root():
    """Two spellings (the agent imports nothing of the controller), one value."""
    from mla_doctor import paths
    from mla_doctor.agent import fs

    assert fs.DEFAULT_RUN_ROOT == paths.DEFAULT_RUN_ROOT


def test_only_the_host_layer_opens_connections():
    """host/target.py's `connect` is the one place a transport is opened: outside host/ and ssh/ no module names
    open_transport, LocalTransport( or inside( (a container's transport)."""
    import re

    pat = re.compile(r"\bopen_transport\b|\bLocalTransport\(|(?<![\w.])inside\(")
    bad = [m for m, p in _modules().items() if layer(m) not in ("host", "ssh") and pat.search(p.read_text())]
    assert not bad, bad


def _agent_reach(start: str) -> set[str]:
    """Every agent module that the modules of package `start` import, transitively, at any level of a module
    (an import inside a function counts: it runs when that function does)."""
    mods = _modules()
    graph = {m: _imports(p, m) for m, p in mods.items() if layer(m) == "agent"}
    todo = [m for m in graph if m == start or m.startswith(start + ".")]
    assert todo, start
    seen = set(todo)
    while todo:
        for dep in graph.get(todo.pop(), ()):
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


# agent package -> the agent packages it must never reach: the files (change/) and the server (runtimes/) are
# two sides that never import each other; a run's lifecycle (lifecycle/: patch and revert ops, watchdog, tick,
# server restore) sits above both, and nothing below it imports it
AGENT_NEVER = {
    "mla_doctor.agent.change": ("mla_doctor.agent.runtimes", "mla_doctor.agent.lifecycle"),
    "mla_doctor.agent.runtimes": ("mla_doctor.agent.change", "mla_doctor.agent.lifecycle"),
    "mla_doctor.agent.facts": ("mla_doctor.agent.change", "mla_doctor.agent.runtimes", "mla_doctor.agent.lifecycle"),
}


def test_change_and_runtimes_never_import_each_other():
    bad = []
    for pkg, never in AGENT_NEVER.items():
        reached = _agent_reach(pkg)
        bad += [f"{pkg} reaches {m}" for m in sorted(reached) if any(m == n or m.startswith(n + ".") for n in never)]
    assert not bad, "\n".join(bad)


# (importing module, name) pairs allowed to cross agent modules with a leading underscore: none. A name another
# module needs is public (tools/codemod_public_names.py renames what a merge brings back).
AGENT_PRIVATE_ALLOWED: set[tuple[str, str]] = set()


def test_agent_modules_use_only_each_others_public_names():
    """No agent module imports `_name` from another (`from ..fs import _read_json`) or reads `module._name` of
    one (`fs._read_json`): what crosses a module boundary is that module's public interface."""
    mods = _modules()
    agent = {m: p for m, p in mods.items() if layer(m) == "agent"}
    bad = []
    for mod, path in agent.items():
        tree = ast.parse(path.read_text(), str(path))
        pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        aliases = {}  # a local name bound to an agent module -> that module
        for n in ast.walk(tree):
            if isinstance(n, ast.ImportFrom):
                base = n.module or ""
                if n.level:
                    up = pkg.split(".")
                    base = ".".join(up[: len(up) - n.level + 1] + ([base] if base else []))
                for a in n.names:
                    if f"{base}.{a.name}" in agent:
                        aliases[a.asname or a.name] = f"{base}.{a.name}"
                    elif base in agent and base != mod and a.name.startswith("_") and not a.name.startswith("__"):
                        bad.append((mod, f"from {base} import {a.name}"))
            elif isinstance(n, ast.Import):
                aliases.update({a.asname: a.name for a in n.names if a.asname and a.name in agent})
        for n in ast.walk(tree):
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in aliases \
                    and aliases[n.value.id] != mod and n.attr.startswith("_") and not n.attr.startswith("__"):
                bad.append((mod, f"{n.value.id}.{n.attr} ({aliases[n.value.id]})"))
    bad = [b for b in bad if (b[0], b[1].split()[-1]) not in AGENT_PRIVATE_ALLOWED]
    assert not bad, "\n".join(f"{m}: {what}" for m, what in sorted(set(bad)))
