"""The controller's content-addressed log-format cache (remote/formats_cache.py): a module it holds is not
harvested by the agent, and the merged formats are exactly a full harvest's (file:line included) on a real
release; one changed byte is harvested afresh; an entry that cannot be found drops the installed formats (the
shipped ones read the log), never guesses; a remote host's answer is not stored; off turns it off."""
from __future__ import annotations

import copy
import json
import shutil
import sys

import pytest

from mla_doctor.agent.facts import log_formats
from mla_doctor.agent.facts.integrity import parse_record, scan_tree
from mla_doctor.agent.facts.logs import installed_formats
from mla_doctor.remote import formats_cache
from tests.support import corpus

PY = list(sys.version_info[:3])
PYVER = "%d.%d" % sys.version_info[:2]


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MLA_DOCTOR_PARSE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def harvest(vdir, local=True, digests=None):
    """One agent harvest with the plan's cache fields, as sent (a copy) and as merged by protocol.call."""
    plan = formats_cache.plan_fields(local=local)
    raw = {"host": {"agent_python": PY}, "log": {"found": True,
                                                 "formats": installed_formats(str(vdir), plan, digests)}}
    sent = copy.deepcopy(raw["log"]["formats"])
    formats_cache.merge(raw, store=local)
    return sent, raw["log"], plan


def without_time(doc):
    return {k: v for k, v in doc.items() if k != "elapsed_s"}


@pytest.fixture(scope="module")
def release():
    tree = corpus.tree_dir("vllm", "0.33.0")
    if not (tree / ".complete").exists():
        pytest.fail("vLLM 0.33.0 sources not cached: `make unit` fetches them first "
                    "(or: python tests/support/corpus.py vllm==0.33.0)")
    return tree


def test_a_hit_on_a_real_release_is_exactly_the_full_harvest(cache, release):
    vdir = release / "vllm"
    digests = {}
    scan = scan_tree(str(vdir), parse_record(str(release / "vllm-0.33.0.dist-info")), [], digests)
    assert not scan["modified"] and len(digests) > 700  # the integrity pass hashed every harvested module
    full = log_formats.compact(log_formats.harvest_tree(str(vdir)))
    sent, miss, plan = harvest(vdir, digests=digests)
    assert "formats_known" not in plan and set(sent["harvested"]) == set(digests)
    assert sent["harvested"] == digests  # the digest of the very bytes harvested: the integrity pass's here
    assert without_time(miss["formats"]) == full and len(full["sites"]) > 500
    sent, hit, plan = harvest(vdir, digests=digests)
    assert len(plan["formats_known"][PYVER]) == len(set(digests.values()))  # empty __init__.py: one digest
    assert sent["sites"] == [] and sent["cached"] == digests and "harvested" not in sent  # nothing harvested
    assert without_time(hit["formats"]) == full  # every format, file and line as a full harvest gives them
    assert "formats_error" not in hit
    # no RECORD (an editable install): the integrity pass lists the modules without digests, the agent hashes
    listing = {}
    scan_tree(str(vdir), None, [], listing)
    assert set(listing) == set(digests) and set(listing.values()) == {None}
    sent, again, _ = harvest(vdir, digests=listing)
    assert sent["cached"] == digests and without_time(again["formats"]) == full
    sent, again, _ = harvest(vdir)  # no integrity pass at all (it failed): the harvest walks the tree
    assert sent["cached"] == digests and without_time(again["formats"]) == full


TREE = {
    "platforms/cuda.py": ("import logging\nlogger = logging.getLogger(__name__)\n\n\ndef pick(name):\n"
                          "    logger.info(\"Using %s backend.\", name)\n"),
    "v1/attention/backends/mla/common.py": ("def f(x):\n    if not x:\n"
                                            "        raise ValueError(\"No valid attention backend\")\n"),
    "engine/core.py": "x = 1\n",  # harvested, no format: held as such
}


@pytest.fixture()
def tree(tmp_path):
    vdir = tmp_path / "site" / "vllm"
    for rel, text in TREE.items():
        (vdir / rel).parent.mkdir(parents=True, exist_ok=True)
        (vdir / rel).write_text(text)
    return vdir


def test_one_changed_byte_is_harvested_afresh(cache, tree):
    harvest(tree)
    (tree / "platforms/cuda.py").write_text(TREE["platforms/cuda.py"].replace("Using %s", "Using %r"))
    sent, merged, _ = harvest(tree)
    assert set(sent["cached"]) == {"v1/attention/backends/mla/common.py", "engine/core.py"}
    assert set(sent["harvested"]) == {"platforms/cuda.py"}
    assert without_time(merged["formats"]) == log_formats.compact(log_formats.harvest_tree(str(tree)))
    assert "Using %r backend." in merged["formats"]["formats"] and "Using %s backend." not in \
        merged["formats"]["formats"]
    sent, _, _ = harvest(tree)  # the new content is held now
    assert set(sent["cached"]) == set(TREE) and "harvested" not in sent


def test_an_entry_gone_drops_the_installed_formats_not_a_guess(cache, tree):
    _, first, _ = harvest(tree)
    for p in cache.glob("formats/py*/packs/*.json"):
        p.unlink()
    sent, merged, _ = harvest(tree)
    assert set(sent["cached"]) == set(TREE)
    assert "formats" not in merged and "no entry for sha256" in merged["formats_error"]
    sent, merged, _ = harvest(tree)  # forgotten by the manifest: harvested again, stored again
    assert "cached" not in sent and without_time(merged["formats"]) == without_time(first["formats"])


def test_a_prefix_collision_is_an_error(cache, tree):
    harvest(tree)
    man_path = next(cache.glob("formats/py*/manifest.json"))
    man = json.loads(man_path.read_text())
    sha = next(iter(man))
    forged = sha[:16] + ("0" if sha[16] != "0" else "1") + sha[17:]  # same prefix, another digest
    man[forged] = man.pop(sha)
    man_path.write_text(json.dumps(man))
    sent, merged, _ = harvest(tree)
    assert sha in sent["cached"].values() and "formats" not in merged and sha in merged["formats_error"]


def test_a_remote_hosts_answer_is_not_stored(cache, tree):
    sent, merged, plan = harvest(tree, local=False)
    assert "formats_digests" not in plan and "harvested" not in sent  # not even named
    raw = {"host": {"agent_python": PY}, "log": {"formats": dict(sent, harvested={"engine/core.py": "a" * 64})}}
    formats_cache.merge(raw, store=False)
    assert formats_cache.known() == {} and not list(cache.glob("formats/*/packs/*"))


def test_another_interpreter_or_harvester_does_not_use_these_entries(cache, tree, monkeypatch):
    harvest(tree)
    held = formats_cache.known()[PYVER]
    sent = installed_formats(str(tree), {"formats_known": {"2.7": held}})
    assert "cached" not in sent and len(sent["sites"]) == 2
    d = next(cache.glob("formats/py*"))
    shutil.move(str(d), str(d.with_name("py%s-000000000000" % PYVER)))  # another log_formats.py's entries
    assert formats_cache.known() == {}


def test_off_disables_it(tree, monkeypatch):
    monkeypatch.setenv("MLA_DOCTOR_PARSE_CACHE", "off")
    sent, merged, plan = harvest(tree)
    assert plan == {} and "harvested" not in sent and "cached" not in sent
    assert without_time(merged["formats"]) == log_formats.compact(log_formats.harvest_tree(str(tree)))
