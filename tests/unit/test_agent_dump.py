"""`mla-doctor agent --dump DIR` (remote/dump.py): the payload exploded into files is the very payload
bundle.py sends, and the dumped run.py, run by hand, answers what the normal path answers."""
from __future__ import annotations

import ast
import hashlib
import json
import os
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
from click.testing import CliRunner

from mla_doctor.agent.protocol import BOOTSTRAP, PACKAGE, PAYLOAD_HEADER, PAYLOAD_MAGIC
from mla_doctor.diagnosis.knowledge import load_knowledge
from mla_doctor.host.agent_dump import dump_agent
from mla_doctor.host.audit import AuditOptions, static_plan
from mla_doctor.remote import bundle
from mla_doctor.remote.dump import MANIFEST
from mla_doctor.remote.runner import run_once
from mla_doctor.ssh.local import LocalTransport

PY = sys.executable
# what differs between two executions of the same static plan: time, and the process table (other tests and
# other users start and stop servers between the two)
VOLATILE = ("elapsed_s", "_elapsed_s", "servers", "lookalikes", "server_error")  # the machine's processes


def _unframe(framed: bytes) -> bytes:
    """The JSON text of the sources a framed payload carries."""
    assert framed[:len(PAYLOAD_MAGIC)] == PAYLOAD_MAGIC
    n = PAYLOAD_HEADER + int.from_bytes(framed[len(PAYLOAD_MAGIC):PAYLOAD_HEADER], "big")
    assert len(framed) == n
    return zlib.decompress(framed[PAYLOAD_HEADER:n])


def _read_back(d: Path) -> dict[str, str]:
    top = d / PACKAGE
    return {p.relative_to(top).as_posix(): p.read_bytes().decode("utf-8") for p in top.rglob("*.py")}


