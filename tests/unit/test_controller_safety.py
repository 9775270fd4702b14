"""The controller half of issue 9: control characters, the template sandbox, hostile YAML, redaction in
every output, and known_hosts markers (@revoked, @cert-authority) — with real parts where they exist: the
real CLI in a subprocess, real keys, and a throwaway sshd of our own on a loopback port."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import paramiko
import pytest
from click.testing import CliRunner

from mla_doctor import reports, yamlfile
from mla_doctor.errors import ConfigFileError, HostKeyError, UsageError
from mla_doctor.fleet import inventory, playbook
from mla_doctor.redact import REDACTED, redact_argv, redact_text, redact_tree
from mla_doctor.reports.host_text import render as render_host_text
from mla_doctor.results import Finding, HostReport, RunReport, Severity
from mla_doctor.safety import check_no_control
from mla_doctor.ssh import transport as tr_mod
from mla_doctor.ssh.transport import ConnectOptions, KnownHosts, SSHTransport, host_matches, load_known_hosts

REPO = Path(__file__).resolve().parents[2]


def _cli(*args, timeout=60):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "mla_doctor", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=REPO)


class _Listener:
    """A loopback port that records whether anything connected (proof that nothing was contacted)."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(5)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        self._stop = False
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()

    def _run(self):
        while not self._stop:
            try:
                c, _ = self.sock.accept()
                self.connections += 1
                c.close()
            except OSError:
                continue

    def close(self):
        self._stop = True
        self.t.join(2)
        self.sock.close()


# ------------------------------------------------------------------------------ control characters

@pytest.mark.parametrize("bad", ["a\rb", "a\nExecStartPre=+/bin/id", "a\0b", "a\x7fb", "a\tb", "\x1b[2J"])
def test_control_characters_are_refused(bad):
    with pytest.raises(UsageError, match="--env: control character"):
        check_no_control(["OK=1", f"K={bad}"], "--env")
    with pytest.raises(ConfigFileError, match=r"^inv.yaml:7: runtime.unit: control character"):
        check_no_control({"unit": bad}, "runtime", "inv.yaml", 7)


def test_plain_values_pass_unchanged():
    v = {"unit": "vllm@0.service", "commands": {"start": "systemctl start 'vllm x' && echo ok"}, "n": 3}
    assert check_no_control(v, "runtime") is v
    assert check_no_control(None, "--unit") is None
    assert check_no_control("ünïcode — fine", "--log-file") == "ünïcode — fine"


def test_cr_in_env_via_the_real_cli_is_a_usage_error_before_any_connection():
    lis = _Listener()
    try:
        p = _cli("run", "--host", "127.0.0.1", "--port", str(lis.port), "--yes", "--connect-timeout", "2",
                 "--env", "HF_HOME=/x\rExecStartPre=+/bin/touch /tmp/pwned")
        time.sleep(0.3)
    finally:
        lis.close()
    assert p.returncode == 2, p.stderr
    assert "--env" in p.stderr and "control character" in p.stderr, p.stderr
    assert lis.connections == 0


@pytest.mark.parametrize("option,value", [
    ("--second-pass", "--enforce-eager\n--api-key x"), ("--unit", "vllm.service\nExecStartPre=+/bin/id"),
    ("--container", "vllm\0"), ("--start-command", "vllm serve\r"), ("--stop-command", "kill 1\n"),
    ("--log-file", "/var/log/v\n.log"), ("--api-key-env", "KEY\r"),
])
def test_every_run_option_that_reaches_the_server_refuses_control_characters(option, value):
    from mla_doctor.cli import cli

    lis = _Listener()
    try:
        extra = ["--runtime", "command", "--start-command", "a", "--stop-command", "b"] if "command" in option else []
        r = CliRunner().invoke(cli, ["run", "--host", "127.0.0.1", "--port", str(lis.port), "--yes",
                                     "--connect-timeout", "2", *extra, option, value])
    finally:
        lis.close()
    assert r.exit_code == 2, r.output
    assert f"{option}: control character" in r.output
    assert lis.connections == 0


