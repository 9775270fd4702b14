"""Per release of the corpus, the knowledge's backends against the classes in the release's own sources (read with
``ast``, tests/support/vllm_classes.py): every MLA ``*Impl`` with a decode entry is a backend the knowledge knows
for that release (or on its commented ``not_backends`` list), every backend the knowledge names for a release has
its class there (a range never starts too early), and each backend's CUDA-graph support level is the one its
metadata builder declares in that release."""
from __future__ import annotations

import pytest
from packaging.specifiers import SpecifierSet

from mla_doctor.diagnosis.knowledge import load_knowledge, parse_version
from tests.support import corpus
from tests.support.vllm_classes import Release

pytestmark = pytest.mark.corpus

RELEASES = [pytest.param(d, v, id="%s-%s" % (d, v)) for d, v in corpus.ALL_RELEASES]
_RELEASE: dict = {}


def release(dist: str, version: str) -> Release:
    if (dist, version) not in _RELEASE:
        _RELEASE[(dist, version)] = Release(dist, version)
    return _RELEASE[(dist, version)]


def not_backends(version: str) -> dict:
    v = parse_version(version)
    return {it["class"]: it["why"] for it in load_knowledge().data.get("not_backends") or []
            if v in SpecifierSet(it["versions"])}


def decode_entries(version: str):
    return [(b, e) for b in load_knowledge().for_version(version).backends for e in b.decode]


@pytest.mark.parametrize("dist, version", RELEASES)
def test_every_mla_impl_is_a_backend_of_the_knowledge(dist, version):
    """An ``*Impl`` that defines or inherits forward_mqa/_forward_decode is some backend's decode entry: the class
    that defines the method is the entry's symbol class (in its def file), and an inheriting class lives in the
    entry's file — or the class is on the knowledge's ``not_backends`` list (an inheriting class too)."""
    rel = release(dist, version)
    entries = decode_entries(version)
    skip = not_backends(version)
    found, unknown = [], []
    for cls, method, owner in rel.impls_with_decode():
        if cls["name"] in skip or owner["name"] in skip:
            continue
        found.append(cls["name"])
        ok = any(e.symbol == "%s.%s" % (owner["name"], method) and e.def_path == owner["file"]
                 and (cls is owner or e.file == cls["file"]) for _b, e in entries)
        if not ok:
            unknown.append("%s (%s, decode %s.%s)" % (cls["name"], cls["file"], owner["name"], method))
    assert found or version == "0.7.0", "no MLA impl found: the scan is broken"  # MLA landed in 0.7.1
    assert not unknown, "%s: MLA impls no backend of the knowledge names for this release: %s" % (version, unknown)


@pytest.mark.parametrize("dist, version", RELEASES)
def test_every_backend_named_for_a_release_is_in_it(dist, version):
    """A backend the knowledge gives for a release has its decode entry there: the file, and the class defining the
    method in the def file (so a range that starts too early fails here, one that starts late fails above)."""
    rel = release(dist, version)
    missing = []
    for b, e in decode_entries(version):
        cls, meth = e.symbol.split(".")
        if not (rel.vllm / e.file).is_file():
            missing.append("%s: no %s" % (b.name, e.file))
        elif not any(r["file"] == e.def_path and meth in r["methods"] for r in rel.by_name.get(cls, [])):
            missing.append("%s: no %s in %s" % (b.name, e.symbol, e.def_path))
    assert not missing, (version, missing)


@pytest.mark.parametrize("dist, version", RELEASES)
def test_not_backends_are_in_the_release(dist, version):
    """The exclusion list is exact: each class it names for a release is there with a decode entry."""
    rel = release(dist, version)
    have = {cls["name"] for cls, _m, _o in rel.impls_with_decode()}
    assert not set(not_backends(version)) - have, (version, sorted(set(not_backends(version)) - have))


@pytest.mark.parametrize("dist, version", RELEASES)
def test_cudagraph_support_is_what_the_builder_declares(dist, version):
    """Each V1 backend's ``cudagraph`` level is its metadata builder's ``AttentionCGSupport`` in that release (class
    attribute or ``get_cudagraph_support``, inherited or not; for a level that depends on the configuration, the
    default). ``NONE`` (a CPU backend: the platform has no CUDA graphs) stands for NEVER or nothing declared."""
    rel = release(dist, version)
    wrong, checked = [], 0
    for b in load_knowledge().for_version(version).backends:
        v1 = [e for e in b.decode if e.engine != "V0"]
        if not v1:
            continue
        e = v1[0]
        cls, meth = e.symbol.split(".")
        backends = rel.backend_class(e.file, b.get_name or "", cls, meth)
        if len(backends) > 1:  # a model-private backend reusing the name (deepseek_v32/amd): the entry's file decides
            backends = [r for r in backends if r["file"] == e.file] or backends
        assert len(backends) == 1, (b.name, [(r["name"], r["file"]) for r in backends])
        builder = rel.builder_of(backends[0])
        assert builder is not None, (b.name, backends[0]["name"])
        default, levels, where = rel.cudagraph_support(builder)
        ok = default == b.cudagraph or (b.cudagraph == "NONE" and default in (None, "NEVER"))
        if not ok:
            wrong.append("%s: knowledge %s, builder %s declares %s (of %s, in %s)" % (
                b.name, b.cudagraph, builder["name"], default, levels, (where or {}).get("name")))
        checked += 1
    assert not wrong, (version, wrong)
    if parse_version(version) >= parse_version("0.8"):
        assert checked, "no V1 backend checked"
