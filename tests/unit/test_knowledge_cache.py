"""The knowledge's cached copy (knowledge.load_data): the same data as the YAML, and an edited file is read afresh."""
from __future__ import annotations

import os
import pickle

import yaml

from mla_doctor.diagnosis import knowledge


def test_cached_copy_is_the_yaml_data_and_is_used(tmp_path, monkeypatch):
    monkeypatch.setenv("MLA_DOCTOR_KNOWLEDGE_CACHE", str(tmp_path / "kc"))
    with open(knowledge.DATA_FILE, encoding="utf-8") as f:
        truth = yaml.safe_load(f)
    assert knowledge.load_data(knowledge.DATA_FILE) == truth  # a miss: read, stored
    (entry,) = (tmp_path / "kc").glob("*.pickle")
    with open(entry, "rb") as f:
        assert pickle.load(f) == truth
    assert knowledge.load_data(knowledge.DATA_FILE) == truth  # a hit
    # the hit really is the stored copy (not a fresh YAML read): a marker put in the entry comes back
    entry.write_bytes(pickle.dumps(dict(truth, marker=1)))
    assert knowledge.load_data(knowledge.DATA_FILE)["marker"] == 1
    # a directory others may write to is not trusted: the YAML is read
    os.chmod(tmp_path / "kc", 0o777)
    assert "marker" not in knowledge.load_data(knowledge.DATA_FILE)


def test_an_edited_yaml_is_read_afresh(tmp_path, monkeypatch):
    monkeypatch.setenv("MLA_DOCTOR_KNOWLEDGE_CACHE", str(tmp_path / "kc"))
    f = tmp_path / "k.yaml"
    f.write_text("newest_known: '0.33.0'\nheads: {16: 32}\n")
    assert knowledge.load_data(f) == {"newest_known": "0.33.0", "heads": {16: 32}}
    f.write_text("newest_known: '0.34.0'\nheads: {16: 32}\n")
    assert knowledge.load_data(f) == {"newest_known": "0.34.0", "heads": {16: 32}}
    assert len(list((tmp_path / "kc").glob("*.pickle"))) == 2


def test_off_reads_the_yaml_and_stores_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("MLA_DOCTOR_KNOWLEDGE_CACHE", "off")
    monkeypatch.setenv("MLA_DOCTOR_CACHE", str(tmp_path / "c"))
    f = tmp_path / "k.yaml"
    f.write_text("a: 1\n")
    assert knowledge.load_data(f) == {"a": 1}
    assert not (tmp_path / "c").exists()
