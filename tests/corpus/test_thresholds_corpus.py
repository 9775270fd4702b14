"""Decode thresholds as the real release sources state them (the agent's `thresholds` extraction) agree with the
knowledge, for every cached release of the corpus (issue 10: a disagreement would be a THRESHOLD_MISMATCH).

The releases are the corpus's (tests/support/corpus.py RELEASES); the ones not cached are fetched by the corpus
tier's own setup, so a missing one is fetched here too (PyPI, once)."""
from __future__ import annotations

import pytest
from packaging.version import Version

from mla_doctor.agent.facts.thresholds import extract, threshold_files, thresholds_section
from mla_doctor.diagnosis.knowledge import load_knowledge
from mla_doctor.diagnosis.static_facts import compare_thresholds
from mla_doctor.host.audit import _agent_index
from tests.support import corpus

pytestmark = pytest.mark.corpus

RELEASES = [r for r in corpus.RELEASES if r[0] == "vllm"]


@pytest.mark.parametrize("dist,version", RELEASES, ids=[v for _, v in RELEASES])
def test_installed_thresholds_agree_with_the_knowledge(dist, version):
    tree = corpus.ensure(dist, version) / "vllm"
    kb = load_knowledge()
    facts = kb.for_version(version)
    files = threshold_files(_agent_index(kb))
    assert set(files["files"]) == set(kb.threshold_files())  # the agent reads exactly the knowledge's files
    section = thresholds_section(str(tree), files)
    found, bad = compare_thresholds(facts, {"thresholds": section})
    assert bad == [], bad
    # the head tables are read from the code, not only trusted: from 0.26 every sparse CUDA builder states one
    if facts.sparse_mode == "mha_if_short":
        for name in ("FLASHMLA_SPARSE", "FLASHINFER_MLA_SPARSE", "FLASH_ATTN_MLA_SPARSE"):
            assert isinstance(found[name]["value"], dict), (name, found.get(name))
        assert found["FLASHINFER_MLA_SPARSE"]["value"] == {"any": {8: 128, 16: 128, 32: 128, 64: 256, 128: 1024,
                                                                   "default": 1024}}
        assert found["FLASHMLA_SPARSE"]["value"]["sm100"][128] == 1024
        assert found["FLASHMLA_SPARSE"]["value"]["other"][128] == 256
    if Version(version) >= Version("0.11.2"):
        assert found["FLASHMLA"]["value"] == 128 and found["FLASHMLA"]["ref"].startswith(
            "vllm/v1/attention/backends/mla/flashmla.py:")


def test_a_changed_threshold_is_a_mismatch_with_both_values_and_the_line():
    """The comparison can fail: the real 0.33.0 FlashAttention-MLA builder with its 512 edited to 256."""
    tree = corpus.ensure("vllm", "0.33.0") / "vllm"
    rel = "v1/attention/backends/mla/flashattn_mla.py"
    text = (tree / rel).read_text().replace("reorder_batch_threshold: int = 512", "reorder_batch_threshold: int = 256")
    facts = load_knowledge().for_version("0.33.0")
    found, bad = compare_thresholds(facts, {"thresholds": {rel: {"exists": True, "items": extract(text)}}})
    assert [(m["backend"], m["knowledge"], m["code"]) for m in bad] == [("FLASH_ATTN_MLA", 512, 256)]
    assert bad[0]["ref"] == "vllm/%s:129 FlashAttnMLAMetadataBuilder" % rel
