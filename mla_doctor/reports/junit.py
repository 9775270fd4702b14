"""JUnit XML: one <testsuite> per host, one <testcase> per check (connect, each step, each finding).

A `fail` finding is a <failure>; an unreachable host's `connect` and a step that could not run are
<error>s; a host that was not run (--max-fail-percent) is <skipped>; a `warn` or `info` finding is a passing
case with its text in <system-out> (a warning never turns CI red). Every text and attribute passes
`terminal.xml`: the file stays valid XML 1.0 and no control character reaches a CI log.
"""
from __future__ import annotations

import xml.etree.ElementTree as ET

from mla_doctor import terminal
from mla_doctor.report_sections import VllmSection


def _case(suite: ET.Element, host: str, name: str, time_s: float = 0.0) -> ET.Element:
    return ET.SubElement(suite, "testcase", name=name, classname=f"mla-doctor.{host}", time=f"{time_s:.3f}")


def render(doc: dict) -> str:
    fl = doc.get("fleet") or {}
    root = ET.Element("testsuites", name=f"mla-doctor {doc.get('command', 'audit')} ({fl.get('playbook')})")
    totals = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for h in doc["hosts"]:
        name = h["host"]
        total_s = float((h.get("timings") or {}).get("total_s") or 0.0)
        suite = ET.SubElement(root, "testsuite", name=name, hostname=name, timestamp=str(doc.get("started") or ""))
        props = ET.SubElement(suite, "properties")
        v = VllmSection.of(h.get("vllm"))
        for k, val in (("verdict", h.get("verdict")), ("exit_status", h.get("exit_status")),
                       ("vllm.version", v.version), ("vllm.distribution", v.distribution),
                       ("address", h.get("address")), ("groups", ",".join(h.get("groups") or []))):
            if val not in (None, ""):
                ET.SubElement(props, "property", name=k, value=str(val))
        counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
        if h.get("error_kind") == "NotRun":
            c = _case(suite, name, "run")
            ET.SubElement(c, "skipped", message=h.get("error") or "not run")
            counts["tests"] += 1
            counts["skipped"] += 1
        else:
            steps = h.get("steps") or []
            c = _case(suite, name, "connect", float((h.get("timings") or {}).get("connect_s") or 0.0))
            counts["tests"] += 1
            connected = h.get("status") != "unreachable" and not (steps and steps[0].get("kind") == "connect")
            if not connected:
                e = ET.SubElement(c, "error", message=h.get("error") or "unreachable", type=h.get("error_kind") or "")
                e.text = h.get("error") or ""
                counts["errors"] += 1
            else:
                for s in steps:
                    c = _case(suite, name, f"step {s.get('name')} ({s.get('kind')})", float(s.get("elapsed_s") or 0))
                    counts["tests"] += 1
                    if s.get("status") != "ok":
                        e = ET.SubElement(c, "error", message=str(s.get("detail") or h.get("error") or "failed"),
                                          type=h.get("error_kind") or "StepFailed")
                        e.text = str(s.get("detail") or h.get("error") or "")
                        counts["errors"] += 1
                    elif s.get("detail"):
                        ET.SubElement(c, "system-out").text = str(s["detail"])
                if not steps and h.get("status") == "error":
                    c = _case(suite, name, "audit")
                    e = ET.SubElement(c, "error", message=h.get("error") or "error", type=h.get("error_kind") or "")
                    e.text = h.get("error") or ""
                    counts["tests"] += 1
                    counts["errors"] += 1
                for f in h.get("findings") or []:
                    c = _case(suite, name, f"{f['code']}")
                    counts["tests"] += 1
                    body = "\n".join([f.get("summary") or ""] + list(f.get("evidence") or [])
                                     + ([f"action: {f['action']}"] if f.get("action") else []))
                    if f.get("severity") == "fail":
                        e = ET.SubElement(c, "failure", message=f.get("summary") or f["code"], type=f["code"])
                        e.text = body
                        counts["failures"] += 1
                    else:
                        ET.SubElement(c, "system-out").text = f"[{f.get('severity')}] {body}"
        for k, n in counts.items():
            suite.set(k, str(n))
            totals[k] += n
        suite.set("time", f"{total_s:.3f}")
    for k, n in totals.items():
        root.set(k, str(n))
    root.set("time", f"{float(doc.get('duration_s') or 0):.3f}")
    for el in root.iter():
        if el.text:
            el.text = terminal.xml(el.text)
        for k, val in list(el.attrib.items()):
            el.set(k, terminal.xml(val, keep_newlines=False))
    if hasattr(ET, "indent"):  # Python 3.9+
        ET.indent(root)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"
