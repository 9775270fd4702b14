"""ssh_config reading: Include expansion (paramiko ignores it), ProxyJump parsing, errors with file:line."""
import os

import pytest

from mla_doctor.errors import ConfigFileError
from mla_doctor.ssh.sshconfig import SSHConfigFile, expand_includes, parse_jump


def write(p, text):
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)
    return p


def test_include_glob_is_expanded_in_order_and_first_value_wins(tmp_path):
    write(tmp_path / "conf.d" / "20-b.conf", "Host gpu1\n  HostName 127.0.0.9\n  Port 2201\n")
    write(tmp_path / "conf.d" / "10-a.conf", "Host gpu1\n  User alice\n  Port 2200\n")
    main = write(tmp_path / "config", f"Include {tmp_path}/conf.d/*.conf\nHost *\n  User root\n  Port 22\n")
    cfg = SSHConfigFile(str(main))
    p = cfg.lookup("gpu1")
    assert (p.hostname, p.port, p.user) == ("127.0.0.9", 2200, "alice")
    assert cfg.lookup("other").user == "root"


def test_relative_include_is_taken_from_home_ssh(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    write(tmp_path / ".ssh" / "extra", "Host jumpy\n  ProxyJump ops@bastion:2222\n")
    main = write(tmp_path / "cfg", "Include extra\n")
    assert SSHConfigFile(str(main)).lookup("jumpy").proxy_jump == "ops@bastion:2222"


def test_nested_include_and_missing_pattern_is_ignored(tmp_path):
    write(tmp_path / "c", "Host deep\n  HostName 127.0.0.5\n")
    write(tmp_path / "b", f"Include {tmp_path}/c\nInclude {tmp_path}/nothing-*.conf\n")
    main = write(tmp_path / "a", f"Include {tmp_path}/b\n")
    assert SSHConfigFile(str(main)).lookup("deep").hostname == "127.0.0.5"


def test_include_cycle_is_an_error_naming_the_files(tmp_path):
    write(tmp_path / "b", f"Include {tmp_path}/a\n")
    main = write(tmp_path / "a", f"Include {tmp_path}/b\n")
    with pytest.raises(ConfigFileError, match="Include cycle"):
        expand_includes(str(main))


def test_bad_line_names_file_and_line(tmp_path):
    main = write(tmp_path / "cfg", "Host a\n  HostName 127.0.0.1\n  ???\n")
    with pytest.raises(ConfigFileError) as e:
        SSHConfigFile(str(main))
    assert f"{main}:3" in str(e.value)


def test_explicit_missing_config_is_an_error(tmp_path):
    with pytest.raises(ConfigFileError, match="does not exist"):
        SSHConfigFile(str(tmp_path / "nope"))


def test_identity_and_known_hosts_are_expanded(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    main = write(tmp_path / "cfg", "Host x\n  IdentityFile ~/.ssh/k\n  UserKnownHostsFile ~/kh1 ~/kh2\n"
                                  "  IdentitiesOnly yes\n  StrictHostKeyChecking yes\n")
    p = SSHConfigFile(str(main)).lookup("x")
    assert p.identity_files == (os.path.join(str(tmp_path), ".ssh/k"),)
    assert p.known_hosts_files == (f"{tmp_path}/kh1", f"{tmp_path}/kh2")
    assert p.identities_only and p.strict_host_key_checking == "yes"


@pytest.mark.parametrize("spec,hops", [
    ("bastion", [(None, "bastion", None)]),
    ("ops@b1:2222,b2", [("ops", "b1", 2222), (None, "b2", None)]),
    ("ssh://u@[::1]:22", [("u", "::1", 22)]),
])
def test_parse_jump(spec, hops):
    assert parse_jump(spec) == hops


def test_a_fleet_shares_one_parse_but_an_edited_include_is_seen(tmp_path):
    """Connections of one run share paramiko's parse of the same text; the text is read every time, so an
    edit anywhere (here in an included file) gives the new answer at the next connection."""
    inc = write(tmp_path / "conf.d" / "a.conf", "Host gpu1\n  HostName 127.0.0.9\n")
    main = write(tmp_path / "config", f"Include {tmp_path}/conf.d/*.conf\n")
    one, two = SSHConfigFile(str(main)), SSHConfigFile(str(main))
    assert one._config is two._config and two.lookup("gpu1").hostname == "127.0.0.9"
    write(inc, "Host gpu1\n  HostName 127.0.0.10\n")
    three = SSHConfigFile(str(main))
    assert three._config is not one._config and three.lookup("gpu1").hostname == "127.0.0.10"
    assert one.lookup("gpu1").hostname == "127.0.0.9"  # an earlier object keeps what it read
