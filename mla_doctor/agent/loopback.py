"""The `http` op: one HTTP request to the server's loopback port made on the host.
"""
from __future__ import annotations

import base64

from .protocol import AGENT_VERSION


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
