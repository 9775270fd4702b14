"""Ctrl-C during a fleet run whose hosts have changes in place: every running host is put back (its run reverted
over a new connection, all at once), hosts not started stay untouched, every host's report says what happened;
a second Ctrl-C stops the restores and each host says what is left and the exact revert — which, run as printed,
puts the files back.

For real: one sshd on loopback (tests/support/loopback_sshd.py) serves four "hosts", each a venv holding its own
copy of vLLM 0.33.0's real sources (cut down: tests/support/small_vllm.py) and its own run root. Each host's job is
the executor's real steps over its one connection: `patch` (the real agent edits the files), then a command that
blocks (as a live step's server wait does). The SIGINT is sent when every running host has reached that command
(an event: its progress line), never after a sleep. Files are checked against the wheel's RECORD hashes and their
modes and mtimes; the runs' locks and watchdogs must be gone. About 30 s for the three tests."""
from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from mla_doctor import interrupts
from mla_doctor.fleet.job import changed_run, left_text, restore_host
from mla_doctor.fleet.scheduler import Events, Undo, run_fleet
from mla_doctor.host import execute
from mla_doctor.host.steps import Command, Patch
from mla_doctor.host.target import HostTarget
from mla_doctor.results import HostReport
from tests.support import loopback_sshd, small_vllm
from tests.support.corpus import venv_with_tree

pytestmark = pytest.mark.sshd

HOSTS = ["h1", "h2", "h3", "h4"]
RUNNING = 3  # --forks: h4 is never started
BLOCK = "wait"  # the step each host blocks in when the signal comes


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    s = loopback_sshd.start(tmp_path_factory.mktemp("sshd"))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    return small_vllm.build(tmp_path_factory.mktemp("small") / "vllm-0.33.0")


def record_mismatches(site: Path) -> list[str]:
    """Files whose sha256 differs from the wheel's RECORD (every kept file has a hash there)."""
    info = next(site.glob("vllm-*.dist-info"))
    bad = []
    for line in (info / "RECORD").read_text().splitlines():
        path, digest, _size = line.rsplit(",", 2)
        if not digest:
            continue
        algo, want = digest.split("=", 1)
        got = base64.urlsafe_b64encode(hashlib.new(algo, (site / path).read_bytes()).digest()).rstrip(b"=")
        if got.decode() != want:
            bad.append(path)
    return bad


def tree_state(site: Path) -> dict:
    return {str(p.relative_to(site)): (p.stat().st_mode, p.stat().st_mtime_ns, p.stat().st_size)
            for p in site.rglob("*") if p.is_file() and "__pycache__" not in p.parts}


