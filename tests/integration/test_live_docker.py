"""`mla-doctor run --runtime docker` end to end: the real vllm-cpu server in a container of a real dockerd
(a unit of the systemd that is PID 1 of a fleet host, tests/fleet/service-host.sh), over real SSH.

The image carries its own copy of the vllm package (and its dist-info, so RECORD integrity is judged on
the container's files); torch and the rest come read-only from the cached venv. Every file the run
changes is in the container's writable layer: the agent runs inside it through `docker exec`.
"""
from __future__ import annotations

import json
import shlex
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from tests.integration.test_live_fleet import READY_SCRIPT, vllm_tree_state
from tests.support import vllm_cpu
from tests.support.live_runs import run_until_debug_restart, wait_restored

pytestmark = [pytest.mark.fleet, pytest.mark.vllm]

HOST = "s02"
NAME = "tiny-vllm"
IMAGE = "mla-doctor-test/tiny-vllm:1"
ROOT = Path(__file__).resolve().parents[2]
APP_SITE = "/app/site"
# the container's vLLM files: sha256, mode and mtime of every .py, plus any probe module left behind
CONTAINER_STATE = r"""
import hashlib, json, os, sys
root = sys.argv[1]
out = {}
for d, _dirs, files in os.walk(os.path.join(root, "vllm")):
    for f in files:
        if f.endswith(".py"):
            p = os.path.join(d, f)
            st = os.stat(p)
            out[p] = [hashlib.sha256(open(p, "rb").read()).hexdigest(), st.st_mode, st.st_mtime_ns]
out["probe-modules"] = sorted(x for x in os.listdir(root) if x.startswith("mla_doctor_probe"))
print(json.dumps(out))
"""


def ssh(fleet, cmd: str, timeout: float = 120, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(fleet.ssh_argv(HOST, cmd), input=stdin, capture_output=True, timeout=timeout)


def out(r: subprocess.CompletedProcess) -> str:
    return r.stdout.decode("utf-8", "replace")


def build_image(fleet, tmp: Path) -> None:
    """A minimal image: empty dirs, usr-merge links, and the vllm package with its dist-info under /app/site."""
    site = next((vllm_cpu.venv_dir() / "lib").glob("python3*/site-packages"))
    tar_path = tmp / "image.tar"
    with tarfile.open(tar_path, "w") as tar:
        for d, mode in (("usr", 0o755), ("etc", 0o755), ("tmp", 0o1777), ("var", 0o755), ("var/tmp", 0o1777),
                        ("proc", 0o755), ("sys", 0o755), ("dev", 0o755), ("opt", 0o755), ("root", 0o700),
                        ("run", 0o755), ("app", 0o755), ("app/site", 0o755)):
            ti = tarfile.TarInfo(d)
            ti.type, ti.mode = tarfile.DIRTYPE, mode
            tar.addfile(ti)
        for link in ("bin", "lib", "lib64", "sbin"):
            ti = tarfile.TarInfo(link)
            ti.type, ti.linkname = tarfile.SYMTYPE, f"usr/{link}"
            tar.addfile(ti)
        for f in ("passwd", "group"):
            tar.add(f"/etc/{f}", arcname=f"etc/{f}")
        tar.add(str(site / "vllm"), arcname="app/site/vllm")
        di = next(site.glob("vllm_cpu-*.dist-info"))
        tar.add(str(di), arcname=f"app/site/{di.name}")
    r = ssh(fleet, f"docker import - {IMAGE}", stdin=tar_path.read_bytes(), timeout=600)
    assert r.returncode == 0, r.stderr
    tar_path.unlink()


def run_container(fleet) -> None:
    env = vllm_cpu.server_env("/tmp", base={"PATH": "/usr/bin:/bin", "HOME": "/root"})
    env["PYTHONPATH"] = APP_SITE
    argv = vllm_cpu.server_argv(str(vllm_cpu.model_dir()), 8000)
    # the venv and the model, each where the suite keeps it ($MLA_DOCTOR_VLLM_VENV / $MLA_DOCTOR_TINY_MLA)
    mounts = [x for d in (vllm_cpu.venv_dir(), vllm_cpu.model_dir()) for x in ("-v", f"{d}:{d}:ro")]
    # vLLM's engine needs more /dev/shm than docker's default 64 MiB (as every real deployment does)
    cmd = (["docker", "run", "-d", "--name", NAME, "--network", "host", "--restart", "unless-stopped",
            "--shm-size", "1g", "-v", "/usr:/usr:ro", *mounts, "-w", "/app"]
           + [x for k, v in sorted(env.items()) for x in ("-e", f"{k}={v}")] + [IMAGE] + argv)
    r = ssh(fleet, " ".join(shlex.quote(a) for a in cmd))
    assert r.returncode == 0, r.stderr


def wait_ready(fleet, timeout: float = 240) -> None:
    r = ssh(fleet, "/usr/bin/python3 -c " + shlex.quote(READY_SCRIPT) + f" {int(timeout)}", timeout=timeout + 30)
    assert "READY" in out(r), out(ssh(fleet, f"docker logs --tail 40 {NAME} 2>&1"))


def container_state(fleet) -> dict:
    r = ssh(fleet, f"docker exec -i {NAME} {vllm_cpu.venv_python()} - {APP_SITE}", stdin=CONTAINER_STATE.encode())
    assert r.returncode == 0, r.stderr
    return json.loads(out(r))


def inspect(fleet) -> dict:
    return json.loads(out(ssh(fleet, f"docker inspect {NAME}")))[0]


@pytest.fixture(scope="module")
def docker_host(fleet, tmp_path_factory):
    vllm_cpu.ensure_venv()
    vllm_cpu.ensure_model()
    fleet.start_service_host(HOST, 201, docker=True)
    try:
        build_image(fleet, tmp_path_factory.mktemp("image"))
        run_container(fleet)
        wait_ready(fleet)
        info = inspect(fleet)
        yield {"config": info["Config"], "state": container_state(fleet), "id": info["Id"]}
    finally:
        ssh(fleet, f"docker rm -f {NAME}; docker rmi -f {IMAGE}", timeout=120)
        fleet.stop_service_host(HOST)


def run_cli(fleet, *args, timeout=900):
    argv = [sys.executable, "-m", "mla_doctor", "run", "--host", HOST, "--ssh-config", str(fleet.ssh_config),
            "--yes", "--method", "patch", "--format", "json", "--run-root", "/var/tmp/mla-live-docker",
            "--runtime", "docker", *args]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=ROOT, stdin=subprocess.DEVNULL)
    return p.returncode, json.loads(p.stdout), p.stderr


