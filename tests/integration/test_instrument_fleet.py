"""`mla-doctor patch` / `revert` over real SSH against every real vLLM release of the corpus.

Each release is installed into a fleet host's private venv (/opt/ml-env); the CLI runs as a
subprocess, as a user runs it. The inserted code is executed for real in the host's interpreter:
the corpus has no torch, so vLLM modules cannot be imported — the instrumented function objects
are extracted from the patched files with `ast`, executed with stand-in arguments, and the probe's
JSONL records are read back. Faults (SIGKILL mid-patch and mid-run, a dropped SSH connection,
read-only and full directories, a file changed after the audit, concurrent runs, a template that
renders invalid Python) must all end with every file as it was.

Run roots live in /var/tmp, which the fleet's hosts share: each test uses its own per-host root.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from mla_doctor.agent.facts import targets as ra
from mla_doctor.host.instrument import load_targets
from mla_doctor.diagnosis.knowledge import parse_version
from tests.support import corpus
from tests.support import fleet as fs

pytestmark = [pytest.mark.fleet, pytest.mark.corpus]

REPO = Path(__file__).resolve().parents[2]
VENV = "/opt/ml-env"
VENV_PY = f"{VENV}/bin/python"
SITE = f"{VENV}/lib/python3.11/site-packages"
HOSTS = ["h06", "h07", "h08", "h09", "h10", "h11", "h12", "h13", "h14"]
LATEST = ("vllm", "0.33.0")
Q_NAMES = ("q", "hidden_states_or_q_c", "ql_nope", "q_nope")  # what the probe counts rows of
RUN_ROOT_PREFIX = "/var/tmp/mla-doctor-test-"


# --------------------------------------------------------------------------- helpers

_HASHES: dict[tuple, str] = {}


def tree_state(root: Path) -> dict[str, tuple]:
    """Files: (mode, mtime_ns, size, sha256); directories: existence and mode (their mtime may change).

    Hashes are cached by (path, inode, size, mtime, ctime): any write or rename changes the ctime,
    which utime cannot set back, so a restored mtime never hides a content change."""
    state = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames:
            p = os.path.join(dirpath, name)
            state[os.path.relpath(p, root) + "/"] = (os.lstat(p).st_mode,)
        for name in filenames:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            key = (p, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
            if key not in _HASHES:
                with open(p, "rb") as f:
                    _HASHES[key] = hashlib.sha256(f.read()).hexdigest()
            state[os.path.relpath(p, root)] = (st.st_mode, st.st_mtime_ns, st.st_size, _HASHES[key])
    return state


def diff_states(a: dict, b: dict) -> list[str]:
    return [f"{k}: {a.get(k)} -> {b.get(k)}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


def sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def cli_argv(fleet, *args) -> list[str]:
    return [sys.executable, "-m", "mla_doctor", *args, "--ssh-config", str(fleet.ssh_config)]


def cli(fleet, *args, timeout=60) -> tuple[int, dict | None, str, str]:
    p = subprocess.run(cli_argv(fleet, *args), capture_output=True, text=True, timeout=timeout,
                       stdin=subprocess.DEVNULL, cwd=REPO)
    doc = json.loads(p.stdout) if "json" in args else None  # JSON must parse whatever happened
    return p.returncode, doc, p.stdout, p.stderr


def wait_for(pred, timeout: float, step: float = 0.05, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(step)


def read_json(p: Path):
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return None


def expected_files(dist: str, version: str) -> set[str]:
    """The vllm-relative files the playbook targets in this release (resolved on the corpus tree)."""
    tset = load_targets()
    v = parse_version(version)
    req = [{"key": t.key, "files": list(t.files), "function": t.function} for t in tset.targets if t.applies(v)]
    res = ra.resolve_targets(str(corpus.ensure(dist, version) / "vllm"), req)
    return {m["rel"] for r in res for m in r["matches"]}


def family_files(dist: str, version: str) -> set[str]:
    """The vllm-relative files of the model-private families' own methods (issue 19), resolved by the agent's
    resolver on the corpus tree with no module bound: every file a patch without a model may add as a family
    probe. A host resolves within its bound (private families first), so its set is a subset of this one."""
    from mla_doctor.agent.facts import resolve as resolver
    out = resolver.resolve_paths(str(corpus.ensure(dist, version) / "vllm"), max_modules=10 ** 6)
    return {t["file"] for t in out["probe_targets"] if t.get("family")}


def check_patched_files(rels, dist: str, version: str, family_targets=None) -> None:
    """Exactly the playbook's targets, plus only family files the code resolution can name (and, when the
    report lists its family targets, exactly their files)."""
    rels = set(rels)
    playbook = expected_files(dist, version)
    extra = rels - playbook
    assert playbook <= rels, sorted(playbook - rels)
    assert extra <= family_files(dist, version), sorted(extra - family_files(dist, version))
    if family_targets is not None:
        assert extra == {t["file"].split("vllm/", 1)[1] for t in family_targets}, (sorted(extra), family_targets)


class Host:
    def __init__(self, fleet, name: str, release: tuple[str, str], run_root: str):
        self.fleet, self.name, self.release, self.run_root = fleet, name, release, run_root
        self.venv = fleet.fs(name, VENV)
        self.site = fs.site_packages(fleet, name)
        self.vllm = self.site / "vllm"

    def ssh(self, command: str, check=True, timeout=60) -> subprocess.CompletedProcess:
        return self.fleet.ssh(self.name, command, check=check, timeout=timeout)

    def run_dir(self, run_id: str) -> Path:
        return Path(self.run_root) / "runs" / run_id

    def manifest(self, run_id: str) -> dict | None:
        return read_json(self.run_dir(run_id) / "manifest.json")

    def records(self, run_id: str) -> list[dict]:
        out = []
        for p in sorted((self.run_dir(run_id) / "records").glob("*.jsonl")):
            out += [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
        return out

    def patch(self, *args, timeout=60):
        return cli(self.fleet, "patch", "--host", self.name, "--python", VENV_PY, "--run-root", self.run_root,
                   "--format", "json", *args, timeout=timeout)

    def patch_popen(self, *args) -> subprocess.Popen:
        return subprocess.Popen(cli_argv(self.fleet, "patch", "--host", self.name, "--python", VENV_PY,
                                         "--run-root", self.run_root, "--format", "json", *args),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                text=True, cwd=REPO)

    def revert(self, *args):
        return cli(self.fleet, "revert", "--host", self.name, "--run-root", self.run_root, "--format", "json", *args)

    def probe_files(self) -> list[Path]:
        return sorted(self.site.glob("mla_doctor_probe_*.py"))


class Hosts:
    """Installs releases on demand into h06-h14 and puts each host's /opt/ml-env back as found."""

    def __init__(self, fleet, stash_suffix="ml-env.stash-instrument"):
        self.fleet = fleet
        self.current: dict[str, tuple[str, str]] = {}
        self.stashed: dict[str, Path] = {}
        self.touched: list[str] = []
        self.run_roots: list[str] = []
        self.suffix = stash_suffix

    def _wipe(self, name: str) -> None:
        for c in self.fleet.fs(name, VENV).iterdir():
            if c.is_dir() and not c.is_symlink():
                shutil.rmtree(c)
            else:
                c.unlink()

    def _first_touch(self, name: str) -> None:
        if name in self.touched:
            return
        self.touched.append(name)
        entries = list(self.fleet.fs(name, VENV).iterdir())
        if entries:  # another module seeded this host: keep its venv aside, put it back at the end
            stash = self.fleet.host_dir(name) / self.suffix
            stash.mkdir()
            for c in entries:
                c.rename(stash / c.name)
            self.stashed[name] = stash

    @contextlib.contextmanager
    def use(self, name: str, release: tuple[str, str], test: str):
        self._first_touch(name)
        if self.current.get(name) != release:
            self.current.pop(name, None)
            self._wipe(name)
            fs.make_venv(self.fleet, name)
            fs.install_tree(self.fleet, name, corpus.ensure(*release))
            self.current[name] = release
        run_root = f"{RUN_ROOT_PREFIX}{test}-{name}"
        shutil.rmtree(run_root, ignore_errors=True)
        self.run_roots.append(run_root)
        ok = False
        try:
            yield Host(self.fleet, name, release, run_root)
            ok = True
        finally:
            if not ok:  # whatever the test left there, the next user gets a fresh install
                self.current.pop(name, None)

    def dirty(self, name: str) -> None:
        self.current.pop(name, None)

    def restore(self) -> None:
        for root in self.run_roots:
            shutil.rmtree(root, ignore_errors=True)
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(self._wipe, self.touched))
        for name in self.touched:
            stash = self.stashed.get(name)
            if stash is not None:
                for c in stash.iterdir():
                    c.rename(self.fleet.fs(name, VENV) / c.name)
                stash.rmdir()


