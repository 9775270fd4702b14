"""The vLLM servers running on this host, read from /proc: argv and environment (secrets redacted
here, before anything is printed), user, supervisor (systemd, docker, Kubernetes, supervisord).

find_servers() lists every process whose command line looks like a vLLM server; identify() decides which
one is the server (the process holding its port's listening socket, or --pid; it must map a vLLM install
of root's or of its own uid) and reports the rest as look-alikes, never used. verified_servers() is the
short form for other modules (attach, restart): [(pid, uid)] and the error, if any.
"""
from __future__ import annotations

import glob
import os
import re

from ..common import int_or_none, read_regular, read_text, run_argv, user_name, find_executable
from ..privilege import call_as, proc_ids
from ..protocol import Refusal
from . import containers


# Server processes we recognise in /proc/<pid>/cmdline.
SERVER_MODULES = ("vllm.entrypoints.openai.api_server", "vllm.entrypoints.api_server")

# The controller's rule (mla_doctor/redact.py): --api-key, --key, --*-key, and any flag naming a token, secret,
# password or credential -- but not tokens/tokenizer (--max-num-batched-tokens, --tokenizer are evidence)
SECRET_ARG_RE = re.compile(r"(?i)^--?(?:.*(?:api[-_]?key|secret|password|passwd|credential).*|(?:.*[-_])?key"
                           r"|.*token(?!s|iz).*)$")

# the same names as the controller's redact.SECRET_ENV (tests/unit/test_agent_pure.py checks they agree)
SECRET_ENV_RE = re.compile(r"(?i)(key|token|secret|password|passwd|passphrase|credential|auth|_pass$|^pass$|_pwd$)")

# Environment variables worth reporting (values redacted when they look secret).
REPORT_ENV_RE = re.compile(r"^(VLLM_|HF_|HUGGING|TRANSFORMERS_|CUDA_VISIBLE|PYTHONPATH$|VIRTUAL_ENV$|TORCH)")

REDACTED = "<redacted>"


def redact_argv(argv):
    """Every value word after a secret flag, up to the next flag (`--api-key a b`: newer vLLM takes
    several), and `--flag=value`."""
    out = []
    hiding = False
    for a in argv:
        if hiding and not a.startswith("-"):
            out.append(REDACTED)
            continue
        hiding = False
        if a.startswith("-") and "=" in a:
            k, _, _v = a.partition("=")
            out.append(k + "=" + REDACTED if SECRET_ARG_RE.match(k) else a)
            continue
        if a.startswith("-") and SECRET_ARG_RE.match(a):
            hiding = True
        out.append(a)
    return out


def redact_env(env):
    out = {}
    for k, v in sorted(env.items()):
        if not REPORT_ENV_RE.match(k):
            continue
        out[k] = REDACTED if SECRET_ENV_RE.search(k) else v
    return out


def proc_cmdline(pid):
    try:
        raw = open("/proc/%s/cmdline" % pid, "rb").read()
    except OSError:
        return None
    return [a.decode("utf-8", "replace") for a in raw.split(b"\0") if a]


def proc_environ(pid):
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


def proc_status(pid):
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


def supervisor(pid, argv):
    """Who would restart this server behind our back: systemd, docker, kubernetes, supervisord."""
    sup = {"kind": "process"}
    try:
        cg = read_text("/proc/%s/cgroup" % pid)
    except OSError:
        cg = ""
    sup["cgroup"] = cg.strip().splitlines()[-1] if cg.strip() else None
    ref = containers.locate(pid) if str(pid).isdigit() else None
    if ref is not None:  # a container a runtime on this node runs, checked against the runtime's own record
        sup["kind"] = "kubernetes" if ref.kubernetes else ref.runtime
        sup.update(runtime=ref.runtime, container=ref.id, name=ref.name, pod=ref.pod, namespace=ref.namespace,
                   container_name=ref.container, pod_uid=ref.pod_uid, label=ref.label(), container_ref=ref.to_json())
        return sup
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
        rc, out, _ = run_argv(["systemctl", "show", unit, "-p", "Restart", "-p", "FragmentPath",
                           "-p", "User", "-p", "MainPID"], timeout=5)
        if rc == 0:
            for line in out.splitlines():
                k, _, v = line.partition("=")
                sup[k.lower()] = v
        return sup
    # supervisord: an ancestor process runs supervisord
    ppid = proc_status(pid).get("PPid")
    seen = 0
    while ppid and ppid not in ("0", "1") and seen < 32:
        a = proc_cmdline(ppid) or []
        if any("supervisord" in os.path.basename(x) for x in a[:2]):
            sup["kind"] = "supervisord"
            sup["supervisor_pid"] = int(ppid)
            break
        ppid = proc_status(ppid).get("PPid")
        seen += 1
    return sup


