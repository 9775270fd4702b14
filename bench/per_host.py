#!/usr/bin/env python3
"""Benchmark: the controller's CPU per host over SSH — a full static audit (`audit_host`) against bare
fabric and bare paramiko doing one command — on real sshd hosts (the test fleet, netns mode), in one process.

Per host, medians of interleaved rounds, CPU of this process (user + sys, all its threads: paramiko's
transport threads included) divided by the hosts:
  fabric_true      - fabric `Connection.run("true")`: connect, authenticate, one command, close;
  paramiko_true    - the same with a bare paramiko SSHClient;
  paramiko_95k     - paramiko sending 95 KB on stdin and reading 100 KB (what an audit moves);
  audit_host       - mla-doctor's static audit of the host (real vLLM 0.33.0 in /opt/ml-env): one connection,
                     one remote execution, the answer merged with the caches and the report built;
  par_*            - fabric_true and audit_host with every host at once (one thread per host);
  fresh process    - a new process per tool over 5 hosts, CPU at checkpoints: interpreter start, imports, the
                     first host (mla-doctor imports paramiko there, lazily; fabric among its imports), each
                     later host: what a whole fleet process pays once, apart from what it pays per host.
The hosts' own CPU (sshd, the agent) is not in these numbers: the comparison is what one controller spends.
Every client verifies host keys against the fleet's known_hosts and loads the identity once (fabric and
paramiko are handed the key; mla-doctor reads the fleet's ssh_config and loads it once per process).

    sudo .venv/bin/python bench/per_host.py [--hosts 12] [--rounds 5]      (needs root: the fleet)
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


CHILD_MLA = r"""
import json, resource, sys
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
out = {"start": cpu()}
sys.path.insert(0, sys.argv[1])
from mla_doctor.host.audit import AuditOptions
from mla_doctor.host.library import audit_host
from mla_doctor.diagnosis.knowledge import load_knowledge
from mla_doctor.ssh.transport import ConnectOptions
out["imports"] = cpu()
kb = load_knowledge()
conn, opts = ConnectOptions(ssh_config=sys.argv[2]), AuditOptions(python="/opt/ml-env/bin/python")
names = sys.argv[3:]
assert audit_host(names[0], conn, opts, kb).status.value == "ok"
out["first"] = cpu()
for n in names[1:]:
    assert audit_host(n, conn, opts, kb).status.value == "ok"
out["later"] = cpu()
print(json.dumps(out))
"""

CHILD_FABRIC = r"""
import json, resource, sys
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
out = {"start": cpu()}
from fabric import Connection
from paramiko import RejectPolicy
out["imports"] = cpu()
hosts = json.loads(sys.argv[1])
def one(h):
    c = Connection(h["host"], port=int(h.get("port") or 22), user=h.get("user"),
                   connect_kwargs={"key_filename": sys.argv[2], "look_for_keys": False, "allow_agent": False})
    c.client.load_host_keys(sys.argv[3])
    c.client.set_missing_host_key_policy(RejectPolicy())
    c.run("true", hide=True, in_stream=False, warn=True)
    c.close()
one(hosts[0])
out["first"] = cpu()
for h in hosts[1:]:
    one(h)
