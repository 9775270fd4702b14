"""Record the real vllm-cpu server's log of a stop on purpose, for the real-log corpus (issue 29).

    .venv/bin/python -m tests.support.record_shutdown_logs --first N [--how sigterm,sigint,ctrl-c,...] [--out DIR]

One server at a time (the machine is small). Per way of stopping:

* ``sigterm`` / ``sigint``: the server as :func:`vllm_cpu.local_server` runs it (stdout+stderr to a file), the
  signal sent to the API server's pid only (``kill PID`` / ``kill -INT PID``, as an operator does);
* ``ctrl-c``: the same command line in a tmux pane; ``tmux send-keys C-c`` (the terminal sends SIGINT to the
  whole foreground process group); the log is the pane's text as an engineer would copy it
  (``capture-pane -J``: wrapped lines joined);
* ``systemctl``: ``systemctl stop UNIT`` on a fleet service host, then ``journalctl -u UNIT -o short-iso``;
* ``docker``: ``docker stop CONTAINER`` on a fleet service host, then ``docker logs CONTAINER`` (merged);
* ``kill-enginecore`` / ``kill-worker``: not a stop but a death by signal, for contrast: ``kill -9`` of the
  engine core (``VLLM::EngineCore``) or its worker (``VLLM::Worker``), as the kernel's OOM killer would.
* ``oom-worker``: the kernel's OOM killer itself: the worker moved into a cgroup v1 memory group of its own
  whose limit is a MiB above what is charged there (the pages it held stay charged where they were), then
  requests with long prompts; the kernel kills the worker when its new pages do not fit. The log is the
  server's, then the kernel's report of that kill as ``dmesg`` prints it (from its ``invoked oom-killer`` line
  to its ``Killed process`` line), as an engineer pastes both.

Each log is written verbatim as ``NNN-v1-vllm-cpu-0320-<how>-stop.log`` (numbering given by ``--first``);
the script prints what it wrote. Everything it started is stopped; a survivor fails the run.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.support import vllm_cpu

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "tests" / "fixtures" / "real_logs"
HOWS = ("sigterm", "sigint", "ctrl-c", "systemctl", "docker", "kill-enginecore", "kill-worker", "oom-worker")


def _say(msg: str) -> None:
    print(f"[record {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _wait_exit(server: vllm_cpu.LocalServer, timeout: float) -> float | None:
    """Seconds until the API server exited by itself, or None if it did not in ``timeout``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if server.proc is not None and server.proc.poll() is not None and not server.pids():
            return time.monotonic() - t0
        time.sleep(0.1)
    return None


def record_signal(sig: signal.Signals, path: Path) -> str:
    """Start the server, send ``sig`` to the API server pid only, keep its log."""
    with vllm_cpu.local_server(log_path=path) as server:
        _say(f"{sig.name}: server ready in {server.ready_seconds:.0f}s, pid {server.proc.pid}")
        os.kill(server.proc.pid, sig)
        took = _wait_exit(server, 60)
        _say(f"{sig.name}: exited by itself in {took:.1f}s (rc {server.proc.returncode})" if took is not None
             else f"{sig.name}: still running after 60s; local_server SIGKILLs it")
    return path.read_text(errors="replace")


def _pid_titled(server: vllm_cpu.LocalServer, title: str) -> int:
    """The server's process whose command line (vLLM sets it) starts with ``title``, e.g. VLLM::EngineCore."""
    for pid in server.pids():
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if cmd.startswith(title):
            return pid
    raise RuntimeError(f"no {title} process among {server.pids()}")


def record_kill(title: str, path: Path) -> str:
    """Start the server, SIGKILL one of its processes (a death by signal, as the kernel's OOM killer deals it)."""
    with vllm_cpu.local_server(log_path=path) as server:
        pid = _pid_titled(server, title)
        _say(f"kill -9 {title} pid {pid}")
        os.kill(pid, signal.SIGKILL)
        took = _wait_exit(server, 60)
        _say(f"{title} killed: the API server exited in {took:.1f}s (rc {server.proc.returncode})" if took is not None
             else f"{title} killed: the API server still runs after 60s; local_server stops it")
    return path.read_text(errors="replace")


def _memory_group(name: str) -> Path:
    """A new cgroup v1 memory group: at the hierarchy's root where root may make one (its path in the kernel's
    report is then only ``/<name>``), else under this process's own group."""
    base = Path("/sys/fs/cgroup/memory")
    own = next((base / rel.lstrip("/") for _n, ctrl, rel in
                (ln.split(":", 2) for ln in Path("/proc/self/cgroup").read_text().splitlines())
                if "memory" in ctrl.split(",")), None)
    for parent in (base, own):
        if parent is None:
            continue
        with contextlib.suppress(OSError):
            (parent / name).mkdir()
            return parent / name
    raise RuntimeError("no cgroup v1 memory group can be made here: the kernel's OOM killer cannot be aimed")