@pytest.fixture(scope="module")
def hosts(fleet):
    h = Hosts(fleet)
    try:
        yield h
    finally:
        h.restore()


@pytest.fixture(scope="module")
def scripts(tmp_path_factory):
    """Host-side helper scripts, in /tmp (shared by the fleet's hosts)."""
    d = tmp_path_factory.mktemp("instrument-scripts")
    (d / "exercise.py").write_text(EXERCISE)
    (d / "plugin_check.py").write_text(PLUGIN_CHECK)
    return d


# Run on the host by the venv's interpreter: compile every patched file, import the probe module,
# then execute every entry target's instrumented function with stand-in arguments.
EXERCISE = r'''
import ast, importlib, inspect, json, sys
args = json.load(open(sys.argv[1]))
out = {"compiled": [], "probe_file": None, "calls": []}
for path in args["files"]:
    compile(open(path, encoding="utf-8").read(), path, "exec", dont_inherit=True)
    out["compiled"].append(path)
out["probe_file"] = importlib.import_module(args["probe"]).__file__

class StandInTensor:
    shape = (7, 16)
    def __getattr__(self, name):
        raise RuntimeError("stand-in tensor: no %s" % name)

for t in args["targets"]:
    cls_name, _, meth = t["function"].rpartition(".")
    tree = ast.parse(open(t["path"], encoding="utf-8").read(), t["path"])
    fn = [s for c in tree.body if isinstance(c, ast.ClassDef) and c.name == cls_name
          for s in c.body if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef)) and s.name == meth][0]
    # a classmethod entry (V4's ROCm sparse impl in 0.22) is called with its class, as vLLM calls it
    is_cm = any(isinstance(d, ast.Name) and d.id == "classmethod" for d in fn.decorator_list)
    # no torch here: drop what would be evaluated at def time (decorators, annotations, defaults)
    fn.decorator_list, fn.returns = [], None
    a = fn.args
    for arg in a.posonlyargs + a.args + a.kwonlyargs + [a.vararg, a.kwarg]:
        if arg is not None:
            arg.annotation = None
    a.defaults = [ast.Constant(None) for _ in a.defaults]
    a.kw_defaults = [None if d is None else ast.Constant(None) for d in a.kw_defaults]
    mod = ast.Module(body=[ast.ClassDef(name=cls_name, bases=[], keywords=[], body=[fn], decorator_list=[])],
                     type_ignores=[])
    ns = {"__name__": "standin"}
    exec(compile(ast.fix_missing_locations(mod), t["path"], "exec"), ns)
    cls = ns[cls_name]
    func = cls.__dict__[meth]
    params = list(inspect.signature(func).parameters.values())[1:]
    pos, kw = [], {}
    names = [p.name for p in params]
    q_param = next((n for n in ("q", "hidden_states_or_q_c", "ql_nope", "q_nope") if n in names), None)
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.default is not p.empty:
            continue
        value = StandInTensor() if p.name in ("q", "hidden_states_or_q_c", "ql_nope", "q_nope") else None
        if p.kind == p.KEYWORD_ONLY:
            kw[p.name] = value
        else:
            pos.append(value)
    try:
        r = func(cls if is_cm else cls.__new__(cls), *pos, **kw)
        if inspect.iscoroutine(r):
            r.close()
        outcome = "returned"
    except BaseException as e:  # the body fails on stand-ins after the probe ran: expected
        outcome = type(e).__name__
    out["calls"].append({"function": t["function"], "key": t["key"], "path": t["path"], "q_param": q_param,
                         "outcome": outcome})
print(json.dumps(out))
'''

