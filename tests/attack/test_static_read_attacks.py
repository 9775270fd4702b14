"""The service user against the root agent's static reads (issue 18, README "Security" -> static reads): the
symbol index (facts/symbols.py) and the log-format harvest (facts/log_formats.py) read files of a vLLM tree
that the service user owns, as root. The user links the files they read to root-only files, to a FIFO and
to a huge sparse file: nothing root-only is read (no digest, no definition, no format of it in the answer),
nothing hangs or allocates, and each link is reported as the link it is.

The agent's own functions, in this (root) process, on a tree a real unprivileged user built: the same code the
root agent runs over SSH and `--local` (tests/attack/test_fleet_attacks.py drives that path end to end)."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time

import pytest

from mla_doctor.agent.facts import log_formats, model, symbols
from tests.attack.conftest import REPO

pytestmark = pytest.mark.attack

# root's secret source file: a log format and a definition only a read of it could reveal
SECRET_PY = b'import logging\nlogger = logging.getLogger(__name__)\n\ndef root_only_secret_fn():\n' \
            b'    logger.info("Using %s backend ROOT-ONLY leaked", 1)\n'


@pytest.fixture
def tree(stage, attacker):
    """A vllm/ tree the attacker owns (in the sticky vartmp), one honest module, and root's 0600 secret."""
    secret = stage.victim.parent / "secret.py"
    secret.write_bytes(SECRET_PY)
    secret.chmod(0o600)
    top = stage.vartmp / "svc"
    attacker.run(f"""
import os
v = os.path.join({str(top)!r}, "vllm")
os.makedirs(os.path.join(v, "attention"))
os.makedirs(os.path.join(v, "engine"))
open(os.path.join(v, "attention", "honest.py"), "w").write(
    "import logging\\nlogger = logging.getLogger(__name__)\\n"
    "def honest():\\n    logger.info('Using %s backend, honest', 1)\\n")
""")
    return top / "vllm", secret


def _plant(attacker, vdir, links: dict[str, str], fifo: str | None = None, sparse: str | None = None):
    code = ["import os"]
    for rel, target in links.items():
        code.append(f"os.symlink({target!r}, {str(vdir / rel)!r})")
    if fifo:
        code.append(f"os.mkfifo({str(vdir / fifo)!r})")
    if sparse:
        code.append(f"f = open({str(vdir / sparse)!r}, 'wb'); f.truncate(64 << 20); f.write(b'def x(): pass'); "
                    "f.close()")
    attacker.run("\n".join(code))


def test_the_symbol_index_follows_no_link_of_the_service_user(stage, attacker, tree):
    vdir, secret = tree
    _plant(attacker, vdir, {"attention/mla.py": str(secret), "engine/env.py": "/proc/self/environ"},
           fifo="attention/fifo.py", sparse="attention/huge.py")
    rels = ["attention/honest.py", "attention/mla.py", "engine/env.py", "attention/fifo.py", "attention/huge.py"]
    t0 = time.monotonic()
    out = symbols.index_tree(str(vdir), {"files": rels, "patterns": {"p": r"ROOT-ONLY|leaked|def "}})
    assert time.monotonic() - t0 < 30, "a FIFO or a sparse file held the index"
    assert "honest" in out["attention/honest.py"]["defs"]  # the honest module is indexed
    for rel in ("attention/mla.py", "engine/env.py"):
        assert out[rel] == {"exists": True, "error": "a symlink: not followed"}, (rel, out[rel])
    assert "error" in out["attention/huge.py"] and "sha256" not in out["attention/fifo.py"], out
    text = repr(out)
    assert hashlib.sha256(SECRET_PY).hexdigest() not in text and "root_only_secret_fn" not in text
    assert "ROOT-ONLY" not in text and "LANG=" not in text
    assert stage.victim.parent.joinpath("secret.py").read_bytes() == SECRET_PY
    stage.assert_unharmed()


