"""The remote agent's parsers, run in-process (the agent is plain stdlib code)."""
import hashlib
import json
import base64
import subprocess
import sys

import pytest

from mla_doctor.agent.change.inserts import apply_inserts
from mla_doctor.agent.facts import install
from mla_doctor.agent.facts import integrity
from mla_doctor.agent.facts import model
from mla_doctor.agent.facts import processes
from mla_doctor.agent.facts import symbols
from mla_doctor.remote.bundle import agent_stdin
from mla_doctor.remote.runner import BOOTSTRAP, agent_command


def test_redact_argv_hides_secrets_in_both_forms():
    argv = ["vllm", "serve", "m", "--api-key", "sk-123", "--hf-token=hf_abc", "--port", "8000"]
    out = processes.redact_argv(argv)
    assert "sk-123" not in out and "--hf-token=hf_abc" not in out
    assert out[:4] == ["vllm", "serve", "m", "--api-key"] and out[-2:] == ["--port", "8000"]


def test_redact_argv_hides_every_value_word_and_keeps_tokens_and_tokenizer():
    from mla_doctor import redact as controller

    argv = ["vllm", "serve", "/m", "--api-key", "k1", "k2", "--max-num-batched-tokens", "8192", "--tokenizer", "/t",
            "--hf-token", "hf_x", "--num-speculative-tokens", "3", "--auth-token=a", "--key", "k3", "--port", "8000"]
    out = processes.redact_argv(argv)
    assert out == ["vllm", "serve", "/m", "--api-key", processes.REDACTED, processes.REDACTED,
                   "--max-num-batched-tokens", "8192", "--tokenizer", "/t", "--hf-token", processes.REDACTED,
                   "--num-speculative-tokens", "3", "--auth-token=" + processes.REDACTED, "--key", processes.REDACTED,
                   "--port", "8000"]
    # the same rule as the controller's last net
    for flag in ("--api-key", "--hf-token", "--tokenizer", "--max-num-batched-tokens", "--ssl-keyfile", "--key",
                 "--client-secret", "--db-password", "--tokenizer-mode", "--token"):
        assert bool(processes.SECRET_ARG_RE.match(flag)) == controller.is_secret_flag(flag), flag


def test_redact_env_keeps_only_relevant_and_hides_secret_values():
    env = {"VLLM_API_KEY": "sk", "HF_TOKEN": "hf", "VLLM_MLA_DISABLE": "1", "PATH": "/bin", "AWS_SECRET": "x"}
    out = processes.redact_env(env)
    assert out == {"HF_TOKEN": processes.REDACTED, "VLLM_API_KEY": processes.REDACTED, "VLLM_MLA_DISABLE": "1"}


@pytest.mark.parametrize("name", ["VLLM_DB_PASS", "HF_PWD", "VLLM_PASSPHRASE", "VLLM_API_KEY", "HF_TOKEN",
                                  "VLLM_AUTH", "PASS", "VLLM_PASSWORD", "VLLM_MLA_DISABLE", "PWD", "VLLM_PASSES",
                                  "HF_HOME", "TORCH_COMPASS"])
def test_the_agents_secret_env_names_are_the_controllers(name):
    # the agent redacts on the host before anything leaves it: a name the controller hides must not travel
    from mla_doctor import redact as controller
    assert bool(processes.SECRET_ENV_RE.search(name)) == controller.is_secret_env(name), name


@pytest.mark.parametrize("argv,ok", [
    (["/venv/bin/python", "/venv/bin/vllm", "serve", "deepseek-ai/DeepSeek-V3"], True),
    (["python3", "-m", "vllm.entrypoints.openai.api_server", "--model", "m"], True),
    (["python3", "-c", "from multiprocessing.spawn import spawn_main"], False),
    (["vllm", "bench", "serve"], False),
])
def test_server_argv_detection(argv, ok):
    assert processes.is_server_argv(argv) is ok


def test_model_arg_from_positional_or_flag():
    assert processes.server_model_arg(["vllm", "serve", "org/m", "--port", "1"]) == "org/m"
    assert processes.server_model_arg(["python", "-m", "vllm.entrypoints.openai.api_server", "--model=/m"]) == "/m"
    assert processes.arg_value(["x", "-tp", "8"], "--tensor-parallel-size", "-tp") == "8"


def test_hf_cache_resolution_prefers_refs_main(tmp_path):
    repo = tmp_path / "hub" / "models--zai-org--GLM-5"
    for snap in ("aaa", "bbb"):
        (repo / "snapshots" / snap).mkdir(parents=True)
        (repo / "snapshots" / snap / "config.json").write_text(json.dumps({"model_type": snap}))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("bbb")
    path, how, _ = model.resolve_model_config("zai-org/GLM-5", env={"HF_HUB_CACHE": str(tmp_path / "hub")})
    assert how == "Hugging Face cache" and path.endswith("bbb/config.json")