# Run on the host with PYTHONPATH=<plugin dir>: find the entry point, register(), then import a stand-in
# module named like a target module and call its target method.
PLUGIN_CHECK = r'''
import importlib, importlib.metadata as md, json, os, sys
name, standin_root = sys.argv[1], sys.argv[2]
eps = [e for e in md.entry_points(group="vllm.general_plugins") if e.name == name]
out = {"entry_points": [(e.name, e.value) for e in eps]}
register = eps[0].load()
plugin = sys.modules[eps[0].module]
register()
out["finders"] = [type(f).__name__ for f in sys.meta_path if type(f).__module__ == plugin.__name__]
modname = sorted(plugin.TARGETS)[0]
qual, target, role = plugin.TARGETS[modname][0]
cls_name, _, meth = qual.rpartition(".")
parts = modname.split(".")
d = standin_root
for part in parts[:-1]:
    d = os.path.join(d, part)
    os.makedirs(d, exist_ok=True)
    open(os.path.join(d, "__init__.py"), "w").close()
with open(os.path.join(d, parts[-1] + ".py"), "w") as f:
    f.write("class %s:\n    def %s(self, q, *args, **kwargs):\n        return 'original ran'\n" % (cls_name, meth))
sys.path.insert(0, standin_root)

class StandInTensor:
    shape = (7, 16)

mod = importlib.import_module(modname)
obj = getattr(mod, cls_name)()
out.update(module=modname, module_file=mod.__file__, function=qual, target=target, role=role,
           wrapped=bool(getattr(getattr(mod, cls_name).__dict__[meth], "__mla_doctor__", False)),
           result=getattr(obj, meth)(StandInTensor(), None))
print(json.dumps(out))
'''


def host_exercise(h: Host, scripts: Path, tmp: Path, run_id: str, report: dict) -> dict:
    patched = [f for f in report["patch"]["files"] if f["outcome"] == "patched"]
    targets = [{"path": f"{SITE}/{t['file']}", "function": t["function"], "key": t["key"], "role": t["role"]}
               for t in report["patch"]["targets"] if t["where"] == "entry"]
    args = tmp / f"exercise-{h.name}-{run_id}.json"
    args.write_text(json.dumps({"files": [f["path"] for f in patched], "targets": targets,
                                "probe": "mla_doctor_probe_" + run_id.replace("-", "_").replace(".", "_")}))
    r = h.ssh(f"{VENV_PY} {scripts / 'exercise.py'} {args}")
    out = json.loads(r.stdout)
    out["targets"] = targets
    return out


# --------------------------------------------------------------------------- every release

RELEASE_HOSTS = [(rel, HOSTS[i % len(HOSTS)]) for i, rel in enumerate(corpus.RELEASES)]