def _inventory(tmp_path, runtime: str = "") -> Path:
    p = tmp_path / "inv.yaml"
    p.write_text("hosts:\n  gpu-1:\n    address: 127.0.0.1\n" + runtime)
    return p


def test_playbook_live_debug_value_with_cr_names_file_and_line(tmp_path):
    pb = tmp_path / "pb.yaml"
    pb.write_text('steps:\n  - audit: {}\n  - name: live\n    live:\n'
                  '      debug: {HF_HOME: "/x\\rExecStartPre=+/bin/id"}\n')
    with pytest.raises(ConfigFileError, match=rf"^{pb}:3: step #2 \(live\): live.debug.*control character"):
        playbook.load(str(pb))


def test_playbook_template_that_renders_a_newline_is_refused_per_host(tmp_path):
    pb = tmp_path / "pb.yaml"
    pb.write_text("steps:\n  - live:\n      second_pass: ['--max-num-seqs', '{{ n }}']\n")
    loaded = playbook.load(str(pb))
    host = inventory.load(str(_inventory(tmp_path))).hosts["gpu-1"]
    assert playbook.plan(loaded, host, {"n": "8"}).steps[0].options["second_pass"] == ["--max-num-seqs", 8]
    with pytest.raises(ConfigFileError, match=rf"^{pb}:2: .*live.second_pass: control character"):
        playbook.plan(loaded, host, {"n": "8\nExecStartPre=+/bin/id"})


def test_inventory_runtime_with_control_characters_is_refused_before_any_connection(tmp_path):
    inv = _inventory(tmp_path, '    runtime: {kind: systemd, unit: "vllm.service\\nExecStartPre=+/bin/id"}\n')
    host = inventory.load(str(inv)).hosts["gpu-1"]
    with pytest.raises(UsageError, match=r"host gpu-1 .*runtime.unit: control character"):
        playbook.plan(playbook.load("static"), host)
    p = _cli("audit", "-i", str(inv), "--dry-run")
    assert p.returncode == 2 and "control character" in p.stderr, p.stderr


# ----------------------------------------------------------------------------------- the sandbox

ESCAPE = "{{ cycler.__init__.__globals__.os.system('touch %s') }}"


def test_template_escape_is_refused_with_file_and_line_and_runs_nothing(tmp_path):
    marker = tmp_path / "pwned"
    pb = tmp_path / "pb.yaml"
    pb.write_text("name: evil\nsteps:\n  - audit: {}\n  - name: innocent\n    audit:\n"
                  f"      model: \"{ESCAPE % marker}\"\n")
    loaded = playbook.load(str(pb))
    host = inventory.load(str(_inventory(tmp_path))).hosts["gpu-1"]
    with pytest.raises(ConfigFileError, match=rf"^{pb}:4: step #2 \(innocent\), host gpu-1: template error: "
                                              r"unsafe template refused \(sandbox\)"):
        playbook.plan(loaded, host)
    assert not marker.exists()


def test_template_escape_under_dry_run_via_the_real_cli(tmp_path):
    marker = tmp_path / "pwned"
    pb = tmp_path / "pb.yaml"
    pb.write_text(f"steps:\n  - command: \"{ESCAPE % marker}\"\n")
    p = _cli("audit", "-i", str(_inventory(tmp_path)), "--playbook", str(pb), "--dry-run")
    assert p.returncode == 2, p.stdout + p.stderr
    assert f"{pb}:2:" in p.stderr and "sandbox" in p.stderr, p.stderr
    assert not marker.exists()


@pytest.mark.parametrize("expr", ["{{ 'a' * 100000000 }}", "{{ [1] * 100000000 }}", "{{ 2 ** 100000 }}",
                                  "{{ range(100000000) | list }}", "{{ ''.__class__.__mro__ }}",
                                  "{{ '{0.__class__}'.format(1) }}"])
def test_template_resource_and_introspection_limits(tmp_path, expr):
    pb = tmp_path / "pb.yaml"
    pb.write_text(f"steps:\n  - audit: {{model: \"{expr}\"}}\n")
    host = inventory.load(str(_inventory(tmp_path))).hosts["gpu-1"]
    t0 = time.monotonic()
    with pytest.raises(ConfigFileError, match=rf"^{pb}:2: .*template error"):
        playbook.plan(playbook.load(str(pb)), host)
    assert time.monotonic() - t0 < 5


