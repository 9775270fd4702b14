"""Pure parts of the systemd and docker runtimes: drop-in rendering, quoting, the docker exec wrapper."""
from __future__ import annotations

import json
import os
import stat
import subprocess

from mla_doctor.agent.runtimes import docker
from mla_doctor.agent.runtimes import systemd
from mla_doctor.ssh.container import ContainerTransport
from mla_doctor.ssh.transport import LocalTransport


def test_dropin_sets_environment_only_by_default():
    text = systemd.render_dropin({"VLLM_LOGGING_LEVEL": "DEBUG", "B": "x y"})
    assert text.splitlines()[1:] == ["[Service]", 'Environment="B=x y"', 'Environment="VLLM_LOGGING_LEVEL=DEBUG"']
    assert "ExecStart" not in text


def test_dropin_replaces_execstart_for_extra_arguments():
    text = systemd.render_dropin({}, ["/v/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--enforce-eager"])
    lines = text.splitlines()
    # an empty ExecStart= first: a service may have only one, the unit's own must be cleared
    assert lines[-2:] == ["ExecStart=",
                          'ExecStart="/v/bin/python" "-m" "vllm.entrypoints.openai.api_server" "--enforce-eager"']


def test_systemd_quoting_escapes_specifiers_and_variables():
    assert systemd.systemd_quote('a "b" \\c') == '"a \\"b\\" \\\\c"'
    assert systemd.systemd_quote("50% $HOME") == '"50%% $$HOME"'  # ExecStart: both literal
    assert systemd.systemd_quote("50% $HOME", exec_line=False) == '"50%% $HOME"'  # Environment= expands no $
    assert systemd.systemd_dropin("vllm.service", "R1") == "/run/systemd/system/vllm.service.d/zz-mla-doctor-R1.conf"


def test_docker_exec_wrapper_quotes_every_word(tmp_path, monkeypatch):
    """The command a container run sends reaches `docker exec` as exactly these words (a stand-in docker
    prints its argv): nothing is split or expanded by the host's shell."""
    fake = tmp_path / "docker"
    fake.write_text("#!/usr/bin/env python3\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    inner = "echo 'it''s' \"$HOME\"; exit 3"
    tr = ContainerTransport(LocalTransport(), "my container; rm -rf /", sudo=False)
    res = tr.run(inner)
    assert json.loads(res.stdout) == ["exec", "-i", "-u", "0", "my container; rm -rf /", "/bin/sh", "-c", inner]
    assert tr.stats is tr.host.stats and tr.stats.executions == 1
    assert ContainerTransport(LocalTransport(), "c", sudo=True).exec_command("true").startswith("sudo -n docker exec")


def test_docker_since_is_rfc3339_with_fractions():
    ts = docker._docker_now()
    assert len(ts) == 27 and ts.endswith("Z") and ts[10] == "T" and ts[19] == "."
    assert subprocess.run(["date", "-d", ts.replace("Z", "+00:00")], capture_output=True).returncode == 0


def test_second_pass_arguments_or_settings_by_name():
    import pytest

    from mla_doctor.host.steps import second_pass as _second_pass
    from mla_doctor.errors import UsageError
    from mla_doctor.diagnosis.knowledge import load_knowledge

    assert _second_pass("--enforce-eager --max-num-seqs 8") == ("--enforce-eager", "--max-num-seqs", "8")
    assert _second_pass("enforce_eager=on,prefix_caching=off") == {"enforce_eager": "on", "prefix_caching": "off"}
    with pytest.raises(UsageError, match="prefix_caching"):
        _second_pass("prefix_cache=off")
    kb = load_knowledge()
    assert kb.setting_args("0.32.0+cpu", "prefix_caching", "off") == ["--no-enable-prefix-caching"]
    assert kb.setting_args("0.7.3", "enforce_eager", "true") == ["--enforce-eager"]
    assert kb.setting_args("0.20.2", "enforce_eager", "off") == []
    with pytest.raises(ValueError, match="unknown server setting"):
        kb.setting_args("0.20.2", "cuda_graphs", "off")
    with pytest.raises(ValueError, match="on or off"):
        kb.setting_args("0.20.2", "enforce_eager", "maybe")