def supervised_refusal(sup):
    kind = sup.get("kind")
    if kind == "systemd" and (sup.get("restart") or "no") != "no":
        return ("the server is systemd unit %s with Restart=%s: it would be restarted behind our back; "
                "use --runtime systemd" % (sup.get("unit"), sup.get("restart")))
    if kind == "kubernetes":
        ref = sup.get("container_ref")
        if ref:  # recognised: pod and container named from the runtime's labels
            return containers.kubernetes_restart_refusal(containers.ContainerRef.from_json(ref))
        return ("the server runs in a Kubernetes pod: a restart would be undone by the pod's controller, which "
                "replaces a container that stops; use --method attach (no restart)")
    if kind == "docker":
        return "the server runs in a docker container; use --runtime docker (or command), or --method attach"
    if kind in (containers.PODMAN, containers.CONTAINERD, containers.CRIO):
        return ("the server runs in %s; restarting it is not supported for this runtime: use --method attach "
                "(no restart), or --runtime command with your own stop/start commands" % sup.get("label", kind))
    if kind == "supervisord":
        return "the server is managed by supervisord; use --runtime command with supervisorctl"
    return None


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


def _in_root(pid, path):
    """``path`` as the process sees it (its own mount namespace: a container's files too)."""
    return "/proc/%s/root%s" % (pid, path)


def _interpreter_of(argv, env, cwd):
    """argv[0] when it names a python (a venv's bin/python: /proc/PID/exe resolves the venv away)."""
    a0 = argv[0] if argv else ""
    if not os.path.basename(a0).startswith("python"):
        return None
    if os.path.isabs(a0):
        return a0
    if "/" in a0:
        return os.path.normpath(os.path.join(cwd, a0)) if cwd else None
    return find_executable(a0, path=env.get("PATH") or "") if env else None


def _venv_root(pid, python):
    """The venv whose bin/ holds ``python`` (pyvenv.cfg beside bin/, as site.py finds it), else None."""
    root = os.path.dirname(os.path.dirname(python))
    cfg = _in_root(pid, os.path.join(root, "pyvenv.cfg"))
    # read, not only stat'ed: a venv the server's user cannot read is not proof; a regular file only (no FIFO:
    # read_text checks on the descriptor); common's reader, as every static fact: the static audit loads no
    # module that changes files (fs)
    try:
        read_text(cfg, 4096)
    except OSError:
        return None
    return root


def _vllm_version(pid, site):
    """(distribution, version) from the ``vllm*.dist-info/METADATA`` beside a vllm package: headers only."""
    for di in sorted(glob.glob(_in_root(pid, os.path.join(glob.escape(site), "vllm*.dist-info")))):
        meta_path = os.path.join(di, "METADATA")
        try:
            # a regular file only (checked on the descriptor), never through a final symlink (its owner's link
            # to a root-only file would put that file's "Version:" line in the report)
            head = read_text(meta_path, 4096, nofollow=True)
        except OSError:
            continue
        meta = dict((k.strip().lower(), v.strip()) for k, _, v in
                    (line.partition(":") for line in head.split("\n\n", 1)[0].splitlines()) if k in ("Name", "Version"))
        if meta.get("version"):
            return meta.get("name"), meta["version"]
    return None, None