def assert_container_as_found(fleet, found: dict) -> None:
    info = inspect(fleet)
    assert info["Id"] == found["id"] and info["State"]["Running"]
    assert info["Config"]["Cmd"] == found["config"]["Cmd"] and info["Config"]["Env"] == found["config"]["Env"]
    assert container_state(fleet) == found["state"]  # every vLLM file in the container byte-identical, no probe
    wait_ready(fleet, 120)


def test_docker_runtime_patches_inside_the_container_and_restores(fleet, docker_host):
    host_venv_before = vllm_tree_state()
    code, doc, err = run_cli(fleet)
    h = doc["hosts"][0]
    assert h["status"] == "ok", (h.get("error"), err[-3000:])
    sup = h["server"]["supervisor"]
    assert sup["kind"] == "docker" and sup["name"] == NAME and sup["container"] == docker_host["id"]
    # the install audited and patched is the container's own copy
    assert h["vllm"]["path"] == f"{APP_SITE}/vllm" and h["static"]["integrity"] == "checked"
    assert h["static"]["modified_files"] == []
    assert h["patch"]["files"] and all(f["path"].startswith(APP_SITE + "/") for f in h["patch"]["files"])
    assert h["live"]["runtime"] == "docker" and h["live"]["server_log"] == "docker:" + NAME
    assert h["live"]["settings_not_applied"] == {"VLLM_LOGGING_LEVEL": "DEBUG"}
    prompts = {p["name"]: p for p in h["prompts"]}
    n = prompts["long"]["prompt_tokens"]
    assert prompts["long"]["calls"]["forward_mha"]["tokens_per_layer"] == {
        "model.layers.0.self_attn.attn": n, "model.layers.1.self_attn.attn": n}
    assert prompts["short"]["observed"]["prefill"] == "mqa" and prompts["long"]["observed"]["decode"] == "mqa"
    assert h["evidence"]["decode_backend"] == "CPU_MLA"  # from `docker logs --since` of the restarted container
    assert code == 0, err[-2000:]
    assert h["restored"] is True and h["live"]["restored_completion"] == h["live"]["baseline_completion"]
    assert vllm_tree_state() == host_venv_before  # the host's own files were never touched
    assert_container_as_found(fleet, docker_host)


