#!/usr/bin/env python3
"""Where a fleet-wide static audit spends its time: the remote agent and the controller, under cProfile.

Starts its own fleet (root), installs real vLLM 0.33.0 sources on every host, then:
1. audits one host alone (no contention): wall, connect, agent time and machine CPU per audit;
2. runs the agent on the first host under cProfile (the exact static plan, shipped as `run_agent` does);
3. audits all hosts at once with a cProfile per worker thread, merged (wall-clock cumulative times
   summed over threads, so waits dominate; tottime of CPU-bound calls is what the controller burns);
4. audits all hosts again unprofiled: controller CPU (getrusage) versus all CPU on the machine.
Profiles are written to --out-dir; the summary is printed. fleet_compare.py measures the peers.

    .venv/bin/python bench/profile_static_fleet.py [--hosts 50] [--out-dir /tmp/mla-prof]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mla_doctor.remote.runner import PLAN_SEPARATOR, agent_source  # noqa: E402
from mla_doctor.host.audit import AuditOptions, audit_host, static_plan  # noqa: E402
from mla_doctor.diagnosis.knowledge import load_knowledge  # noqa: E402
from mla_doctor.ssh.transport import ConnectOptions  # noqa: E402
from tests.support import corpus  # noqa: E402
from tests.support import fleet as fs  # noqa: E402

# The agent's bootstrap (agent_runner.BOOTSTRAP) with main() under cProfile; the report goes to stderr.
WRAP = r'''
import sys, cProfile, pstats, io, time
d = sys.stdin.buffer.read()
s, _, p = d.partition(%r)
g = {"__name__": "mla_doctor_agent"}
t0 = time.perf_counter()
exec(compile(s, "mla_doctor_agent.py", "exec"), g)
t1 = time.perf_counter()
pr = cProfile.Profile(); pr.enable()
rc = g["main"](p)
pr.disable()
t2 = time.perf_counter()
st = io.StringIO()
ps = pstats.Stats(pr, stream=st)
st.write("compile+exec module %%.3f s, main %%.3f s\n" %% (t1 - t0, t2 - t1))
ps.sort_stats("tottime").print_stats(25)
ps.sort_stats("cumulative").print_stats(40)
sys.stderr.write(st.getvalue())
sys.exit(rc)
''' % PLAN_SEPARATOR


def machine_cpu_s() -> float:
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (sum(v[:3]) + sum(v[5:8])) / os.sysconf("SC_CLK_TCK")


def self_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hosts", type=int, default=50)
    ap.add_argument("--out-dir", default="/tmp/mla-prof")
    args = ap.parse_args()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    med = statistics.median
    kb = load_knowledge()
    tree = corpus.ensure("vllm", "0.33.0")
    with tempfile.TemporaryDirectory(prefix="mla-prof-") as tmp:
        fleet = fs.start_fleet(args.hosts, Path(tmp) / "fleet")
        try:
            with ThreadPoolExecutor(4) as ex:
                list(ex.map(lambda n: (fs.make_venv(fleet, n), fs.install_tree(fleet, n, tree)), fleet.names))
            names = fleet.names
            conn = ConnectOptions(ssh_config=str(fleet.ssh_config))
            opts = AuditOptions(python="/opt/ml-env/bin/python")
            audit_host(names[0], conn, opts, kb)  # warm the page cache and the controller's imports

            rows = []
            for _ in range(5):
                c0, t0 = machine_cpu_s(), time.perf_counter()
                r = audit_host(names[0], conn, opts, kb)
                rows.append((time.perf_counter() - t0, r.timings["connect_s"], r.timings["agent_s"],
                             machine_cpu_s() - c0))
            print(f"one host alone, median of 5: wall {med(x[0] for x in rows):.3f} s, connect "
                  f"{med(x[1] for x in rows):.3f} s, agent {med(x[2] for x in rows):.3f} s, machine CPU "
                  f"{med(x[3] for x in rows):.3f} s; sent/received {r.transport['bytes_sent']}/"
                  f"{r.transport['bytes_received']} bytes")

            payload = agent_source() + PLAN_SEPARATOR + json.dumps(static_plan(kb, opts)).encode()
            t0 = time.perf_counter()
            p = subprocess.run(fleet.ssh_argv(names[0], "/opt/ml-env/bin/python -B -c " + shlex.quote(WRAP)),
                               input=payload, capture_output=True, timeout=120)
            (out / "agent_profile.txt").write_text(p.stderr.decode(errors="replace"))
            sizes = {k: len(json.dumps(v)) for k, v in json.loads(p.stdout).items()} if p.returncode == 0 else {}
            print(f"agent under cProfile on {names[0]}: {time.perf_counter() - t0:.2f} s, rc {p.returncode}; "
                  f"answer bytes by key {sizes}; profile: {out / 'agent_profile.txt'}")

            profs: list[cProfile.Profile] = []

            def profiled(n):
                pr = cProfile.Profile()
                pr.enable()
                try:
                    return audit_host(n, conn, opts, kb)
                finally:
                    pr.disable()
                    profs.append(pr)

            for label, fn in (("profiled controller", profiled),
                              ("unprofiled", lambda n: audit_host(n, conn, opts, kb))):
                s0, c0, t0 = self_cpu_s(), machine_cpu_s(), time.perf_counter()
                with ThreadPoolExecutor(len(names)) as ex:
                    reps = list(ex.map(fn, names))
                wall, mc, ctl = time.perf_counter() - t0, machine_cpu_s() - c0, self_cpu_s() - s0
                assert all(x.status.value == "ok" for x in reps), [x.error for x in reps]
                print(f"{len(names)} hosts at once, {label}: wall {wall:.2f} s, controller CPU {ctl:.2f} s, "
                      f"machine CPU {mc:.1f} s (hosts ≈ {mc - ctl:.1f} s); per host agent "
                      f"{med(x.timings['agent_s'] for x in reps):.2f} s median, connect "
                      f"{med(x.timings['connect_s'] for x in reps):.2f} s median")
            st = io.StringIO()
            ps = pstats.Stats(profs[0], stream=st)
            for pr in profs[1:]:
                ps.add(pr)
            ps.sort_stats("tottime").print_stats(30)
            ps.sort_stats("cumulative").print_stats(50)
            (out / "controller_profile.txt").write_text(st.getvalue())
            print(f"controller profile: {out / 'controller_profile.txt'}")
        finally:
            fs.stop_fleet(fleet)
    return 0


if __name__ == "__main__":
    sys.exit(main())