@pytest.mark.parametrize("release,name", RELEASE_HOSTS, ids=[f"{d}-{v}" for (d, v), _ in RELEASE_HOSTS])
def test_release_patch_exercise_revert(hosts, scripts, tmp_path, release, name):
    with hosts.use(name, release, "release") as h:
        before = tree_state(h.venv)
        run_id = "rel-" + release[1]
        code, doc, _, err = h.patch("--ttl", "0", "--run-id", run_id)
        rep = doc["hosts"][0]
        assert code == 0 and rep["status"] == "ok", (rep["error"], err)
        p = rep["patch"]
        assert p["run_id"] == run_id and p["outcome"] == "patched" and p["missing_symbols"] == []
        roles = {t["role"] for t in p["targets"]}
        assert {"dispatch", "prefill", "decode"} <= roles, roles
        # every target file patched, exactly those changed, each reported with its real hashes
        files = {f["rel"]: f for f in p["files"]}
        check_patched_files(files, *release, [t for t in p["targets"] if t["key"].startswith("family:")])
        after = tree_state(h.venv)
        probe = f"mla_doctor_probe_{run_id.replace('-', '_').replace('.', '_')}.py"
        changed = {k for k in diff_states(before, after)}
        assert {c.split(":")[0] for c in changed} == {f"lib/python3.11/site-packages/vllm/{r}" for r in files} | {
            f"lib/python3.11/site-packages/{probe}"}
        for rel, f in files.items():
            assert f["outcome"] == "patched"
            assert f["original_sha256"] == before[f"lib/python3.11/site-packages/vllm/{rel}"][3]
            assert f["patched_sha256"] == sha(h.vllm / rel) != f["original_sha256"]
            st = (h.vllm / rel).stat()
            assert (st.st_mode, st.st_uid) == (before[f"lib/python3.11/site-packages/vllm/{rel}"][0], 0)
        # the inserted code, for real: compile, import the probe, run every entry target on stand-ins
        ex = host_exercise(h, scripts, tmp_path, run_id, rep)
        assert len(ex["compiled"]) == len(files)
        assert ex["probe_file"] == f"{SITE}/{probe}"
        recs = h.records(run_id)
        armed = [r for r in recs if r["event"] == "armed"]
        calls = [r for r in recs if r["event"] == "call"]
        assert len(armed) == 1 and all(r["python"] == VENV_PY and r["run"] == run_id for r in armed)
        # one per entry target, with its role, class and the stand-in's 7 query rows
        assert sorted((c["target"], c["role"], c["function"]) for c in calls) == sorted(
            (t["key"], t["role"], t["function"]) for t in ex["targets"])
        q_params = {(c["key"], c["function"]): c["q_param"] for c in ex["calls"]}
        for c in calls:
            assert c["class"] == c["function"].split(".")[0] and c["seq"] >= 1 and c["nested"] is False
            q_param = q_params[c["target"], c["function"]]
            if q_param:
                assert c["tokens"]["q_rows"] == 7 and c["tokens"]["q_from"] == q_param
        assert all(q_params[t["key"], t["function"]] for t in ex["targets"] if t["role"] in ("prefill", "decode"))
        # revert: byte-identical (sha256, mode, mtime), nothing left behind but the run's report
        code, doc, _, err = h.revert("--run", run_id)
        rep = doc["hosts"][0]
        assert code == 0 and rep["status"] == "ok", (rep["error"], err)
        (run,) = rep["revert"]["runs"]
        assert run["state"] == "reverted" and {f["outcome"] for f in run["files"]} == {"restored"}
        assert diff_states(before, tree_state(h.venv)) == []
        # the manifest stays as the run's report; the records went with the run (issue 9: collected by then)
        assert sorted(os.listdir(h.run_dir(run_id))) == ["manifest.json"]
        assert sorted(os.listdir(h.run_root)) == ["runs"]  # the host lock is released


def test_a_local_users_forged_run_is_refused_by_the_root_agent_over_ssh(hosts, tmp_path):
    """The attacker tier's first attack (tests/attack), over SSH on a fleet host: a real unprivileged user
    pre-creates the run root in the shared sticky /var/tmp with a forged manifest and server spec; root's
    `revert` and `patch` over SSH refuse it, naming the path and its owner; nothing is written, nothing runs."""
    import pwd
    import types
    import uuid

    from tests.attack.conftest import VICTIM_TEXT, User
    from tests.attack.test_run_state_attacks import forged_run, refused

    name = "mlaatk" + uuid.uuid4().hex[:8]
    subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name], check=True,
                   capture_output=True)
    secret = Path(tempfile.mkdtemp(prefix="mla-doctor-test-victim-", dir="/var/tmp"))  # root's, 0700
    try:
        pw = pwd.getpwnam(name)
        attacker = User(name, pw.pw_uid, pw.pw_gid)
        victim, marker = secret / "victim", secret / "marker"
        victim.write_bytes(VICTIM_TEXT)
        victim.chmod(0o600)
        with hosts.use("h10", ("vllm", "0.13.0"), "attack") as h:
            before = tree_state(h.venv)
            stage = types.SimpleNamespace(victim=victim, marker=marker)
            attacker.run(forged_run(stage, h.run_root))
            for verb in (h.revert, lambda: h.revert("--run", "X"), lambda: h.patch("--ttl", "0")):
                code, doc, out, err = verb()
                res = types.SimpleNamespace(returncode=code, stdout=out, stderr=err)
                refused(res, h.run_root, name)
                assert doc["hosts"][0]["status"] != "ok"
                assert victim.read_bytes() == VICTIM_TEXT and oct(victim.stat().st_mode & 0o777) == "0o600"
                assert not marker.exists()  # the forged server spec's command never ran
                assert diff_states(before, tree_state(h.venv)) == []
    finally:
        shutil.rmtree(secret, ignore_errors=True)
        subprocess.run(["userdel", name], capture_output=True)


def test_missing_symbols_are_refused_with_their_list(hosts):
    with hosts.use("h10", ("vllm", "0.13.0"), "missing") as h:
        common = h.vllm / "v1/attention/backends/mla/common.py"
        original = common.read_bytes()
        st = common.stat()
        try:
            # a build whose prefill entry is gone: refused by the controller before any write
            common.write_bytes(original.replace(b"    def _forward_prefill(\n", b"    def _forward_prefill_v2(\n", 1))
            before = tree_state(h.venv)
            code, doc, _, _ = h.patch("--ttl", "0")
            rep = doc["hosts"][0]
            assert code == 4 and rep["status"] == "error" and rep["patch"]["outcome"] == "refused"
            (miss,) = rep["patch"]["missing_symbols"]
            assert miss.startswith("MLACommonImpl._forward_prefill in v1/attention/backends/mla/common.py (prefill, ")
            assert "symbols not found in this install" in rep["error"]
            assert "MLACommonImpl._forward_prefill" in rep["error"]
            assert diff_states(before, tree_state(h.venv)) == [] and not Path(h.run_root).exists()
            # the function is there but the split it is inserted after is not: refused by the agent
            common.write_bytes(original.replace(b"        num_decode_tokens = attn_metadata.num_decode_tokens\n",
                                                b"        n_decode = attn_metadata.num_decode_tokens\n", 1))
            before = tree_state(h.venv)
            code, doc, _, _ = h.patch("--ttl", "0")
            rep = doc["hosts"][0]
            assert code == 4 and rep["patch"]["outcome"] == "refused"
            assert rep["patch"]["missing_symbols"] == [
                "v1/attention/backends/mla/common.py: MLACommonImpl.forward (after_assign:num_decode_tokens)"]
            assert "symbols not found in this install" in rep["error"]
            assert diff_states(before, tree_state(h.venv)) == [] and not Path(h.run_root).exists()
            assert h.probe_files() == []
        finally:
            common.write_bytes(original)
            os.utime(common, ns=(st.st_atime_ns, st.st_mtime_ns))


