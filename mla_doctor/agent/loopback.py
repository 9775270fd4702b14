"""The `http` op: one HTTP request to the server's loopback port made on the host.
"""
from __future__ import annotations

import base64

from .protocol import AGENT_VERSION


CLONE_NEWNET = 0x40000000


def in_netns(pid, fn):
    """fn()'s JSON-able answer, computed in a child that joined pid's network namespace (a pod's, a container's
    own): its loopback is not the node's. The agent itself never leaves the node's namespaces."""
    import ctypes
    import json
    import os

    fd = os.open("/proc/%d/ns/net" % int(pid), os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    r, w = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child's answer comes back through the pipe
        code = 0
        try:
            os.close(r)
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.setns(fd, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns into pid %d's network namespace" % int(pid))
            res = fn()
        except BaseException as e:
            res, code = {"status": None, "error": "%s: %s" % (type(e).__name__, e)}, 1
        data = json.dumps(res).encode()
        while data:
            data = data[os.write(w, data):]
        os._exit(code)
    os.close(w)
    os.close(fd)
    chunks = []
    while True:
        b = os.read(r, 1 << 16)
        if not b:
            break
        chunks.append(b)
    os.close(r)
    os.waitpid(child, 0)
    try:
        return json.loads(b"".join(chunks).decode("utf-8"))
    except ValueError:
        return {"status": None, "error": "the request in pid %d's network namespace gave no answer" % int(pid)}


def op_http(plan):
    """One HTTP request to the server's loopback port, made on the host: the fallback when the host's
    sshd refuses TCP forwarding, and the way into a server's own network namespace (netns_pid: a pod's or a
    container's; the port proven its listening socket's there). Headers (an API key) arrive on stdin, never
    on a command line."""
    if plan.get("netns_pid"):
        out = in_netns(int(plan["netns_pid"]), lambda: _request(plan))
        out.update(agent_version=AGENT_VERSION, op="http")
        return out
    return _request(plan)


def _request(plan):
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
