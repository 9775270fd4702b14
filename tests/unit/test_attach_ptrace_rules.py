"""attach's ptrace check (agent/attach/checks.py) says Yama's refusal before anything changes, on a host without
Yama too: the setting and the agent's capabilities are the check's inputs (read from /proc unless given), so the
rule is exercised here where no kernel has Yama. No gdb is run when the rule already refuses."""
from __future__ import annotations

import os

import pytest

from mla_doctor.agent.attach import checks

NO_GDB = "/nonexistent/gdb"  # reaching the real attach with it raises: the rule must refuse first
WITH_CAP = {"CapEff": "%016x" % (1 << checks.CAP_SYS_PTRACE)}
WITHOUT_CAP = {"CapEff": "%016x" % ((1 << 41) - 1 & ~(1 << checks.CAP_SYS_PTRACE))}


@pytest.mark.parametrize("scope", [1, 2])
def test_yama_without_cap_sys_ptrace_is_refused_up_front_even_for_the_agents_own_uid(scope):
    why = checks.ptrace_refusals([os.geteuid()], NO_GDB, scope=scope, status=WITHOUT_CAP)
    assert len(why) == 1 and "CAP_SYS_PTRACE" in why[0] and f"ptrace_scope = {scope}" in why[0]
    assert checks.PATCH_FIX in why[0]


def test_yama_3_is_refused_even_with_the_capability():
    why = checks.ptrace_refusals([0], NO_GDB, scope=3, status=WITH_CAP)
    assert len(why) == 1 and "ptrace_scope = 3" in why[0] and "reboot" in why[0]


def test_another_users_server_without_the_capability_is_refused_without_yama():
    why = checks.ptrace_refusals([os.geteuid() + 1], NO_GDB, scope=0, status=WITHOUT_CAP)
    assert len(why) == 1 and "runs as another user" in why[0]


def test_the_setting_is_read_from_yama_s_file(tmp_path, monkeypatch):
    f = tmp_path / "ptrace_scope"
    f.write_text("1\n")
    monkeypatch.setattr(checks, "YAMA_PATH", str(f))
    assert checks.yama_scope() == 1
    monkeypatch.setattr(checks, "YAMA_PATH", str(tmp_path / "absent"))
    assert checks.yama_scope() is None


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/usr/local/bin/gdb"), reason="root and gdb 18")
def test_yama_1_with_the_capability_goes_on_to_the_real_test_attach():
    # root with CAP_SYS_PTRACE under Yama 1: allowed; the real attach to a child of ours then passes
    assert checks.ptrace_refusals([0], "/usr/local/bin/gdb", scope=1, status=WITH_CAP) == []