def _site_dirs(pid, prefix, env):
    """The directories this interpreter imports packages from: its prefix's site directories (as site.py
    lists them, /usr/local's too for /usr), its own PYTHONPATH, its user site under its own HOME."""
    pats = ["lib/python3*/site-packages", "lib/python3*/dist-packages", "lib64/python3*/site-packages",
            "lib/python3/dist-packages", "local/lib/python3*/dist-packages", "local/lib/python3*/site-packages"]
    out = []
    if prefix:
        for pat in pats:
            found = glob.glob(_in_root(pid, os.path.join(glob.escape(prefix), pat)))
            out += [f[len(_in_root(pid, "")):] for f in found]
        if prefix == "/usr":
            for pat in pats[:2]:
                found = glob.glob(_in_root(pid, os.path.join("/usr/local", pat)))
                out += [f[len(_in_root(pid, "")):] for f in found]
    out += _pth_dirs(pid, out)
    for d in (env.get("PYTHONPATH") or "").split(":"):
        if os.path.isabs(d):
            out.append(d)
    home = env.get("HOME")
    if home and os.path.isabs(home):
        out += [f[len(_in_root(pid, "")):] for f in
                glob.glob(_in_root(pid, os.path.join(glob.escape(home), ".local/lib/python3*/site-packages")))]
    return out


_FINDER_RE = re.compile(r"""['"]vllm['"]\s*:\s*['"](/[^'"]+)['"]""")


def _pth_dirs(pid, sites):
    """What an editable install adds to sys.path: absolute path lines of the site directories' *.pth files and
    the `vllm` entry of a setuptools `__editable___*_finder.py` MAPPING. Read through the one door (no final
    symlink, regular files only, bounded); used only to compare paths, never reported."""
    out = []
    for site in sites:
        for name in sorted(glob.glob(_in_root(pid, os.path.join(glob.escape(site), "*.pth"))))[:64]:
            try:
                text = read_regular(name, limit=65536, nofollow=True, max_size=1 << 20).decode("utf-8", "replace")
            except OSError:
                continue
            out += [ln.strip() for ln in text.splitlines() if ln.strip().startswith("/")]
        for name in sorted(glob.glob(_in_root(pid, os.path.join(glob.escape(site), "__editable___*finder.py"))))[:8]:
            try:
                text = read_regular(name, limit=1 << 20, nofollow=True, max_size=1 << 20).decode("utf-8", "replace")
            except OSError:
                continue
            out += [os.path.dirname(m.group(1).rstrip("/")) for m in _FINDER_RE.finditer(text)]
    return out


def imported_vllm_dir(pid, mapped, sites, same_root):
    """The mapped vllm package directory the process's own interpreter imports (its parent is one of the
    interpreter's site directories), else None: any process can map a world-readable vllm/_C.abi3.so, so a
    mapping alone proves nothing."""
    def norm(p):
        p = os.path.normpath(p)
        return os.path.realpath(p) if same_root else p

    wanted = {norm(d) for d in sites}
    for vdir in mapped:
        if norm(os.path.dirname(vdir)) in wanted:
            return vdir
    return None


def server_install(pid, argv, env, exe, cwd, mapped):
    """Which install a server runs from: its interpreter's prefix (the venv root: pyvenv.cfg beside the bin/ of
    argv[0], of $VIRTUAL_ENV, of /proc/PID/exe; else the exe's own prefix), and the vllm package it has
    mapped (else the one in that prefix's site-packages), with that package's distribution and version."""
    env = env or {}
    python = _interpreter_of(argv, env, cwd)
    prefix = prefix_from = None
    venv = env.get("VIRTUAL_ENV")
    for how, cand in (("argv[0]", python), ("VIRTUAL_ENV", os.path.join(venv, "bin", "python") if venv else None),
                      ("exe", exe)):
        root = _venv_root(pid, cand) if cand and os.path.isabs(cand) else None
        if root:
            prefix, prefix_from = root, "pyvenv.cfg beside the bin/ of " + how
            break
    if prefix is None and exe:
        prefix, prefix_from = os.path.dirname(os.path.dirname(exe)), "exe"
    try:
        same_root = os.readlink(_in_root(pid, "")) == "/"
    except OSError:
        same_root = False
    vdir = imported_vllm_dir(pid, mapped, _site_dirs(pid, prefix, env), same_root)
    vdir_from = "mapped, under its interpreter's site directories" if vdir else None
    if vdir is None and mapped:  # mapped from elsewhere: not the install it runs (a look-alike's mmap)
        return {"python": python or exe, "prefix": prefix, "prefix_from": prefix_from, "virtual_env": venv,
                "vllm_dir": None, "vllm_dir_from": None, "foreign_mapped": list(mapped), "distribution": None,
                "version": None, "vllm_dir_real": None}
    if vdir is None and prefix:
        found = sorted(glob.glob(_in_root(pid, os.path.join(glob.escape(prefix), "lib", "python3*", "site-packages",
                                                         "vllm", "__init__.py"))))
        if found:
            vdir, vdir_from = os.path.dirname(found[0])[len(_in_root(pid, "")):], "prefix site-packages"
    dist, version = _vllm_version(pid, os.path.dirname(vdir)) if vdir else (None, None)
    return {"python": python or exe, "prefix": prefix, "prefix_from": prefix_from, "virtual_env": venv,
            "vllm_dir": vdir, "vllm_dir_from": vdir_from, "distribution": dist, "version": version,
            # as this host's paths resolve (a container's are its own: kept as it sees them)
            "vllm_dir_real": os.path.realpath(vdir) if vdir and same_root else vdir}