def test_the_log_format_harvest_follows_no_link_of_the_service_user(stage, attacker, tree):
    vdir, secret = tree
    _plant(attacker, vdir, {"attention/mla.py": str(secret), "engine/env.py": "/proc/self/environ"},
           fifo="attention/fifo.py", sparse="attention/huge.py")
    t0 = time.monotonic()
    hashed: dict = {}
    found = log_formats.harvest_tree(str(vdir), hashed=hashed)
    assert time.monotonic() - t0 < 30, "a FIFO or a sparse file held the harvest"
    formats = {r["format"] for r in found}
    assert any("honest" in f for f in formats), formats  # the honest module is harvested
    assert not any("ROOT-ONLY" in f for f in formats), "root read the root-only file through the user's link"
    assert set(hashed) == {"attention/honest.py"}, hashed  # nothing else was read
    # the integrity pass's module list (links included) goes through the same reader
    digests = {"attention/honest.py": None, "attention/mla.py": None, "engine/env.py": None}
    found = log_formats.harvest_tree(str(vdir), digests=digests, known={"0" * 16})
    assert not any("ROOT-ONLY" in r["format"] for r in found)
    stage.assert_unharmed()


def _linked_dir(stage, attacker, vdir):
    """root's 0700 directory holding secret.py, and the attacker's `vllm/linked` -> that directory: a link on the
    way to the file, not the file's own name (the final-link refusal does not see it)."""
    rootdir = stage.victim.parent / "rootdir"
    rootdir.mkdir(mode=0o700)
    (rootdir / "secret.py").write_bytes(SECRET_PY)
    (rootdir / "secret.py").chmod(0o600)
    attacker.run(f"import os; os.symlink({str(rootdir)!r}, {str(vdir / 'linked')!r})")
    return rootdir


def test_no_read_follows_a_directory_link_of_the_service_user(stage, attacker, tree):
    """The symbol index, the log-format harvest, the integrity scan and attach's RECORD check, each given a file
    under `vllm/linked/` (the user's link to a root-only directory): none reads it; the index says it is a link."""
    from mla_doctor.agent.attach import ops as attach_ops
    from mla_doctor.agent.facts import integrity

    vdir, _secret = tree
    _linked_dir(stage, attacker, vdir)
    out = symbols.index_tree(str(vdir), {"files": ["linked/secret.py", "attention/honest.py"],
                                         "patterns": {"p": r"ROOT-ONLY|leaked|def "}})
    assert out["linked/secret.py"] == {"exists": True, "error": "a symlink: not followed"}, out["linked/secret.py"]
    assert "honest" in out["attention/honest.py"]["defs"]
    found = log_formats.harvest_tree(str(vdir), digests={"linked/secret.py": None, "attention/honest.py": None},
                                     known={"0" * 16})
    assert not any("ROOT-ONLY" in r["format"] for r in found) and any("honest" in r["format"] for r in found)
    # RECORD (the attacker's) lists the linked file with its true hash: a match would be an oracle on root's file
    import base64
    true = base64.urlsafe_b64encode(hashlib.sha256(SECRET_PY).digest()).rstrip(b"=").decode()
    attacker.run(f"import os; d = os.path.join({str(vdir.parent)!r}, 'vllm-0.0.1.dist-info'); os.makedirs(d); "
                 f"open(os.path.join(d, 'RECORD'), 'w').write('vllm/linked/secret.py,sha256={true},"
                 f"{len(SECRET_PY)}\\n')")
    dig = attach_ops._install_digest(str(vdir))
    assert dig["files"] == 0 and dig["modified"] == ["vllm/linked/secret.py"], dig
    assert dig["unread"]["vllm/linked/secret.py"] == "a symlink: not followed", dig
    scan = integrity.scan_tree(str(vdir), {"vllm/linked/secret.py": "sha256=" + true}, ["root_only_secret_fn"])
    assert "root_only_secret_fn" not in repr(scan) and "vllm/linked/secret.py" in scan["missing"], scan
    stage.assert_unharmed()


# ------------------------------------------------------------------ the model directory (README gap, closed)

ROOT_CONFIG = b'{"model_type": "root-only-secret-model", "kv_lora_rank": 512}\n'


@pytest.fixture
def root_config(stage):
    """A root-only 0600 config.json (root's own model, say): a classifying key only a read of it reveals."""
    p = stage.victim.parent / "config.json"
    p.write_bytes(ROOT_CONFIG)
    p.chmod(0o600)
    return p


