"""Honest errors at the terminal (issue 11): real subprocesses, real exit codes, real files. Nothing here
connects anywhere: `--local` runs the agent on this machine against a copy of real vLLM sources or none."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from mla_doctor.exit_codes import ExitStatus

ROOT = Path(__file__).resolve().parents[2]


def run(*args, env=None, cwd=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "mla_doctor", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=cwd or ROOT)


@pytest.mark.parametrize("spelling", [["--format", "json"], ["--format=json"]])
@pytest.mark.parametrize("args,needle", [
    (["static", "--host", "h", "--port", "0"], "--port"),
    (["static", "--host", "h", "--port", "70000"], "--port"),
    (["static", "--host", "h", "--connect-timeout", "-1"], "--connect-timeout"),
    (["static", "--host", "h", "--connect-timeout", "0"], "--connect-timeout"),
    (["static", "--host", "h", "--command-timeout", "-1"], "--command-timeout"),
    (["patch", "--host", "h", "--ttl", "-1"], "--ttl"),
    (["run", "--host", "h", "--yes", "--ready-timeout", "0"], "--ready-timeout"),
    (["run", "--host", "h", "--yes", "--max-tokens", "0"], "--max-tokens"),
    (["audit", "-i", "x.yaml", "--port", "0"], "--port"),
    (["audit", "-i", "x.yaml", "--host-timeout", "-5"], "--host-timeout"),
    (["static", "--local", "-o", "/nonexistent-dir/r.json"], "/nonexistent-dir"),
])
def test_bad_numbers_and_outputs_are_usage_errors_with_json(args, needle, spelling):
    p = run(*args, *spelling)
    assert p.returncode == ExitStatus.USAGE, p.stdout + p.stderr
    doc = json.loads(p.stdout)
    assert doc["exit_name"] == "USAGE" and needle in doc["error"] and doc["command"] == args[0]
    assert needle in p.stderr and "Traceback" not in p.stderr


def test_output_checked_before_any_work(tmp_path):
    # a loopback host that accepts and never says a word (an SSH connect would wait the full timeout):
    # the bad -o must win at once, and nothing may even connect
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)
        silent.settimeout(0)
        t0 = time.monotonic()
        p = run("static", "--host", f"127.0.0.1:{silent.getsockname()[1]}", "--connect-timeout", "30",
                "-o", str(tmp_path / "no" / "r.txt"))
        assert p.returncode == 2 and time.monotonic() - t0 < 15
        assert "does not exist" in p.stderr
        with pytest.raises(BlockingIOError):
            silent.accept()  # no connection was attempted


def test_internal_error_is_70_one_line_and_json_and_debug_shows_the_traceback():
    code = ("import sys, mla_doctor.host.audit as h, mla_doctor.cli as c\n"
            "def boom(*a, **k): raise KeyError('planted bug')\n"
            "h.static_on = boom\n"
            "c.main(sys.argv[1:])\n")
    p = subprocess.run([sys.executable, "-c", code, "static", "--local", "--format=json"], capture_output=True,
                       text=True, cwd=ROOT, timeout=120)
    assert p.returncode == ExitStatus.INTERNAL == 70
    assert json.loads(p.stdout)["exit_name"] == "INTERNAL"
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "internal error" in lines[0] and "--debug" in lines[0] and "planted bug" in lines[0]
    d = subprocess.run([sys.executable, "-c", code, "--debug", "static", "--local"], capture_output=True, text=True,
                       cwd=ROOT, timeout=120)
    assert d.returncode == 70 and "Traceback" in d.stderr and "KeyError" in d.stderr


def test_python_that_is_not_python_is_named(tmp_path):
    p = run("static", "--local", "--python", "/bin/true", "--format", "json")
    assert p.returncode == ExitStatus.HOST_ERROR
    err = json.loads(p.stdout)["hosts"][0]["error"]
    assert "/bin/true is not a Python 3.8+ interpreter" in err and "answered nothing" not in err


def test_unwritable_output_after_the_work_keeps_the_status_and_the_report():
    # /dev/full passes the check (writable) and fails the write (ENOSPC): the report lands on stdout instead
    p = run("static", "--local", "--python", "/bin/true", "-o", "/dev/full")
    assert p.returncode == ExitStatus.HOST_ERROR  # the work's status, not 2
    assert "/dev/full: cannot write report" in p.stderr and "exit 4 HOST_ERROR" in p.stderr
    assert "not a Python 3.8+ interpreter" in p.stdout


def test_text_output_file_is_instead_of_stdout(tmp_path):
    out = tmp_path / "r.txt"
    p = run("static", "--local", "--python", "/bin/true", "-o", str(out))
    assert p.returncode == ExitStatus.HOST_ERROR
    assert p.stdout == "" and "not a Python 3.8+ interpreter" in out.read_text()
    assert f"report written to {out}" in p.stderr


def _report(tmp_path, name, doc):
    f = tmp_path / name
    f.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return str(f)


@pytest.mark.parametrize("sub", ["render", "merge"])
@pytest.mark.parametrize("content,needle", [
    ("{not json", "not JSON"),
    ("[1, 2]", "not an mla-doctor JSON report"),
    ({"tool": "mla-doctor", "hosts": [{"name": "x"}]}, "hosts[0]"),
    ({"tool": "mla-doctor", "hosts": [{"host": "a", "findings": {"x": 1}}]}, "'findings'"),
    ({"tool": "mla-doctor", "hosts": [{"host": "a", "exit_status": 42}]}, "exit_status 42"),
])
def test_report_input_is_validated_naming_the_file(tmp_path, sub, content, needle):
    f = _report(tmp_path, "bad.json", content)
    p = run("report", sub, f, "--format", "json")
    assert p.returncode == ExitStatus.USAGE, p.stdout + p.stderr
    assert f in p.stderr and needle in p.stderr and "Traceback" not in p.stderr
    assert json.loads(p.stdout)["command"] == f"report {sub}"


def test_merge_of_a_failed_shard_is_never_ok(tmp_path):
    good = _report(tmp_path, "s1.json", {"tool": "mla-doctor", "command": "audit", "overall": "ok",
                                         "exit_status": 0, "hosts": [], "fleet": {"playbook": "static"}})
    # what `audit --format json -o s2.json` leaves when the shard's audit failed as a whole
    failed = _report(tmp_path, "s2.json", {"tool": "mla-doctor", "command": "audit", "overall": "error",
                                           "exit_status": 2, "exit_name": "USAGE", "error": "inv.yaml:3: bad",
                                           "hosts": []})
    p = run("report", "merge", good, failed)
    assert p.returncode != 0, p.stdout
    doc = json.loads(p.stdout)
    assert doc["overall"] == "error" and doc["exit_status"] != 0
    assert doc["fleet"]["failed_shards"][0]["path"] == failed


def test_patch_undo_hint_is_the_exact_command(tmp_path):
    p = run("patch", "--local", "--python", "/bin/true", "--run-root", str(tmp_path / "r"), "--dry-run")
    assert p.returncode == ExitStatus.HOST_ERROR  # nothing patched: no undo hint to give
    assert "undo:" not in p.stdout
    from mla_doctor.host.target import target_from_options
    from mla_doctor.host.undo import revert_command

    def undo_command(kw, run_id, run_root, default_run_root):  # what `patch` prints: from the command's target
        t = target_from_options(kw)
        return revert_command(t.address, t.conn, t.python, run_id, run_root, default_run_root)

    kw = {"local": True, "python": "/opt/v/bin/python", "sudo": True}
    assert undo_command(kw, "R1", "/srv/runs", "/var/tmp/mla-doctor") == \
        "mla-doctor revert --local --python /opt/v/bin/python --sudo --run-root /srv/runs --run R1"
    kw = {"host": "ops@gpu 1", "port": 2222, "identity": ("/k",), "ssh_config": "/c", "host_key_policy": "strict"}
    assert undo_command(kw, "R1", "/var/tmp/mla-doctor", "/var/tmp/mla-doctor") == \
        "mla-doctor revert --host 'ops@gpu 1' --port 2222 --ssh-config /c --host-key-policy strict -i /k --run R1"


def _silent_server():
    """A TCP port that accepts and never says a word: an SSH connect to it hangs until its timeout."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(16)
    conns = []

    def accept():
        while True:
            try:
                conns.append(s.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    return s, s.getsockname()[1]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_in_a_live_fleet_run_ends_the_running_host_and_starts_no_other(tmp_path, sig):
    """A runbook that changes hosts (live steps, one at a time): Ctrl-C ends the running host's job, puts back
    what it changed (nothing yet: it never got past the banner), never starts the next host, and writes the
    report and the retry file (tests/unit/test_fleet_interrupt_restore.py: hosts with changes in place)."""
    srv, port = _silent_server()
    inv = tmp_path / "inv.yaml"
    inv.write_text(f"hosts:\n  stuck: {{address: 127.0.0.1, port: {port}}}\n"
                   f"  later: {{address: 127.0.0.1, port: {port}}}\n")
    out, retry = tmp_path / "r.json", tmp_path / "failed.retry"
    proc = subprocess.Popen([sys.executable, "-m", "mla_doctor", "audit", "-i", str(inv), "--playbook", "mla-path",
                             "--yes", "--connect-timeout", "60", "--progress", "plain", "--format", "json",
                             "-o", str(out), "--retry-file", str(retry), "--known-hosts", str(tmp_path / "kh")],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "HOME": str(tmp_path)})
    try:
        err = ""
        while "stuck: connect" not in err and proc.poll() is None:  # the event: the host's job is connecting
            err += os.read(proc.stderr.fileno(), 65536).decode()
        assert "stuck: connect" in err, err
        proc.send_signal(sig)
        _, rest = proc.communicate(timeout=60)  # ends in a second or two; generous for a loaded machine
    finally:
        proc.kill()
        srv.close()
    assert proc.returncode == ExitStatus.INTERRUPTED, rest
    assert "interrupted: restoring 1 running host(s) (stuck) before exiting" in rest
    doc = json.loads(out.read_text())
    hosts = {h["host"]: h for h in doc["hosts"]}
    assert hosts["stuck"]["error_kind"] == "Interrupted" and hosts["stuck"]["error"] == \
        f"interrupted ({sig.name}) while connecting: nothing was changed", hosts["stuck"]
    assert hosts["later"]["error_kind"] == "NotRun" and f"interrupted ({sig.name}) before it started" in \
        hosts["later"]["error"]
    assert doc["fleet"]["interrupted"] is True and doc["exit_status"] == 130
    assert sorted(retry.read_text().split()) == ["later", "stuck"]