out["later"] = cpu()
print(json.dumps(out))
"""


def fresh_processes(fleet, rounds: int) -> dict[str, dict[str, list[float]]]:
    """Each tool in a new process over the first 5 hosts: ms of CPU at each checkpoint (see the docstring)."""
    import json
    import subprocess

    names = fleet.names[:5]
    hosts = [h for h in fleet.hosts if h["name"] in names]
    argv = {"mla-doctor": [sys.executable, "-c", CHILD_MLA, str(ROOT), str(fleet.ssh_config)] + names,
            "fabric": [sys.executable, "-c", CHILD_FABRIC, json.dumps(hosts), str(fleet.key),
                       str(fleet.known_hosts)]}
    got: dict[str, dict[str, list[float]]] = {k: {} for k in argv}
    for _ in range(rounds):
        for tool, cmd in argv.items():
            d = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
            for step, ms in (("start", d["start"]), ("imports", d["imports"] - d["start"]),
                             ("first host", d["first"] - d["imports"]),
                             ("each later host", (d["later"] - d["first"]) / (len(names) - 1))):
                got[tool].setdefault(step, []).append(ms * 1000)
    return got


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hosts", type=int, default=12, help="fleet size; the first host only warms up")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()

    import fabric
    import paramiko

    from mla_doctor.diagnosis.knowledge import load_knowledge
    from mla_doctor.host.audit import AuditOptions
    from mla_doctor.host.library import audit_host
    from mla_doctor.ssh.transport import ConnectOptions
    from tests.support import corpus
    from tests.support import fleet as fs

    tree = corpus.ensure("vllm", "0.33.0")
    with tempfile.TemporaryDirectory(prefix="mla-per-host-") as tmp:
        fleet = fs.start_fleet(args.hosts, Path(tmp) / "fleet", mode="netns")
        try:
            for n in fleet.names:
                fs.make_venv(fleet, n)
                fs.install_tree(fleet, n, tree)
            hosts = {e["name"]: e for e in fleet.hosts}
            pkey = paramiko.Ed25519Key.from_private_key_file(str(fleet.key))
            kb = load_knowledge()
            conn = ConnectOptions(ssh_config=str(fleet.ssh_config))
            opts = AuditOptions(python="/opt/ml-env/bin/python")
            big = os.urandom(95_000)

            def bare(name, cmd="true", stdin=None):
                h = hosts[name]
                c = paramiko.SSHClient()
                c.load_host_keys(str(fleet.known_hosts))
                c.set_missing_host_key_policy(paramiko.RejectPolicy())
                c.connect(h["host"], port=int(h.get("port") or 22), username=h.get("user"), pkey=pkey,
                          allow_agent=False, look_for_keys=False)
                i, o, e = c.exec_command(cmd)
                if stdin:
                    i.write(stdin)
                    i.channel.shutdown_write()
                o.read()
                e.read()
                c.close()

            def fab(name):
                h = hosts[name]
                c = fabric.Connection(h["host"], port=int(h.get("port") or 22), user=h.get("user"),
                                      connect_kwargs={"pkey": pkey, "allow_agent": False, "look_for_keys": False})
                c.client.load_host_keys(str(fleet.known_hosts))
                c.client.set_missing_host_key_policy(paramiko.RejectPolicy())
                c.run("true", hide=True, in_stream=False, warn=True)
                c.close()

            def audit(name):
                r = audit_host(name, conn, opts, kb)
                assert r.status.value == "ok", (name, r.error)

            others = fleet.names[1:]

            def each(fn):
                return lambda: [fn(n) for n in others]

            def at_once(fn):
                def go():
                    with ThreadPoolExecutor(len(others)) as ex:
                        list(ex.map(fn, others))
                return go

            kinds = {"fabric_true": each(fab), "paramiko_true": each(bare),
                     "paramiko_95k": each(lambda n: bare(n, "cat >/dev/null; head -c 100000 /dev/zero", big)),
                     "audit_host": each(audit), "par_fabric_true": at_once(fab), "par_audit_host": at_once(audit)}
            for fn in (fab, bare, audit):
                fn(fleet.names[0])  # warm: imports, the knowledge, the caches, the key
            got: dict[str, list[float]] = {k: [] for k in kinds}
            names = list(kinds)
            for r in range(args.rounds):
                for k in names[r % len(names):] + names[:r % len(names)]:
                    c0 = cpu()
                    kinds[k]()
                    got[k].append((cpu() - c0) / len(others) * 1000)
            fresh = fresh_processes(fleet, args.rounds)
        finally:
            fs.stop_fleet(fleet)
    print(f"controller CPU per host, {len(others)} hosts, {args.rounds} rounds, load {os.getloadavg()[0]:.2f}")
    print()
    print("| per host | median | min–max |")
    print("|---|---|---|")
    for k, v in got.items():
        print(f"| {k} | {statistics.median(v):.1f} ms | {min(v):.1f}–{max(v):.1f} |")
    seq = statistics.median(got["audit_host"]) / statistics.median(got["fabric_true"])
    par = statistics.median(got["par_audit_host"]) / statistics.median(got["par_fabric_true"])
    print()
    print(f"audit_host / fabric: {seq:.2f}x one host at a time, {par:.2f}x all at once "
          f"(goal <= 1: {'met' if max(seq, par) <= 1 else 'NOT met'})")
    print()
    print("a fresh process per tool, 5 hosts one at a time, ms of CPU (median):")
    print()
    print("| tool | " + " | ".join(fresh["fabric"]) + " |")
    print("|---|" + "---|" * len(fresh["fabric"]))
    for tool, steps in fresh.items():
        print(f"| {tool} | " + " | ".join(f"{statistics.median(v):.1f}" for v in steps.values()) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
