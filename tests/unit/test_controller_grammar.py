"""Issue 27, the controller: values by a strict grammar (an address, a user, a port), the API key variable by an
allow-list, probe records by type.

An IPv6 scope id took anything but `%` and `/` (`fe80::1%$(cmd)`) and reached a shell through ssh_config's
`Match exec "… %h"` or `ProxyCommand sh -c '… %h'`: the real paramiko look-up with a real `Match exec` runs
here, with a canary file the injected command would create. An inventory's `api_key_env` named any controller
variable (`AWS_SECRET_ACCESS_KEY`), whose value went to the host. A forged `detached` record crashed the run
(exit 70, no report). Fast: real files, the real CLI in a subprocess where the CLI is the point."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mla_doctor.errors import ConfigFileError, UsageError
from mla_doctor.fleet import inventory
from mla_doctor.host.live import attach
from mla_doctor.host.live.records import process_row_problem, record_problem
from mla_doctor.safety import host_problem
from mla_doctor.ssh.sshconfig import SSHConfigFile, split_target

from tests.unit.test_attach_host import fake_run, proc

REPO = Path(__file__).resolve().parents[2]

# what the scope id carried (anything but % and /): each would run `touch canary` in the cwd through a shell
HOSTILE_SCOPES = ["fe80::1%$(touch${IFS}canary)", "[fe80::1%;touch${IFS}canary;]", "fe80::1%`touch canary`",
                  "fe80::1%a b", "fe80::1%eth0;x", "[fe80::1%|touch canary]", "fe80::1%", "fe80::1%0123456789abcdef",
                  "10.0.0.1%eth0", "gpu-1%eth0"]


def _cli(*args, cwd, env_extra=None, timeout=60):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLA_DOCTOR_")}
    env["PYTHONPATH"] = str(REPO)
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "mla_doctor", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=cwd)


# ---------------------------------------------------------------------------------------------- the grammar

@pytest.mark.parametrize("value", HOSTILE_SCOPES)
def test_an_ipv6_scope_id_is_an_interface_name_and_nothing_else(value):
    assert host_problem(value), value


@pytest.mark.parametrize("value", ["fe80::1%eth0", "[fe80::1%eth0]", "fe80::1%enp3s0f1.100", "fe80::1%br-lan_2",
                                   "fe80::1%7", "::1", "[2001:db8::2]", "10.1.230.174", "gpu-17.example.com",
                                   "node_7.lab."])
def test_addresses_by_the_grammar_pass(value):
    assert host_problem(value) is None


@pytest.mark.parametrize("target, why", [
    ("ops@fe80::1%$(id)", "scope id"), ("[fe80::1%;id;]:22", "scope id"), ("$(id)@gpu-1", "not a user name"),
    ("gpu-1:0", "not a TCP port"), ("gpu-1:70000", "not a TCP port"), ("[::1]:x", "bad port"), ("[::1]22", "bad port"),
    ("-oProxyCommand=id", "not a host name")])
def test_a_target_is_checked_part_by_part(target, why):
    with pytest.raises(UsageError, match=why):
        split_target(target)
    assert split_target("ops@[fe80::1%eth0]:2222") == ("ops", "fe80::1%eth0", 2222)


@pytest.mark.parametrize("value", HOSTILE_SCOPES[:3])
def test_inventory_yaml_and_ini_refuse_a_hostile_scope_id_naming_file_and_line(tmp_path, value):
    y = tmp_path / "inv.yaml"
    y.write_text("hosts:\n  gpu-1:\n    user: ops\n    address: " + json.dumps(value) + "\n")
    with pytest.raises(ConfigFileError, match=rf"^{y}:\d+: host gpu-1: address .*scope id"):
        inventory.load(str(y))
    ini = tmp_path / "inv.ini"
    ini.write_text("[gpu]\ngpu-1 ansible_host='" + value + "'\n")
    with pytest.raises(ConfigFileError, match=rf"^{ini}:2: .*address .*scope id"):
        inventory.load(str(ini))


def _exec_config(tmp_path: Path) -> Path:
    """An ssh_config as operators write them: `Match exec` with %h, and a ProxyCommand through `sh -c`."""
    cfg = tmp_path / "ssh_config"
    cfg.write_text('Match exec "echo %h > seen-by-match-exec"\n  Port 22\n'
                   "Host *\n  ProxyCommand sh -c 'echo %h >/dev/null; exec nc %h %p'\n")
    return cfg


TRANSPORT_PROBE = r"""
import sys
from mla_doctor.errors import UsageError
from mla_doctor.ssh.sshconfig import SSHConfigFile, proxy_command_line
from mla_doctor.ssh.transport import ConnectOptions, SSHTransport
cfg, value = sys.argv[1], sys.argv[2]
conf = SSHConfigFile(cfg)
print("control", conf.lookup("gpu-1").hostname)
for what, attempt in (("lookup", lambda: conf.lookup(value)),
                      ("transport", lambda: SSHTransport("ops@" + value, ConnectOptions(ssh_config=cfg,
                                                                                         connect_timeout=1))),
                      ("proxycommand", lambda: proxy_command_line("sh -c 'exec nc %h %p'", value.strip("[]"), 22))):
    try:
        attempt()
        print(what, "ACCEPTED")
    except UsageError as e:
        print(what, "refused:", e.message)
    except Exception as e:
        print(what, "failed otherwise:", type(e).__name__, e)