@pytest.fixture
def user_process(attacker):
    """A live process of the attacker (its ids are what the server's files are read as)."""
    def drop():
        os.setgroups([])
        os.setresgid(attacker.gid, attacker.gid, attacker.gid)
        os.setresuid(attacker.uid, attacker.uid, attacker.uid)
    p = subprocess.Popen(["sleep", "300"], preexec_fn=drop, cwd="/")
    yield p
    p.kill()
    p.wait()


def test_the_servers_model_dir_is_read_as_the_server_user(stage, attacker, root_config, user_process):
    """The user's server names a model directory whose config.json links to root's, and an HF cache (HF_HOME)
    whose refs/main links to root's victim: root's agent reads them as the server's user -- that user's
    EACCES, never root's bytes, and the victim's text never becomes a path in `tried`."""
    top = stage.vartmp / "model"
    attacker.run(f"""
import os
os.makedirs(os.path.join({str(top)!r}, "dir"))
os.symlink({str(root_config)!r}, os.path.join({str(top)!r}, "dir", "config.json"))
hub = os.path.join({str(top)!r}, "hf", "hub", "models--org--m")
os.makedirs(os.path.join(hub, "refs"))
os.makedirs(os.path.join(hub, "snapshots"))
os.symlink({str(stage.victim)!r}, os.path.join(hub, "refs", "main"))
""")
    server = {"pid": user_process.pid, "uid": attacker.uid, "cwd": "/", "_raw_env": {"HF_HOME": str(top / "hf")}}
    out = model.model_section({}, dict(server, model_arg=str(top / "dir")))
    assert "root-only-secret-model" not in repr(out), "root read its root-only config for the user's server"
    assert out["read_as"] == attacker.uid, out
    assert "config" not in out and out.get("error"), out  # the user cannot even see it: "no config.json found"
    # root's own tight directory named by the user's server: still read as the server's user (who cannot)
    out = model.model_section({}, dict(server, _raw_env={}, model_arg=str(root_config.parent)))
    assert "root-only-secret-model" not in repr(out) and out["read_as"] == attacker.uid, out
    out = model.model_section({}, dict(server, model_arg="org/m"))
    assert "precious" not in repr(out), "root read its victim as the user's refs/main"
    assert out["read_as"] == attacker.uid, out
    # control: the user's own honest config is read (as the user)
    attacker.run(f"open({str(top / 'own.json')!r}, 'w').write('{{\"model_type\": \"deepseek_v3\"}}')")
    attacker.run(f"import os; os.makedirs({str(top / 'dir2')!r}); "
                 f"os.rename({str(top / 'own.json')!r}, {str(top / 'dir2' / 'config.json')!r})")
    out = model.model_section({}, dict(server, model_arg=str(top / "dir2")))
    assert out["config"] == {"model_type": "deepseek_v3"}, out
    stage.assert_unharmed()


def test_a_model_argument_another_user_controls_is_read_as_that_user(stage, attacker, root_config):
    """`--model <dir>` with no server: the directory is the attacker's, its config.json a link to root's
    root-only config -- read as the attacker (refused by the kernel), through the real CLI as root."""
    top = stage.vartmp / "m2"
    attacker.run(f"import os; os.makedirs({str(top)!r}); os.symlink({str(root_config)!r}, "
                 f"{str(top / 'config.json')!r})")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLA_DOCTOR_")}
    env.update(PYTHONPATH=str(REPO), HOME=str(stage.base / "home"))
    r = subprocess.run([sys.executable, "-m", "mla_doctor", "static", "--local", "--python", str(stage.python),
                        "--model", str(top), "--format", "json"], capture_output=True, text=True, timeout=240,
                       env=env, cwd=str(stage.base))
    assert "root-only-secret-model" not in r.stdout + r.stderr, "root read its root-only config for the attacker"
    doc = json.loads(r.stdout)
    m = (doc["hosts"][0] if "hosts" in doc else doc)["model"]
    assert m["read_as"] == attacker.uid and "config" not in m and m["error"], m  # the user cannot see it
    stage.assert_unharmed()
