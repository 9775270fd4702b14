"""The resolution once per release (agent/facts/resolve_hint.py, remote/resolve_cache.py), on the real vLLM
0.33.0 tree: a second audit takes the stored answer, and it is exactly the one the agent computes; a tree the
scan does not prove (one file edited) is resolved again, never answered from the cache; a key the controller no
longer holds is an error, never a guess."""
from __future__ import annotations

import json

import pytest

from mla_doctor.agent.facts import resolve_hint
from mla_doctor.diagnosis.knowledge import load_knowledge
from mla_doctor.host.audit import AuditOptions, static_request
from mla_doctor.remote import protocol, resolve_cache
from mla_doctor.ssh.local import LocalTransport
from tests.support import corpus


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    if not (corpus.tree_dir("vllm", "0.33.0") / ".complete").exists():
        pytest.fail("vLLM 0.33.0 sources not cached: `make unit` fetches them first")
    venv = corpus.release_venv(tmp_path_factory.mktemp("resolve-cache") / "venv", "vllm", "0.33.0")
    return str(venv / "bin" / "python"), next(venv.glob("lib/python3*/site-packages"))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MLA_DOCTOR_RESOLVE_CACHE", str(tmp_path / "resolve"))
    monkeypatch.setenv("MLA_DOCTOR_PARSE_CACHE", "off")
    monkeypatch.setenv("MLA_DOCTOR_FORMATS_CACHE", "off")
    return tmp_path / "resolve"


def audit(py, seen):
    """One static audit of the release (no model given): the agent's raw resolution before the merge in `seen`."""
    real = resolve_cache.merge

    def spy(raw, store=True, host=None):
        seen.append(json.loads(json.dumps(raw.get("resolution"))))
        real(raw, store, host)

    resolve_cache.merge = spy
    try:
        req = static_request(load_knowledge(), AuditOptions(python=py, model="/nonexistent-model-dir"))
        return protocol.call(LocalTransport(), req, python=py).raw
    finally:
        resolve_cache.merge = real


def test_second_audit_takes_the_stored_answer_which_is_the_computed_one(release, cache):
    py, _site = release
    seen: list = []
    first = audit(py, seen)
    assert seen[0].get("cache_key") and "architectures" in seen[0], "the first audit resolves and keys it"
    assert "cache_key" not in first["resolution"], "the key is the cache's, never in the answer"
    assert len(list(cache.rglob("*.json"))) == 1
    second = audit(py, seen)
    assert seen[1] == {"cached": seen[0]["cache_key"]}, "the second audit of the release resolves nothing"
    assert second["resolution"] == first["resolution"]
    assert not [e for e in second.get("errors") or [] if e["step"] == "resolution"]


def test_a_tree_the_scan_does_not_prove_is_resolved_again(release, cache):
    py, site = release
    seen: list = []
    audit(py, seen)
    f = site / "vllm" / "model_executor" / "models" / "deepseek_v2.py"
    data = f.read_bytes()
    try:
        f.write_bytes(data + b"\n# edited\n")
        audit(py, seen)
    finally:
        f.write_bytes(data)
    assert "cached" not in seen[1] and "cache_key" not in seen[1], "an edited tree is never keyed"
    assert seen[1]["architectures"]


def test_tree_key_needs_a_clean_scan():
    rec = {"vllm/a.py": "sha256=x", "vllm/b.py": "sha256=y"}
    clean = {"modified": [], "unrecorded": [], "missing": [], "unreadable": [], "instrumented": []}
    assert resolve_hint.tree_key(rec, clean)
    for k in clean:
        assert resolve_hint.tree_key(rec, dict(clean, **{k: ["vllm/a.py"]})) is None, k
    assert resolve_hint.tree_key(dict(rec, **{"vllm/c.py": ""}), clean) is None
    assert resolve_hint.tree_key(None, clean) is None


def test_a_key_no_longer_held_is_an_error_never_a_guess(cache):
    raw = {"resolution": {"cached": "ab" * 32}, "errors": []}
    resolve_cache.merge(raw)
    assert raw["resolution"] is None
    assert raw["errors"] == [{"step": "resolution", "error": "resolve cache: no entry for key " + "ab" * 32}]


def test_a_remote_hosts_answer_serves_that_host_alone(cache):
    """A remote host's answer is believed for its own report: stored for it, never under a key others share."""
    key = "cd" * 32
    resolve_cache.merge({"resolution": {"scope": "all_mla", "cache_key": key}}, store=False, host="gpu-17")
    assert [p[:4] for p in resolve_cache.known("gpu-17")] == ["cdcd"]
    assert resolve_cache.known("gpu-18") == [] and resolve_cache.known() == []
    mine = {"resolution": {"cached": key}}
    resolve_cache.merge(mine, store=False, host="gpu-17")
    assert mine["resolution"] == {"scope": "all_mla"}
    other = {"resolution": {"cached": key}}
    resolve_cache.merge(other, store=False, host="gpu-18")
    assert other["resolution"] is None and other["errors"]
    # a second host on the same release: its own key file, the one answer kept once
    resolve_cache.merge({"resolution": {"scope": "all_mla", "cache_key": key}}, store=False, host="gpu-18")
    assert len(list(cache.rglob("answers/*.json"))) == 1 and len(list(cache.rglob("hosts/*/*.json"))) == 2
    # an answer changed on disk is not believed
    blob = next(cache.rglob("answers/*.json"))
    blob.write_bytes(blob.read_bytes().replace(b"all_mla", b"forged!"))
    bad = {"resolution": {"cached": key}}
    resolve_cache.merge(bad, store=False, host="gpu-17")
    assert bad["resolution"] is None
    # this machine's agent: for every host
    resolve_cache.merge({"resolution": {"scope": "model", "cache_key": "ef" * 32}}, store=True, host="local")
    assert "efefefefefefefef" in resolve_cache.known("gpu-18") and "efefefefefefefef" in resolve_cache.known()