DEFAULT_PORT = 8000  # vLLM's --port default
MAX_CONFIG_BYTES = 1 << 20
_YAML_PORT_RE = re.compile(r"""(?m)^port[ \t]*:[ \t]*(["']?)([0-9]{1,5})\1[ \t]*(?:#.*)?$""")


def _read_config_port(path):
    """`port:` of a vLLM --config YAML file (top-level key, as vLLM's parser turns it into --port), or None.
    A regular file only, bounded (read_regular: a FIFO hangs nothing)."""
    m = _YAML_PORT_RE.search(read_regular(path, max_size=MAX_CONFIG_BYTES).decode("utf-8", "replace"))
    return int(m.group(2)) if m else None


def server_port(pid, argv, cwd):
    """(port, where it came from) the way vLLM reads it: `--port` on the command line wins, else `port:` in
    the `--config FILE` YAML (read as the server's own user: root never opens a file of theirs by name),
    else 8000. vLLM reads no environment variable for the API port (VLLM_PORT is its internal one)."""
    port = arg_value(argv, "--port")
    if port is not None:
        return (int(port), "--port") if port.isdigit() else (None, "--port %r is not a number" % port)
    cfg = arg_value(argv, "--config")
    if cfg:
        path = cfg if os.path.isabs(cfg) else os.path.join(cwd or "/", cfg)
        try:
            same_root = os.readlink(_in_root(pid, "")) == "/"
            got = call_as(proc_ids(pid), _read_config_port, (path if same_root else _in_root(pid, path),),
                          timeout=10.0)
        except OSError as e:
            return None, "--config %s: not readable as the server's user (%s)" % (cfg, e.strerror or e)
        if got is not None:
            return int(got), "--config " + cfg
    return DEFAULT_PORT, "default"


def _stdout_target(pid):
    """(the name fd 1 points at, the path to read it by) when the server's stdout is a regular file. It is read
    through /proc/PID/fd/1 -- the very file the server writes, even renamed or deleted -- never by its name (a
    name ending " (deleted)" or a path planted since must not make root read another file)."""
    link = "/proc/%s/fd/1" % pid
    try:
        t = os.readlink(link)
        st = os.stat(link)
    except OSError:
        return None, None
    import stat as _stat

    return (t, link) if _stat.S_ISREG(st.st_mode) and fd_writable(link) else (None, None)


def fd_writable(link):
    """Whether the descriptor /proc/PID/fd/N is open for writing. Reopening it through /proc is checked against
    root's rights, not the server's: a descriptor it holds only by path (O_PATH, granted on any file in a
    searchable directory: /etc/shadow) or only for reading must not make root read a file the server could not."""
    pid, fd = link.split("/")[2], link.rsplit("/", 1)[1]
    try:
        with open("/proc/%s/fdinfo/%s" % (pid, fd)) as f:
            for line in f:
                if line.startswith("flags:"):
                    flags = int(line.split()[1], 8)
                    return (not flags & getattr(os, "O_PATH", 0o10000000)
                            and flags & 3 in (os.O_WRONLY, os.O_RDWR))  # 3: O_ACCMODE
    except (OSError, ValueError, IndexError):
        pass
    return False