# --------------------------------------------------------------------------- CLI behaviour

def test_dry_run_prints_diffs_and_changes_nothing(hosts):
    with hosts.use("h11", LATEST, "dryrun") as h:
        before = tree_state(h.venv)
        p = subprocess.run(cli_argv(h.fleet, "patch", "--host", h.name, "--python", VENV_PY, "--run-root",
                                    h.run_root, "--dry-run"), capture_output=True, text=True, timeout=60, cwd=REPO)
        assert p.returncode == 0, p.stderr
        rels = expected_files(*LATEST)  # the playbook's: each has its diff (family files may add more)
        for rel in rels:
            assert f"--- a/vllm/{rel}" in p.stdout and f"+++ b/vllm/{rel}" in p.stdout
        assert p.stdout.count("@@ -") >= len(rels) and "+# >>> mla-doctor run " in p.stdout
        code, doc, _, _ = h.patch("--dry-run", "--run-id", "dry1")
        pr = doc["hosts"][0]["patch"]
        assert code == 0 and pr["outcome"] == "dry-run" and pr["dry_run"] is True
        check_patched_files({f["rel"] for f in pr["files"]}, *LATEST,
                            [t for t in pr["targets"] if t["key"].startswith("family:")])
        for f in pr["files"]:
            assert f["outcome"] == "would-patch" and f["original_sha256"] == sha(h.vllm / f["rel"])
            assert f["diff"].startswith(f"--- a/vllm/{f['rel']}\n+++ b/vllm/{f['rel']}\n@@ ")
        assert diff_states(before, tree_state(h.venv)) == []
        assert not Path(h.run_root).exists()  # not even the run root
        # the diff is exactly what a real patch with the same run id writes
        code, doc, _, _ = h.patch("--ttl", "0", "--run-id", "dry1")
        real = {f["rel"]: f["patched_sha256"] for f in doc["hosts"][0]["patch"]["files"]}
        assert real == {f["rel"]: f["patched_sha256"] for f in pr["files"]}
        assert all(sha(h.vllm / rel) == s for rel, s in real.items())
        code, doc, _, _ = h.revert("--run", "dry1")
        assert code == 0 and diff_states(before, tree_state(h.venv)) == []


def test_same_run_id_never_patches_twice_and_keeps_one_watchdog(hosts):
    with hosts.use("h12", LATEST, "rerun") as h:
        before = tree_state(h.venv)
        code, doc, _, err = h.patch("--ttl", "120", "--run-id", "again")
        first = doc["hosts"][0]["patch"]
        assert code == 0 and first["outcome"] == "patched", err
        mid = {f["rel"]: sha(h.vllm / f["rel"]) for f in first["files"]}
        code, doc, _, err = h.patch("--ttl", "120", "--run-id", "again")
        second = doc["hosts"][0]["patch"]
        # (exit 1 today: the audit before the patch reports the run's own instrumented files as modified)
        assert doc["hosts"][0]["status"] == "ok" and second["outcome"] == "patched", err
        assert {f["outcome"] for f in second["files"]} == {"already-patched"}
        by_rel = {f["rel"]: f for f in first["files"]}
        for f in second["files"]:
            assert f["patched_sha256"] == by_rel[f["rel"]]["patched_sha256"] == sha(h.vllm / f["rel"])
            assert f["original_sha256"] == by_rel[f["rel"]]["original_sha256"]
            text = (h.vllm / f["rel"]).read_text()
            assert text.count(ra.MARK_BEGIN % "again") == text.count(ra.MARK_END % "again") >= 2
        assert mid == {f["rel"]: sha(h.vllm / f["rel"]) for f in second["files"]}
        assert second["watchdog_pid"] == first["watchdog_pid"]
        assert len(h.manifest("again")["files"]) == len(first["files"])
        code, doc, _, _ = h.revert("--run", "again")
        assert code == 0 and doc["hosts"][0]["revert"]["runs"][0]["state"] == "reverted"
        assert diff_states(before, tree_state(h.venv)) == []
        wd = first["watchdog_pid"]
        wait_for(lambda: h.ssh(f"kill -0 {wd}", check=False).returncode != 0, 5, 0.2, "the watchdog to stop")
        # reverting again is harmless: the files are original, the run stays reverted
        code, doc, _, _ = h.revert("--run", "again")
        assert code == 0 and doc["hosts"][0]["revert"]["runs"][0]["state"] == "reverted"