"""


@pytest.mark.parametrize("value", HOSTILE_SCOPES[:3])
def test_the_transport_refuses_a_hostile_scope_id_before_match_exec_runs(tmp_path, value):
    """The transport's own check (a caller that skipped the inventory and the CLI): the real paramiko look-up
    with a real `Match exec` (in a child: paramiko runs it through `invoke`, which reads stdin). The control: a
    plain name does run Match exec here (the config is live)."""
    cfg = _exec_config(tmp_path)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    p = subprocess.run([sys.executable, "-c", TRANSPORT_PROBE, str(cfg), value], capture_output=True, text=True,
                       cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, timeout=60)
    assert p.returncode == 0, p.stderr
    assert not (tmp_path / "canary").exists(), "the scope id ran a command on the controller"
    assert "control gpu-1" in p.stdout
    assert (tmp_path / "seen-by-match-exec").read_text().strip() == "gpu-1", "Match exec ran with another %h"
    for what in ("lookup", "transport", "proxycommand"):
        assert f"{what} refused:" in p.stdout and "scope id" in p.stdout, p.stdout


def test_hostile_inventory_and_host_with_a_live_ssh_config_run_nothing(tmp_path):
    """End to end, the real CLI: an ssh_config whose Match exec and ProxyCommand paste %h into a shell; an
    inventory address (YAML and INI `ansible_host=`) and `--host` with a hostile scope id. Refused (exit 2,
    file:line), and the canary the command would create is never created."""
    cfg = _exec_config(tmp_path)
    y = tmp_path / "inv.yaml"
    y.write_text("hosts:\n  gpu-1:\n    address: 'fe80::1%$(touch${IFS}canary)'\n")
    ini = tmp_path / "inv.ini"
    ini.write_text("[gpu]\ngpu-1 ansible_host='[fe80::1%;touch${IFS}canary;]'\n")
    for inv, line in ((y, 3), (ini, 2)):
        p = _cli("audit", "-i", str(inv), "--ssh-config", str(cfg), "--yes", "--connect-timeout", "2", cwd=tmp_path)
        assert p.returncode == 2, p.stdout + p.stderr
        assert f"{inv}:{line}" in p.stderr and "scope id" in p.stderr, p.stderr
    p = _cli("static", "--host", "fe80::1%$(touch${IFS}canary)", "--ssh-config", str(cfg), "--connect-timeout", "2",
             cwd=tmp_path)
    assert p.returncode == 2 and "--host" in p.stderr and "scope id" in p.stderr, p.stdout + p.stderr
    assert not (tmp_path / "canary").exists()
    assert not (tmp_path / "seen-by-match-exec").exists(), "refused before any ssh_config look-up"


def test_ssh_config_port_and_proxyjump_port_by_kind(tmp_path):
    cfg = tmp_path / "ssh_config"
    cfg.write_text("Host badport\n  Port 99999\nHost textport\n  Port ssh\n")
    conf = SSHConfigFile(str(cfg))
    for alias in ("badport", "textport"):
        with pytest.raises(UsageError, match="not a TCP port"):
            conf.lookup(alias)
    from mla_doctor.ssh.sshconfig import parse_jump
    with pytest.raises(UsageError, match="bad port"):
        parse_jump("bastion:x")


# ------------------------------------------------------------------------------------ api_key_env allow-list

SECRET = "AWS_SECRET_ACCESS_KEY"


@pytest.mark.parametrize("fmt", ["yaml", "ansible-yaml", "ini"])
def test_inventory_api_key_env_outside_the_allow_list_is_refused_naming_file_and_line(tmp_path, fmt):
    if fmt == "yaml":
        p = tmp_path / "inv.yaml"
        p.write_text(f"hosts:\n  gpu-1:\n    address: 192.0.2.1\n    api_key_env: {SECRET}\n")
    elif fmt == "ansible-yaml":
        p = tmp_path / "inv.yaml"
        p.write_text(f"gpu:\n  hosts:\n    gpu-1:\n      ansible_host: 192.0.2.1\n      api_key_env: {SECRET}\n")
    else:
        p = tmp_path / "inv.ini"
        p.write_text(f"[gpu]\ngpu-1 ansible_host=192.0.2.1\n[gpu:vars]\napi_key_env={SECRET}\n")
    with pytest.raises(ConfigFileError, match=rf"^{p}:\d+: .*api_key_env '{SECRET}' is not an API key variable "
                                              rf".*--api-key-env {SECRET}"):
        inventory.load(str(p))
    # named by the operator on the command line: allowed
    assert inventory.load(str(p), allow_env=[SECRET]).hosts["gpu-1"].vars["api_key_env"] == SECRET


@pytest.mark.parametrize("name", ["VLLM_API_KEY", "OPENAI_API_KEY", "VLLM_KEY", "INFERENCE_API_KEY"])
def test_allow_listed_names_pass(tmp_path, name):
    p = tmp_path / "inv.ini"
    p.write_text(f"[gpu]\ngpu-1 ansible_host=192.0.2.1 api_key_env={name}\n")
    assert inventory.load(str(p)).hosts["gpu-1"].vars["api_key_env"] == name


@pytest.mark.parametrize("name", [SECRET, "GITHUB_TOKEN", "HOME", "vllm_api_key", "API_KEY", "MY_API_KEYS"])
def test_other_names_are_not_allow_listed(name):
    assert not inventory.api_key_env_allowed(name)


def test_the_secret_never_leaves_the_cli_unless_the_operator_names_it(tmp_path):
    """The real CLI: the inventory's AWS_SECRET_ACCESS_KEY is a usage error before any connection; the same
    with `--api-key-env AWS_SECRET_ACCESS_KEY` (the operator's explicit word) plans the run."""
    p = tmp_path / "inv.ini"
    p.write_text(f"[gpu]\ngpu-1 ansible_host=192.0.2.1 api_key_env={SECRET}\n")
    env = {SECRET: "wJalrXUtnFEMI-secret-value"}
    r = _cli("audit", "-i", str(p), "--dry-run", cwd=tmp_path, env_extra=env)
    assert r.returncode == 2 and f"{p}:2" in r.stderr and "api_key_env" in r.stderr, r.stdout + r.stderr
    assert "wJalrXUtnFEMI" not in r.stdout + r.stderr
    r = _cli("audit", "-i", str(p), "--dry-run", "--api-key-env", SECRET, cwd=tmp_path, env_extra=env)
    assert r.returncode == 0, r.stdout + r.stderr
    # a runbook's own api_key_env: the same rule, naming the runbook's file and line
    pb = tmp_path / "pb.yaml"
    pb.write_text(f"name: mine\nsteps:\n  - live:\n      api_key_env: {SECRET}\n")
    q = tmp_path / "ok.ini"
    q.write_text("[gpu]\ngpu-1 ansible_host=192.0.2.1\n")
    r = _cli("audit", "-i", str(q), "--playbook", str(pb), "--dry-run", "--yes", cwd=tmp_path)
    assert r.returncode == 2 and str(pb) in r.stderr and "api_key_env" in r.stderr, r.stdout + r.stderr


HOSTILE_ENV_NAMES = ["X;touch canary", "X$(touch canary)", "X`touch canary`", "A B", "1X", "", "X-Y"]


@pytest.mark.parametrize("name", HOSTILE_ENV_NAMES)
def test_run_api_key_env_is_a_name_checked_up_front(tmp_path, name):
    """`run --api-key-env 'X;touch canary'` (and `audit --api-key-env`): a usage error (exit 2) naming the flag,
    before any server is looked for or any file read; no canary is made."""
    r = _cli("run", "--local", "--method", "attach", "--api-key-env", name, cwd=tmp_path)
    assert r.returncode == 2 and "--api-key-env" in r.stderr and "environment variable name" in r.stderr, \
        r.stdout + r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "canary").exists()
    r = _cli("audit", "-i", str(tmp_path / "absent.ini"), "--dry-run", "--api-key-env", name, cwd=tmp_path)
    assert r.returncode == 2 and "environment variable name" in r.stderr, r.stdout + r.stderr