def _listening(pid):
    """The TCP ports this process itself holds a listening socket of (socket inode in /proc/PID/fd matched in
    its own network namespace's /proc/PID/net/tcp{,6}, state LISTEN)."""
    inodes = set()
    try:
        for fd in os.listdir("/proc/%s/fd" % pid):
            try:
                t = os.readlink("/proc/%s/fd/%s" % (pid, fd))
            except OSError:
                continue
            if t.startswith("socket:["):
                inodes.add(t[8:-1])
    except OSError:
        return []
    if not inodes:
        return []
    ports = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = read_text("/proc/%s/net/%s" % (pid, table), 16 << 20).splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if len(f) > 9 and f[3] == "0A" and f[9] in inodes:
                ports.add(int(f[1].rsplit(":", 1)[1], 16))
    return sorted(ports)


def _own_netns(pid):
    """Whether the process runs in another network namespace than this agent's (a pod's, a container's)."""
    try:
        return os.readlink("/proc/%s/ns/net" % pid) != os.readlink("/proc/self/ns/net")
    except OSError:
        return False


def op_port_held(plan):
    """Before each request of a run: does the proven server (pid) still hold the listening socket of its port?
    A server that died and a port another process took since get no request, and no API key (the controller
    asks before every request: remote/http.py's guard)."""
    pid, port = plan.get("pid"), plan.get("port")
    ident = plan.get("identity")
    if isinstance(ident, dict):
        return _port_held_by_identity(port, ident)
    alive = isinstance(pid, int) and pid > 0 and os.path.isdir("/proc/%d" % pid)
    ports = _listening(pid) if alive else []
    out = {"op": "port_held", "pid": pid, "port": port, "alive": alive, "listening_ports": ports,
           "held": bool(alive and port in ports)}
    if plan.get("tree") and alive and not out["held"]:
        # a unit's main process or a start command's may be a wrapper: the listener may be one of its children
        for child in _descendants(pid):
            if port in _listening(child):
                out.update(held=True, server_pid=child)
                break
    return out


def _descendants(pid):
    """Every process under `pid` (children, theirs...), from /proc's parent links."""
    kids = {}
    for p in os.listdir("/proc"):
        if p.isdigit():
            ppid = int_or_none(proc_status(p).get("PPid"))
            if ppid:
                kids.setdefault(ppid, []).append(int(p))
    out, todo = [], list(kids.get(pid, ()))
    while todo:
        p = todo.pop(0)
        out.append(p)
        todo.extend(kids.get(p, ()))
    return out


def _port_held_by_identity(port, ident):
    """After a restart by a start command (no pid of ours) or a unit whose main pid is not known: the port's
    listener must be a vLLM server identify() proves on that port, run by the same uid from the same install
    as the server the run proved first; its pid is answered (server_pid), requests then follow it."""
    uid, vdir = ident.get("uid"), ident.get("vllm_dir")
    out = {"op": "port_held", "pid": None, "port": port, "alive": False, "listening_ports": [], "held": False}
    if not isinstance(port, int) or not isinstance(uid, int) or not vdir:
        return out
    servers, lookalikes, _error = identify({"port": port}, [s for s in find_servers()
                                                           if port in (s.get("listening_ports") or [])])
    for s in servers:
        if s["uid"] == uid and (s.get("install") or {}).get("vllm_dir") == vdir:
            out.update(pid=s["pid"], server_pid=s["pid"], alive=True, held=True,
                       listening_ports=s.get("listening_ports") or [])
            return out
    other = servers + lookalikes
    if other:
        out.update(alive=True, listening_ports=[port], holder="pid %d (user %s)" % (other[0]["pid"],
                                                                                     other[0]["user"]))
    return out


def _install_owner(vdir, pid):
    """uid owning the vllm directory a server runs (as the process sees it), or None."""
    try:
        return os.stat(_in_root(pid, vdir), follow_symlinks=False).st_uid
    except (OSError, TypeError):
        return None