class Fleet:
    def __init__(self, sshd, tree: Path, base: Path):
        self.sshd = sshd
        self.sites, self.roots, self.targets, self.before = {}, {}, {}, {}
        for h in HOSTS:
            self.sites[h] = venv_with_tree(base / h, tree)
            self.roots[h] = str(base / f"{h}-runs")
            self.targets[h] = HostTarget(name=h, address=sshd.target, python=str(base / h / "bin" / "python"),
                                         conn=sshd.options(command_timeout=120, connect_timeout=30))
            self.before[h] = tree_state(self.sites[h])
        self.lines: list[str] = []
        self.lock = threading.Lock()

    def job(self, host, cancel, step) -> HostReport:
        steps = [Patch.make(ttl=600, run_root=self.roots[host], name="patch"),
                 Command.make({"run": "sleep 300", "timeout": 400}, name=BLOCK)]
        return execute(self.targets[host], steps, step, cancel)

    def undo(self, hold_restore: threading.Event | None = None) -> Undo:
        def restore(h, report, cancel, step):
            if hold_restore is not None:  # the second Ctrl-C's test: the restore is under way and waits there
                step("restore starts")
                hold_restore.wait(60)
            return restore_host(self.targets[h], self.roots[h], report, cancel, step)

        return Undo(needed=lambda h, r: changed_run(r) is not None, restore=restore,
                    left=lambda h, r: left_text(self.targets[h], self.roots[h], r), bound_s=120)

    def run(self, undo: Undo, signal_at: dict[str, int]):
        """run_fleet under the real signal handling; SIGINT when `signal_at[msg]` hosts have said `msg`."""
        seen: dict[str, set] = {}

        def step(host, msg):
            with self.lock:
                self.lines.append(f"{host}: {msg}")
                seen.setdefault(msg, set()).add(host)
                if len(seen[msg]) == signal_at.get(msg):
                    os.kill(os.getpid(), signal.SIGINT)

        done: dict[str, HostReport] = {}
        events = Events(step=step, done=lambda h, r: done.setdefault(h, r))
        with interrupts.handling():
            results, sched = run_fleet(HOSTS, self.job, limit=RUNNING, events=events, undo=undo)
        return results, sched, done

    def state(self, h: str, report: HostReport) -> dict:
        """The run as its host has it: manifest state, files in the run dir, the run root, its watchdog alive."""
        d = Path(self.roots[h]) / "runs" / report.patch["run_id"]
        man = json.loads((d / "manifest.json").read_text())  # written before the revert answers
        pid = report.patch.get("watchdog_pid")
        assert pid, report.patch
        alive = _alive(pid)
        if alive and man.get("state") == "reverted":
            # the revert SIGTERMs the watchdog, which then clears its files and exits: wait for that event
            # (bounded generously: a loaded machine may take seconds to schedule it)
            deadline = time.monotonic() + 60
            while (alive := _alive(pid)) and time.monotonic() < deadline:
                time.sleep(0.05)
        return {"state": man.get("state"), "files": sorted(os.listdir(d)), "root": sorted(os.listdir(self.roots[h])),
                "watchdog_alive": alive}


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture
def fleet(sshd, tree, tmp_path, monkeypatch):
    monkeypatch.setenv("MLA_DOCTOR_PARSE_CACHE", "off")
    interrupts.reset()
    yield Fleet(sshd, tree, tmp_path)
    interrupts.reset()


def test_ctrl_c_puts_every_running_host_back_and_starts_no_other(fleet, capfd):
    assert all(record_mismatches(fleet.sites[h]) == [] for h in HOSTS)  # the real release's bytes to start with
    results, sched, done = fleet.run(fleet.undo(), {BLOCK: RUNNING})
    err = capfd.readouterr().err
    assert sched.interrupted == "SIGINT"
    assert f"interrupted: restoring {RUNNING} running host(s) (h1, h2, h3) before exiting" in err
    assert set(results) == set(done) == set(HOSTS)
    for h in HOSTS[:RUNNING]:
        r = results[h]
        rid = r.patch["run_id"]
        assert r.patch["outcome"] == "patched" and r.restored is True, (h, r.error)
        assert r.error_kind == "Interrupted" and f"run {rid} reverted after the interrupt" in r.error
        assert r.exit_override is None
        (run,) = r.revert["runs"]
        assert run["state"] == "reverted" and {f["outcome"] for f in run["files"]} == {"restored"}
        assert record_mismatches(fleet.sites[h]) == [] and tree_state(fleet.sites[h]) == fleet.before[h]
        st = fleet.state(h, r)
        # nothing left behind but the run's report and its watchdog's log; the host lock released
        assert st == {"state": "reverted", "files": ["manifest.json", "watchdog.log", "watchdog.pid"],
                      "root": ["runs"], "watchdog_alive": False}
        # its progress: patched, blocked, then put back over a new connection
        mine = [ln.split(": ", 1)[1] for ln in fleet.lines if ln.startswith(f"{h}: ")]
        assert mine[-2:] == [f"interrupted: restoring run {rid} (revert files, server as found)",
                             f"restored run {rid}"]
    # never started: nothing made, nothing changed
    assert results["h4"].error_kind == "NotRun" and "interrupted (SIGINT) before it started" in results["h4"].error
    assert not Path(fleet.roots["h4"]).exists() and tree_state(fleet.sites["h4"]) == fleet.before["h4"]
    assert not any(ln.startswith("h4: ") for ln in fleet.lines)
    # every host is in the retry list (none ended OK) and the run's status is the interrupt's
    assert all(r.exit_status().name != "OK" for r in results.values())


