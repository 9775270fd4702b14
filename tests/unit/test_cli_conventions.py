"""Conventions (issue 11): config file and MLA_DOCTOR_* variables with CLI > env > config > default, shown in
--help; shell completion; examples in every command's help. Real subprocesses, real files."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run(*args, env=None, home=None):
    e = {k: v for k, v in os.environ.items() if not k.startswith("MLA_DOCTOR_") and k != "XDG_CONFIG_HOME"}
    if home:
        e["HOME"] = str(home)
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "mla_doctor", *args], capture_output=True, text=True, timeout=60,
                          cwd=ROOT, env=e)


@pytest.fixture
def inv(tmp_path):
    f = tmp_path / "hosts.ini"
    f.write_text("[gpu]\nh1 ansible_host=10.0.0.1\n")
    return f


def _user(p):
    assert p.returncode == 0, p.stdout + p.stderr
    return json.loads(p.stdout)["hosts"][0]["connect"]["user"]


def test_precedence_cli_env_config_default(tmp_path, inv):
    home = tmp_path / "home"
    cfg = home / ".config" / "mla-doctor" / "config.yaml"
    args = ("audit", "-i", str(inv), "--dry-run", "--format", "json")
    assert _user(run(*args, home=home)) is None  # built-in default
    cfg.parent.mkdir(parents=True)
    cfg.write_text("user: from-config\naudit: {forks: 3}\n")
    assert _user(run(*args, home=home)) == "from-config"
    env = {"MLA_DOCTOR_AUDIT_USER": "from-env"}
    assert _user(run(*args, home=home, env=env)) == "from-env"
    assert _user(run(*args, "--user", "from-cli", home=home, env=env)) == "from-cli"
    p = run(*args, home=home)
    assert json.loads(p.stdout)["fleet"]["forks"] == 3
    other = tmp_path / "other.yaml"
    other.write_text("audit: {user: explicit}\n")
    assert _user(run("--config", str(other), *args, home=home)) == "explicit"
    assert _user(run(*args, home=home, env={"MLA_DOCTOR_CONFIG": str(other)})) == "explicit"


def test_config_values_are_validated_like_the_command_line(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("port: 0\n")
    p = run("--config", str(cfg), "static", "--host", "h", "--format=json")
    assert p.returncode == 2 and "--port" in json.loads(p.stdout)["error"]
    p = run("static", "--host", "h", env={"MLA_DOCTOR_STATIC_CONNECT_TIMEOUT": "-1"})
    assert p.returncode == 2 and "--connect-timeout" in p.stderr


@pytest.mark.parametrize("text,needle", [
    ("bogus: 1\n", "unknown option or command 'bogus'"),
    ("static: {forks: 3}\n", "static: unknown option 'forks'"),
    ("static: [1]\n", "static: expected a mapping"),
    ("user: [unclosed\n", "not YAML"),
])
def test_bad_config_file_is_a_usage_error_naming_the_file(tmp_path, text, needle):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(text)
    p = run("--config", str(cfg), "playbooks", "--format", "json")
    assert p.returncode == 2, p.stdout + p.stderr
    assert str(cfg) in p.stderr and needle in p.stderr
    assert json.loads(p.stdout)["exit_name"] == "USAGE"
    missing = run("--config", str(tmp_path / "nope.yaml"), "playbooks")
    assert missing.returncode == 2 and "nope.yaml" in missing.stderr


def test_help_shows_env_vars_and_examples():
    for cmd in ("static", "patch", "revert", "run", "audit", "playbooks", "completion"):
        p = run(cmd, "--help")
        assert p.returncode == 0
        assert "mla-doctor " + cmd in p.stdout.replace("Usage: mla-doctor " + cmd, ""), f"{cmd}: no example"
    p = run("static", "--help")
    assert "MLA_DOCTOR_STATIC_PORT" in p.stdout
    top = run("--help").stdout
    assert "--config" in top and "-v, --verbose" in top and "--debug" in top and "70" in top


@pytest.mark.parametrize("shell,needle", [("bash", "complete -o"), ("zsh", "compdef"),
                                          ("fish", "complete --no-files --command mla-doctor")])
def test_completion_scripts(shell, needle):
    p = run("completion", shell)
    assert p.returncode == 0 and needle in p.stdout and "_MLA_DOCTOR_COMPLETE" in p.stdout


def test_completion_completes_commands():
    p = run(env={"_MLA_DOCTOR_COMPLETE": "bash_complete", "COMP_WORDS": "mla-doctor sta", "COMP_CWORD": "1"})
    assert "static" in p.stdout
