"""What a fleet audit does once per process instead of once per host (issue "hardware floor": controller CPU
per host): the encoded plan, the identity key, the caches' digest lists — each reused only while it is
exactly what would be built again."""
from __future__ import annotations

import copy
import json
import os

import paramiko
import pytest

from mla_doctor.diagnosis.knowledge import load_knowledge
from mla_doctor.host.audit import AuditOptions, static_plan
from mla_doctor.remote import bundle, formats_cache, parse_cache
from mla_doctor.ssh import transport


@pytest.fixture(scope="module")
def plan():
    return static_plan(load_knowledge(), AuditOptions(python="/opt/ml-env/bin/python"))


def _decoded(stdin: bytes) -> dict:
    return json.loads(stdin[len(bundle.payload()):])


def test_an_equal_plan_reuses_the_bytes_and_any_difference_encodes_anew(plan):
    first = bundle.agent_stdin(plan)
    again = bundle.agent_stdin(copy.deepcopy(plan))
    assert again is first and _decoded(again) == plan  # equal plan, another object: the same bytes
    other = copy.deepcopy(plan)
    other["index"]["files"] = other["index"]["files"][:-1]  # one named file less, deep inside
    assert _decoded(bundle.agent_stdin(other)) == other != plan
    assert _decoded(bundle.agent_stdin(dict(plan, log="/var/log/x.log")))["log"] == "/var/log/x.log"


def test_the_same_plan_object_changed_in_place_is_encoded_again(plan):
    p = copy.deepcopy(plan)
    bundle.agent_stdin(p)
    p["model"] = "/models/changed"
    assert _decoded(bundle.agent_stdin(p))["model"] == "/models/changed"


def test_a_new_payload_is_never_paired_with_old_bytes(plan, monkeypatch):
    before = bundle.agent_stdin(copy.deepcopy(plan))
    monkeypatch.setattr(bundle, "payload", lambda: b"MLAD-another-payload")
    assert bundle.agent_stdin(copy.deepcopy(plan)).startswith(b"MLAD-another-payload")
    monkeypatch.undo()
    assert bundle.agent_stdin(copy.deepcopy(plan)) == before


def test_the_compiled_agent_is_never_taken_from_the_reused_bytes(plan, tmp_path, monkeypatch):
    monkeypatch.setenv("MLA_DOCTOR_AGENT_CODE_CACHE", str(tmp_path / "code"))
    plain_bytes = bundle.agent_stdin(copy.deepcopy(plan))
    compiled = bundle.agent_stdin(copy.deepcopy(plan), compiled=True)
    assert compiled != plain_bytes and compiled[len(bundle.payload()):].startswith(b"MLAC")


def _key_file(tmp_path, name="id_ed25519", password=None):
    """A new ed25519 key in OpenSSH's format (what ssh-keygen writes), encrypted with `password` if given."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    enc = serialization.BestAvailableEncryption(password.encode()) if password else serialization.NoEncryption()
    path = tmp_path / name
    path.write_bytes(Ed25519PrivateKey.generate().private_bytes(serialization.Encoding.PEM,
                                                                serialization.PrivateFormat.OpenSSH, enc))
    path.chmod(0o600)
    return str(path)


def test_an_identity_is_loaded_once_while_its_file_stays_as_it_is(tmp_path, monkeypatch):
    path = _key_file(tmp_path)
    calls = []
    real = paramiko.Ed25519Key.from_private_key_file.__func__

    def counting(cls, filename, password=None):
        calls.append(filename)
        return real(cls, filename, password)

    monkeypatch.setattr(paramiko.Ed25519Key, "from_private_key_file", classmethod(counting))
    a = transport.identity_key(path)
    b = transport.identity_key(path)
    assert a is b and isinstance(a, paramiko.Ed25519Key) and calls == [path]
    want = paramiko.Ed25519Key.from_private_key_file(path)
    assert a.get_fingerprint() == want.get_fingerprint()
    os.remove(path)
    path2 = _key_file(tmp_path)  # a new key at the same path: read afresh
    c = transport.identity_key(path2)
    assert c is not a and c.get_fingerprint() == paramiko.Ed25519Key.from_private_key_file(path2).get_fingerprint()


def test_a_key_that_needs_a_passphrase_is_left_to_paramiko(tmp_path):
    assert transport.identity_key(_key_file(tmp_path, "id_locked", password="secret-pass")) is None
    assert transport.identity_key(str(tmp_path / "no-such-key")) is None


def test_the_digest_lists_follow_the_manifests(tmp_path, monkeypatch, plan):
    """The plan's digest prefixes are built once per manifest content: a changed manifest gives new ones."""
    monkeypatch.setenv("MLA_DOCTOR_PARSE_CACHE", str(tmp_path / "parse"))
    rel = plan["index"]["files"][0]
    man = parse_cache._manifest(tmp_path / "parse", "3.11", plan["symbols"])
    man.parent.mkdir(parents=True)
    (tmp_path / "parse").chmod(0o700)
    man.write_text(json.dumps({rel: {"a" * 64: ["X"]}}))
    assert parse_cache.known(plan["symbols"], plan["index"]["files"]) == {"3.11": {rel: {"a" * 16: ["X"]}}}
    man.write_text(json.dumps({rel: {"b" * 64: ["Y"], "a" * 64: ["X"]}}))
    os.utime(man, ns=(1, 1))  # another mtime, as any rewrite gives
    assert parse_cache.known(plan["symbols"], plan["index"]["files"]) == {
        "3.11": {rel: {"b" * 16: ["Y"], "a" * 16: ["X"]}}}
    fdir = formats_cache._dir(tmp_path / "parse", "3.11")
    fdir.mkdir(parents=True)
    (fdir / "manifest.json").write_text(json.dumps({"c" * 64: "p1"}))
    assert formats_cache.known() == {"3.11": ["c" * 16]}
    (fdir / "manifest.json").write_text(json.dumps({"c" * 64: "p1", "d" * 64: "p2"}))
    os.utime(fdir / "manifest.json", ns=(2, 2))
    assert formats_cache.known() == {"3.11": ["c" * 16, "d" * 16]}
