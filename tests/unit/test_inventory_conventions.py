"""Inventory conventions users bring from Ansible, and mistakes named as what they are (issue 11)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mla_doctor.errors import ConfigFileError
from mla_doctor.fleet import inventory

ROOT = Path(__file__).resolve().parents[2]


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "mla_doctor", *args], capture_output=True, text=True, timeout=60,
                          cwd=ROOT)


@pytest.mark.parametrize("text,key,hint", [
    ("host:\n  gpu-1: {address: 10.0.0.1}\nvars:\n  user: ops\n", "host", "hosts"),
    ("host:\n  gpu-1: {address: 10.0.0.1}\n", "host", "hosts"),
    ("hosts:\n  gpu-1: {}\ngroup:\n  gpu: {hosts: [gpu-1]}\n", "group", "groups"),
    ("hosts:\n  gpu-1: {}\nvar:\n  user: ops\n", "var", "vars"),
    ("hosts:\n  gpu-1: {}\nextra:\n  user: ops\n", "extra", None),
])
def test_a_top_level_typo_is_named(tmp_path, text, key, hint):
    f = tmp_path / "inv.yaml"
    f.write_text(text)
    with pytest.raises(ConfigFileError) as e:
        inventory.load(str(f))
    msg = str(e.value)
    assert f"top-level key {key!r}" in msg and "group vars" not in msg
    assert (f"did you mean {hint!r}" in msg) if hint else "did you mean" not in msg


def test_ansible_yaml_groups_still_load(tmp_path):
    f = tmp_path / "inv.yaml"
    f.write_text("all:\n  children:\n    gpu:\n      hosts:\n        h1: {ansible_host: 10.0.0.1}\n"
                 "gpus:\n  hosts:\n    h2: {}\n")
    inv = inventory.load(str(f))
    assert set(inv.hosts) == {"h1", "h2"}


def test_ansible_connection_local_and_ssh_plugins(tmp_path):
    f = tmp_path / "hosts.ini"
    f.write_text("[gpu]\nbox ansible_connection=local\nh2 ansible_connection=ssh ansible_host=10.0.0.2\n"
                 "h3 ansible_connection=paramiko\n")
    inv = inventory.load(str(f))
    assert inv.hosts["box"].vars["connection"] == "local"
    assert inv.hosts["h2"].vars["connection"] == "ssh" and inv.hosts["h3"].vars["connection"] == "ssh"
    f.write_text("[gpu]\nw ansible_connection=winrm\n")
    with pytest.raises(ConfigFileError, match=r"hosts.ini:2: host w: connection 'winrm' is not supported"):
        inventory.load(str(f))


def test_extra_vars_override_inventory_connection_vars(tmp_path):
    f = tmp_path / "hosts.ini"
    f.write_text("[gpu]\nh1 ansible_host=10.0.0.1 ansible_user=ops ansible_port=2200\n")
    p = _cli("audit", "-i", str(f), "--dry-run", "--format", "json",
             "-e", "ansible_user=root", "-e", "port=2222", "-e", "model_dir=/m")
    assert p.returncode == 0, p.stderr
    c = json.loads(p.stdout)["hosts"][0]["connect"]
    assert c["user"] == "root" and c["port"] == 2222
    bad = _cli("audit", "-i", str(f), "--dry-run", "-e", "port=0")
    assert bad.returncode == 2 and "port 0 is not a TCP port" in bad.stderr


def test_connection_local_in_the_plan_and_never_silently_ssh(tmp_path):
    f = tmp_path / "hosts.ini"
    f.write_text("[gpu]\nbox ansible_connection=local\n")
    p = _cli("audit", "-i", str(f), "--dry-run")
    assert p.returncode == 0 and "box: local (no SSH)" in p.stdout
    from mla_doctor.fleet import job
    from mla_doctor.ssh.transport import ConnectOptions

    if not job.host_conn(ConnectOptions(), {"connection": "local"}).local:
        r = _cli("audit", "-i", str(f), "--format", "json")
        assert r.returncode == 2 and "connection local" in json.loads(r.stdout)["error"]


def test_templates_in_expect_values_are_not_parsed_before_rendering(tmp_path):
    inv = tmp_path / "inv.yaml"
    inv.write_text("hosts:\n  gpu-1:\n    address: 10.0.0.1\n    expect: {vllm: '>={{ min_vllm }}'}\n")
    pb = tmp_path / "pb.yaml"
    pb.write_text("name: t\nsteps:\n  - audit: {}\n  - expect: {vllm: '>={{ v }}', integrity: '{{ i }}'}\n")
    inventory.load(str(inv))  # no "invalid specifier" for a template
    p = _cli("audit", "-i", str(inv), "--playbook", str(pb), "--dry-run", "--format", "json",
             "-e", "v=0.10.2", "-e", "i=clean", "-e", "min_vllm=0.9")
    assert p.returncode == 0, p.stdout + p.stderr
    step = json.loads(p.stdout)["hosts"][0]["steps"][1]["options"]
    assert step["vllm"] == ">=0.10.2" and step["integrity"] == "clean"
    bad = _cli("audit", "-i", str(inv), "--playbook", str(pb), "--dry-run", "-e", "v=banana", "-e", "i=clean",
               "-e", "min_vllm=0.9")
    assert bad.returncode == 2 and "version specifier" in bad.stderr