def _why_not(s, want_port):
    """Why a process that looks like vLLM is not taken for the server (None: it is)."""
    inst = s.get("install") or {}
    if inst.get("foreign_mapped"):
        return ("maps vLLM's native code from %s, which its own interpreter (prefix %s) does not import: a "
                "mapping of a world-readable file proves nothing" % (", ".join(inst["foreign_mapped"]),
                                                                     inst.get("prefix")))
    if not inst.get("vllm_dir"):
        return "maps no vLLM package and its interpreter's prefix holds none"
    owner = _install_owner(inst["vllm_dir"], s["pid"])
    if owner is None:
        return "its vLLM at %s cannot be examined" % inst["vllm_dir"]
    if owner not in (0, s["uid"]):
        return ("runs as %s (uid %d) a vLLM at %s owned by uid %d: not its owner's server"
                % (s["user"], s["uid"], inst["vllm_dir"], owner))
    port = want_port if want_port is not None else s.get("port")
    if port is None:
        return "its port cannot be read the way vLLM reads it (%s)" % s.get("port_from")
    if port not in (s.get("listening_ports") or []):
        return ("does not listen on port %d (listens on %s)"
                % (port, ", ".join(str(p) for p in s.get("listening_ports") or []) or "nothing"))
    return None


def identify(plan, candidates):
    """The server, identified, never guessed: the process that serves the port (its own listening socket),
    or the one `--pid` names; it must map a vLLM install (a .so of its package in /proc/PID/maps, else its
    interpreter's prefix) that belongs to root or to the uid it runs as. (servers, look-alikes, error): every
    other process that looks like vLLM is reported as a look-alike with why, and never run, restarted, given
    the records directory or used as evidence; several servers and no --pid: `error` lists them."""
    plan = plan or {}
    want_pid = int_or_none(plan.get("pid"))
    want_port = int_or_none(plan.get("port"))
    servers, lookalikes = [], []
    ref, ref_error = None, None
    if plan.get("container"):  # --container: the server is the one that runs in it (the runtime names it)
        try:
            ref = containers.resolve(str(plan["container"]))
        except Refusal as e:
            ref_error = "--container %s: %s" % (plan["container"], e)
    for s in candidates:
        if want_pid is not None and s["pid"] != want_pid:
            why = "not the --pid %d named" % want_pid
        elif ref_error or (ref is not None and not containers.owns(ref.root_pid, s["pid"])):
            why = "not in the --container %s named" % plan["container"]
        else:
            why = _why_not(s, None if want_pid is not None and want_port is None and
                           s["pid"] == want_pid else want_port)
            if why and want_pid is not None and why.startswith("does not listen"):
                why = None  # --pid names it: a server still starting listens on nothing yet
        if not why and want_port is not None:  # proven on the operator's port: requests go there
            s["port"], s["port_from"] = want_port, "--port (proven: its listening socket)"
        if why:
            lookalikes.append({"pid": s["pid"], "user": s["user"], "uid": s["uid"], "argv": s["argv"],
                               "listening_ports": s.get("listening_ports"), "why": why})
        else:
            servers.append(s)
    error = None
    if ref_error:
        error = ref_error
    elif ref is not None and not servers:
        error = "no vLLM server proven in %s (--container %s)%s" % (ref.label(), plan["container"], "".join(
            "; pid %d: %s" % (x["pid"], x["why"]) for x in lookalikes if containers.owns(ref.root_pid, x["pid"])))
    elif want_pid is not None and not servers:
        error = "--pid %d is not a vLLM server this host runs%s" % (want_pid, "".join(
            ": " + x["why"] for x in lookalikes if x["pid"] == want_pid))
    elif len(servers) > 1:
        error = ("several vLLM servers: %s; name one with --pid"
                 % "; ".join(_candidate(s) for s in servers))
    elif not servers and lookalikes:  # never "vLLM not found": say what was seen and why none is proven
        by_pid = {s["pid"]: s for s in candidates}
        error = ("no process is proven to be the vLLM server%s; %d look%s like one: %s; name the server with "
                 "--pid" % (" on port %d" % want_port if want_port is not None else "", len(lookalikes),
                                        "s" if len(lookalikes) == 1 else "",
                                        "; ".join("%s: %s" % (_candidate(by_pid[x["pid"]]), x["why"])
                                                  for x in lookalikes)))
    for x in lookalikes:
        x["port"] = _port_of(candidates, x["pid"])
    return servers, lookalikes, error


