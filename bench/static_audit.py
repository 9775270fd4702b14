#!/usr/bin/env python3
"""Benchmark: wall time and SSH round trips of `mla-doctor static` on the test fleet.

Starts its own fleet (root), installs real vLLM 0.33.0 sources on every host, then measures
(a) one host, in-process (no interpreter start-up), N rounds, and (b) 10 hosts in parallel.
Round trips are counted from the hosts' sshd logs (logins) and the transport (executions).
Prints a Markdown table; the README quotes it.

    .venv/bin/python bench/static_audit.py [--rounds 9] [--hosts 10]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mla_doctor.host.audit import AuditOptions  # noqa: E402
from mla_doctor.host.library import audit_host  # noqa: E402
from mla_doctor.diagnosis.knowledge import load_knowledge  # noqa: E402
from mla_doctor.ssh.transport import ConnectOptions  # noqa: E402
from tests.support import corpus  # noqa: E402
from tests.support import fleet as fs  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--hosts", type=int, default=10)
    args = ap.parse_args()
    kb = load_knowledge()
    tree = corpus.ensure("vllm", "0.33.0")
    with tempfile.TemporaryDirectory() as tmp:
        fleet = fs.start_fleet(args.hosts, Path(tmp) / "f")
        try:
            names = fleet.names
            for n in names:
                fs.make_venv(fleet, n)
                fs.install_tree(fleet, n, tree)
            conn = ConnectOptions(ssh_config=str(fleet.ssh_config))
            opts = AuditOptions(python="/opt/ml-env/bin/python")
            audit_host(names[0], conn, opts, kb)  # warm the controller's imports and the host's page cache
            one, agent, connect = [], [], []
            before = fleet.count_accepted(names[0])
            for _ in range(args.rounds):
                t0 = time.perf_counter()
                r = audit_host(names[0], conn, opts, kb)
                one.append(time.perf_counter() - t0)
                agent.append(r.timings["agent_s"])
                connect.append(r.timings["connect_s"])
                assert r.status.value == "ok" and r.transport["executions"] == 1, r.error
            logins_one = (fleet.count_accepted(names[0]) - before) / args.rounds
            par = []
            execs = []
            before = {n: fleet.count_accepted(n) for n in names}
            for _ in range(args.rounds):
                t0 = time.perf_counter()
                with ThreadPoolExecutor(len(names)) as ex:
                    reports = list(ex.map(lambda n: audit_host(n, conn, opts, kb), names))
                par.append(time.perf_counter() - t0)
                assert all(r.status.value == "ok" for r in reports), [r.error for r in reports]
                execs.append(max(r.transport["executions"] for r in reports))
            logins = max((fleet.count_accepted(n) - before[n]) / args.rounds for n in names)
        finally:
            fs.stop_fleet(fleet)
    med = statistics.median
    print("| scenario (vLLM 0.33.0, 3231 files) | wall median (min–max) | agent on host | connect | "
          "logins/host | executions/host |")
    print("|---|---|---|---|---|---|")
    print(f"| 1 host, in-process | {med(one):.3f} s ({min(one):.3f}–{max(one):.3f}) | {med(agent):.3f} s | "
          f"{med(connect):.3f} s | {logins_one:.0f} | 1 |")
    print(f"| {len(names)} hosts in parallel | {med(par):.3f} s ({min(par):.3f}–{max(par):.3f}) | – | – | "
          f"{logins:.0f} | {max(execs)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