@pytest.fixture(scope="module")
def dumped(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("dump") / "agent"
    dump_agent(d, AuditOptions(python=PY))
    return d


def _run_py(d: Path, *args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([PY, str(d / "run.py"), *args], input=stdin, capture_output=True, timeout=180)


def test_the_dumped_sources_are_the_payload_bundle_sends(dumped):
    sent = _unframe(bundle.payload())  # what the controller frames and sends every host
    on_disk = _read_back(dumped)
    assert set(on_disk) == set(json.loads(sent))  # no module left out, none added
    assert json.dumps(on_disk, sort_keys=True).encode("utf-8") == sent  # byte for byte
    man = json.loads((dumped / MANIFEST).read_text())
    digest = hashlib.sha256(sent).hexdigest()
    assert man["sources_sha256"] == digest == bundle._agent()[2]
    assert man["files"] == {rel: hashlib.sha256((dumped / PACKAGE / rel).read_bytes()).hexdigest()
                            for rel in on_disk}
    assert (dumped / "bootstrap.py").read_text() == BOOTSTRAP
    # the payload run.py frames from the files is the one bundle.py sends (the same sources, the same framing)
    out = dumped.parent / "payload.bin"
    assert _run_py(dumped, "--payload", str(out)).returncode == 0
    assert _unframe(out.read_bytes()) == sent
    assert _run_py(dumped, "--check").returncode == 0


def test_the_dumped_script_answers_as_the_normal_path(dumped):
    plan = json.loads((dumped / "plan-static.json").read_text())
    assert plan == static_plan(load_knowledge(), AuditOptions(python=PY))
    p = _run_py(dumped, str(dumped / "plan-static.json"))
    assert p.returncode == 0, p.stderr.decode()
    assert p.stderr == b""  # nothing differs from the shipped payload: no note
    by_hand = json.loads(p.stdout)
    normal = run_once(LocalTransport(120), plan, python=PY, timeout=120)
    assert by_hand["agent_version"] == normal["agent_version"] and by_hand["op"] == normal["op"] == "static"
    assert "fatal" not in by_hand and by_hand["host"]["agent_python"] == list(sys.version_info[:3])
    assert {k: v for k, v in by_hand.items() if k not in VOLATILE} == \
        {k: v for k, v in normal.items() if k not in VOLATILE}
    # the plan on stdin, and --debug: the agent names the modules it loaded (a read-only op: facts only)
    p = _run_py(dumped, "-", "--debug", stdin=json.dumps(plan).encode())
    loaded = json.loads(p.stdout)["modules_loaded"]
    assert "facts.ops" in loaded and not [m for m in loaded if m.startswith(("change", "runtimes"))]


def test_an_edited_source_is_what_runs_and_is_named(tmp_path):
    d = tmp_path / "agent"
    dump_agent(d, AuditOptions(python=PY))
    ops = d / PACKAGE / "facts" / "ops.py"
    ops.write_text(ops.read_text() + "\nimport sys as _s\n_s.stderr.write('debug print reached\\n')\n")
    p = _run_py(d, str(d / "plan-static.json"))
    err = p.stderr.decode()
    assert p.returncode == 0 and json.loads(p.stdout)["op"] == "static"
    assert "debug print reached" in err and "1 source(s) differ" in err and "facts/ops.py" in err
    check = _run_py(d, "--check")
    assert check.returncode == 1 and check.stdout.decode().split() == ["facts/ops.py"]
    # a module removed from the tree is named too, and the agent without it fails as it would on a host
    (d / PACKAGE / "facts" / "ops.py").unlink()
    p = _run_py(d, str(d / "plan-static.json"))
    assert "facts/ops.py" in p.stderr.decode() and "fatal" in json.loads(p.stdout)


def test_the_script_is_stdlib_only_and_python38(dumped):
    run_py = dumped / "run.py"
    tree = ast.parse(run_py.read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert imported and imported <= set(sys.stdlib_module_names), imported
    vermin = Path(PY).with_name("vermin")
    p = subprocess.run([str(vermin), "--no-tips", "--violations", "-t=3.8-", str(run_py)], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert os.access(run_py, os.X_OK)


def test_the_command(tmp_path, monkeypatch):
    from mla_doctor.cli import cli

    d = tmp_path / "agent"
    res = CliRunner().invoke(cli, ["agent", "--dump", str(d), "--plan", "--python", PY, "--model", "/m"])
    assert res.exit_code == 0, res.output
    printed = json.loads(res.stdout)
    assert printed == json.loads((d / "plan-static.json").read_text())
    assert printed == static_plan(load_knowledge(), AuditOptions(python=PY, model="/m"))
    assert "README.txt" in res.stderr and (d / "README.txt").read_text().count("run.py") >= 3
    # an earlier dump is written again; any other non-empty directory is refused, naming it
    assert CliRunner().invoke(cli, ["agent", "--dump", str(d)]).exit_code == 0
    other = tmp_path / "other"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    res = CliRunner().invoke(cli, ["agent", "--dump", str(other)])
    assert res.exit_code == 2 and str(other) in res.stderr and (other / "keep.txt").read_text() == "mine"
    assert CliRunner().invoke(cli, ["agent"]).exit_code == 2


def test_the_plan_is_what_static_sends(monkeypatch, tmp_path):
    """`agent --plan` prints the plan `static` sends (less the caches' hints: with the caches off, the same)."""
    from mla_doctor.cli import cli
    from mla_doctor.remote import runner

    monkeypatch.setenv("MLA_DOCTOR_PARSE_CACHE", "off")
    monkeypatch.setenv("MLA_DOCTOR_CACHE", str(tmp_path / "cache"))
    sent = []
    real = runner.run_agent
    monkeypatch.setattr(runner, "run_agent", lambda tr, plan, **kw: sent.append(plan) or real(tr, plan, **kw))
    args = ["--python", PY, "--log", str(tmp_path / "no.log")]
    CliRunner().invoke(cli, ["static", "--local", "--format", "json", *args])
    printed = CliRunner().invoke(cli, ["agent", "--plan", *args])
    assert len(sent) == 1 and sent[0] == json.loads(printed.stdout)