def test_revert_without_run_undoes_what_an_interrupted_run_left(hosts):
    with hosts.use("h13", LATEST, "norun") as h:
        before = tree_state(h.venv)
        code, doc, _, _ = h.patch("--ttl", "0", "--run-id", "done1")
        code, doc, _, _ = h.revert("--run", "done1")
        assert code == 0
        # interrupted: the controller is killed as soon as the patch starts; no lease, so no watchdog
        proc = h.patch_popen("--ttl", "0", "--run-id", "cut1")
        wait_for(lambda: h.run_dir("cut1").is_dir() or proc.poll() is not None, 30, 0.002, "the run dir")
        proc.kill()
        proc.wait(10)
        assert proc.returncode == -signal.SIGKILL
        m = wait_for(lambda: (h.manifest("cut1") or {}).get("state") == "patched" and h.manifest("cut1"), 15,
                     what="the agent to finish the patch without its controller")
        check_patched_files({f["rel"] for f in m["files"]}, *LATEST)
        assert diff_states(before, tree_state(h.venv)) != []
        code, doc, _, err = h.revert()
        rep = doc["hosts"][0]
        assert code == 0 and rep["status"] == "ok", (rep["error"], err)
        assert [r["run_id"] for r in rep["revert"]["runs"]] == ["cut1"]  # the finished run is left alone
        assert {f["outcome"] for f in rep["revert"]["runs"][0]["files"]} == {"restored"}
        assert diff_states(before, tree_state(h.venv)) == []


def test_revert_of_an_edited_file_keeps_both_and_reports_a_conflict(hosts):
    with hosts.use("h14", LATEST, "conflict") as h:
        before = tree_state(h.venv)
        code, doc, _, _ = h.patch("--ttl", "0", "--run-id", "edit1")
        assert code == 0
        rel = "v1/attention/backends/mla/triton_mla.py"
        target = h.vllm / rel
        edited = target.read_bytes() + b"\n# operator's hotfix after the patch\n"
        target.write_bytes(edited)
        code, doc, _, _ = h.revert("--run", "edit1")
        rep = doc["hosts"][0]
        assert code == 5 and doc["exit_name"] == "NOT_RESTORED" and rep["status"] == "error"
        assert rel in rep["error"] and "conflict" in rep["error"]
        (run,) = rep["revert"]["runs"]
        assert run["state"] == "revert-incomplete"
        outcomes = {f["rel"]: f for f in run["files"]}
        assert outcomes[rel]["outcome"] == "conflict"
        assert {f["outcome"] for r, f in outcomes.items() if r != rel} == {"restored"}
        assert target.read_bytes() == edited  # never clobbered
        kept = outcomes[rel]["kept"]
        assert Path(kept["current"]).read_bytes() == edited
        original = corpus.ensure(*LATEST) / "vllm" / rel
        assert Path(kept["original"]).read_bytes() == original.read_bytes()
        assert [d for d in diff_states(before, tree_state(h.venv)) if not d.startswith(
            f"lib/python3.11/site-packages/vllm/{rel}:")] == []
        hosts.dirty(h.name)


def test_plugin_method_edits_no_vllm_file(hosts, scripts, tmp_path):
    with hosts.use("h06", LATEST, "plugin") as h:
        before = tree_state(h.venv)
        before_dirs = {k: os.stat(h.venv / k).st_mtime_ns for k in before if k.endswith("/")}
        code, doc, _, err = h.patch("--method", "plugin", "--ttl", "0", "--run-id", "plug1")
        p = doc["hosts"][0]["patch"]
        assert code == 0 and p["outcome"] == "patched" and p["method"] == "plugin", err
        assert p["files"] == [] and h.probe_files() == []
        assert diff_states(before, tree_state(h.venv)) == []
        assert before_dirs == {k: os.stat(h.venv / k).st_mtime_ns for k in before_dirs}
        pdir = Path(p["plugin"]["dir"])
        assert pdir == h.run_dir("plug1") / "plugin" and pdir.is_dir()
        name = p["plugin"]["entry_point_name"]
        assert p["plugin"]["env"]["PYTHONPATH"] == str(pdir)
        standin = tmp_path / "standin"
        r = h.ssh(f"PYTHONPATH={pdir} {VENV_PY} {scripts / 'plugin_check.py'} {name} {standin}")
        out = json.loads(r.stdout)
        assert out["entry_points"] == [[name, "mla_doctor_plugin_plug1:register"]]
        assert out["finders"] == ["_Finder"] and out["wrapped"] is True and out["result"] == "original ran"
        assert out["module"].startswith("vllm.") and out["module_file"].startswith(str(standin))
        calls = [c for c in h.records("plug1") if c["event"] == "call"]
        assert [(c["function"], c["target"], c["role"], c["tokens"]["q_rows"]) for c in calls] == [
            (out["function"], out["target"], out["role"], 7)]
        assert any(c["event"] == "armed" for c in h.records("plug1"))
        # inert without an active lease: the same calls in a new process record nothing
        lease = h.run_dir("plug1") / "lease.json"
        lease.write_text(json.dumps({**json.loads(lease.read_text()), "expires": time.time() - 1}))
        n = len(h.records("plug1"))
        out = json.loads(h.ssh(f"PYTHONPATH={pdir} {VENV_PY} {scripts / 'plugin_check.py'} {name} {standin}").stdout)
        assert out["wrapped"] is True and out["result"] == "original ran" and len(h.records("plug1")) == n
        code, doc, _, _ = h.revert("--run", "plug1")
        assert code == 0 and not pdir.exists()
        assert diff_states(before, tree_state(h.venv)) == []


# --------------------------------------------------------------------------- faults

def _restored(h: Host, before: dict) -> bool:
    try:
        return diff_states(before, tree_state(h.venv)) == []
    except FileNotFoundError:
        # Polled while the watchdog is mid-restore: a temp file vanished between listing and stat.
        return False


