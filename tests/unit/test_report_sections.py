"""The typed report sections (mla_doctor/report_sections.py) keep the JSON contract: a section read from a saved
report or built from a recorded agent answer serialises back to the same JSON, byte for byte (keys, order,
values, omissions); the keys are in the order the report is built in; a missing or ill-typed key reads as the
readers' fallback and still serialises as it was given; secrets are redacted through a section."""
from __future__ import annotations

import copy
import dataclasses
import json

import pytest

from mla_doctor.diagnosis.knowledge import load_knowledge
from mla_doctor.diagnosis.static_facts import verify_static
from mla_doctor.host.audit import build_static_report
from mla_doctor.report_sections import SECTIONS, LogSection, ModelSection, ServerSection, StaticSection, VllmSection
from mla_doctor.results import HostReport, RunReport, host_to_dict, plain
from tests.support.fake_agent import load

RECORDINGS = {name: load(name) for name in ("static_local", "run_local")}


def _dumps(x) -> str:
    return json.dumps(x, sort_keys=False)


def _answers():
    """Every recorded agent `static` answer, and the edits that take the report's other branches."""
    from tests.unit.test_server_install import other_python

    for name, doc in RECORDINGS.items():
        for i, ex in enumerate(e for e in doc["exchanges"] if e.get("kind") == "agent" and e["op"] == "static"):
            ans = ex["answer"]
            yield f"{name}[{i}]", copy.deepcopy(ans)
            no_server = copy.deepcopy(ans)
            no_server["servers"] = []
            yield f"{name}[{i}] no server", no_server
            no_log = copy.deepcopy(ans)
            no_log["log"] = {"found": False, "reason": "no log here"}
            yield f"{name}[{i}] no log", no_log
            two = copy.deepcopy(ans)
            two["servers"] = two["servers"] * 2
            two.update(lookalikes=[{"pid": 9, "why": "not listening"}], server_error="ps failed")
            yield f"{name}[{i}] two servers", two
            yield f"{name}[{i}] other install", other_python(copy.deepcopy(ans))


ANSWERS = dict(_answers())


@pytest.fixture(scope="module")
def kb():
    return load_knowledge()


@pytest.mark.parametrize("name", sorted(RECORDINGS))
def test_every_saved_report_section_round_trips_byte_for_byte(name):
    for h in RECORDINGS[name]["report"]["hosts"]:
        for key, cls in SECTIONS.items():
            saved = h.get(key)
            got = cls.from_dict(saved)
            assert (got is None) == (saved is None), key
            if got is not None:
                assert _dumps(got.to_dict()) == _dumps(saved), (name, key)
                assert got == saved and dict(got) == saved  # reads as the JSON it serialises to


@pytest.mark.parametrize("case", sorted(ANSWERS))
def test_every_built_section_round_trips_byte_for_byte(case, kb):
    report = build_static_report("gpu-1", copy.deepcopy(ANSWERS[case]), kb)
    d = host_to_dict(report)
    for key, cls in SECTIONS.items():
        built = getattr(report, key)
        assert built is None or isinstance(built, cls), key  # typed where the report is built
        if built is not None:
            again = cls.from_dict(json.loads(_dumps(d[key])))  # as `report render` reads a saved report
            assert _dumps(again.to_dict()) == _dumps(d[key]) == _dumps(plain(built)), (case, key)
    # the whole host, through the JSON and back into a HostReport's sections: the same JSON again
    back = HostReport(host="gpu-1", **{k: SECTIONS[k].from_dict(d[k]) for k in SECTIONS})
    assert {k: host_to_dict(back)[k] for k in SECTIONS} == {k: d[k] for k in SECTIONS}
    assert _dumps({k: host_to_dict(back)[k] for k in SECTIONS}) == _dumps({k: d[k] for k in SECTIONS})


def test_the_sections_keys_are_in_the_order_the_report_is_built_in(kb):
    ans = copy.deepcopy(ANSWERS["static_local[0] two servers"])
    d = host_to_dict(build_static_report("gpu-1", ans, kb))
    audit = plain(verify_static(kb.for_version(ans["vllm"]["version"]), ans))
    scan = ["modified_files", "instrumented_files", "missing_files", "unrecorded_files", "unreadable_files",
            "py_files", "integrity"]
    assert list(d["static"]) == [*audit, *scan, *ans["side_code"], *(["code_paths"] if "code_paths" in
                                                                     d["static"] else [])]
    assert list(d["server"]) == ["running", *ans["servers"][0], "others", "lookalikes", "server_error"]
    assert list(d["model"]) == [*ans["model"], "classification"]
    assert list(d["vllm"]) == [f.name for f in dataclasses.fields(VllmSection)][:-2]
    # the recorded server's log is its stdout, read through /proc/PID/fd/1: read_via, between evidence and formats
    assert ans["log"]["read_via"].startswith("/proc/")
    assert list(d["log"])[:3] == ["source", "total_lines", "evidence"] and list(d["log"])[3:] == ["read_via",
                                                                                                    "formats"]
    no_log = copy.deepcopy(ANSWERS["static_local[0] no log"])
    assert host_to_dict(build_static_report("gpu-1", no_log, kb))["log"] == {"source": None, "reason": "no log here"}
    other = host_to_dict(build_static_report("gpu-1", copy.deepcopy(ANSWERS["static_local[0] other install"]), kb))
    assert list(other["server"])[-1] == "other_install" and other["model"] is None


def test_a_missing_or_ill_typed_key_reads_as_the_fallback_and_serialises_as_given():
    saved = {"zeta": 1, "decode_thresholds": None, "modified_files": "x.py", "integrity": "checked"}
    st = StaticSection.from_dict(saved)
    assert st.decode_thresholds == {} and st.modified_files == [] and st.sparse_gate == {}  # the readers' `or {}`
    assert st.integrity == "checked" and st.code_paths is None and st.symbol("prefill_entry") is None
    assert _dumps(st.to_dict()) == _dumps(saved) and list(st) == list(saved)
    assert StaticSection.from_dict(None) is None and StaticSection.of(None) == {} and not StaticSection.of(None)
    assert StaticSection.of(st) is st  # a typed section is used as is (its identity carries the log formats)
    srv = ServerSection.from_dict({"running": True, "pid": 7})
    assert (srv.running, srv.pid, srv.supervisor, srv.argv) == (True, 7, {}, [])
    moved = srv.with_(supervisor={"kind": "docker"}, pid=8)
    assert _dumps(moved.to_dict()) == _dumps({"running": True, "pid": 8, "supervisor": {"kind": "docker"}})
    assert srv.to_dict() == {"running": True, "pid": 7}  # frozen: with_ is a copy
    with pytest.raises(dataclasses.FrozenInstanceError):
        srv.pid = 9  # type: ignore[misc]
    assert ModelSection.of({"config": {"index_topk": 2048}}).config["index_topk"] == 2048
    assert LogSection.of({"source": None, "reason": "none"}).evidence == {}


def test_a_secret_in_a_typed_section_is_redacted_in_every_rendering():
    h = HostReport(host="gpu-1", server=ServerSection.from_dict(
        {"running": True, "argv": ["vllm", "serve", "--api-key", "sk-typed"], "env": {"HF_TOKEN": "hf_typed"}}))
    for text in (_dumps(RunReport("static", [h]).to_dict()), repr(h.redacted().server)):
        assert "sk-typed" not in text and "hf_typed" not in text and "vllm" in text
    assert isinstance(h.redacted().server, ServerSection) and h.server["argv"][-1] == "sk-typed"