def _dmesg() -> list[str]:
    return subprocess.run(["dmesg"], capture_output=True, text=True, check=True).stdout.splitlines()


def record_oom(title: str, path: Path) -> str:
    """Start the server; make the kernel's OOM killer kill one of its processes; the log, then the kernel's report."""
    with vllm_cpu.local_server(log_path=path) as server:
        pid = _pid_titled(server, title)
        group = _memory_group(f"mla-doctor-oom-{pid}")
        try:
            # the pages it holds stay charged where they were (this kernel moves no charge): the group's limit
            # bounds only what it maps from now on, a MiB
            (group / "cgroup.procs").write_text(str(pid))
            held = int((group / "memory.usage_in_bytes").read_text())
            (group / "memory.limit_in_bytes").write_text(str(held + (1 << 20)))
            _say(f"{title} pid {pid} in {group.name}: charged {held >> 10} KiB there, limit +1 MiB")
            t0 = time.monotonic()
            while server.alive() and time.monotonic() - t0 < 120:
                with contextlib.suppress(Exception):   # the request the kill cuts short fails: expected
                    server.complete([5] * 900, max_tokens=60, timeout=30)
            took = _wait_exit(server, 60)
        finally:
            with contextlib.suppress(OSError):
                for left in (group / "cgroup.procs").read_text().split():   # back to the parent group
                    (group.parent / "cgroup.procs").write_text(left)
            with contextlib.suppress(OSError):
                group.rmdir()
        # the kill of this pid, and the report that starts at the nearest "invoked oom-killer" before it (the ring
        # buffer may have dropped older lines meanwhile: found by content, not by position)
        report = _dmesg()
        end = next((i for i in range(len(report) - 1, -1, -1) if f"Killed process {pid} (" in report[i]), None)
        start = next((i for i in range(end, -1, -1) if "invoked oom-killer" in report[i]), None) \
            if end is not None else None
        if start is None or end is None:
            raise RuntimeError(f"no kernel OOM kill of pid {pid} in dmesg:\n" + "\n".join(report[-40:]))
        _say(f"{title} OOM-killed by the kernel; the API server exited in {took:.1f}s" if took is not None
             else f"{title} OOM-killed; the API server still runs after 60s; local_server stops it")
    with path.open("a", encoding="utf-8") as f:
        f.write("\n".join(report[start:end + 1]) + "\n")
    return path.read_text(errors="replace")


def record_ctrl_c(path: Path) -> str:
    """The server in a tmux pane (a real terminal); Ctrl-C; the pane's text."""
    model = vllm_cpu.ensure_model()
    port = vllm_cpu.free_port()
    work = Path(tempfile.mkdtemp(prefix="mla-doctor-ctrlc-"))
    (work / "tmp").mkdir()
    env = vllm_cpu.server_env(work / "tmp")
    session = f"mla-doctor-ctrlc-{os.getpid()}"
    cmd = " ".join(shlex.quote(a) for a in vllm_cpu.server_argv(model, port))
    keep = set(vllm_cpu.SERVER_ENV) | {"TMPDIR"}
    exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(env.items()) if k in keep)
    tmux = ["tmux", "-L", session]
    try:
        subprocess.run(tmux + ["new-session", "-d", "-s", session, "-x", "250", "-y", "50", "-c", str(work),
                               f"env {exports} {cmd}; echo exit=$?; sleep 3600"], check=True)
        subprocess.run(tmux + ["set-option", "-t", session, "history-limit", "100000"], check=True)
        deadline = time.monotonic() + 240
        while True:
            try:
                status, _ = vllm_cpu.http("GET", f"http://127.0.0.1:{port}/health", timeout=2)
                if status == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("ctrl-c: server not healthy in 240 s")
            time.sleep(1)
        vllm_cpu.http("POST", f"http://127.0.0.1:{port}/v1/completions",
                      {"model": vllm_cpu.SERVED_MODEL_NAME, "prompt": "hello", "max_tokens": 3}, timeout=120)
        _say("ctrl-c: server ready; sending C-c")
        subprocess.run(tmux + ["send-keys", "-t", session, "C-c"], check=True)
        end = time.monotonic() + 60
        text = ""
        while time.monotonic() < end:
            text = subprocess.run(tmux + ["capture-pane", "-p", "-J", "-S", "-", "-t", session],
                                  check=True, capture_output=True, text=True).stdout
            if "exit=" in text:
                break
            time.sleep(0.5)
        _say("ctrl-c: the server exited" if "exit=" in text else "ctrl-c: still running after 60 s")
        text = text.rstrip("\n") + "\n"
        path.write_text(text)
        return text
    finally:
        subprocess.run(tmux + ["kill-server"], check=False)
        shutil.rmtree(work, ignore_errors=True)


