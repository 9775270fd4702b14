#!/usr/bin/env python3
"""Fill the controller's parse cache (mla_doctor/remote/parse_cache.py) from the corpus releases' sources, so
that the first audit of a host running one of them already skips `ast` for the knowledge's named files; and the
log-format cache (mla_doctor/remote/formats_cache.py) with every harvested module's formats, so that the agent
skips the log-format harvest where a server log is found.

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
    from mla_doctor.agent.facts.log_formats import harvest_tree
    from mla_doctor.agent.facts.symbols import index_tree
    from mla_doctor.diagnosis.knowledge import load_knowledge
    from mla_doctor.host.audit import AuditOptions, static_plan
    from mla_doctor.remote import formats_cache, parse_cache
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
        hashed: dict[str, str] = {}
        recs = harvest_tree(str(tree / "vllm"), hashed=hashed)  # the agent's own harvest, every module
        m = formats_cache.store_harvested(pyver, recs, hashed)
        print(f"{dist}=={version}: {n} files' parse and {m} modules' log formats held for Python {pyver} in "
              f"{parse_cache.cache_dir()}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
