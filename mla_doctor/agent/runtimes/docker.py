"""The `docker` runtime. Files are audited, patched and reverted by this agent run *inside* the
container (docker exec); this part runs on the host: it restarts the container (`docker restart`
keeps its writable layer, so the patched files stay, and its environment, which cannot change
without re-creating it), reads `docker logs --since`, and watches the run's lease. A restart ends
every process in the container, the in-container watchdog too: the host's watchdog then reverts
the files through `docker exec` and restarts the container if the controller goes away.
"""
from __future__ import annotations

import json
import subprocess
import time

from .. import reexec
from ..common import time_now
from ..daemon import watchdog_pid, watchdog_start, start_daemon
from ..facts.logs import filter_lines
from ..facts.processes import find_servers, identify
from ..fs import read_json, server_paths, write_private
from ..lease import lease_expired, write_lease
from ..protocol import AGENT_VERSION, BOOTSTRAP, Refusal
from .base import Runtime, gpu_free_or_refuse, restart_state
from .registry import restore_server


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
            "network_mode": (d.get("HostConfig") or {}).get("NetworkMode"),
            # a kubelet's container (cri-dockerd): the pod's names, and only those, from its labels
            "kubernetes": {k: v for k, v in ((d.get("Config") or {}).get("Labels") or {}).items()
                           if k in ("io.kubernetes.pod.name", "io.kubernetes.pod.namespace",
                                    "io.kubernetes.container.name") and isinstance(v, str)}}


def _docker_container(srv):
    sup = srv.get("supervisor") or {}
    if sup.get("kind") in ("docker", "kubernetes") and sup.get("container") and \
            sup.get("runtime", "docker") == "docker":
        return sup["container"]
    return None


def proven_containers(candidates):
    """({container id: [pids of the vLLM servers proven in it]}, [look-alikes in a container: id, pid, user,
    why]). A container counts only for a server identify() proves (the process that holds the listening socket
    of its own port, its install its own): a process that merely looks like vLLM (its argv, a mapping) never
    makes its container the one diagnosed, and is listed with why."""
    servers, lookalikes, _error = identify({}, candidates)
    seen = {}
    for srv in servers:
        cid = _docker_container(srv)
        if cid:
            seen.setdefault(cid, []).append(srv["pid"])
    by_pid = {c["pid"]: c for c in candidates}
    unproven = []
    for x in lookalikes:
        cid = _docker_container(by_pid.get(x["pid"]) or {})
        if cid:
            unproven.append({"id": cid, "pid": x["pid"], "user": x.get("user"), "why": x["why"]})
    return seen, unproven


def op_docker_find(plan):
    """The container to diagnose: the one named, else every container in which a vLLM server is proven (see
    proven_containers); those where something only looks like one are listed apart (`unproven`)."""
    out = {"agent_version": AGENT_VERSION, "op": "docker_find", "containers": []}
    if plan.get("container"):
        info = docker_inspect(plan["container"])
        out["containers"].append(info)
        return out
    seen, unproven = proven_containers(find_servers())
    for cid, pids in sorted(seen.items()):
        try:
            info = docker_inspect(cid)
        except Refusal as e:
            info = {"id": cid, "error": str(e)}
        info["server_pids"] = pids
        out["containers"].append(info)
    if unproven:
        out["unproven"] = unproven
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
    gpu_free_or_refuse(spec)
    since = _docker_now()
    rc, _out, err = _docker(["start", spec["id"]], timeout=120)
    if rc != 0:
        raise Refusal("docker start %s failed: %s" % (spec["name"], err.decode("utf-8", "replace").strip()[-300:]))
    info = docker_inspect(spec["id"])
    cur = {"runtime": "docker", "container": spec["id"], "launch": n, "mode": mode, "since": since,
           "pid": info.get("pid"), "restart_count": info.get("restart_count", 0), "started": time_now(),
           "port": spec["port"]}
    write_private(server_paths(run_dir)[1], cur)
    return cur


def _capture_container(plan):
    info = docker_inspect(plan["container"])
    if not info["running"]:
        raise Refusal("container %s is not running" % info["name"])
    return dict(info, runtime="docker", port=int(plan["port"]), grace_s=plan.get("grace_s", 30),
                python=plan.get("container_python"), container_run_root=plan.get("container_run_root"),
                run_id=plan["run_id"], captured=time_now())


def op_docker_restart(plan):
    # the host side of a container run has no patch run directory: this is its first write
    run_dir, spec, current = restart_state(plan, lambda: _capture_container(plan), make_run_dir=True)
    write_lease(run_dir, plan.get("ttl") or 120)
    cur = _docker_restart(spec, run_dir, int(current.get("launch", 0)) + 1, plan.get("mode", "debug"))
    wd = watchdog_pid(run_dir)
    if not wd and reexec.PAYLOAD:  # in-process (tests): no payload to run inside the container
        wd = start_daemon(lambda: docker_watchdog_loop(run_dir, float(plan.get("watchdog_poll", 1.0))))
    return {"agent_version": AGENT_VERSION, "op": "docker_restart", "container": spec["name"], "pid": cur["pid"],
            "log": "docker:" + spec["name"], "log_offset": 0, "port": spec["port"], "watchdog_pid": wd}


def _container_agent(spec, plan, timeout=300):
    """This agent, run inside the container with one plan (the host watchdog's revert)."""
    py = spec.get("python") or "python3"
    rc, out, err = _docker(["exec", "-i", "-u", "0", spec["id"], py, *reexec.FLAGS, "-c", BOOTSTRAP],
                           timeout=timeout, stdin=reexec.stdin_for(plan))
    try:
        return json.loads(out.decode("utf-8", "replace"))
    except ValueError:
        return {"fatal": "exit %d: %s" % (rc, err.decode("utf-8", "replace")[-300:])}


def docker_revert_and_restore(run_dir, reason, note=lambda m: None):
    """The container's files reverted (this agent inside it), then the container restarted as found."""
    spec = read_json(server_paths(run_dir)[0])
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
    note, stop = watchdog_start(run_dir, "host watchdog (container run)")
    _orig_path, cur_path = server_paths(run_dir)
    while not stop:
        try:
            cur = read_json(cur_path)
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
    out["log_lines"] = filter_lines(lines[seen:], plan.get("log_patterns") or {}, "docker:" + cur["container"])[
        "lines"]
    return out


class DockerRuntime(Runtime):
    kind = "docker"

    def restart(self, plan):
        return op_docker_restart(plan)

    def restore(self, spec, run_dir, current, note):
        if current.get("mode") == "original":
            return {"restored": True, "already": True, "pid": current.get("pid")}
        cur = _docker_restart(spec, run_dir, int(current.get("launch", 0)) + 1, "original")
        note("container %s restarted" % spec["name"])
        return {"restored": True, "pid": cur["pid"], "log": "docker:" + spec["name"], "log_offset": 0}

    def tick(self, cur, plan, out):
        return _docker_tick(cur, plan, out)

    def revert_host_run(self, run_dir, reason):
        """The host side of a container run: its files reverted inside the container, the container restarted."""
        return docker_revert_and_restore(run_dir, reason)


RUNTIME = DockerRuntime()
