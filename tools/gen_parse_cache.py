#!/usr/bin/env python3
"""Fill the controller's parse cache (mla_doctor/remote/parse_cache.py) from the corpus releases' sources, so
that the first audit of a host running one of them already skips `ast` for the knowledge's named files.

Each release's named files are parsed here by the agent's own index code, with this interpreter: the entries
are for this Python's major.minor only (another grammar may not parse a file alike). Content-addressed, so an
entry is right for any host whose file has that sha256, whatever release it came from.

    .venv/bin/python tools/gen_parse_cache.py [dist==version ...]   (default: every cached corpus release)
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main(argv: list[str]) -> int:
    from mla_doctor.agent.facts.symbols import index_tree
    from mla_doctor.diagnosis.knowledge import load_knowledge
    from mla_doctor.host.audit import AuditOptions, static_plan
    from mla_doctor.remote import parse_cache
    from tests.support import corpus

    plan = static_plan(load_knowledge(), AuditOptions())
    pyver = "%d.%d" % sys.version_info[:2]
    wanted = [tuple(a.split("==", 1)) for a in argv] or corpus.RELEASES
    for dist, version in wanted:
        tree = corpus.tree_dir(dist, version)
        if not (tree / ".complete").exists():
            if argv:
                tree = corpus.ensure(dist, version)
            else:
                print(f"{dist}=={version}: not cached, skipped")
                continue
        index = index_tree(str(tree / "vllm"), {"files": plan["index"]["files"]})
        n = parse_cache.store_parsed(pyver, plan["symbols"], index)
        print(f"{dist}=={version}: {n} files held for Python {pyver} in {parse_cache.cache_dir()}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