def test_gguf_uses_hf_config_path(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    cfg = tmp_path / "cfgdir"
    cfg.mkdir()
    (cfg / "config.json").write_text('{"model_type": "glm_moe_dsa", "index_topk": 2048}')
    path, how, _ = model.resolve_model_config(str(tmp_path / "m.gguf"), hf_config_path=str(cfg))
    assert how == "--hf-config-path"
    assert model.read_model_config(path)["index_topk"] == 2048
    path, how, _ = model.resolve_model_config(str(tmp_path / "m.gguf"))
    assert path is None and "GGUF" in how


def _fake_install(site, files):
    vdir = site / "vllm"
    record = []
    for rel, text in files.items():
        p = site / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(text.encode())
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{rel},sha256={digest},{len(text)}")
    di = site / "vllm-9.9.9.dist-info"
    di.mkdir()
    (di / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 9.9.9\n\nbody\n")
    (di / "RECORD").write_text("\n".join(record + ["vllm-9.9.9.dist-info/RECORD,,"]) + "\n")
    return vdir


def test_scan_tree_reports_modified_missing_unrecorded_and_symbols(tmp_path):
    vdir = _fake_install(tmp_path, {
        "vllm/__init__.py": "",
        "vllm/a.py": "class A:\n    def forward_mha(self):\n        pass\n",
        "vllm/b.py": "x = 1\n",
        "vllm/gone.py": "y = 2\n",
    })
    (vdir / "b.py").write_text("x = 1\nprint('debug')\n")
    (vdir / "gone.py").unlink()
    (vdir / "extra.py").write_text("z = 3\n")
    ident = install.vllm_identity(str(vdir))
    assert (ident["version"], ident["distribution"], ident["install_kind"]) == ("9.9.9", "vllm", "wheel")
    scan = integrity.scan_tree(str(vdir), integrity.parse_record(ident["dist_info"]), ["forward_mha"])
    assert scan["modified"] == ["vllm/b.py"]
    assert scan["missing"] == ["vllm/gone.py"]
    assert scan["unrecorded"] == ["vllm/extra.py"]
    assert scan["symbol_hits"] == {"forward_mha": [["a.py", 2]]}


def test_index_file_ast_and_regex_fallback(tmp_path):
    src = "class K(Base[int]):\n    @deco\n    def f(\n        self,\n    ):\n        use_sparse = True\n"
    p = tmp_path / "k.py"
    p.write_text(src)
    out = symbols.index_file(str(p), {"gate": r"use_sparse"})
    assert out["parser"] == "ast"
    assert out["defs"] == {"K.f": 3} and out["classes"]["K"]["bases"] == ["Base"]
    assert out["matches"]["gate"] == [[6, "use_sparse = True"]]
    p.write_text(src + "type X[T] = list[T] if 0 else ((\n")  # unparsable: regex fallback
    out = symbols.index_file(str(p), {})
    assert out["parser"] == "regex" and out["defs"]["K.f"] == 3


def test_version_fallback_to_version_file(tmp_path):
    vdir = tmp_path / "vllm"
    vdir.mkdir()
    (vdir / "_version.py").write_text("__version__ = version = '0.31.0'\n")
    ident = install.vllm_identity(str(vdir))
    assert ident["version"] == "0.31.0" and ident["install_kind"] == "source"


def test_agent_runs_under_the_bootstrap_and_always_answers_json():
    payload = agent_stdin({"op": "nope"})
    p = subprocess.run([sys.executable, "-B", "-c", BOOTSTRAP], input=payload, capture_output=True)
    assert json.loads(p.stdout)["fatal"].startswith("unknown op")


def test_agent_command_quotes_the_python_path():
    cmd = agent_command(python="/opt/my env/bin/python; rm -rf /", sudo=True)
    assert "rm -rf /'" in cmd or "rm -rf /" not in cmd.replace("'/opt/my env/bin/python; rm -rf /'", "")
    p = subprocess.run(["/bin/sh", "-n", "-c", cmd])
    assert p.returncode == 0


def test_no_python_on_the_host_is_a_clear_error(monkeypatch, tmp_path):
    """The real shell script runs; no candidate interpreter exists on this 'host'."""
    from mla_doctor.remote import runner as agent_runner
    from mla_doctor.errors import NoPythonError
    from mla_doctor.ssh.transport import LocalTransport

    monkeypatch.setattr(agent_runner, "FALLBACK_PYTHONS", (str(tmp_path / "nope3"), str(tmp_path / "nope")))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(NoPythonError, match="no Python interpreter found"):
        agent_runner.run_agent(LocalTransport(), {"op": "static"})


def test_old_python_is_refused_by_the_bootstrap(tmp_path):
    fake = tmp_path / "python3"
    fake.write_text("#!/bin/sh\necho 'mla-doctor: the agent needs Python 3.8+, /x is 3.6' >&2; exit 97\n")
    fake.chmod(0o755)
    from mla_doctor.remote.runner import run_agent
    from mla_doctor.errors import NoPythonError
    from mla_doctor.ssh.transport import LocalTransport

    with pytest.raises(NoPythonError, match="3.8"):
        run_agent(LocalTransport(), {"op": "static"}, python=str(fake))


def test_scan_tells_our_instrumentation_from_other_edits(tmp_path):
    src = "class A:\n    def forward_mha(self, q):\n        return q\n"
    vdir = _fake_install(tmp_path, {"vllm/__init__.py": "", "vllm/a.py": src, "vllm/b.py": src})
    patched, missing = apply_inserts(src, [{"function": "A.forward_mha", "where": "entry", "code": "pass"}], "r9")
    assert not missing
    (vdir / "a.py").write_text(patched)
    (vdir / "b.py").write_text(patched + "print('debug')\n")
    ident = install.vllm_identity(str(vdir))
    scan = integrity.scan_tree(str(vdir), integrity.parse_record(ident["dist_info"]), [])
    assert scan["instrumented"] == [{"path": "vllm/a.py", "runs": ["r9"]}]
    assert scan["modified"] == ["vllm/b.py"]  # our block plus someone else's edit: a modification


@pytest.mark.parametrize("cgroup,kind,extra", [
    ("0::/system.slice/docker-" + "a" * 64 + ".scope\n", "docker", {"container": "a" * 64}),
    ("0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod12345678_aaaa_bbbb_cccc_123456789abc.slice"
     "/cri-containerd-" + "b" * 64 + ".scope\n", "kubernetes",
     {"pod_uid": "12345678-aaaa-bbbb-cccc-123456789abc"}),
    ("0::/system.slice/vllm.service\n", "systemd", {"unit": "vllm.service", "restart": "always"}),
    ("0::/user.slice/user-0.slice/session-3.scope\n", "process", {}),
])
def test_supervisor_from_cgroup(monkeypatch, cgroup, kind, extra):
    monkeypatch.setattr(processes, "read_text", lambda path, limit=None: cgroup)
    monkeypatch.setattr(processes, "run_argv", lambda argv, timeout=10, env=None: (
        0, "Restart=always\nFragmentPath=/etc/systemd/system/vllm.service\nUser=vllm\nMainPID=42\n", ""))
    monkeypatch.setattr(processes, "proc_status", lambda pid: {"PPid": "1"})
    sup = processes.supervisor("42", ["vllm", "serve"])
    assert sup["kind"] == kind
    for k, v in extra.items():
        assert sup[k] == v
    why = processes.supervised_refusal(sup)
    assert (why is None) == (kind == "process")


def test_read_text_refuses_a_fifo_or_device_without_blocking(tmp_path):
    """A FIFO where the agent expects a file (pyvenv.cfg, METADATA, config.json: the service user's to change)
    must not hang the root agent: open() of a FIFO blocks until a writer comes."""
    import os
    import threading

    from mla_doctor.agent.common import read_text

    fifo = tmp_path / "pyvenv.cfg"
    os.mkfifo(fifo)
    got = {}

    def read():
        try:
            got["text"] = read_text(str(fifo), 4096)
        except OSError as e:
            got["error"] = e

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(30)  # returns at once; generous for a loaded machine (the bug blocks for ever)
    if t.is_alive():  # unblock the reader so the test run itself does not hang
        with open(fifo, "wb"):
            pass
        t.join(5)
        raise AssertionError("_read_text blocked on a FIFO")
    assert "error" in got and "not a regular file" in str(got["error"])
    with pytest.raises(OSError):
        read_text("/dev/null")
    (tmp_path / "ok.cfg").write_text("home = /usr/bin\n")
    assert read_text(str(tmp_path / "ok.cfg")) == "home = /usr/bin\n"


def test_a_fifo_in_the_vllm_tree_or_at_the_log_path_cannot_hang_the_audit(tmp_path):
    """The vLLM tree and the server's log are the service user's: a FIFO named like a module, or put where the
    log was, is reported unreadable and the audit goes on (open() on a FIFO would block the root agent)."""
    import os
    import threading

    from mla_doctor.agent.facts.integrity import scan_tree
    from mla_doctor.agent.facts.logs import _log_lines

    vdir = tmp_path / "site" / "vllm"
    vdir.mkdir(parents=True)
    (vdir / "ok.py").write_text("def forward_mqa(self):\n    pass\n")
    os.mkfifo(vdir / "trap.py")
    os.mkfifo(tmp_path / "server.log")
    got = {}

    def audit():
        got["scan"] = scan_tree(str(vdir), None, ["forward_mqa"])
        got["log"] = _log_lines({"log": str(tmp_path / "server.log")}, None)

    t = threading.Thread(target=audit, daemon=True)
    t.start()
    t.join(60)  # a tiny tree: well under a second; generous for a loaded machine (the bug blocks for ever)
    for fifo in (vdir / "trap.py", tmp_path / "server.log"):
        if t.is_alive():  # unblock a reader blocked in open() so the run itself ends
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:  # ENXIO: no reader on this one
                pass
    t.join(5)
    assert "log" in got, "the audit blocked on a FIFO"
    scan = got["scan"]
    assert [u["path"] for u in scan["unreadable"]] == ["vllm/trap.py"] and "regular" in scan["unreadable"][0]["error"]
    assert scan["symbol_hits"] == {"forward_mqa": [["ok.py", 1]]}
    assert got["log"]["found"] is False and "server.log" in str(got["log"])