def test_ordinary_templates_still_render_natively(tmp_path):
    pb = tmp_path / "pb.yaml"
    pb.write_text("vars: {n: 3}\nsteps:\n  - live: {max_tokens: '{{ n * 2 }}', prompts: \"{{ 'short' }}\"}\n")
    host = inventory.load(str(_inventory(tmp_path))).hosts["gpu-1"]
    opts = playbook.plan(playbook.load(str(pb)), host).steps[0].options
    assert opts["max_tokens"] == 6 and opts["prompts"] == ["short"]


# ------------------------------------------------------------------------------------ hostile YAML

def _bomb() -> str:
    lines = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for prev, name in zip("abcdefgh", "bcdefghi"):
        lines.append(f"{name}: &{name} [" + ",".join([f"*{prev}"] * 9) + "]")
    return "\n".join(lines) + "\n"


def test_alias_bomb_fails_fast_with_file_and_line(tmp_path):
    text = _bomb()
    assert len(text) < 700
    p = tmp_path / "bomb.yaml"
    p.write_text(text)
    t0 = time.monotonic()
    with pytest.raises(ConfigFileError, match=rf"^{p}:1: YAML anchor &a is not supported"):
        yamlfile.load(str(p))
    assert time.monotonic() - t0 < 10  # milliseconds; generous for a loaded machine (the bomb: 9**9 nodes)


def test_alias_bomb_via_the_real_cli_inventory_and_playbook(tmp_path):
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(_bomb())
    for args in (["-i", str(bomb)], ["-i", str(_inventory(tmp_path)), "--playbook", str(bomb)]):
        p = _cli("audit", *args, "--dry-run", timeout=30)
        assert p.returncode == 2, p.stderr
        assert f"{bomb}:1: YAML anchor" in p.stderr


@pytest.mark.parametrize("text,line,what", [
    ("x: 1\ny: *nope\n", 2, "alias"), ("x: 1\nbase: &b {u: 1}\n", 2, "anchor"),
    ("a: 1\nh:\n  <<: *base\n", 3, "alias"), ("a: " + "[" * 100 + "]" * 100 + "\n", 1, "nested deeper"),
])
def test_anchors_aliases_and_deep_nesting_are_refused(text, line, what):
    with pytest.raises(ConfigFileError, match=rf"^f.yaml:{line}: .*{what}"):
        yamlfile.load("f.yaml", text)


