"""Inventories (mla-doctor YAML, Ansible YAML, Ansible INI), --limit, --shard; errors name file:line."""
from __future__ import annotations

from pathlib import Path

import pytest

from mla_doctor.fleet import inventory as inv
from mla_doctor.errors import ConfigFileError, UsageError

ROOT = Path(__file__).resolve().parents[2]


def write(tmp_path, text, name="inv.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_example_inventory_loads_with_precedence_and_merged_expectations():
    i = inv.load(str(ROOT / "inventory.example.yaml"))
    assert i.format == "mla-doctor"
    g1 = i.hosts["gpu-01"]
    assert g1.target == "10.1.230.11" and g1.groups == ["prod", "h200"]  # outer group first
    assert g1.vars["expect"] == {"integrity": "clean", "vllm": ">=0.29", "prefill": "mha", "decode": "mqa"}
    assert i.hosts["gpu-03"].vars["runtime"] == {"kind": "systemd", "unit": "vllm.service"}
    assert i.hosts["gpu-03"].vars["port"] == 2222
    c = i.hosts["canary-01"]
    assert c.vars["user"] == "mlaops" and c.vars["sudo"] is True and c.vars["api_key_env"] == "VLLM_API_KEY"
    assert c.vars["expect"]["vllm"] == ">=0.33"  # host beats inventory-wide vars


def test_inner_group_beats_outer_and_host_beats_both(tmp_path):
    p = write(tmp_path, """
vars: {user: a, python: /top}
groups:
  outer: {children: [inner], vars: {user: outer, port: 2200}}
  inner: {hosts: {x: {user: host}, y: null}, vars: {user: inner}}
""")
    i = inv.load(p)
    assert i.hosts["x"].vars["user"] == "host" and i.hosts["y"].vars["user"] == "inner"
    assert i.hosts["y"].vars["port"] == 2200 and i.hosts["y"].vars["python"] == "/top"
    assert i.hosts["y"].groups == ["outer", "inner"]


def test_ansible_yaml_inventory(tmp_path):
    p = write(tmp_path, """
all:
  vars: {ansible_user: ops, server_port: 8000}
  children:
    gpu:
      hosts:
        g1: {ansible_host: 10.0.0.1, ansible_port: 2222, ansible_python_interpreter: /opt/v/bin/python}
        g2: {ansible_become: true, ansible_ssh_private_key_file: /k/id}
      children:
        canary: {hosts: {g2: {}}}
    web: {hosts: {w1: {some_other_tool_var: 3}}}
""")
    i = inv.load(p)
    assert i.format == "ansible-yaml"
    g1, g2 = i.hosts["g1"], i.hosts["g2"]
    assert (g1.target, g1.vars["port"], g1.vars["user"], g1.vars["python"]) == ("10.0.0.1", 2222, "ops",
                                                                                 "/opt/v/bin/python")
    assert g2.vars["sudo"] is True and g2.vars["identity"] == ["/k/id"] and g2.groups == ["gpu", "canary"]
    assert i.hosts["w1"].vars["some_other_tool_var"] == 3  # other tools' vars are kept, not refused
    assert [h.name for h in i.select("canary")] == ["g2"]


def test_ansible_ini_inventory(tmp_path):
    p = write(tmp_path, """# fleet
lonely ansible_host=10.0.0.9

[gpu]
g1 ansible_host=10.0.0.1 ansible_port=2222
g2 ansible_user=ops

[gpu:vars]
python=/opt/v/bin/python
ansible_become=yes

[prod:children]
gpu

[all:vars]
server_port=8000
""", name="hosts.ini")
    i = inv.load(p)
    assert i.format == "ansible-ini" and i.names == ["lonely", "g1", "g2"]
    assert i.hosts["g1"].vars["port"] == 2222 and i.hosts["g1"].vars["sudo"] is True
    assert i.hosts["g2"].vars["user"] == "ops" and i.hosts["g2"].groups == ["prod", "gpu"]
    assert i.hosts["lonely"].vars == {"server_port": 8000, "address": "10.0.0.9"}


@pytest.mark.parametrize("text,line,needle", [
    ("hosts:\n  a: {user: root}\n  b:\n    prot: 22\n", 4, "unknown var 'prot'"),
    ("hosts:\n  a:\n    port: 99999\n", 3, "not a TCP port"),
    ("hosts:\n  a:\n    port: twenty\n", 3, "port must be int"),
    ("hosts:\n  a:\n    api_key_env: sk-live-123\n", 3, "never the key itself"),
    ("hosts:\n  a:\n    runtime: {kind: k8s}\n", 3, "runtime kind 'k8s'"),
    ("hosts:\n  a:\n    runtime: {kind: systemd, unit: 5}\n", 3, "runtime unit must be a name"),
    ("hosts:\n  a:\n    expect: {prefill: dense}\n", 3, "expect prefill is one of"),
    ("hosts:\n  a:\n    expect: {vllm: 'about 0.10'}\n", 3, "version specifier"),
    ("hosts:\n  a:\n    expect: {colour: red}\n", 3, "unknown key 'colour'"),
    ("groups:\n  g:\n    hosts: [a]\n    children: [nope]\n", 3, "child group 'nope' is not defined"),
    ("groups:\n  g:\n    children: [h]\n  h:\n    children: [g]\n", None, "group cycle"),
    ("groups:\n  g:\n    hostz: [a]\n", 3, "unknown key 'hostz'"),
    ("hosts:\n  a: {user: [unclosed\n", 3, "YAML error"),  # where PyYAML notices
])
def test_errors_name_file_and_line(tmp_path, text, line, needle):
    p = write(tmp_path, text)
    with pytest.raises(ConfigFileError) as e:
        inv.load(p)
    assert needle in str(e.value)
    if line:
        assert str(e.value).startswith(f"{p}:{line}:"), str(e.value)
    else:
        assert str(e.value).startswith(p)
    assert e.value.exit_status == 2


def test_ini_errors_name_the_line(tmp_path):
    p = write(tmp_path, "[gpu]\ng1 port\n", name="h.ini")
    with pytest.raises(ConfigFileError, match=r"h\.ini:2: host g1: expected KEY=VALUE"):
        inv.load(p)


def _fleet(tmp_path):
    return inv.load(write(tmp_path, """
hosts: {gpu-01: {}, gpu-02: {}, gpu-03: {}, cpu-01: {}, canary-01: {}}
groups:
  gpu: {hosts: [gpu-01, gpu-02, gpu-03]}
  canary: {hosts: [canary-01, gpu-03]}
"""))


def test_limit_groups_globs_exclusions_intersections(tmp_path):
    i = _fleet(tmp_path)
    sel = lambda lim: [h.name for h in i.select(lim)]  # noqa: E731
    assert sel(None) == ["gpu-01", "gpu-02", "gpu-03", "cpu-01", "canary-01"]
    assert sel("gpu") == ["gpu-01", "gpu-02", "gpu-03"]
    assert sel("gpu,!canary") == ["gpu-01", "gpu-02"]
    assert sel("gpu:&canary") == ["gpu-03"]
    assert sel("*-01") == ["gpu-01", "cpu-01", "canary-01"]
    assert sel("cpu-01,canary") == ["gpu-03", "cpu-01", "canary-01"]
    assert sel("!gpu") == ["cpu-01", "canary-01"]
    with pytest.raises(UsageError, match="'gpu-9' is neither a group nor a host"):
        i.select("gpu-9")
    with pytest.raises(UsageError, match="matches no host"):
        i.select("gpu,!gpu")


def test_limit_retry_file(tmp_path):
    i = _fleet(tmp_path)
    retry = tmp_path / "failed.retry"
    retry.write_text("gpu-02\ncpu-01\n\n")
    assert [h.name for h in i.select(f"@{retry}")] == ["gpu-02", "cpu-01"]
    retry.write_text("gpu-02\nghost\n")
    with pytest.raises(UsageError, match="not in .*ghost"):
        i.select(f"@{retry}")
    with pytest.raises(UsageError, match="cannot read"):
        i.select(f"@{tmp_path}/nope.retry")


def test_shards_are_deterministic_disjoint_and_complete(tmp_path):
    i = _fleet(tmp_path)
    hosts = i.select(None)
    shards = [[h.name for h in inv.shard(hosts, k, 3)] for k in (1, 2, 3)]
    assert sorted(sum(shards, [])) == sorted(i.names)
    assert all(shards) and len(set(sum(shards, []))) == len(i.names)
    # independent of the order hosts are listed in: sharding sorts by name
    assert [sorted(h.name for h in inv.shard(list(reversed(hosts)), k, 3)) for k in (1, 2, 3)] == [
        sorted(s) for s in shards]
    assert [len(s) for s in shards] == [2, 2, 1]
    assert inv.parse_shard("2/4") == (2, 4)
    for bad in ("0/2", "3/2", "x", "1/"):
        with pytest.raises(UsageError, match="--shard"):
            inv.parse_shard(bad)