def test_a_second_ctrl_c_stops_the_restores_and_the_printed_revert_puts_the_files_back(fleet, capfd):
    hold = threading.Event()
    try:
        results, _sched, _done = fleet.run(fleet.undo(hold), {BLOCK: RUNNING, "restore starts": RUNNING})
    finally:
        hold.set()
    err = capfd.readouterr().err
    assert f"the restore of {RUNNING} running host(s) (h1, h2, h3) is stopped. left on the hosts:" in err
    for h in HOSTS[:RUNNING]:
        r = results[h]
        rid = r.patch["run_id"]
        assert r.restored is False and r.exit_status().name == "NOT_RESTORED"
        assert "the restore was stopped (a second interrupt)" in r.error
        assert fleet.state(h, r)["state"] == "patched" and record_mismatches(fleet.sites[h])  # left as said
        # stderr names it, with the exact command; run as printed, it puts the files back byte for byte
        m = re.search(rf"^  {h}: run {rid} may have left instrumented files; .* to undo now: (mla-doctor revert .*)$",
                      err, re.M)
        assert m, err
        assert m.group(1) in r.error
        argv = shlex.split(m.group(1))
        assert argv[argv.index("--run") + 1] == rid and argv[argv.index("--run-root") + 1] == fleet.roots[h]
        exe = Path(sys.executable).with_name("mla-doctor")
        p = subprocess.run([str(exe), *argv[1:], "--format", "json"], capture_output=True, text=True, timeout=180)
        assert p.returncode == 0, p.stderr
        assert record_mismatches(fleet.sites[h]) == [] and tree_state(fleet.sites[h]) == fleet.before[h]
        assert fleet.state(h, r)["state"] == "reverted"


def test_the_cli_undo_reverts_a_live_run_in_its_runbooks_run_root(fleet, tmp_path):
    """What `mla-doctor audit` builds (fleet_undo, from the inventory and the runbook): a live step's run left on a
    host (here made by a real patch) is found in the runbook's own run root and reverted over a new connection."""
    from mla_doctor.cancel import Cancel
    from mla_doctor.fleet import inventory, playbook
    from mla_doctor.fleet.job import fleet_undo
    from mla_doctor.fleet.scheduler import FleetHostReport

    root = str(tmp_path / "live-runs")
    pb = tmp_path / "pb.yaml"
    pb.write_text(f"name: t\nsteps:\n  - live: {{run_root: {root}}}\n")
    inv = tmp_path / "inv.yaml"
    inv.write_text(f"hosts:\n  h1: {{address: 127.0.0.1, port: {fleet.sshd.port}, user: {fleet.sshd.user}, "
                   f"python: {fleet.targets['h1'].python}}}\n")
    host = inventory.load(str(inv)).hosts["h1"]
    plans = {"h1": playbook.plan(playbook.load(str(pb)), host)}
    left = execute(fleet.targets["h1"], [Patch.make(ttl=600, run_root=root, name="patch")])
    rid = left.patch["run_id"]
    assert left.patch["outcome"] == "patched" and record_mismatches(fleet.sites["h1"])
    undo = fleet_undo(plans, fleet.sshd.options(command_timeout=120, connect_timeout=30))
    report = FleetHostReport(host="h1", live={"run_id": rid})  # a live run cut off after its patch
    assert undo.needed("h1", report)
    assert f"--run-root {root} --run {rid}" in undo.left("h1", report)
    steps = []
    out = undo.restore("h1", report, Cancel(), steps.append)
    assert out.restored is True, out.error
    assert steps == [f"interrupted: restoring run {rid} (revert files, server as found)", f"restored run {rid}"]
    assert record_mismatches(fleet.sites["h1"]) == [] and tree_state(fleet.sites["h1"]) == fleet.before["h1"]
    assert not undo.needed("h1", out)