@pytest.mark.parametrize("name", ["VLLM_API_KEY", "_K", "my_key2"])
def test_run_api_key_env_names_pass_the_grammar(name):
    from mla_doctor.host.live_options import RunOptions

    assert RunOptions(api_key_env=name).api_key_env == name
    with pytest.raises(UsageError, match="environment variable name"):
        RunOptions(api_key_env=name + ";id")


# ----------------------------------------------------------------------------------------- records by type

GOOD_CALL = {"event": "call", "pid": 7, "epoch": 2, "seq": 1, "role": "decode", "function": "X.forward_mqa",
             "class": "X", "process": "w0", "comm": "VLLM::Worker", "layer": "model.layers.0", "tp_rank": 0,
             "capturing": None, "nested": False, "layer_inferred": False, "ts": 1.5, "target": "decode-1",
             "tokens": {"q_rows": 1, "q_from": "q", "metadata": {"num_decodes": 1, "has_decode": True}}}
GOOD_DETACHED = {"event": "detached", "pid": 7, "reason": "lease ended", "error": None, "restored": 3,
                 "still_wrapped": [], "dynamo_before": {"stats": {"unique_graphs": 0}, "compiled_frames": None},
                 "dynamo_after": {"stats": {"unique_graphs": 0}, "compiled_frames": None}, "loggers_restored": 0}
