"""Per release of the corpus: the harvested log formats mean what the knowledge says, look-alike lines
(MoE, KV cache, vision) rendered from the same release never become the attention backend, and the shipped
format data is exactly what ``tools/gen_log_formats.py`` generates from the real sources (it cannot go stale)."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from mla_doctor.diagnosis.log_reading import load_formats, meaning_of, read_log
from tests.support.corpus import RELEASES, cached_json, ensure

pytestmark = pytest.mark.corpus

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("gen_log_formats", ROOT / "tools" / "gen_log_formats.py")
gen = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gen)

_TOKEN = re.compile(r"%%|%[-+ #0]*\d*(?:\.\d+)?[sdifrx]|\{[^{}]*\}")
SAMPLE = "FLASHMLA"


def render(fmt: str, value: str = SAMPLE) -> str:
    """A log line as vLLM would print it: every placeholder given a sample value."""
    return _TOKEN.sub(lambda m: "%" if m.group() == "%%" else ("7" if m.group()[-1] in "di" else value), fmt)


_HARVEST: dict = {}
# the harvester's own source: a changed harvester re-harvests every release, an unchanged one reads the cache
HARVESTER_SRC = (ROOT / "mla_doctor" / "agent" / "facts" / "log_formats.py").read_text(encoding="utf-8")


def harvested(dist: str, version: str, whole: bool = False) -> list:
    key = (gen.release_key(dist, version), whole)
    if key not in _HARVEST:
        def build():
            return gen.harvester.harvest_tree(str(ensure(dist, version) / "vllm"), whole=whole)
        _HARVEST[key] = cached_json("log-formats-whole" if whole else "log-formats", dist, version, HARVESTER_SRC,
                                    build)
    return _HARVEST[key]


@pytest.mark.parametrize("dist, version", RELEASES)
def test_fast_harvest_equals_the_whole_file_parse(dist, version):
    """What the agent sends (candidate statements only) is exactly what parsing every module whole gives."""
    assert harvested(dist, version) == harvested(dist, version, whole=True)


@pytest.mark.parametrize("dist, version", RELEASES)
def test_shipped_data_is_what_the_generator_writes(dist, version):
    key = gen.release_key(dist, version)
    doc = load_formats()
    assert key in doc["releases"], f"{key} missing: run python tools/gen_log_formats.py"
    assert gen.records(doc, key) == harvested(dist, version), f"{key} stale: run python tools/gen_log_formats.py"


@pytest.mark.parametrize("dist, version", RELEASES)
def test_backend_formats_parse_to_their_meaning(dist, version):
    recs = harvested(dist, version)
    key = gen.release_key(dist, version)
    checked = 0
    for r in recs:
        mean = meaning_of(r["format"], r["level"])
        if mean.kind not in ("attention_backend", "prefill_backend"):
            continue
        line = "INFO 01-01 00:00:00 [x.py:1] " + render(r["format"])
        got = read_log([line], version=version if dist == "vllm" else version + "+cpu")
        fact = got.attention_backend if mean.kind == "attention_backend" else got.prefill_backend
        assert fact is not None, (r, line)
        assert fact.kind == mean.kind and key in fact.releases, (r, line, fact)
        if mean.arg:
            assert fact.value == SAMPLE, (r, line, fact.value)
        checked += 1
    assert checked >= 1


@pytest.mark.parametrize("dist, version", RELEASES)
def test_look_alike_lines_never_become_the_attention_backend(dist, version):
    recs = harvested(dist, version)
    looks = [r for r in recs if meaning_of(r["format"], r["level"]).kind in ("moe", "kv_cache", "vision")
             and r["level"] != "raise"]
    if version not in ("0.7.3",):
        assert looks, "no MoE / KV-cache / vision format harvested"
    for r in looks:
        for value in (SAMPLE, "FLASHINFER_MLA", "'FLASHINFER_TRTLLM'"):
            line = "(EngineCore_DP0 pid=1) INFO 01-01 00:00:00 [x.py:1] " + render(r["format"], value)
            for v in (version, None):
                got = read_log([line], version=v)
                assert got.attention_backend is None, (r, line, got.attention_backend)
