"""One real-browser screenshot of the fleet HTML with a warning and a fault (issue 11): headless chromium
renders the page offline; the PNG is a rendered page and the DOM has the warning code in the problem column and
the live/static answer in the verdict column. A few seconds: the unit tier."""
from __future__ import annotations

import copy
import os
import re
import shutil
import subprocess

import pytest

from mla_doctor import reports
from mla_doctor.diagnosis.knowledge import load_knowledge
from mla_doctor.fleet.scheduler import FleetHostReport
from mla_doctor.host.audit import build_static_report
from mla_doctor.results import Finding, Severity
from tests.support.fake_agent import load


def _chromium() -> str:
    for c in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(c):
            return shutil.which(c)
    pytest.fail("no chromium to render the HTML report: apt-get install -y chromium (make system-packages)",
                pytrace=False)


def _host(name: str, **edits) -> FleetHostReport:
    real = build_static_report(name, copy.deepcopy(load("static_local")["exchanges"][0]["answer"]), load_knowledge())
    h = FleetHostReport(host=name, address=f"127.0.0.{len(name)}")
    for k in real.__dataclass_fields__:
        if k not in ("host",):
            setattr(h, k, getattr(real, k))
    for k, v in edits.items():
        setattr(h, k, v)
    return h


def test_fleet_html_with_a_warning_and_a_fault_in_a_real_browser(tmp_path):
    warned = _host("gpu-warn")
    warned.findings = warned.findings + [Finding("CUDA_GRAPHS_HIDE_DECODE", Severity.WARN, "decode hidden by graphs",
                                                 action="run with --enforce-eager")]
    faulty = _host("gpu-fault")
    faulty.findings = faulty.findings + [Finding("VLLM_FILES_MODIFIED", Severity.FAIL, "1 vLLM file modified",
                                                 action="reinstall the wheel")]
    faulty.static = {**faulty.static, "modified_files": ["vllm/model_executor/layers/attention/mla_attention.py"]}
    doc = reports.fleet_document([warned, faulty, _host("gpu-ok")], {"playbook": "static", "inventory": "inv.yaml"},
                                 0.0, 1.0)
    page = tmp_path / "fleet.html"
    page.write_text(reports.render(doc, "html"))
    base = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={tmp_path / 'u'}",
            "--window-size=1400,1000", "--hide-scrollbars"]
    shot = tmp_path / "fleet.png"
    r = subprocess.run(base + [f"--screenshot={shot}", page.as_uri()], capture_output=True, text=True, timeout=90)
    assert shot.exists(), r.stderr[-2000:]
    png = shot.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000  # a rendered page, not a blank one
    if os.environ.get("MLA_DOCTOR_KEEP_SCREENSHOT"):
        shutil.copy(shot, os.environ["MLA_DOCTOR_KEEP_SCREENSHOT"])
    dom = subprocess.run(base + ["--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=90).stdout
    rows = {m.group(1): m.group(0) for m in re.finditer(r'<tr class="v-\w+"><td><a href="#host-([\w-]+)">.*?</tr>',
                                                         dom, re.S)}
    assert set(rows) == {"gpu-warn", "gpu-fault", "gpu-ok"}
    cell = re.compile(r'<td class="(problem|path-verdict)">(.*?)</td>', re.S)
    warn_cells = dict(cell.findall(rows["gpu-warn"]))
    assert warn_cells["problem"] == "warn CUDA_GRAPHS_HIDE_DECODE"
    assert warn_cells["path-verdict"] == "CPU_MLA: 1 token → forward_mqa, over 1 → forward_mha"
    fault_cells = dict(cell.findall(rows["gpu-fault"]))
    assert fault_cells["problem"] == "VLLM_FILES_MODIFIED" and fault_cells["path-verdict"].startswith("CPU_MLA")
