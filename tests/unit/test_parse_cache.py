"""The controller's content-addressed parse cache (remote/parse_cache.py): a file the cache holds is not
parsed by the agent and its merged answer is what parsing gives; one changed byte is parsed afresh; an entry
that cannot be found is an error on that file, never a guess; the names sent along still decide the search."""
from __future__ import annotations

import copy
import sys

import pytest

from mla_doctor.agent.facts.symbols import index_tree, symbols_to_search
from mla_doctor.remote import parse_cache

SRC = '''import os


class MLACommonImpl:
    def forward_mqa(self, q):
        return q

    async def _forward_prefill(self, q):
        return q


def split_decodes_and_prefills(x):
    return x
'''
SYMBOLS = ["forward_mqa", "_forward_prefill", "split_decodes_and_prefills"]
PY = list(sys.version_info[:3])


@pytest.fixture()
def tree(tmp_path, monkeypatch):
    monkeypatch.setenv("MLA_DOCTOR_PARSE_CACHE", str(tmp_path / "cache"))
    vdir = tmp_path / "vllm"
    (vdir / "v1").mkdir(parents=True)
    (vdir / "v1" / "common.py").write_text(SRC)
    return vdir


def audit(vdir, files=("v1/common.py",)):
    """One agent index with what the controller's cache knows, merged as protocol.call merges it."""
    req = {"files": list(files), "known": parse_cache.known(SYMBOLS, list(files)),
           "patterns": {"mqa": r"def forward_mq\w"}}
    raw = {"host": {"agent_python": PY}, "index": index_tree(str(vdir), req)}
    sent = copy.deepcopy(raw["index"])
    parse_cache.merge(raw, SYMBOLS)
    return sent, raw["index"], req["known"]


def test_a_cached_file_is_not_parsed_and_merges_to_the_parsed_answer(tree):
    sent1, first, _ = audit(tree)
    assert sent1["v1/common.py"]["parser"] == "ast"  # a miss: parsed, then stored
    sent2, second, known = audit(tree)
    assert sent2["v1/common.py"]["parser"] == "cached" and "defs" not in sent2["v1/common.py"]
    assert second == first and first["v1/common.py"]["matches"] == {"mqa": [[5, "def forward_mqa(self, q):"]]}
    assert first["v1/common.py"]["defs"] == {"MLACommonImpl.forward_mqa": 5, "MLACommonImpl._forward_prefill": 8,
                                             "split_decodes_and_prefills": 12}
    pyver = "%d.%d" % sys.version_info[:2]
    assert list(known[pyver]["v1/common.py"].values()) == [sorted(first["v1/common.py"]["defs"])]


def test_one_changed_byte_is_parsed_afresh(tree):
    audit(tree)
    (tree / "v1" / "common.py").write_text(SRC.replace("def forward_mqa", "def forward_mqb"))
    sent, merged, _ = audit(tree)
    assert sent["v1/common.py"]["parser"] == "ast"
    assert "MLACommonImpl.forward_mqb" in merged["v1/common.py"]["defs"]
    assert "MLACommonImpl.forward_mqa" not in merged["v1/common.py"]["defs"]


def test_an_entry_gone_is_an_error_not_a_guess(tree, tmp_path):
    _, first, _ = audit(tree)
    for p in (tmp_path / "cache").glob("py*/%s.json" % first["v1/common.py"]["sha256"]):
        p.unlink()
    sent, merged, _ = audit(tree)
    assert sent["v1/common.py"]["parser"] == "cached"
    assert "defs" not in merged["v1/common.py"] and "parse cache" in merged["v1/common.py"]["error"]
    sent, merged, _ = audit(tree)  # dropped from the manifest: parsed again, then stored again
    assert sent["v1/common.py"]["parser"] == "ast" and merged == first


def test_a_remote_hosts_answer_is_not_stored(tree):
    raw = {"host": {"agent_python": PY}, "index": index_tree(str(tree), {"files": ["v1/common.py"]})}
    raw["index"]["v1/common.py"]["defs"] = {"Forged.forward_mqa": 1}
    parse_cache.merge(raw, SYMBOLS, store=False)
    assert parse_cache.known(SYMBOLS, ["v1/common.py"]) == {}


def test_another_interpreter_does_not_use_this_ones_parse(tree):
    audit(tree)
    known = parse_cache.known(SYMBOLS, ["v1/common.py"])
    other = {"2.7": next(iter(known.values()))}
    out = index_tree(str(tree), {"files": ["v1/common.py"], "known": other})
    assert out["v1/common.py"]["parser"] == "ast"


def test_the_cached_names_decide_the_tree_wide_search(tree):
    audit(tree)
    sent, _, known = audit(tree)
    needs = {"entries": [["v1/common.py", "MLACommonImpl.forward_mqa"], ["v1/common.py", "Gone._forward_decode"]],
             "bounds": [], "classes": [[0, 1]]}
    assert symbols_to_search(SYMBOLS + ["_forward_decode"], needs, "0.33.0", sent, known) == ["_forward_decode"]
    needs["classes"] = [[0]]
    assert symbols_to_search(SYMBOLS, needs, "0.33.0", sent, known) == []
    assert symbols_to_search(SYMBOLS, needs, "0.33.0", sent, {}) == ["forward_mqa"]  # no names: searched


def test_off_disables_it(tree, monkeypatch):
    monkeypatch.setenv("MLA_DOCTOR_PARSE_CACHE", "off")
    audit(tree)
    sent, _, known = audit(tree)
    assert known == {} and sent["v1/common.py"]["parser"] == "ast"