def test_ctrl_c_in_a_fleet_audit_writes_finished_hosts_and_the_retry_file(tmp_path):
    srv, port = _silent_server()
    refused = socket.socket()
    refused.bind(("127.0.0.1", 0))
    dead_port = refused.getsockname()[1]
    refused.close()  # nothing listens there: connection refused at once
    inv = tmp_path / "inv.yaml"
    inv.write_text(f"hosts:\n  fast: {{address: 127.0.0.1, port: {dead_port}}}\n"
                   f"  stuck: {{address: 127.0.0.1, port: {port}}}\n")
    out, retry = tmp_path / "r.json", tmp_path / "failed.retry"
    proc = subprocess.Popen([sys.executable, "-m", "mla_doctor", "audit", "-i", str(inv), "--connect-timeout", "60",
                             "--progress", "plain", "--format", "json", "-o", str(out), "--retry-file", str(retry),
                             "--known-hosts", str(tmp_path / "kh")],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "HOME": str(tmp_path)})
    try:
        deadline = time.monotonic() + 30
        err = ""
        while time.monotonic() < deadline and "fast: UNREACHABLE" not in err:
            time.sleep(0.2)
            err += os.read(proc.stderr.fileno(), 65536).decode() if proc.poll() is None else ""
        assert "fast: UNREACHABLE" in err, err
        proc.send_signal(signal.SIGINT)
        _, rest = proc.communicate(timeout=30)
    finally:
        proc.kill()
        srv.close()
    assert proc.returncode == ExitStatus.INTERRUPTED, rest
    doc = json.loads(out.read_text())
    hosts = {h["host"]: h for h in doc["hosts"]}
    assert hosts["fast"]["status"] == "unreachable"
    assert hosts["stuck"]["error_kind"] == "NotRun" and "interrupted" in hosts["stuck"]["error"]
    assert doc["fleet"]["interrupted"] is True and doc["exit_status"] == 130
    assert retry.read_text().split() == ["fast", "stuck"]
