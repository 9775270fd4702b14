"""The test fleet itself works: plain OpenSSH client (`ssh -F fleet.ssh_config`) against it."""
from __future__ import annotations

import socket
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.support.fleet import install_tree, make_venv, site_packages

pytestmark = pytest.mark.fleet

SUDO, HIDDEN, REKEYED, BASTION = "h03", "h04", "h05", "h01"


def _need(fleet, *names):
    if HIDDEN in names and fleet.mode != "netns":
        pytest.skip("FLEET_MODE=loopback: one shared network stack, so no host can be hidden behind a bastion")
    missing = [n for n in names if n not in fleet.names]
    if missing:
        pytest.fail(f"FLEET_N too small for this test: needs {missing}")


def test_hosts_json_and_ssh_config(fleet):
    _need(fleet, SUDO, REKEYED)
    assert fleet.names == [f"h{i:02d}" for i in range(1, len(fleet.hosts) + 1)]
    for h in fleet.hosts:
        assert set(h) == {"name", "host", "port", "user", "proxy_jump", "sudo"}
    assert fleet.host(SUDO)["user"] == "mlaops" and fleet.host(SUDO)["sudo"] is True
    if fleet.mode == "netns":
        assert fleet.host(HIDDEN)["proxy_jump"] == BASTION and fleet.host(HIDDEN)["host"] == "127.0.0.1"
    assert fleet.host("h02") == {"name": "h02", "host": fleet.host("h02")["host"], "port": fleet.host("h02")["port"],
                                 "user": "root", "proxy_jump": None, "sudo": False}
    cfg = fleet.ssh_config.read_text()
    assert cfg.index("Include ") < cfg.index("Host *"), "per-host blocks must come before the defaults"
    # OpenSSH's own resolution of the config
    out = subprocess.run(["ssh", "-G", "-F", str(fleet.ssh_config), SUDO], capture_output=True, text=True, check=True)
    assert "\nuser mlaops\n" in out.stdout
    if fleet.mode == "netns":
        out = subprocess.run(["ssh", "-G", "-F", str(fleet.ssh_config), HIDDEN],
                             capture_output=True, text=True, check=True)
        assert f"\nproxyjump {BASTION}\n" in out.stdout and "\nport 2204\n" in out.stdout


def test_every_reachable_host_answers_with_its_name(fleet):
    names = [n for n in fleet.names if n not in fleet.rekeyed_hosts]

    def probe(name):
        return fleet.ssh(name, "hostname; id -un; echo $MLA_FLEET_HOST")

    with ThreadPoolExecutor(len(names)) as ex:
        results = dict(zip(names, ex.map(probe, names)))
    for name, r in results.items():
        assert r.returncode == 0, f"{name}: {r.stderr}"
        assert r.stdout.split() == [name, fleet.host(name)["user"], name]
        assert fleet.count_accepted(name) >= 1


def test_sudo_host_refuses_root_accepts_mlaops(fleet):
    _need(fleet, SUDO)
    r = fleet.ssh(SUDO, "true", user="root")
    assert r.returncode == 255 and "Permission denied" in r.stderr
    assert "User root from" in fleet.sshd_log(SUDO) and "not allowed" in fleet.sshd_log(SUDO)
    r = fleet.ssh(SUDO, "id -un; sudo -n true && echo sudo-ok; sudo -n id -un; hostname")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["mlaops", "sudo-ok", "root", SUDO]
    assert "unable to resolve host" not in r.stderr   # each host has its own /etc/hosts
    # other hosts still take root
    assert fleet.ssh("h02", "id -un", user="root").stdout.strip() == "root"


def test_hidden_host_only_through_bastion(fleet):
    _need(fleet, HIDDEN, BASTION)
    h = fleet.host(HIDDEN)
    # direct TCP from the controller fails fast: neither its address:port here, nor on the bastion's address
    for addr in (h["host"], fleet.host(BASTION)["host"]):
        with pytest.raises(OSError):
            socket.create_connection((addr, h["port"]), timeout=2).close()
    # ...and OpenSSH without the jump cannot reach it either
    r = fleet.ssh(HIDDEN, "true", options=["ProxyJump=none", "ConnectTimeout=3"])
    assert r.returncode == 255
    before = fleet.count_accepted(BASTION)
    r = fleet.ssh(HIDDEN, "hostname; cat /proc/1/cmdline | tr '\\0' ' '")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[0] == HIDDEN and f"hosts/{HIDDEN}/sshd_config" in r.stdout
    assert fleet.count_accepted(BASTION) == before + 1      # the jump logged in to the bastion
    assert "Accepted publickey for root from 127.0.0.1 " in fleet.sshd_log(HIDDEN)   # via the bastion's loopback
    # own PID/mount/UTS namespaces, the bastion's network namespace
    assert fleet.ssh(BASTION, "hostname").stdout.strip() == BASTION


def test_rekeyed_host_refused_by_strict_checking(fleet):
    _need(fleet, REKEYED)
    r = fleet.ssh(REKEYED, "true")
    assert r.returncode == 255
    assert "REMOTE HOST IDENTIFICATION HAS CHANGED" in r.stderr
    assert "Host key verification failed" in r.stderr
    assert fleet.count_accepted(REKEYED) == 0


def _known_hosts_line(fleet, name, pub):
    h = fleet.host(name)
    where = h["host"] if h["port"] == 22 else f"[{h['host']}]:{h['port']}"
    return f"{where} {pub}\n"


