"""The run's lease: the controller renews it; the watchdog reverts the run once it expires.
Also the `renew` op.
"""
from __future__ import annotations


from . import fs
from .common import time_now
from .fs import lease_path, read_json, plan_run_dir, server_paths, write_json
from .protocol import AGENT_VERSION, Refusal


def write_lease(run_dir, ttl, epoch=None):
    """(Re)write the lease; the epoch (the controller's prompt window) is kept unless given."""
    if epoch is None:
        try:
            epoch = read_json(lease_path(run_dir)).get("epoch", 0)
        except (OSError, ValueError):
            epoch = 0
    lease = {"expires": (time_now() + ttl) if ttl and ttl > 0 else 0, "ttl": ttl, "renewed": time_now(), "epoch": epoch}
    write_json(lease_path(run_dir), lease, 0o644)  # the probe, running as the server's user, reads it
    return lease


def lease_expired(run_dir):
    try:
        lease = read_json(lease_path(run_dir))
        return bool(lease.get("expires")) and time_now() > float(lease["expires"])
    except (OSError, ValueError, TypeError, AttributeError, Refusal):
        return True


def op_renew(plan):
    run_dir = plan_run_dir(plan)
    if not fs.exists(fs.manifest_path(run_dir)) and fs.exists(server_paths(run_dir)[0]):
        # the host side of a container run (docker runtime): only its lease, for the host's watchdog
        return {"agent_version": AGENT_VERSION, "op": "renew", "renewed": True,
                "lease": write_lease(run_dir, plan.get("ttl") or 0)}
    m = read_json(fs.manifest_path(run_dir))
    if m.get("state") != "patched":
        return {"agent_version": AGENT_VERSION, "op": "renew", "renewed": False, "state": m.get("state")}
    return {"agent_version": AGENT_VERSION, "op": "renew", "renewed": True,
            "lease": write_lease(run_dir, plan.get("ttl") or m.get("ttl") or 0)}
