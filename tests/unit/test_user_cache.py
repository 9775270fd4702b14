"""The controller's caches are believed (parse results, harvested formats) or run (pickled knowledge, marshalled
agent code): one rule (mla_doctor/user_cache.py) keeps them to directories no other user may write to, and a
cache entry is tied to the code that made it."""
from __future__ import annotations

import os

from mla_doctor import user_cache
from mla_doctor.diagnosis.knowledge import load_data
from mla_doctor.remote import parse_cache

from tests.unit.test_parse_cache import audit  # noqa: F401 - the fixture's audit helper
from tests.unit.test_parse_cache import tree  # noqa: F401 - pytest fixture


def test_a_directory_others_may_write_to_is_never_used(tmp_path, monkeypatch):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o700)
    monkeypatch.setenv("MLA_DOCTOR_PARSE_CACHE", str(shared))
    assert user_cache.directory("parse", "MLA_DOCTOR_PARSE_CACHE") == shared
    os.chmod(shared, 0o777)  # another local user could plant entries
    assert user_cache.directory("parse", "MLA_DOCTOR_PARSE_CACHE") is None and parse_cache.cache_dir() is None
    os.chmod(shared, 0o700)
    os.chmod(tmp_path, 0o777)  # ... or swap the directory itself through its parent
    try:
        assert not user_cache.private(shared) and not user_cache.ensure(shared)
    finally:
        os.chmod(tmp_path, 0o700)
    sticky = tmp_path / "sticky"
    sticky.mkdir(mode=0o1777)
    os.chmod(sticky, 0o1777)  # like /tmp: others may not rename what is ours
    mine = sticky / "mine"
    assert user_cache.ensure(mine) and (mine.stat().st_mode & 0o777) == 0o700


def test_knowledge_is_not_unpickled_from_a_shared_directory(tmp_path, monkeypatch):
    yml = tmp_path / "k.yaml"
    yml.write_text("a: 1\n")
    cache = tmp_path / "kc"
    monkeypatch.setenv("MLA_DOCTOR_KNOWLEDGE_CACHE", str(cache))
    assert load_data(yml) == {"a": 1} and len(list(cache.glob("*.pickle"))) == 1
    entry = next(cache.glob("*.pickle"))
    import pickle

    entry.write_bytes(pickle.dumps({"a": "planted"}))
    assert load_data(yml) == {"a": "planted"}  # private: the entry is believed (content-keyed, this user's)
    os.chmod(cache, 0o757)
    assert load_data(yml) == {"a": 1}  # others may write there: the YAML itself is read


def test_parse_entries_of_another_parser_version_are_not_read(tree, monkeypatch):  # noqa: F811
    sent1, first, _ = audit(tree)
    assert sent1["v1/common.py"]["parser"] == "ast"
    assert audit(tree)[0]["v1/common.py"]["parser"] == "cached"
    monkeypatch.setattr(parse_cache, "tag", lambda: "another-parser")
    sent3, third, known = audit(tree)
    assert known == {} and sent3["v1/common.py"]["parser"] == "ast" and third == first