def test_size_cap(tmp_path):
    big = tmp_path / "big.yaml"
    big.write_text("# pad\n" * (yamlfile.MAX_BYTES // 6 + 10))
    with pytest.raises(ConfigFileError, match="too large"):
        yamlfile.load(str(big))
    with pytest.raises(ConfigFileError, match="too large"):
        yamlfile.load(str(big), big.read_text())
    assert yamlfile.load("ok.yaml", "a: {b: [1, 2]}\n") == {"a": {"b": [1, 2], "__line__": 1}, "__line__": 1}


# ------------------------------------------------------------------------------------- redaction

def test_redact_argv_nargs_plus_and_forms():
    argv = ["vllm", "serve", "/m", "--api-key", "k1", "k2", "--port", "8000", "--hf-token=t", "--auth-token", "a",
            "--max-num-batched-tokens", "8192", "--tokenizer", "/tok", "--ssl-keyfile", "/k.pem",
            "--db-password", "p", "--client-secret", "s"]
    assert redact_argv(argv) == ["vllm", "serve", "/m", "--api-key", REDACTED, REDACTED, "--port", "8000",
                                 f"--hf-token={REDACTED}", "--auth-token", REDACTED, "--max-num-batched-tokens",
                                 "8192", "--tokenizer", "/tok", "--ssl-keyfile", "/k.pem", "--db-password",
                                 REDACTED, "--client-secret", REDACTED]


def test_redact_text_urls_env_words_and_flags():
    t = ("restart: vllm serve --api-key sk-1 sk-2 --port 1; HF_TOKEN=hf_x VLLM_LOGGING_LEVEL=DEBUG "
         "from https://bob:hunter2@hub.example/x and git@github.com:o/r, max_num_batched_tokens=2048")
    out = redact_text(t)
    for s in ("sk-1", "sk-2", "hf_x", "bob", "hunter2"):
        assert s not in out
    for s in ("--port 1", "VLLM_LOGGING_LEVEL=DEBUG", "https://<redacted>@hub.example/x", "git@github.com:o/r",
              "max_num_batched_tokens=2048"):
        assert s in out


SECRETS = ("sk-first", "sk-second", "hf_secret_value", "hunter2", "bob")


def _report() -> RunReport:
    h = HostReport(host="gpu-1")
    h.server = {"running": True, "argv": ["vllm", "serve", "--api-key", "sk-first", "sk-second", "--port", "8000"],
                "env": {"HF_TOKEN": "hf_secret_value", "VLLM_LOGGING_LEVEL": "DEBUG"}}
    h.live = {"run_id": "r1", "method": "patch", "runtime": "process", "configuration": "production",
              "settings": {"VLLM_LOGGING_LEVEL": "DEBUG", "HF_TOKEN": "hf_secret_value"},
              "second_pass": ["--api-key", "sk-first", "sk-second"]}
    h.findings = [Finding("MODEL_DOWNLOAD", Severity.FAIL, "download from https://bob:hunter2@hub.example/m failed",
                          evidence=["vllm serve --api-key sk-first sk-second", "HF_TOKEN=hf_secret_value"],
                          action="retry without https://bob:hunter2@hub.example")]
    h.error = "step live: server exited: vllm serve --api-key sk-first sk-second (https://bob:hunter2@hub.example)"
    h.status = h.status.ERROR
    return RunReport(command="run", hosts=[h])


@pytest.mark.parametrize("fmt", ["json", "text", "markdown", "junit", "html", "host-text"])
def test_no_secret_reaches_any_report_format(fmt):
    report = _report()
    if fmt == "host-text":
        out = render_host_text(report.redacted())
        # the one-host text report shows the live settings only for a host that ran
        report.hosts[0].status = report.hosts[0].status.OK
        out += render_host_text(report.redacted())
        assert "HF_TOKEN=<redacted>" in out
    else:
        doc = reports.fleet_document(report.hosts, {"inventory": "inv.yaml", "playbook": "mla-path"}, 0.0, 1.0)
        out = reports.render(doc, fmt)
        json.dumps(doc)
    for s in SECRETS:
        assert s not in out, (fmt, s)
    assert "redacted" in out


def test_to_dict_redacts_the_live_settings_and_keeps_evidence():
    d = _report().to_dict()
    h = d["hosts"][0]
    assert h["live"]["settings"] == {"VLLM_LOGGING_LEVEL": "DEBUG", "HF_TOKEN": REDACTED}
    assert h["server"]["argv"] == ["vllm", "serve", "--api-key", REDACTED, REDACTED, "--port", "8000"]
    assert redact_tree({"argv": ["--max-num-batched-tokens", "8192"]}) == {"argv": ["--max-num-batched-tokens",
                                                                                     "8192"]}


def test_redaction_does_not_touch_the_report_it_renders():
    report = _report()
    report.to_dict()
    report.redacted()
    assert report.hosts[0].live["settings"]["HF_TOKEN"] == "hf_secret_value"  # still the server's to use


# ----------------------------------------------------------------------------------- known_hosts

def _key_line(key) -> str:
    return f"{key.get_name()} {key.get_base64()}"


@pytest.fixture()
def keys(tmp_path):
    return {"ed": paramiko.Ed25519Key.from_private_key_file(_gen_ed25519(tmp_path / "ed")),
            "rsa": paramiko.RSAKey.generate(2048), "ca": paramiko.RSAKey.generate(2048)}


def _gen_ed25519(path: Path) -> str:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)
    return str(path)


def test_marker_lines_parse_without_crashing(tmp_path, keys):
    kh = tmp_path / "known_hosts"
    kh.write_text("\n".join([
        "# comment", "",
        f"@cert-authority *.corp,!bad.corp {_key_line(keys['ca'])}",
        f"@revoked * {_key_line(keys['rsa'])}",
        f"gpu-1,[gpu-1]:2222 {_key_line(keys['ed'])}",
        f"gpu-2 {_key_line(keys['rsa'])}",
        "@revoked", "@unknown x ssh-ed25519 AAAA", "gpu-3 ssh-ed25519 !!notbase64!!", "gpu-4 ssh-foo AAAA",
        "gpu-5 ssh-ed25519",
    ]) + "\n")
    with pytest.raises(paramiko.hostkeys.InvalidHostKey):  # what crashed the tool before: paramiko's reader
        paramiko.HostKeys(str(kh))
    k = load_known_hosts([str(kh)], system=None)
    assert k.revoked_at(keys["rsa"]) == f"{kh}:4" and k.revoked_at(keys["ed"]) is None
    assert k.authority_for("a.corp") == f"{kh}:3"
    assert k.authority_for("bad.corp") is None and k.authority_for("gpu-1") is None
    assert {n for _, n, _ in k.skipped} == {7, 8, 9, 10, 11}
    table = k.fill(paramiko.HostKeys())
    assert table.lookup("gpu-1") is not None and table.lookup("[gpu-1]:2222") is not None
    assert table.lookup("gpu-2") is None  # its only key is revoked: unknown to paramiko, refused by the policy


def test_known_hosts_read_once_per_process_and_filled_for_one_name(tmp_path, keys):
    """A fleet's connections share one parse of known_hosts (it was re-read per host: O(hosts x lines)),
    each fills paramiko with only the name it looks up, and an accept-new append is seen at once."""
    from mla_doctor.ssh.transport import known_hosts_for

    kh = tmp_path / "known_hosts"
    hashed = paramiko.HostKeys.hash_host("[gpu-h]:2222")
    kh.write_text(f"gpu-1 {_key_line(keys['ed'])}\ngpu-2 {_key_line(keys['rsa'])}\n"
                  f"{hashed} {_key_line(keys['ca'])}\n")
    first = known_hosts_for([str(kh)], system=None)
    assert known_hosts_for([str(kh)], system=None) is first  # no second parse while the file is unchanged
    table = first.fill(paramiko.HostKeys(), only="gpu-1")
    assert table.lookup("gpu-1") is not None and table.lookup("gpu-2") is None
    assert first.fill(paramiko.HostKeys(), only="[gpu-h]:2222").lookup("[gpu-h]:2222") is not None
    assert first.fill(paramiko.HostKeys(), only="gpu-h").lookup("gpu-h") is None  # the hash is of [gpu-h]:2222
    with open(kh, "a") as f:  # accept-new appends a line: the next connection must see it
        f.write(f"gpu-3 {_key_line(keys['ed'])}\n")
    again = known_hosts_for([str(kh)], system=None)
    assert again is not first and again.fill(paramiko.HostKeys(), only="gpu-3").lookup("gpu-3") is not None


def test_refuse_revoked_and_ca_only_hosts(keys):
    k = KnownHosts(revoked=[("kh", 4, keys["rsa"].asbytes())], authorities=[("kh", 3, ["*.corp"])])
    with pytest.raises(HostKeyError, match=r"REVOKED HOST KEY: gpu-2 offered ssh-rsa SHA256:.* kh:4 marks @revoked"):
        k.refuse("gpu-2", keys["rsa"], "gpu-2")
    with pytest.raises(HostKeyError, match=r"kh:3 trusts a certificate authority .* host certificates are not "
                                           "supported"):
        k.refuse("a.corp", keys["ed"], "a.corp")
    k.refuse("gpu-9", keys["ed"], "gpu-9")  # neither: the policy decides (strict / accept-new)


def test_hashed_and_negated_patterns():
    hashed = paramiko.HostKeys.hash_host("[10.0.0.5]:2222")
    assert host_matches([hashed], "[10.0.0.5]:2222") and not host_matches([hashed], "10.0.0.5")
    assert host_matches(["gpu-?", "!gpu-9"], "gpu-1") and not host_matches(["gpu-?", "!gpu-9"], "gpu-9")
    assert not host_matches(["|1|broken"], "x")
    assert host_matches(["[10.0.0.5]:*"], "[10.0.0.5]:2222") and not host_matches(["[10.0.0.5]:*"], "1")


# a throwaway sshd of our own (no namespaces, not the fleet): the refusal end to end, over a real handshake

@pytest.fixture()
def sshd(tmp_path):
    if os.geteuid() != 0 or not shutil.which("sshd") and not os.path.exists("/usr/sbin/sshd"):
        pytest.skip("needs root and OpenSSH's sshd (a throwaway server on a loopback port)")
    exe = shutil.which("sshd") or "/usr/sbin/sshd"
    os.makedirs("/run/sshd", mode=0o755, exist_ok=True)
    d = tmp_path / "sshd"
    d.mkdir()
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / "host_ed25519")], check=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = d / "sshd_config"
    cfg.write_text(f"Port {port}\nListenAddress 127.0.0.1\nHostKey {d / 'host_ed25519'}\nPidFile {d / 'pid'}\n"
                   f"AuthorizedKeysFile {d / 'authorized_keys'}\nPasswordAuthentication no\n"
                   "KbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n")
    proc = subprocess.Popen([exe, "-D", "-e", "-f", str(cfg)], stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60  # generous: a loaded machine; sshd's port answering is the event
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            break
        except OSError:
            time.sleep(0.05)
    else:
        proc.kill()
        pytest.fail(f"sshd did not start: {proc.stderr.read().decode()}")
    host_key = paramiko.Ed25519Key.from_private_key_file(str(d / "host_ed25519"))
    try:
        yield port, host_key
    finally:
        proc.terminate()
        proc.wait(5)


def _connect(port, kh, policy, identity="/nonexistent"):
    return SSHTransport("127.0.0.1", ConnectOptions(port=port, known_hosts=str(kh), host_key_policy=policy,
                                                    identity=(identity,), connect_timeout=30,
                                                    ssh_config="/dev/null"))


@pytest.mark.parametrize("policy", ["strict", "accept-new"])
def test_real_sshd_with_a_revoked_key_is_refused(sshd, tmp_path, policy):
    port, host_key = sshd
    kh = tmp_path / "known_hosts"
    kh.write_text(f"@revoked * {_key_line(host_key)}\n[127.0.0.1]:{port} {_key_line(host_key)}\n")
    before = kh.read_text()
    with pytest.raises(HostKeyError, match="REVOKED HOST KEY"):
        _connect(port, kh, policy)
    assert kh.read_text() == before  # nothing recorded
    # the CLI: exit 3 (unreachable / refused), one clear message
    p = _cli("static", "--host", "127.0.0.1", "--port", str(port), "--known-hosts", str(kh), "--ssh-config",
             "/dev/null", "-i", "/nonexistent", "--host-key-policy", policy)
    assert p.returncode == 3, p.stderr + p.stdout
    assert "REVOKED HOST KEY" in p.stdout + p.stderr and "Traceback" not in p.stderr


def test_real_sshd_only_a_ca_vouches_for_is_refused_not_trusted_on_first_use(sshd, tmp_path, keys):
    port, _ = sshd
    kh = tmp_path / "known_hosts"
    kh.write_text(f"@cert-authority 127.0.0.1,[127.0.0.1]:* {_key_line(keys['ca'])}\n")
    with pytest.raises(HostKeyError, match="host certificates are not supported"):
        _connect(port, kh, "accept-new")
    assert kh.read_text().count("\n") == 1  # accept-new did not record the key


def test_real_sshd_control_a_listed_key_gets_past_the_host_key_check(sshd, tmp_path, keys):
    port, host_key = sshd
    kh = tmp_path / "known_hosts"
    kh.write_text(f"@revoked * {_key_line(keys['rsa'])}\n@cert-authority *.corp {_key_line(keys['ca'])}\n"
                  f"[127.0.0.1]:{port} {_key_line(host_key)}\n")
    with pytest.raises(tr_mod.AuthError):  # host key accepted; our (unauthorized) key is not
        _connect(port, kh, "strict", identity=_gen_ed25519(tmp_path / "client"))
