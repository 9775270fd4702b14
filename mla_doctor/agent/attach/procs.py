"""The processes that run the model, read from /proc: the server and its descendants that load vLLM's
native code (V1: EngineCore and its TP/PP workers; V0 and in-process engines: the server itself).

Each is named by (pid, start time): a pid reused by another process is never attached to.
"""
from __future__ import annotations

import os

INTERPRETER_SYMBOLS = ("Py_AddPendingCall", "PyRun_SimpleString")
CPYTHON_SYMBOLS = ("Py_Initialize", "PyEval_SaveThread", "_PyRuntime")


def start_time(pid):
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22), or None."""
    try:
        with open("/proc/%d/stat" % int(pid), "rb") as f:
            data = f.read()
    except OSError:
        return None
    rest = data[data.rfind(b")") + 2:].split()
    try:
        return int(rest[19])
    except (IndexError, ValueError):
        return None


def status(pid):
    out = {}
    try:
        with open("/proc/%d/status" % int(pid)) as f:
            for line in f:
                k, _, v = line.partition(":")
                out[k] = v.strip()
    except OSError:
        pass
    return out


def ns_pid(st, pid):
    """The pid the process has in its own pid namespace (a container's: what its os.getpid() and so its probe's
    records say), the last of /proc/PID/status NSpid; the pid itself where there is no other."""
    last = (st.get("NSpid") or "").split()[-1:]
    return int(last[0]) if last and last[0].isdigit() else int(pid)


def _read(path):
    try:
        with open(path, "rb") as f:
            return f.read(65536)
    except OSError:
        return b""


def children_of(root):
    """Every descendant of `root` (pids), from the PPid of each /proc entry."""
    parent = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            pp = status(name).get("PPid")
            if pp and pp.isdigit():
                parent[int(name)] = int(pp)
    kids, todo = [], [int(root)]
    while todo:
        p = todo.pop()
        for c, pp in sorted(parent.items()):
            if pp == p and c not in kids:
                kids.append(c)
                todo.append(c)
    return sorted(kids)


def _maps_full(pid):
    """(address range, path) of each file mapping; /proc/PID/maps can exceed 64 KiB for a torch process: read
    it whole."""
    try:
        with open("/proc/%d/maps" % int(pid)) as f:
            return [(ln.split(None, 1)[0], ln.split(None, 5)[5].strip()) for ln in f if len(ln.split(None, 5)) == 6]
    except OSError:
        return []


def describe(pid):
    """What an attach needs to know of one process."""
    st = status(pid)
    try:
        exe = os.readlink("/proc/%d/exe" % pid)
    except OSError:
        exe = None
    ranged = _maps_full(pid)
    maps = [m for _r, m in ranged]
    lib = next(((r, m) for r, m in ranged if os.path.basename(m).startswith("libpython3")), None)
    libpython = lib[1] if lib else None
    return {"pid": int(pid), "start_time": start_time(pid), "comm": _read("/proc/%d/comm" % pid).decode(
        "utf-8", "replace").strip(), "uid": int((st.get("Uid") or "-1").split()[0]), "ppid": int(st.get("PPid") or 0),
        "tracer_pid": int(st.get("TracerPid") or 0), "ns_pid": ns_pid(st, pid),
        "state": (st.get("State") or "?")[:1], "exe": exe,
        "libpython": libpython,
        # the very file the process mapped (never re-found by a name its owner controls: a FIFO planted there)
        "libpython_map": "/proc/%d/map_files/%s" % (int(pid), lib[0]) if lib else None,
        "maps_vllm": sorted({m[:m.rfind("/vllm/") + 5] for m in maps
                                                     if "/vllm/" in m and m.endswith(".so")})}


def model_processes(server_pid, vllm_dir):
    """The server and its descendants that map vLLM's native code from `vllm_dir` (the resource tracker
    and other helpers do not, and never wake to run a pending call)."""
    out = []
    mine = {vllm_dir, os.path.realpath(vllm_dir)}  # maps name files resolved
    for pid in [int(server_pid)] + children_of(server_pid):
        d = describe(pid)
        if d["start_time"] is None:
            continue
        if mine.intersection(d["maps_vllm"]):  # its own mapping of this very install, not one that merely ends alike
            out.append(d)
    return out


def identify_server(pid, port=None):
    """The server the audit found, proven again now (facts/processes.identify: the process holding the
    listening socket of its port, of `port` when given, running an install its own interpreter imports, root's
    or its own), else None: a look-alike is never attached to."""
    from ..facts.processes import find_servers, identify

    servers, _looks, error = identify({"pid": int(pid), "port": port}, find_servers())
    for s in servers:
        if s.get("pid") == int(pid) and not error:
            return {k: v for k, v in s.items() if not k.startswith("_")}
    return None