def test_rekey_script_changes_a_running_hosts_key(fleet):
    name = fleet.names[-1]
    assert name not in fleet.rekeyed_hosts + fleet.sudo_hosts + fleet.hidden_hosts
    assert fleet.ssh(name, "true").returncode == 0
    fleet.fs(name, "/root/marker").write_text("kept\n")
    old_line = _known_hosts_line(fleet, name, " ".join(
        (fleet.host_dir(name) / "ssh_host_ed25519_key.pub").read_text().split()[:2]))
    assert old_line in fleet.known_hosts.read_text()
    fleet.rekey(name)
    try:
        assert old_line in fleet.known_hosts.read_text(), "rekey.sh must not touch known_hosts"
        r = fleet.ssh(name, "true")
        assert r.returncode == 255 and "REMOTE HOST IDENTIFICATION HAS CHANGED" in r.stderr
    finally:
        # accept the new key (as an admin would), so later tests can use the host again
        new_pub = " ".join((fleet.host_dir(name) / "ssh_host_ed25519_key.pub").read_text().split()[:2])
        kh = fleet.known_hosts.read_text().replace(old_line, _known_hosts_line(fleet, name, new_pub))
        fleet.known_hosts.write_text(kh)
    r = fleet.ssh(name, "hostname; cat /root/marker")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [name, "kept"]   # files survive the restart


def test_make_venv_works_inside_the_host(fleet):
    name, other = "h02", "h06"
    _need(fleet, name, other)
    py = make_venv(fleet, name)
    assert py == "/opt/ml-env/bin/python"
    r = fleet.ssh(name, f"{py} -c 'import sys, site; print(sys.prefix); print(site.getsitepackages()[0])'")
    assert r.returncode == 0, r.stderr
    prefix, sp = r.stdout.split()
    assert prefix == "/opt/ml-env"
    assert site_packages(fleet, name) == fleet.fs(name, sp)
    # not on another host
    r = fleet.ssh(other, f"test -e {py}")
    assert r.returncode == 1


def test_make_venv_on_sudo_and_hidden_hosts(fleet):
    _need(fleet, SUDO)
    for name in [SUDO] + ([HIDDEN] if fleet.mode == "netns" else []):
        py = make_venv(fleet, name)
        r = fleet.ssh(name, f"{py} -c 'import sys; print(sys.prefix)'")
        assert (r.returncode, r.stdout.strip()) == (0, "/opt/ml-env"), r.stderr


def test_install_tree_is_importable_and_editable(fleet, tmp_path):
    name = "h07"
    _need(fleet, name)
    src = tmp_path / "tree"
    (src / "vllm").mkdir(parents=True)
    (src / "vllm" / "__init__.py").write_text("__version__ = '0.0.1+fleet'\n")
    (src / "vllm-0.0.1.dist-info").mkdir()
    (src / "vllm-0.0.1.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.0.1\n")
    (src / ".complete").write_text("x\n")
    make_venv(fleet, name)
    sp = install_tree(fleet, name, src)
    assert not (sp / ".complete").exists()
    # a plain copy: editing it does not touch the source
    (sp / "vllm" / "__init__.py").write_text("__version__ = '0.0.2+edited'\n")
    assert "0.0.1" in (src / "vllm" / "__init__.py").read_text()
    cmd = ("/opt/ml-env/bin/python -c 'import vllm, importlib.metadata as m; "
           "print(vllm.__version__, m.version(\"vllm\"), vllm.__file__)'")
    r = fleet.ssh(name, cmd)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["0.0.2+edited", "0.0.1", "/opt/ml-env/lib/python3.11/site-packages/vllm/__init__.py"]


def test_opt_ml_env_is_private_per_host(fleet):
    names = [n for n in fleet.names if n not in fleet.rekeyed_hosts]
    for n in names:
        fleet.fs(n, "/opt/ml-env/WHO").write_text(f"{n}\n")
    with ThreadPoolExecutor(len(names)) as ex:
        outs = list(ex.map(lambda n: fleet.ssh(n, "cat /opt/ml-env/WHO"), names))
    for n, r in zip(names, outs):
        assert (r.returncode, r.stdout) == (0, f"{n}\n"), r.stderr
    with pytest.raises(ValueError):
        fleet.fs("h01", "/etc/passwd")   # shared, not per host


def test_each_host_has_its_own_localhost(fleet):
    if fleet.mode != "netns":
        pytest.skip("loopback mode shares one network stack")
    a, b = "h01", "h02"
    start = ("nohup python3 -m http.server 8000 --bind 127.0.0.1 >/dev/null 2>&1 & "
             "for i in $(seq 100); do ss -ltn | grep -q :8000 && break; sleep 0.05; done; ss -ltn | grep -c :8000")
    for n in (a, b):
        r = fleet.ssh(n, start)
        assert r.stdout.strip() == "1", (n, r.stdout, r.stderr)
    fleet.ssh(a, "pkill -f 'http[.]server'; sleep 0.2")
    assert fleet.ssh(a, "ss -ltn | grep -c :8000").stdout.strip() == "0"
    assert fleet.ssh(b, "ss -ltn | grep -c :8000").stdout.strip() == "1"
    fleet.ssh(b, "pkill -f 'http[.]server'")


@pytest.mark.corpus
def test_install_a_real_release(fleet):
    from tests.support import corpus

    name = "h08"
    _need(fleet, name)
    make_venv(fleet, name)
    install_tree(fleet, name, corpus.ensure("vllm", "0.10.2"))
    r = fleet.ssh(name, "/opt/ml-env/bin/python -c 'import importlib.metadata as m; print(m.version(\"vllm\"))'; "
                        "test -f /opt/ml-env/lib/python3.11/site-packages/vllm/model_executor/models/deepseek_v2.py")
    assert (r.returncode, r.stdout.strip()) == (0, "0.10.2"), r.stderr