def test_sigkill_mid_run_watchdog_restores_within_ttl(hosts):
    ttl = 4
    with hosts.use("h07", LATEST, "killrun") as h:
        before = tree_state(h.venv)
        proc = h.patch_popen("--ttl", str(ttl), "--hold", "--run-id", "hold1")
        try:
            wait_for(lambda: (h.manifest("hold1") or {}).get("state") == "patched", 30, what="state patched")
            assert not _restored(h, before) and h.probe_files()
            lease = read_json(h.run_dir("hold1") / "lease.json")
            # --hold renews the lease (every ttl/3, at least 1 s): its expiry moves forward
            renewed = wait_for(lambda: (read_json(h.run_dir("hold1") / "lease.json") or lease)["expires"]
                               > lease["expires"] and read_json(h.run_dir("hold1") / "lease.json"), ttl, 0.1,
                               "a lease renewal")
            assert renewed["ttl"] == ttl and proc.poll() is None
        finally:
            proc.kill()
            proc.wait(10)
        assert proc.returncode == -signal.SIGKILL
        wait_for(lambda: _restored(h, before), ttl + 5, 0.1, "the watchdog to restore every file")
        m = wait_for(lambda: (h.manifest("hold1") or {}).get("state") == "reverted" and h.manifest("hold1"), 5)
        assert m["reverted"]["reason"] == "watchdog: lease expired"
        assert {f["outcome"] for f in m["reverted"]["files"]} == {"restored"}
        assert "lease expired: reverting" in (h.run_dir("hold1") / "watchdog.log").read_text()
        assert h.probe_files() == [] and not (Path(h.run_root) / "lock.json").exists()


def test_sigkill_mid_patch_agent_finishes_and_watchdog_restores(hosts):
    ttl = 2
    with hosts.use("h08", LATEST, "killpatch") as h:
        before = tree_state(h.venv)
        proc = h.patch_popen("--ttl", str(ttl), "--run-id", "cut2")
        wait_for(lambda: h.run_dir("cut2").is_dir() or proc.poll() is not None, 30, 0.002, "the run dir")
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        assert proc.returncode == -signal.SIGKILL  # killed while the host was patching, not after
        m = wait_for(lambda: (h.manifest("cut2") or {}).get("state") == "reverted" and h.manifest("cut2"),
                     ttl + 6, 0.1, "the watchdog to revert the run")
        assert m["reverted"]["reason"] == "watchdog: lease expired"
        # the agent had finished the patch on its own: every target was patched, then restored
        check_patched_files({f["rel"] for f in m["files"]}, *LATEST)
        assert {f["outcome"] for f in m["reverted"]["files"]} == {"restored"}
        assert _restored(h, before)


def _sshd_session_pid(h: Host, client_pid: int) -> int:
    """The host-side `sshd: root@notty` process serving the TCP connection that client_pid holds."""
    addr = h.fleet.host(h.name)["host"]
    ss = subprocess.run(["ss", "-tnpH", "state", "established", "dst", addr], capture_output=True, text=True,
                        check=True).stdout
    lines = [ln for ln in ss.splitlines() if f"pid={client_pid}," in ln]
    assert len(lines) == 1, ss
    local_port = lines[0].split()[2].rsplit(":", 1)[1]
    remote = h.ssh(f"ss -tnpH state established '( sport = :22 and dport = :{local_port} )'").stdout
    for pid in re.findall(r"pid=(\d+),", remote):
        cmd = h.ssh(f"tr '\\0' ' ' </proc/{pid}/cmdline", check=False).stdout
        if re.match(r"sshd(-session)?: \S+@notty", cmd):
            return int(pid)
    raise AssertionError(f"no sshd session process for port {local_port}: {remote}")


def test_dropped_ssh_connection_watchdog_restores_within_ttl(hosts):
    ttl = 4
    with hosts.use("h09", LATEST, "sshdrop") as h:
        before = tree_state(h.venv)
        proc = h.patch_popen("--ttl", str(ttl), "--hold", "--run-id", "drop1")
        try:
            wait_for(lambda: (h.manifest("drop1") or {}).get("state") == "patched", 30, what="state patched")
            session = _sshd_session_pid(h, proc.pid)
            h.ssh(f"kill -9 {session}")
            out, err = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        assert "connection lost" in err and proc.returncode == 3, err
        doc = json.loads(out)
        assert doc["hosts"][0]["status"] == "unreachable"
        wait_for(lambda: _restored(h, before), ttl + 5, 0.1, "the watchdog to restore every file")
        m = h.manifest("drop1")
        assert m["state"] == "reverted" and m["reverted"]["reason"] == "watchdog: lease expired"
        assert h.probe_files() == []


def test_read_only_target_directory_is_refused(hosts):
    with hosts.use("h10", LATEST, "readonly") as h:
        d = f"{SITE}/vllm/v1/attention/backends/mla"
        before = tree_state(h.venv)
        h.ssh(f"mount --bind {d} {d} && mount -o remount,ro,bind {d}")
        try:
            code, doc, _, _ = h.patch("--ttl", "0")
            rep = doc["hosts"][0]
            assert code == 4 and rep["patch"]["outcome"] == "refused"
            assert f"{d}: directory is not writable (read-only filesystem or permissions)" in rep["error"]
        finally:
            h.ssh(f"umount {d}")
        assert diff_states(before, tree_state(h.venv)) == []
        assert not Path(h.run_root).exists() and h.probe_files() == []