def record_systemctl(fleet, path: Path) -> str:
    from tests.integration import test_live_systemd as sd

    fleet.start_service_host(sd.HOST, 200)
    try:
        install = f"cat > /run/systemd/system/{sd.UNIT} && systemctl daemon-reload && systemctl start {sd.UNIT}"
        r = sd.ssh(fleet, install, stdin=sd.unit_text())
        if r.returncode != 0:
            raise RuntimeError(f"starting {sd.UNIT}: {r.stderr}")
        sd.wait_ready(fleet)
        _say("systemctl: server ready; systemctl stop")
        r = sd.ssh(fleet, f"systemctl stop {sd.UNIT}", timeout=120)
        _say(f"systemctl stop: rc {r.returncode}")
        text = sd.ssh(fleet, f"journalctl -u {sd.UNIT} --no-pager -o short-iso").stdout
        path.write_text(text)
        return text
    finally:
        sd.ssh(fleet, f"systemctl stop {sd.UNIT}", timeout=90)
        fleet.stop_service_host(sd.HOST)


def record_docker(fleet, path: Path) -> str:
    from tests.integration import test_live_docker as dk

    fleet.start_service_host(dk.HOST, 201, docker=True)
    try:
        with tempfile.TemporaryDirectory(prefix="record-image-") as tmp:
            dk.build_image(fleet, Path(tmp))
        dk.run_container(fleet)
        dk.wait_ready(fleet)
        _say("docker: server ready; docker stop")
        r = dk.ssh(fleet, f"docker stop {shlex.quote(dk.NAME)}", timeout=120)
        _say(f"docker stop: rc {r.returncode}")
        text = dk.out(dk.ssh(fleet, f"docker logs {shlex.quote(dk.NAME)} 2>&1"))
        path.write_text(text)
        return text
    finally:
        dk.ssh(fleet, f"docker rm -f {dk.NAME}; docker rmi -f {dk.IMAGE}", timeout=120)
        fleet.stop_service_host(dk.HOST)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--how", default=",".join(HOWS), help=f"comma-separated, of {','.join(HOWS)}")
    ap.add_argument("--first", type=int, required=True, help="the file number of the first log written")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    hows = [h for h in args.how.split(",") if h]
    bad = [h for h in hows if h not in HOWS]
    if bad:
        ap.error(f"unknown --how {bad}")
    vllm_cpu.ensure_venv()
    vllm_cpu.ensure_model()
    args.out.mkdir(parents=True, exist_ok=True)
    n = args.first
    written: list[Path] = []
    fleet = fleet_dir = None
    try:
        for how in hows:
            kind = how if how.startswith(("kill-", "oom-")) else f"{how}-stop"
            path = args.out / f"{n:03d}-v1-vllm-cpu-0320-{kind}.log"
            if how == "sigterm":
                text = record_signal(signal.SIGTERM, path)
            elif how == "sigint":
                text = record_signal(signal.SIGINT, path)
            elif how == "ctrl-c":
                text = record_ctrl_c(path)
            elif how == "kill-enginecore":
                text = record_kill("VLLM::EngineCore", path)
            elif how == "kill-worker":
                text = record_kill("VLLM::Worker", path)
            elif how == "oom-worker":
                text = record_oom("VLLM::Worker", path)
            else:
                if fleet is None:
                    from tests.support import fleet as fleet_support
                    fleet_dir = Path(tempfile.mkdtemp(prefix="record-fleet-")) / "f"
                    fleet = fleet_support.start_fleet(1, fleet_dir)
                text = record_systemctl(fleet, path) if how == "systemctl" else record_docker(fleet, path)
            if "Initializing a V1 LLM engine" not in text:
                raise RuntimeError(f"{path.name}: no engine start line in the log:\n{text[-3000:]}")
            _say(f"wrote {path} ({len(text.splitlines())} lines)")
            written.append(path)
            n += 1
    finally:
        if fleet is not None:
            from tests.support import fleet as fleet_support
            _say(fleet_support.stop_fleet(fleet))
            with contextlib.suppress(OSError):
                fleet_dir.parent.rmdir()
    for p in written:
        print(p.relative_to(ROOT) if p.is_relative_to(ROOT) else p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
