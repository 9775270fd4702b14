"""A root-owned interpreter whose site directory another user can change (issue 18, README gap, closed): root's
venv, its bin/python and every directory above it root's, but its site-packages handed to the service user
(chown) or left world-writable, or one .pth in it the user's. `python -s` still runs site-packages' .pth lines
at start, so asking that interpreter where vLLM is as root would run the user's code as root: it is asked as
the user who can change it (nobody, for a loose mode of root's), never as root."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.attack.conftest import ATTACKER_PYTHON, REPO
from tests.attack.test_host_attacks import _attacker_dir, _payload

pytestmark = pytest.mark.attack


@pytest.fixture
def root_venv(stage):
    """Root's venv (no pip), the stage's real release in its site-packages; returns (python, site)."""
    venv = stage.base / "root-venv"
    subprocess.run([ATTACKER_PYTHON, "-m", "venv", "--without-pip", str(venv)], check=True, capture_output=True)
    site = next((venv / "lib").glob("python3*/site-packages"))
    (site / "release.pth").write_text(f"{stage.site}\n")  # root's path line to root's copy of the release
    return venv / "bin" / "python", site


def _static(stage, python):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLA_DOCTOR_")}
    env.update(PYTHONPATH=str(REPO), HOME=str(stage.base / "home"))
    r = subprocess.run([sys.executable, "-m", "mla_doctor", "static", "--local", "--python", str(python),
                        "--format", "json"], capture_output=True, text=True, timeout=240, env=env,
                       cwd=str(stage.base))
    return r, json.loads(r.stdout)


def _ran(pay):
    f = pay / "ran-as"
    return f.read_text().split() if f.exists() else []


@pytest.mark.parametrize("how", ["chown", "world-writable", "pth-file"])
def test_a_root_venv_whose_site_packages_another_user_can_change_is_never_asked_as_root(stage, attacker,
                                                                                     root_venv, how):
    python, site = root_venv
    pay = _attacker_dir(stage, attacker, "site-" + how)
    attacker.run(f"open({str(pay / 'p.py')!r}, 'w').write({_payload(stage, pay)!r})")
    line = f"import os; exec(open({str(pay / 'p.py')!r}).read())\n"
    if how == "chown":
        os.chown(site, attacker.uid, attacker.gid)
    elif how == "world-writable":
        site.chmod(0o777)
    else:  # root's directory, but a .pth in it is the user's (it rewrites it at will)
        (site / "user.pth").write_text("\n")
        os.chown(site / "user.pth", attacker.uid, attacker.gid)
    target = site / ("user.pth" if how == "pth-file" else "evil.pth")
    attacker.run(f"open({str(target)!r}, 'w').write({line!r})")
    r, doc = _static(stage, python)
    assert not stage.marker.exists(), f"the user's .pth in root's venv ran as root ({how})"
    ran = set(_ran(pay))
    assert "0" not in ran, ran
    expected = {str(attacker.uid)} if how != "world-writable" else {"65534"}  # nobody: a loose mode of root's
    assert ran == expected, (ran, r.stderr[-2000:])
    h = doc["hosts"][0] if "hosts" in doc else doc
    assert (h.get("vllm") or {}).get("version"), h.get("error")  # still located: asked as the user, it answers
    stage.assert_unharmed()


def test_a_tight_root_venv_is_still_asked_as_root(stage, attacker, root_venv):
    """The control: the same venv, all root's and tight, is asked as root (it runs root's .pth only)."""
    python, site = root_venv
    pay = _attacker_dir(stage, attacker, "site-control")
    (site / "root.pth").write_text(f"import os; open({str(pay / 'ran-as')!r}, 'a').write(str(os.getuid()) + '\\n')\n")
    r, doc = _static(stage, python)
    assert set(_ran(pay)) == {"0"}, (_ran(pay), r.stderr[-2000:])
    stage.assert_unharmed()


def test_the_agent_run_inside_a_container_takes_nothing_from_the_images_env_or_workdir(tmp_path, monkeypatch):
    """The host watchdog's revert runs this agent inside the container (runtimes/docker.py _container_agent) as
    the container's root. The image's ENV (PYTHONPATH) and WORKDIR are whoever built the image's: a json.py
    there must not run (the bootstrap imports json). `docker` is replaced by running the very argv it would
    exec, here, with that environment and working directory (no docker daemon on this machine)."""
    from mla_doctor.agent import reexec
    from mla_doctor.agent.runtimes import docker
    from mla_doctor.remote.bundle import payload

    image = tmp_path / "workdir"
    image.mkdir()
    marker = tmp_path / "ran-as-root"
    for name in ("json.py", "zlib.py", "sitecustomize.py"):
        (image / name).write_text(f"open({str(marker)!r}, 'a').write({name!r} + '\\n')\n")
    seen = {}

    def fake_docker(args, timeout=60, stdin=None):
        assert args[:4] == ["exec", "-i", "-u", "0"], args
        rest = list(args[4:])
        cwd = str(image)  # the image's WORKDIR (-I keeps it off sys.path; the agent then moves to /)
        seen["argv"] = rest[1:]
        env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(image), "PYTHONSTARTUP": str(image / "json.py")}
        p = subprocess.run(rest[1:], input=stdin, capture_output=True, timeout=timeout, cwd=cwd, env=env)
        return p.returncode, p.stdout, p.stderr

    monkeypatch.setattr(docker, "_docker", fake_docker)
    monkeypatch.setattr(reexec, "PAYLOAD", payload())
    res = docker._container_agent({"id": "c0", "python": ATTACKER_PYTHON},
                                  {"op": "revert", "run_id": "nosuchrun", "run_root": str(tmp_path / "root"),
                                   "restore_server": False})
    assert not marker.exists(), f"the image's code ran as root: {marker.read_text()} (argv {seen['argv']})"
    assert "fatal" not in res or "exit" not in str(res.get("fatal")), res  # the agent itself answered
    assert seen["argv"][1:4] == ["-I", "-S", "-B"], seen["argv"]