HOSTILE = [None, True, "1", 1.5, [], {}, ["x"], {"a": "b"}, float("nan"), 10 ** 30, -1]


def _fields(rec):
    return [k for k in rec if k not in ("event",)]


@pytest.mark.parametrize("good", [GOOD_CALL, GOOD_DETACHED])
def test_each_field_by_type_a_few_hostile_values(good):
    """Each field of a real record, set to values of other types: every one either passes as the same kind
    (None where optional) or is named as malformed; none raises."""
    assert record_problem(good) is None
    bad = 0
    for k in _fields(good):
        for v in HOSTILE:
            rec = dict(good, **{k: v})
            why = record_problem(rec)  # never raises
            same_kind = (v is None or type(v) is type(good[k]) or (good[k] is None and isinstance(v, (str, bool)))
                         or (isinstance(good[k], float) and isinstance(v, int) and not isinstance(v, bool)))
            if not same_kind:
                assert why, (k, v)
                bad += 1
    assert bad > 40


@pytest.mark.parametrize("rec", [1, "x", [], {"event": "detached"}, {"event": "call", "pid": True},
                                 {"event": "exploded", "pid": 1}, {"event": "call", "pid": 1, "tokens": "many"},
                                 {"event": "call", "pid": 1, "tokens": {"q_rows": "1"}},
                                 {"event": "call", "pid": 1, "tokens": {"metadata": {"num_decodes": "9"}}},
                                 {"event": "detached", "pid": 1, "still_wrapped": "X.forward"},
                                 {"event": "detached", "pid": 1, "dynamo_before": {"stats": {"u": "1"}}},
                                 {"event": "detached", "pid": 1, "dynamo_after": []}])
