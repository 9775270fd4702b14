"""On every cached corpus release, the audit with the tree-wide symbol search cut to what the named files
leave undecided (symbols_to_search) verifies exactly as with every symbol searched."""
from __future__ import annotations

import pytest

from mla_doctor.agent.facts.integrity import scan_tree
from mla_doctor.agent.facts.symbols import index_tree, symbols_to_search
from mla_doctor.diagnosis.knowledge import load_knowledge
from mla_doctor.diagnosis.static_facts import verify_static
from mla_doctor.host.audit import AuditOptions, static_plan
from tests.support import corpus

pytestmark = pytest.mark.corpus

KB = load_knowledge()
PLAN = static_plan(KB, AuditOptions())


@pytest.mark.parametrize("dist,version", corpus.RELEASES, ids=[f"{d}-{v}" for d, v in corpus.RELEASES])
def test_cut_search_verifies_as_the_full_one(dist, version):
    tree = corpus.tree_dir(dist, version)
    if not (tree / ".complete").exists():
        pytest.skip(f"{dist} {version} not cached")
    vdir = str(tree / "vllm")
    # the agent's answers, cached by its source and the request (tests/support/corpus.py agent_answer)
    index = corpus.agent_answer("agent-index-tree", dist, version, PLAN["index"],
                                lambda: index_tree(vdir, PLAN["index"]))
    wanted = symbols_to_search(PLAN["symbols"], PLAN["symbol_needs"], version, index)

    def scan(symbols):
        return corpus.agent_answer("agent-scan", dist, version, sorted(symbols),
                                   lambda: scan_tree(vdir, None, symbols))
    full = {"vllm": {"version": version}, "index": index, "scan": scan(PLAN["symbols"])}
    cut = {"vllm": {"version": version}, "index": index, "scan": scan(wanted)}
    facts = KB.for_version(version)
    assert verify_static(facts, cut) == verify_static(facts, full)
    assert full["scan"]["symbol_hits"]  # the full search found defs, so an equal verdict is not vacuous
