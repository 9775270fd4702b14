"""The tree-wide `def SYMBOL` search is skipped only where the knowledge's named files decide: the agent's
class of a version holds every entry the controller's knowledge resolves for that version, a version it
cannot place searches everything, and an entry not found in the index makes its symbol searched."""
from __future__ import annotations

import pytest

from mla_doctor.agent.facts.symbols import _release_tuple, symbols_to_search
from mla_doctor.diagnosis.knowledge import load_knowledge
from mla_doctor.diagnosis.symbol_needs import symbol_needs

KB = load_knowledge()
SYMBOLS = KB.agent_request()["symbols"]
NEEDS = symbol_needs(KB.data, SYMBOLS)
VERSIONS = sorted({str(v) for v in KB.inspected} | {"0.5.0", "0.6.0", "0.7.0", "0.10.1.1", "0.10.2rc1",
                                                   "0.11.0.post1", "0.16", "0.16.0.0", "0.32.0+cpu",
                                                   "0.33.0.dev4+g1234abc", "0.34.0", "1.0", "0.8.5-1",
                                                   "0.0.0", "0.33.0 ", "0.15.1foo"})


def _entries_read(version):
    """(def path, symbol) of every entry static_facts._resolve may look up for this version."""
    f = KB.for_version(version)
    ents = [f.dispatch, f.prefill, f.decode_common, f.metadata_split, *f.other_engine_entries, *f.never_patch]
    for b in f.backends:
        ents.extend(b.decode)
        ents.append(b.prefill)
    out = set()
    for e in ents:
        if e is None:
            continue
        leaf = e.symbol.rsplit(".", 1)[-1]
        if leaf in SYMBOLS and not leaf.startswith("__") and leaf != "forward":
            out.add((e.def_path, e.symbol))
    return out


def _class_of(version):
    rel = _release_tuple(version)
    k = 0
    for i, b in enumerate(NEEDS["bounds"]):
        if rel == tuple(b):
            return {tuple(NEEDS["entries"][n]) for n in NEEDS["classes"][2 * i + 1]}
        if rel > tuple(b):
            k = 2 * i + 2
    return {tuple(NEEDS["entries"][n]) for n in NEEDS["classes"][k]}


def test_the_knowledge_gives_a_table():
    assert NEEDS and NEEDS["bounds"] and len(NEEDS["classes"]) == 2 * len(NEEDS["bounds"]) + 1


@pytest.mark.parametrize("version", VERSIONS)
def test_a_versions_class_holds_every_entry_its_knowledge_reads(version):
    assert _release_tuple(version) is not None
    assert _entries_read(version) <= _class_of(version)


def test_the_class_is_exactly_the_releases_entries_at_a_boundary_and_between():
    for v in ("0.10.2", "0.11.1", "0.33.0"):
        assert _class_of(v) == _entries_read(v)


@pytest.mark.parametrize("version", [None, "", "v0.33.0", " 0.33.0", "1!0.33.0", "7", "dev"])
def test_a_version_the_agent_cannot_place_searches_every_symbol(version):
    assert symbols_to_search(SYMBOLS, NEEDS, version, {}) == SYMBOLS


def _index_finding_all(version):
    index = {}
    for path, sym in _class_of(version):
        index.setdefault(path, {"exists": True, "defs": {}})["defs"][sym] = 10
    return index


def test_nothing_is_searched_when_the_named_files_hold_every_def():
    assert symbols_to_search(SYMBOLS, NEEDS, "0.33.0", _index_finding_all("0.33.0")) == []


def test_a_def_missing_from_its_file_is_searched_for():
    index = _index_finding_all("0.33.0")
    path, sym = sorted(_class_of("0.33.0"))[0]
    del index[path]["defs"][sym]
    others = [p for p, s in _class_of("0.33.0") if s == sym and p != path]
    for p in others:  # the same qualified name defined in another indexed file would decide it
        index[p]["defs"].pop(sym, None)
    assert symbols_to_search(SYMBOLS, NEEDS, "0.33.0", index) == [sym.rsplit(".", 1)[-1]]
    index[path]["defs"]["Other." + sym.rsplit(".", 1)[-1]] = 3  # the same method on another class decides it
    if sym.count(".") == 1:
        assert symbols_to_search(SYMBOLS, NEEDS, "0.33.0", index) == []


def test_no_table_or_a_malformed_one_searches_every_symbol():
    assert symbols_to_search(SYMBOLS, None, "0.33.0", {}) == SYMBOLS
    assert symbols_to_search(SYMBOLS, {"bounds": [[0, 1]], "classes": []}, "0.33.0", {}) == SYMBOLS


def test_a_specifier_it_cannot_order_gives_no_table():
    data = {"dispatch": [{"versions": "==0.10.*", "file": "a.py", "symbol": "A.forward_mqa"}]}
    assert symbol_needs(data, ["forward_mqa"]) is None
    data["dispatch"][0]["versions"] = ">=0.10,<0.11"
    assert symbol_needs(data, ["forward_mqa"])["bounds"] == [[0, 10], [0, 11]]