def test_static_audit_inside_the_container_cli_and_inventory(fleet, docker_host, tmp_path):
    """Read-only: `static --container` and a fleet audit whose inventory says runtime docker audit the
    container's own vLLM (not the host's), and change nothing."""
    base = [sys.executable, "-m", "mla_doctor"]
    p = subprocess.run(base + ["static", "--host", HOST, "--ssh-config", str(fleet.ssh_config), "--container", NAME,
                               "--format", "json"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    h = json.loads(p.stdout)["hosts"][0]
    assert p.returncode == 0 and h["status"] == "ok", p.stdout[-2000:] + p.stderr[-2000:]
    assert h["vllm"]["path"] == f"{APP_SITE}/vllm" and h["vllm"]["located_by"] == "running server"
    assert h["static"]["integrity"] == "checked" and h["static"]["modified_files"] == []
    assert h["server"]["running"] and h["server"]["pid"] == 1  # pid 1 of the container's own namespace
    inv = tmp_path / "inventory.yaml"
    inv.write_text(f"hosts:\n  {HOST}:\n    runtime: {{kind: docker, container: {NAME}}}\n")
    p = subprocess.run(base + ["audit", "-i", str(inv), "--ssh-config", str(fleet.ssh_config), "--format", "json",
                               "--progress", "none"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    fh = json.loads(p.stdout)["hosts"][0]
    assert p.returncode == 0 and fh["status"] == "ok", p.stdout[-2000:] + p.stderr[-2000:]
    assert fh["vllm"]["path"] == f"{APP_SITE}/vllm"
    assert container_state(fleet) == docker_host["state"]


def test_docker_runtime_refuses_the_plugin_method_before_any_change(fleet, docker_host):
    started = inspect(fleet)["State"]["StartedAt"]
    code, doc, _err = run_cli(fleet, "--method", "plugin", timeout=120)
    h = doc["hosts"][0]
    assert code != 0 and h["status"] == "error" and "--method patch" in h["error"]
    assert inspect(fleet)["State"]["StartedAt"] == started  # never restarted


def test_controller_killed_mid_run_host_watchdog_restores_the_container(fleet, docker_host):
    run_root = "/var/tmp/mla-live-docker-kill"
    argv = [sys.executable, "-m", "mla_doctor", "run", "--host", HOST, "--ssh-config", str(fleet.ssh_config),
            "--yes", "--method", "patch", "--format", "json", "--run-root", run_root, "--ttl", "15",
            "--runtime", "docker"]

    def on_debug():
        assert container_state(fleet)["probe-modules"], "the probe is not installed in the container"

    run_dir = run_until_debug_restart(argv, run_root, ROOT, on_debug, timeout=180)
    _m, cur_state, log = wait_restored(run_dir, 15 + 150)
    assert cur_state.get("mode") == "original", log
    assert "revert: ['reverted']" in log, log
    wait_ready(fleet, 240)
    assert_container_as_found(fleet, docker_host)


def test_manual_revert_after_a_lost_controller(fleet, docker_host):
    """The README's undo: `revert --container` restores the files inside the container, then `revert` on the
    host restarts the container as found (long lease: no watchdog acts in between)."""
    run_root = "/var/tmp/mla-live-docker-manual"
    base = [sys.executable, "-m", "mla_doctor"]
    conn = ["--host", HOST, "--ssh-config", str(fleet.ssh_config), "--run-root", run_root, "--format", "json"]
    run_dir = run_until_debug_restart(base + ["run", *conn, "--yes", "--method", "patch", "--ttl", "600",
                                                 "--runtime", "docker"],
                                      run_root, ROOT, timeout=180)
    run_id = run_dir.name
    assert container_state(fleet) != docker_host["state"]  # patched, probe installed
    p = subprocess.run(base + ["revert", *conn, "--container", NAME, "--run", run_id], capture_output=True,
                       text=True, timeout=300, cwd=ROOT, stdin=subprocess.DEVNULL)
    doc = json.loads(p.stdout)
    assert p.returncode == 0 and doc["hosts"][0]["revert"]["runs"][0]["state"] == "reverted", p.stdout + p.stderr
    assert container_state(fleet) == docker_host["state"]  # files back while the debug server still runs
    p = subprocess.run(base + ["revert", *conn], capture_output=True, text=True, timeout=600, cwd=ROOT,
                       stdin=subprocess.DEVNULL)
    doc = json.loads(p.stdout)
    runs_out = doc["hosts"][0]["revert"]["runs"]
    assert p.returncode == 0, p.stdout + p.stderr
    assert [r["run_id"] for r in runs_out] == [run_id] and runs_out[0]["server"]["restored"] is True
    assert json.loads((run_dir / "server-current.json").read_text())["mode"] == "original"
    wait_ready(fleet, 240)
    assert_container_as_found(fleet, docker_host)


def test_attach_the_default_is_refused_before_any_change_with_the_reason_and_the_fix(fleet, docker_host):
    """`run` without --method (attach) on a docker host: refused before anything changes, naming the
    container, why (attach works from the node: run without --runtime) and the restart's command."""
    started = inspect(fleet)["State"]["StartedAt"]
    argv = [sys.executable, "-m", "mla_doctor", "run", "--host", HOST, "--ssh-config", str(fleet.ssh_config),
            "--format", "json", "--run-root", "/var/tmp/mla-live-docker-attach", "--runtime", "docker"]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=ROOT, stdin=subprocess.DEVNULL)
    h = json.loads(p.stdout)["hosts"][0]
    assert p.returncode != 0 and h["status"] == "error" and h["error_kind"] == "AttachRefused", h.get("error")
    assert f"container {NAME}" in h["error"] and "run without --runtime" in h["error"]
    assert "Nothing was changed" in h["error"]
    assert f"mla-doctor run --host {HOST} --runtime docker --method patch --yes" in h["error"]
    assert inspect(fleet)["State"]["StartedAt"] == started  # never restarted
    assert ssh(fleet, "ls /var/tmp/mla-live-docker-attach/runs 2>/dev/null").stdout.strip() == b""
    assert container_state(fleet) == docker_host["state"]
