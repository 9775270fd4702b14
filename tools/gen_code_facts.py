#!/usr/bin/env python3
"""Regenerate ``mla_doctor/diagnosis/knowledge/code_facts.json.gz``: what each release's code says, for
``explain`` (which reads no installed code): the MLA model types (``is_deepseek_mla``), each MLA architecture's
own layers where its family has them (its resolution, pruned; None: the shared split) and its ``index_topk``
test. Harvested by the agent's own resolver (``agent/facts/resolve.py``) from the real release sources, so
``explain`` on a log of a harvested release uses the code's facts, and says the table's (history) only where the
release was not harvested.

    python tools/gen_code_facts.py             # every release of the corpus (tests/support/corpus.py)
    python tools/gen_code_facts.py 0.34.0      # add or refresh releases (vllm, from the corpus cache)
"""
from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "mla_doctor" / "diagnosis" / "knowledge" / "code_facts.json.gz"  # ~850 KB of JSON, ~32 KB gzipped
SCHEMA = 1

sys.path.insert(0, str(ROOT))
from mla_doctor.agent.facts.resolve import resolve_paths  # noqa: E402  (stdlib-only, like the agent)
from mla_doctor.diagnosis import code_paths as cp  # noqa: E402
from tests.support import corpus  # noqa: E402  (the test suite's cache of release sources)


DROP = ("sha256", "probe_targets", "other_backends", "backend")


def _pruned(v):
    """The resolution without what explain never reads (hashes, probe targets, backends)."""
    if isinstance(v, dict):
        return {k: _pruned(x) for k, x in v.items() if k not in DROP}
    if isinstance(v, list):
        return [_pruned(x) for x in v]
    return v


def harvest(version: str) -> dict:
    vdir = str(corpus.ensure("vllm", version) / "vllm")
    res = resolve_paths(vdir, None, {"distribution": "vllm"}, {}, max_modules=10 ** 6)
    archs = {}
    for a in res["architectures"]:
        for fp in cp.family_paths({"architectures": [a]}):
            own = cp.family_route(fp) is not None
            # a family with its own layer: its resolution (pruned), so explain keeps only the layers the served
            # config builds (code_paths.served_path: Kimi-Linear's DSA layer only with dsa_config)
            archs[fp.architecture] = {"resolution": _pruned(a) if own else None, "sparse_gate": a.get("sparse_gate")}
    return {"mla_model_types": res.get("mla_model_types"), "architectures": archs}


def main(argv: list) -> int:
    doc = json.loads(gzip.decompress(OUT.read_bytes())) if OUT.exists() else {"schema": SCHEMA, "releases": {}}
    versions = argv or sorted({v for d, v in corpus.ALL_RELEASES if d == "vllm"}, key=Version)
    for v in versions:
        doc["releases"][v] = harvest(v)
        print(v, len(doc["releases"][v]["architectures"]), file=sys.stderr)
    doc["releases"] = dict(sorted(doc["releases"].items(), key=lambda kv: Version(kv[0])))
    data = (json.dumps(doc, sort_keys=False, separators=(",", ":")) + "\n").encode()
    OUT.write_bytes(gzip.compress(data, mtime=0))  # mtime 0: the same facts, the same bytes
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