def _port_of(candidates, pid):
    return next((c.get("port") for c in candidates if c["pid"] == pid), None)


def _candidate(s):
    """pid, user, port and install of one process that looks like vLLM (a usage error lists each)."""
    inst = s.get("install") or {}
    return "pid %d (user %s, port %s, install %s)" % (s["pid"], s["user"], s.get("port"), inst.get("vllm_dir") or
                                                      ", ".join(inst.get("foreign_mapped") or []) or "none")


def verified_servers(plan=None):
    """For other modules (attach, restart): [(pid, uid)] of the servers identify() verified, and the error."""
    servers, _others, error = identify(plan, find_servers())
    return [(s["pid"], s["uid"]) for s in servers], error


def find_servers():
    """Every process whose command line looks like a vLLM server (a child re-exec of one excluded), with its
    facts; identify() decides which, if any, is the server."""
    servers = []
    pids = [p for p in os.listdir("/proc") if p.isdigit()]
    matched = {}
    for pid in pids:
        argv = proc_cmdline(pid)
        if argv and is_server_argv(argv):
            matched[pid] = argv
    for pid, argv in sorted(matched.items(), key=lambda kv: int(kv[0])):
        st = proc_status(pid)
        if st.get("PPid") in matched:  # a child re-exec of the same server
            continue
        env = proc_environ(pid)
        uid = (st.get("Uid") or "0").split()[0]
        try:
            exe = os.readlink("/proc/%s/exe" % pid)
        except OSError:
            exe = None
        try:
            cwd = os.readlink("/proc/%s/cwd" % pid)
        except OSError:
            cwd = None
        port, port_from = server_port(pid, argv, cwd)
        sup = supervisor(pid, argv)
        mapped = _mapped_vllm_dirs(pid)
        stdout_name, stdout_path = _stdout_target(pid)
        servers.append({
            "pid": int(pid),
            "argv": redact_argv(argv),
            "exe": exe,
            "cwd": cwd,
            "user": user_name(uid),
            "uid": int(uid),
            "environ_readable": env is not None,
            "env": redact_env(env or {}),
            "supervisor": sup,
            "process_runtime_refusal": supervised_refusal(sup),  # why `--runtime process` must not restart it
            "port": port,  # as vLLM reads it; identify() proves the process holds its listening socket
            "port_from": port_from,
            "listening_ports": _listening(pid),
            "own_netns": _own_netns(pid),  # its loopback is not the node's: requests are made inside it
            "bind_host": arg_value(argv, "--host"),
            "model_arg": server_model_arg(argv),
            "served_model_name": arg_value(argv, "--served-model-name"),
            "tensor_parallel_size": int_or_none(arg_value(argv, "--tensor-parallel-size", "-tp")),
            "pipeline_parallel_size": int_or_none(arg_value(argv, "--pipeline-parallel-size", "-pp")),
            "speculative_config": arg_value(argv, "--speculative-config", "--speculative_config"),
            "speculative_model": arg_value(argv, "--speculative-model"),
            "num_speculative_tokens": int_or_none(arg_value(argv, "--num-speculative-tokens")),
            "attention_backend_arg": arg_value(argv, "--attention-backend"),
            "enforce_eager": "--enforce-eager" in argv,
            "hf_config_path": arg_value(argv, "--hf-config-path"),
            "mapped_vllm_dirs": mapped,
            "install": server_install(pid, argv, env, exe, cwd, mapped),  # which install it runs from
            "stdout_file": stdout_name,  # what it is called (shown); read only through stdout_fd
            "stdout_fd": stdout_path,
            "_raw_env": env,  # stripped before output; used to locate the interpreter's paths
            "_argv": argv,  # unredacted, stripped before output
        })
    return servers