def test_malformed_records_are_named(rec):
    assert record_problem(rec)


@pytest.mark.parametrize("forged", [
    "detached", 42, ["x"], {"still_wrapped": "CPUMLAImpl.forward_mqa"}, {"still_wrapped": [1, 2]},
    {"still_wrapped": [], "dynamo_before": "lots", "dynamo_after": {"stats": []}},
    {"still_wrapped": [], "dynamo_before": {"frames": {"ok": "9"}}, "dynamo_after": None},
    {"still_wrapped": None, "dynamo_before": {"stats": {"unique_graphs": 10 ** 400 // 10 ** 399}}, "pid": "7"}])
def test_a_forged_detached_record_is_a_restore_problem_never_a_traceback(forged):
    """The issue's crash: a `detached` record the service user forged made detach() raise (exit 70, no report).
    Now the row is named malformed, the run is reported NOT restored, and nothing raises."""
    run = fake_run({"outcome": "detached", "processes": [proc(detached_record=forged)],
                    "install_after": {"digest": "d1"}})
    attach.detach(run)
    problems = run.live["restore_problems"]
    assert any("malformed detach answer" in p for p in problems), problems
    assert run.report.restored is False
    assert process_row_problem(proc()) is None  # the control: a well-formed row passes


def test_a_forged_process_row_is_a_problem_too():
    run = fake_run({"outcome": "detached", "install_after": {"digest": "d1"},
                    "processes": ["pid 1", proc(pid_before="11"), proc(attached="yes"), proc()]})
    attach.detach(run)
    assert sum("malformed detach answer" in p for p in run.live["restore_problems"]) == 3


@pytest.mark.parametrize("value", [".nan", "-1", "0", ".inf", "-.inf"])
@pytest.mark.parametrize("key", ["connect_timeout", "command_timeout", "host_timeout"])
def test_inventory_timeouts_are_seconds_above_zero(tmp_path, key, value):
    """Red team: `connect_timeout: .nan` was an internal error in the host's job (ValueError from the socket)."""
    p = tmp_path / "inv.yaml"
    p.write_text(f"hosts:\n  gpu-1:\n    address: 192.0.2.1\n    {key}: {value}\n")
    with pytest.raises(ConfigFileError, match=rf"^{p}:3: host gpu-1: {key} .* is not a number of seconds > 0"):
        inventory.load(str(p))
    p.write_text(f"hosts:\n  gpu-1:\n    address: 192.0.2.1\n    {key}: 2.5\n")
    assert inventory.load(str(p)).hosts["gpu-1"].vars[key] == 2.5


def test_malformed_records_are_left_out_counted_and_reported():
    """Both live methods read the probe's records through LiveRun.records: a forged one is left out of the
    verdict, counted, and a PROBE_RECORDS_MALFORMED finding names what was wrong."""
    from types import SimpleNamespace

    from mla_doctor.host.live.records import malformed_findings
    from mla_doctor.host.live.session import LiveRun
    from mla_doctor.remote.protocol import RecordsAnswer

    forged = [1, {"event": "call", "pid": 7, "tokens": {"q_rows": "lots"}}, dict(GOOD_CALL, epoch="2"),
              {"event": "armed", "pid": "7"}]
    run = LiveRun.__new__(LiveRun)  # the state records() reads; the agent's answer as it would arrive
    run.live, run.records_offsets, run.armed, run.run_id = {}, {}, [], "r1"
    run.ropts = SimpleNamespace(run_root="/var/tmp/mla-doctor")
    run.call = lambda request, **kw: RecordsAnswer({"records": [GOOD_CALL, *forged], "offsets": {"a": 9}})
    assert run.records() == [GOOD_CALL]
    assert run.live["records_malformed"]["count"] == 4
    (f,) = malformed_findings(run.live)
    assert f.code == "PROBE_RECORDS_MALFORMED" and "4 probe record(s)" in f.summary
    assert any("tokens: q_rows is not an integer" in e for e in f.evidence), f.evidence
    assert malformed_findings({}) == []