def test_full_target_directory_is_refused(hosts):
    with hosts.use("h11", LATEST, "full") as h:
        d = f"{SITE}/vllm/v1/attention/backends/mla"
        copy = "/dev/shm/mla-doctor-test-full"
        before = tree_state(h.venv)
        listing = f"cd {d} && find . -type f ! -name zz-fill -exec stat -c '%n %a %Y %s' {{}} + | sort && " \
                  "find . -type f ! -name zz-fill -exec sha256sum {} + | sort"
        h.ssh(f"rm -rf {copy} && cp -a {d} {copy} && mount -t tmpfs -o size=2m mla-full {d} && cp -a {copy}/. {d}/ "
              f"&& (dd if=/dev/zero of={d}/zz-fill bs=64k 2>/dev/null; true) && sync")
        try:
            assert h.ssh(f"df --output=avail -B1 {d} | tail -1").stdout.strip() == "0"
            on_tmpfs = h.ssh(listing).stdout
            code, doc, _, _ = h.patch("--ttl", "0")
            rep = doc["hosts"][0]
            assert code == 4 and rep["patch"]["outcome"] == "refused", rep["error"]
            assert f"{d}: not enough free space" in rep["error"]
            assert h.ssh(listing).stdout == on_tmpfs
        finally:
            h.ssh(f"umount {d}; rm -rf {copy}")
        assert diff_states(before, tree_state(h.venv)) == []
        assert not Path(h.run_root).exists() and h.probe_files() == []


def test_file_changed_between_audit_and_patch_is_refused(hosts):
    from mla_doctor.remote.runner import run_agent
    from mla_doctor.host.audit import AuditOptions
    from mla_doctor.host.instrument import PatchOptions, prepare_patch
    from mla_doctor.diagnosis.knowledge import load_knowledge
    from mla_doctor.host.patch import audit_for_patch
    from mla_doctor.ssh.transport import ConnectOptions, open_transport

    with hosts.use("h12", LATEST, "changed") as h:
        conn = ConnectOptions(ssh_config=str(h.fleet.ssh_config))
        kb = load_knowledge()
        popts = PatchOptions(ttl=0, run_root=h.run_root, run_id="stale1")
        tr = open_transport(h.name, conn)
        try:
            report, raw = audit_for_patch(tr, h.name, conn, AuditOptions(python=VENV_PY), popts, kb)
            assert report.status.value == "ok"
            prepared = prepare_patch(kb, load_targets(), raw, popts)
            rel = "v1/attention/backends/mla/flashmla.py"
            assert rel in {f["rel"] for f in prepared.plan["files"]}
            target = h.vllm / rel
            target.write_bytes(target.read_bytes() + b"# changed after the audit\n")
            before = tree_state(h.venv)
            res = run_agent(tr, prepared.plan, timeout=60)
        finally:
            tr.close()
        assert res["outcome"] == "refused"
        assert [r for r in res["refused"] if "changed since the audit" in r] == [
            r for r in res["refused"] if r.startswith(f"{SITE}/vllm/{rel} changed since the audit")] != []
        assert len(res["refused"]) == 1
        assert diff_states(before, tree_state(h.venv)) == []
        assert not Path(h.run_root).exists() and h.probe_files() == []
        hosts.dirty(h.name)


def test_second_concurrent_run_is_refused(hosts):
    with hosts.use("h13", LATEST, "concurrent") as h:
        before = tree_state(h.venv)
        procs = {rid: h.patch_popen("--ttl", "0", "--run-id", rid) for rid in ("one", "two")}
        docs = {}
        for rid, proc in procs.items():
            out, err = proc.communicate(timeout=60)
            docs[rid] = json.loads(out)["hosts"][0]
        outcomes = sorted((d["patch"]["outcome"], rid) for rid, d in docs.items())
        assert [o for o, _ in outcomes] == ["patched", "refused"], {r: d["error"] for r, d in docs.items()}
        winner = next(rid for rid, d in docs.items() if d["patch"]["outcome"] == "patched")
        loser = docs[next(rid for rid in docs if rid != winner)]
        assert f"run(s) {winner}" in loser["error"] or f"holds this host: {winner}" in loser["error"], loser["error"]
        patched = tree_state(h.venv)
        # and one more, after the fact: refused, nothing touched
        code, doc, _, _ = h.patch("--ttl", "0", "--run-id", "three")
        assert code == 4 and doc["hosts"][0]["patch"]["outcome"] == "refused"
        assert winner in doc["hosts"][0]["error"]
        assert diff_states(patched, tree_state(h.venv)) == []
        assert not h.run_dir("three").exists() and not h.run_dir(
            next(rid for rid in docs if rid != winner)).exists()
        code, doc, _, _ = h.revert("--run", winner)
        assert code == 0 and diff_states(before, tree_state(h.venv)) == []


def test_template_rendering_invalid_python_is_refused_before_writing(hosts, tmp_path):
    tdir = tmp_path / "templates"
    shutil.copytree(REPO / "templates", tdir)
    text = (tdir / "probe_call.py.j2").read_text()
    assert "except Exception:\n    pass\n" in text
    (tdir / "probe_call.py.j2").write_text(text.replace("except Exception:\n    pass\n", "", 1))  # a bare `try:`
    message = "the rendered instrumentation is not valid Python"
    with hosts.use("h14", LATEST, "template") as h:
        before = tree_state(h.venv)
        code, doc, _, _ = h.patch("--ttl", "0", "--templates", str(tdir))
        rep = doc["hosts"][0]
        assert code == 4 and rep["patch"]["outcome"] == "refused"
        assert message in rep["error"]
        assert diff_states(before, tree_state(h.venv)) == []
        assert not Path(h.run_root).exists() and h.probe_files() == []
