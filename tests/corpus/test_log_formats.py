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


# The kinds part 2b of issue 10 renders besides the backends: what a line of each means to the report.
STATE_KINDS = ("engine", "cudagraph", "eager", "fatal")
_LEVELS = {"debug": "DEBUG", "info": "INFO", "warning": "WARNING", "error": "ERROR", "critical": "CRITICAL"}
# a CUDA-graph line that states the mode it sets ("Overriding cudagraph_mode to PIECEWISE", "... from %s to X",
# "setting cudagraph mode to X", "Fallback to cudagraph_mode=NONE"); advice ("use cudagraph_mode=NONE instead") is not
_STATED_MODE = re.compile(r"(?i)(?:setting|overriding|fallback to) cudagraph[_ ]mode(?: from \S+)? "
                          r"(?:to |=)([A-Z_]{4,})")


def logged(r: dict, value: str) -> str:
    """The first line vLLM prints for the format (a multi-line message continues on lines of its own): a raise
    as the exception's ``Type: message`` in a worker's output, a logger call with vLLM's prefix."""
    msg = render(r["format"], value).split("\n")[0]
    if r["level"] == "raise":
        return f"(EngineCore_DP0 pid=1) {r.get('exc') or 'RuntimeError'}: {msg}"
    return f"(EngineCore_DP0 pid=1) {_LEVELS.get(r['level'], 'ERROR')} 01-01 00:00:00 [x.py:1] {msg}"


def _edge_space(r: dict) -> str | None:
    """The formats whose printed line loses edge whitespace (once unread; asserted read below)."""
    if r["level"] == "raise" and r["format"][:1].isspace():
        return "raise_leading_space"    # ValueError(" The selected backend, ...") prints "ValueError:  The ..."
    if r["format"].endswith(", ") and meaning_of(r["format"], r["level"]).kind == "engine":
        return "v0_engine_trailing"     # "... use_cached_outputs=%s, ": the logged line is rstripped
    return None


def _state_records(dist: str, version: str) -> list:
    return [r for r in harvested(dist, version) if meaning_of(r["format"], r["level"]).kind in STATE_KINDS]


@pytest.mark.parametrize("dist, version", RELEASES)
def test_engine_cudagraph_and_fatal_formats_parse_to_their_meaning(dist, version):
    """Every engine, CUDA-graph (mode, capture, downgrade raise), eager and fatal format of the release, rendered,
    is read by log_reading as its meaning — V0/V1 for the engine, the cudagraph fact, a fatal line — and none is
    ever the attention backend."""
    stated = version if dist == "vllm" else version + "+cpu"
    recs = _state_records(dist, version)
    kinds = {meaning_of(r["format"], r["level"]).kind for r in recs}
    assert {"engine", "cudagraph", "fatal"} <= kinds, kinds
    lines = [logged(r, version) for r in recs]
    for v in (stated, None):   # the release stated, and a log that states none (every release's formats)
        got = read_log(lines, version=v, scope=False)   # one reading for all: each line keeps its own fact
        assert got.attention_backend is None and got.prefill_backend is None, got.attention_backend
        by_n = {f.n: f for f in got.facts}
        for n, r in enumerate(recs, 1):
            mean = meaning_of(r["format"], r["level"])
            fact = by_n.get(n)
            assert fact is not None and fact.kind == mean.kind, (r, lines[n - 1], fact)
            if mean.kind == "fatal":
                assert fact in got.fatal, (r, fact)
        assert len(got.fatal) == sum(1 for r in recs if meaning_of(r["format"], r["level"]).kind == "fatal")
    for r in recs:   # the engine line alone: the engine it names and the release it states
        mean = meaning_of(r["format"], r["level"])
        if mean.kind != "engine":
            continue
        got = read_log([logged(r, version)], version=stated)
        assert got.engine == mean.engine and got.engine_line is not None, (r, got.engine)
        assert got.engine_line.value == version and got.cudagraph_mode is None, (r, got.engine_line)


def test_edge_whitespace_formats_are_read():
    """The V0 engine line (its format ends in ", ", rstripped in the log) and the raises whose message starts
    with a space ("ValueError:  The selected backend, ...") are read as their meaning: the engine and release it
    states, the fatal line and its exception."""
    seen = set()
    for dist, version in RELEASES:
        stated = version if dist == "vllm" else version + "+cpu"
        for r in _state_records(dist, version):
            why = _edge_space(r)
            if not why:
                continue
            seen.add(why)
            got = read_log([logged(r, version)], version=stated)
            mean = meaning_of(r["format"], r["level"])
            facts = [f for f in got.facts if f.kind == mean.kind]
            assert len(facts) == 1 and facts[0].format == r["format"], (r, got.facts)
            if why == "v0_engine_trailing":
                assert got.engine == "V0" and got.engine_line.value == version, (r, got.engine_line)
            else:
                assert got.fatal == facts and facts[0].value == (r.get("exc") or "RuntimeError"), (r, facts)
    assert seen == {"raise_leading_space", "v0_engine_trailing"}


def test_cudagraph_lines_that_state_a_mode_set_it():
    wrong = []
    for dist, version in RELEASES:
        for r in _state_records(dist, version):
            mode = _STATED_MODE.search(r["format"])
            if not mode or r["level"] == "raise" or meaning_of(r["format"], r["level"]).kind != "cudagraph":
                continue
            got = read_log([logged(r, "FULL_AND_PIECEWISE")], version=version if dist == "vllm" else version + "+cpu")
            if got.cudagraph_mode != mode.group(1):
                wrong.append((version, r["format"][:80], got.cudagraph_mode))
    assert not wrong, wrong
