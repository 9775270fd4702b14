#!/usr/bin/env python3
"""Benchmark: a fleet audit with mla-doctor versus Ansible, pyinfra and bare fabric greps (issue "Fleet audits").

One fleet of N real sshd hosts (netns mode, default 50), every host holding a venv with the real vLLM
0.33.0 sources. In every round each tool runs once as a fresh process (start-up counts for all), in a
rotated order:

* mla-doctor, library: ``audit_host`` over all hosts in a ThreadPoolExecutor (the FULL static audit:
  version, MLA code paths, integrity of every vLLM file against RECORD, server, model, log). Primary number.
* mla-doctor, CLI: ``mla-doctor audit -i INVENTORY --forks N`` (when the fleet command is there).
* fabric ``ThreadingGroup`` running only QUESTION (RejectPolicy on the fleet's known_hosts, in_stream=False).
* pyinfra CLI ``exec`` of QUESTION (fleet known_hosts, strict host-key checking).
* Ansible ad-hoc ``-m shell`` of QUESTION (pipelining, forks N, host_key_checking on, no ControlPersist).

Nothing is cached across runs: no ControlPersist masters, no fact caches, a new process each time.
Measured per run: wall time (process start to exit), client CPU and the largest process's peak RSS
(``/usr/bin/time``), logins per host (sshd logs, before/after). One extra, untimed round samples the
whole process tree's RSS and PSS (Ansible forks workers and ssh clients). Every run is checked: every
host must answer, the peers with exactly the grep lines and version a local grep of that host's tree
gives, mla-doctor with status ok, version 0.33.0, the MLA entries confirmed and no modified files.

ansible-core and pyinfra get their own venvs under ``$MLA_DOCTOR_CACHE/bench-tools`` (default
``~/.cache/mla-doctor/bench-tools``), never the project's. Needs root (the fleet), ``/usr/bin/time``.

    .venv/bin/python bench/fleet_compare.py [--hosts 50] [--rounds 5] [--out bench/RESULTS.md]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VENV_PY = "/opt/ml-env/bin/python"
VERSION = "0.33.0"
ANSIBLE_CORE = "2.19.14"
PYINFRA = "3.10.0"

# "The same question" for the peers, as a person would type it: the MLA entry points and the sparse
# (DSA) gate in the two files that hold them, plus the installed version from the dist-info.
QUESTION = ("cd /opt/ml-env/lib/python3*/site-packages && "
            "grep -nE 'def forward_mha|def forward_mqa|is_v32|index_topk|use_sparse' "
            "vllm/model_executor/layers/attention/mla_attention.py vllm/model_executor/models/deepseek_v2.py; "
            "grep -m1 -H '^Version:' vllm-*.dist-info/METADATA")

LIB, CLI, FABRIC, PYINFRA_T, ANSIBLE = "mla-lib", "mla-cli", "fabric", "pyinfra", "ansible"
LABELS = {
    LIB: "mla-doctor, library (`audit_host` × {n}, full static audit)",
    CLI: "mla-doctor, CLI (`mla-doctor audit --forks {n}`, full static audit)",
    FABRIC: "fabric `ThreadingGroup.run` (greps only)",
    PYINFRA_T: "pyinfra CLI `exec` (greps only)",
    ANSIBLE: "Ansible ad-hoc `-m shell`, pipelining (greps only)",
}


# ------------------------------------------------------------------------------ child processes
# Run as `python bench/fleet_compare.py --child KIND SPEC.json`; only the stdlib is imported above,
# so each child pays for its own imports exactly like the CLIs do.

def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def child_mla_lib(spec: dict) -> dict:
    import resource

    t_imp = time.perf_counter()
    from mla_doctor.host.audit import AuditOptions
    from mla_doctor.host.library import audit_host
    from mla_doctor.diagnosis.knowledge import load_knowledge
    from mla_doctor.results import plain
    from mla_doctor.ssh.transport import ConnectOptions

    t0 = time.perf_counter()
    base = _rss_kib()
    kb = load_knowledge()
    conn = ConnectOptions(ssh_config=spec["ssh_config"])
    opts = AuditOptions(python=VENV_PY)
    with ThreadPoolExecutor(spec["forks"]) as ex:
        reports = list(ex.map(lambda n: audit_host(n, conn, opts, kb), spec["names"]))
    elapsed = time.perf_counter() - t0
    hosts = {}
    for r in reports:
        st = plain(r.static) if r.static else {}
        hosts[r.host] = {"status": r.status.value, "error": r.error, "version": (r.vllm or {}).get("version"),
                         "static": {k: st.get(k) for k in ("prefill_entry", "decode_entry", "dispatch",
                                                           "sparse_gate", "modified_files", "missing_files",
                                                           "py_files")},
                         "connections": r.transport.get("connections"), "executions": r.transport.get("executions"),
                         "timings": r.timings}
    return {"in_process_s": elapsed, "import_s": t0 - t_imp, "base_rss_kib": base,
            "peak_rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "hosts": hosts}


def child_fabric(spec: dict) -> dict:
    import resource

    t_imp = time.perf_counter()
    from fabric import ThreadingGroup
    from fabric.exceptions import GroupException
    from paramiko import RejectPolicy

    t0 = time.perf_counter()
    base = _rss_kib()
    hosts = spec["hosts"]
    group = ThreadingGroup(*[h["host"] for h in hosts], user="root", connect_timeout=10,
                           connect_kwargs={"key_filename": spec["key"], "look_for_keys": False,
                                           "allow_agent": False})
    for c in group:
        c.client.load_host_keys(spec["known_hosts"])
        c.client.set_missing_host_key_policy(RejectPolicy())
    try:
        results = group.run(QUESTION, hide=True, in_stream=False, warn=True)
    except GroupException as e:
        results = e.result
    elapsed = time.perf_counter() - t0
    by_addr = {h["host"]: h["name"] for h in hosts}
    out = {}
    for c, r in results.items():
        name = by_addr[c.host]
        out[name] = ({"rc": r.exited, "stdout": r.stdout} if hasattr(r, "exited") else {"error": repr(r)})
    group.close()
    return {"in_process_s": elapsed, "import_s": t0 - t_imp, "base_rss_kib": base,
            "peak_rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "hosts": out}


def run_child(kind: str, spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    sys.path.insert(0, str(REPO))
    out = child_mla_lib(spec) if kind == LIB else child_fabric(spec)
    sys.stdout.write(json.dumps(out))
    return 0


# ------------------------------------------------------------------------------------ set-up

def sh(argv, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL, **kw)


def tools_dir() -> Path:
    root = Path(os.environ.get("MLA_DOCTOR_CACHE", Path.home() / ".cache" / "mla-doctor"))
    return root / "bench-tools"


def ensure_venv(name: str, requirement: str, probe: str) -> Path:
    """A venv of its own for a peer tool, outside the repository; installed once with pip."""
    venv = tools_dir() / name
    exe = venv / "bin" / probe
    if exe.exists():
        return venv
    venv.parent.mkdir(parents=True, exist_ok=True)
    print(f"installing {requirement} into {venv} ...", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", requirement], check=True)
    return venv


def ensure_time() -> str:
    if not Path("/usr/bin/time").exists():
        subprocess.run(["apt-get", "install", "-y", "time"], check=True, capture_output=True)
    return "/usr/bin/time"


def versions(ansible_venv: Path, pyinfra_venv: Path) -> dict:
    from importlib.metadata import version

    import mla_doctor

    rev = sh(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"]).stdout.strip()
    dirty = sh(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"]).stdout.strip()
    pyinfra_pkgs = sh([str(pyinfra_venv / "bin" / "python"), "-c",
                       "from importlib.metadata import version as v; "
                       "print(v('pyinfra'), v('paramiko'), v('gevent'))"]).stdout.split()
    ansible_v = sh([str(ansible_venv / "bin" / "python"), "-c",
                    "from importlib.metadata import version as v; print(v('ansible-core'))"]).stdout.strip()
    ssh_v = sh(["ssh", "-V"]).stderr.strip()
    return {"mla-doctor": f"{mla_doctor.__version__} (git {rev}{' + uncommitted changes' if dirty else ''}, "
                          f"working tree incl. untracked fleet files)",
            "fabric": f"{version('fabric')} (paramiko {version('paramiko')}, invoke {version('invoke')}), "
                      f"the project venv's",
            "mla-doctor's paramiko": version("paramiko"),
            "pyinfra": f"{pyinfra_pkgs[0]} (paramiko {pyinfra_pkgs[1]}, gevent {pyinfra_pkgs[2]})"
            if len(pyinfra_pkgs) == 3 else "?",
            "ansible-core": ansible_v,
            "OpenSSH": ssh_v,
            "controller Python": platform.python_version(),
            "host Python": sh(["/usr/bin/python3", "-V"]).stdout.strip()}


def machine() -> str:
    model = "?"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
            break
    mem = int(Path("/proc/meminfo").read_text().split()[1]) // 1024
    return (f"{os.cpu_count()} cores ({model}), {mem / 1024:.0f} GiB RAM, {platform.system()} "
            f"{platform.release()}, {sh(['sh', '-c', '. /etc/os-release; echo $PRETTY_NAME']).stdout.strip()}")


def seed(fleet, tree: Path) -> None:
    from tests.support import fleet as fs

    def one(name):
        fs.make_venv(fleet, name)
        fs.install_tree(fleet, name, tree)

    with ThreadPoolExecutor(4) as ex:
        list(ex.map(one, fleet.names))


def expected_answers(fleet) -> dict[str, list[str]]:
    """What QUESTION prints on each host, computed on the controller from that host's own tree."""
    out = {}
    for name in fleet.names:
        local = QUESTION.replace("/opt/ml-env", shlex.quote(str(fleet.fs(name, "/opt/ml-env"))))
        r = sh(["sh", "-c", local])
        out[name] = sorted(line for line in r.stdout.splitlines() if line.strip())
    return out


# ----------------------------------------------------------------------------------- the tools

class Tool:
    def __init__(self, key: str, argv: list[str], env: dict | None, check, cwd: Path | None = None):
        self.key, self.argv, self.env, self.check, self.cwd = key, argv, env, check, cwd


def build_tools(fleet, work: Path, ansible_venv: Path, pyinfra_venv: Path, forks: int,
                expected: dict[str, list[str]], with_cli: bool) -> list[Tool]:
    names = fleet.names
    me = [sys.executable, str(Path(__file__).resolve())]
    spec = {"names": names, "hosts": fleet.hosts, "ssh_config": str(fleet.ssh_config), "key": str(fleet.key),
            "known_hosts": str(fleet.known_hosts), "forks": forks}
    (work / "spec.json").write_text(json.dumps(spec))

    def check_lines(per_host: dict[str, list[str]]) -> dict[str, str]:
        bad = {}
        for n in names:
            got = sorted(line for line in per_host.get(n, []) if line.strip())
            if n not in per_host:
                bad[n] = "no answer"
            elif got != expected[n]:
                bad[n] = f"{len(got)} lines, expected {len(expected[n])}"
        return bad

    def check_lib(stdout, stderr, rc):
        doc = json.loads(stdout)
        bad = {}
        for n in names:
            h = doc["hosts"].get(n)
            why = mla_problem(h)
            if why:
                bad[n] = why
        return bad, doc

    def check_cli(stdout, stderr, rc):
        doc = json.loads((work / "mla-cli.json").read_text())
        hosts = {h["host"]: h for h in doc["hosts"]}
        bad = {n: mla_problem(hosts.get(n)) for n in names}
        return {n: w for n, w in bad.items() if w}, {"exit_status": doc.get("exit_status"), "rc": rc}

    def check_fabric(stdout, stderr, rc):
        doc = json.loads(stdout)
        per = {n: h["stdout"].splitlines() for n, h in doc["hosts"].items() if "stdout" in h}
        return check_lines(per), doc

    def check_pyinfra(stdout, stderr, rc):
        per: dict[str, list[str]] = {}
        for line in (stdout + stderr).splitlines():
            m = re.match(r"^\s*\[(h\d+)\] (.*)$", line)
            if m and (m.group(2).startswith("vllm")):
                per.setdefault(m.group(1), []).append(m.group(2).rstrip())
        return check_lines(per), None

    def check_ansible(stdout, stderr, rc):
        per: dict[str, list[str]] = {}
        cur = None
        for line in stdout.splitlines():
            m = re.match(r"^(h\d+) \| (\S+) \| rc=(\d+) >>$", line)
            if m:
                cur = m.group(1) if m.group(2) == "CHANGED" and m.group(3) == "0" else None
                if cur:
                    per[cur] = []
            elif re.match(r"^(h\d+) \| ", line):
                cur = None
            elif cur:
                per[cur].append(line)
        return check_lines(per), None

    tools = [Tool(LIB, [*me, "--child", LIB, str(work / "spec.json")], None, check_lib, REPO)]
    if with_cli:
        inv = {"vars": {"python": VENV_PY}, "hosts": {n: None for n in names}}
        (work / "inventory.json").write_text(json.dumps(inv))   # JSON is YAML
        (work / "inventory.yaml").write_text(json.dumps(inv, indent=1))
        # `python -m mla_doctor` from the checkout, as the test suite runs it (the venv's editable
        # `mla-doctor` entry point does not import outside the checkout here)
        argv = [sys.executable, "-m", "mla_doctor", "audit", "-i", str(work / "inventory.yaml"), "--forks", str(forks),
                "--format", "json", "-o", str(work / "mla-cli.json"), "--progress", "none",
                "--ssh-config", str(fleet.ssh_config)]
        tools.append(Tool(CLI, argv, None, check_cli, REPO))
    tools.append(Tool(FABRIC, [*me, "--child", FABRIC, str(work / "spec.json")], None, check_fabric, REPO))

    # pyinfra: an inventory file, the CLI's exec
    common = {"ssh_user": "root", "ssh_key": str(fleet.key), "ssh_known_hosts_file": str(fleet.known_hosts),
              "ssh_strict_host_key_checking": "yes"}
    entries = [(h["name"], {"ssh_hostname": h["host"], "ssh_port": h["port"], **common}) for h in fleet.hosts]
    (work / "pyinfra_inventory.py").write_text(f"hosts = {entries!r}\n")
    argv = [str(pyinfra_venv / "bin" / "pyinfra"), "-y", "--parallel", str(forks),
            str(work / "pyinfra_inventory.py"), "exec", "--", QUESTION]
    tools.append(Tool(PYINFRA_T, argv, {"PYINFRA_PROGRESS": "off"}, check_pyinfra, work))

    # Ansible: INI inventory + ansible.cfg; ssh reads the fleet's ssh_config (strict, fleet known_hosts)
    lines = ["[fleet]"] + [f"{h['name']} ansible_host={h['host']} ansible_port={h['port']}" for h in fleet.hosts]
    lines += ["", "[fleet:vars]", "ansible_user=root", f"ansible_ssh_private_key_file={fleet.key}",
              "ansible_python_interpreter=/usr/bin/python3"]
    (work / "ansible_inventory.ini").write_text("\n".join(lines) + "\n")
    (work / "ansible.cfg").write_text(f"""[defaults]
inventory = {work / 'ansible_inventory.ini'}
host_key_checking = True
forks = {forks}
timeout = 10
retry_files_enabled = False
[ssh_connection]
pipelining = True
# no ControlPersist (it would keep connections across runs), no -C; strictness from the fleet's ssh_config
ssh_args = -F {fleet.ssh_config} -o ControlMaster=no
""")
    env = {"ANSIBLE_CONFIG": str(work / "ansible.cfg"), "ANSIBLE_HOME": str(work / "ansible-home"),
           "ANSIBLE_NOCOLOR": "1", "ANSIBLE_LOCAL_TEMP": str(work / "ansible-tmp")}
    argv = [str(ansible_venv / "bin" / "ansible"), "fleet", "-m", "shell", "-a", QUESTION]
    tools.append(Tool(ANSIBLE, argv, env, check_ansible, work))
    return tools


def mla_problem(h: dict | None) -> str | None:
    if not h:
        return "no report"
    if h.get("status") != "ok":
        return f"status {h.get('status')}: {h.get('error')}"
    version = h.get("version") or (h.get("vllm") or {}).get("version")
    if version != VERSION:
        return f"version {version}"
    st = h.get("static") or {}
    for k in ("prefill_entry", "decode_entry"):
        e = st.get(k)
        if not e or not (e.get("line") or e.get("confirmed")):
            return f"{k} not confirmed: {e}"
    if st.get("modified_files") or st.get("missing_files"):
        return f"modified {st.get('modified_files')} missing {st.get('missing_files')}"
    return None


# ------------------------------------------------------------------------------------ measuring

def logins(fleet) -> dict[str, int]:
    return {n: fleet.count_accepted(n) for n in fleet.names}


def _machine_cpu_s() -> float:
    """CPU seconds used by everything on the machine so far (controller + every host), from /proc/stat."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    busy = sum(v[:3]) + sum(v[5:8])   # user nice system + irq softirq steal (idle and iowait excluded)
    return busy / os.sysconf("SC_CLK_TCK")


def timed_run(tool: Tool, fleet, work: Path, timeout: float) -> dict:
    tfile = work / f"time-{tool.key}.txt"
    env = dict(os.environ, **(tool.env or {}))
    before = logins(fleet)
    c0 = _machine_cpu_s()
    t0 = time.perf_counter()
    p = subprocess.run(["/usr/bin/time", "-f", "%M %U %S", "-o", str(tfile), *tool.argv], capture_output=True,
                       text=True, stdin=subprocess.DEVNULL, env=env, cwd=tool.cwd, timeout=timeout)
    wall = time.perf_counter() - t0
    machine_cpu = _machine_cpu_s() - c0
    after = logins(fleet)
    maxrss, user, system = tfile.read_text().split()[-3:]
    run = {"wall": wall, "rc": p.returncode, "machine_cpu_s": machine_cpu, "maxrss_kib": int(maxrss),
           "cpu_s": float(user) + float(system),
           "logins": [after[n] - before[n] for n in fleet.names]}
    try:
        bad, doc = tool.check(p.stdout, p.stderr, p.returncode)
    except Exception as e:  # an unparseable answer is a failed run, reported as such
        bad, doc = {"*": f"{type(e).__name__}: {e}; rc {p.returncode}; stderr {p.stderr[-500:]}"}, None
    run["bad"] = bad
    if isinstance(doc, dict) and "in_process_s" in doc:
        tm = [h.get("timings") or {} for h in doc["hosts"].values()]
        for k in ("connect_s", "agent_s", "total_s"):
            xs = [t[k] for t in tm if k in t]
            if xs:
                run[f"host_{k}"] = (statistics.median(xs), max(xs))
        run.update(in_process_s=doc["in_process_s"], import_s=doc["import_s"], base_rss_kib=doc["base_rss_kib"],
                   peak_rss_kib=doc["peak_rss_kib"])
    if bad:
        run["stderr_tail"] = p.stderr[-2000:]
    return run


def _tree(root: int) -> list[int]:
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(kids.get(pid, []))
    return out


def _mem(pid: int) -> tuple[int, int]:
    rss = pss = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Rss:"):
                    rss = int(line.split()[1])
                elif line.startswith("Pss:"):
                    pss = int(line.split()[1])
    except OSError:
        pass
    return rss, pss


def memory_run(tool: Tool, fleet, timeout: float, interval: float = 0.05) -> dict:
    """Untimed: sample the tool's whole process tree (RSS and PSS sums, process count)."""
    env = dict(os.environ, **(tool.env or {}))
    p = subprocess.Popen(tool.argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                         env=env, cwd=tool.cwd, text=True)
    peak = {"rss_kib": 0, "pss_kib": 0, "procs": 0}
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            pids = _tree(p.pid)
            mem = [_mem(x) for x in pids]
            peak["rss_kib"] = max(peak["rss_kib"], sum(m[0] for m in mem))
            peak["pss_kib"] = max(peak["pss_kib"], sum(m[1] for m in mem))
            peak["procs"] = max(peak["procs"], len(pids))
            stop.wait(interval)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    out, err = p.communicate(timeout=timeout)
    stop.set()
    th.join()
    bad, _ = tool.check(out, err, p.returncode)
    return {**peak, "ok": not bad}


# ------------------------------------------------------------------------------------- report

def fmt_range(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} s ({min(xs):.2f}–{max(xs):.2f})"


def render(results: dict, tools: list[Tool], mem: dict, meta: dict) -> str:
    n = meta["hosts"]
    med = statistics.median
    ref = med(r["wall"] for r in results[LIB])
    lines = [f"| tool ({n} hosts, {meta['rounds']} rounds) | wall, median (min–max) | ratio to mla-doctor library "
             f"| client CPU, median | machine CPU, median | logins/host | peak RSS, largest process "
             f"| tree peak RSS / PSS | MiB/host (tree RSS / PSS) | correct runs |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for t in tools:
        rs = results[t.key]
        walls = [r["wall"] for r in rs]
        lg = [x for r in rs for x in r["logins"]]
        lg_txt = f"{med(lg):g}" if min(lg) == max(lg) else f"{med(lg):g} ({min(lg)}–{max(lg)})"
        m = mem.get(t.key) or {}
        rss = max(r["maxrss_kib"] for r in rs) / 1024
        tree = (f"{m['rss_kib'] / 1024:.0f} / {m['pss_kib'] / 1024:.0f} MiB ({m['procs']} procs)"
                if m else "–")
        per = f"{m['rss_kib'] / 1024 / n:.2f} / {m['pss_kib'] / 1024 / n:.2f}" if m else "–"
        ok = sum(1 for r in rs if not r["bad"])
        lines.append(f"| {LABELS[t.key].format(n=n)} "
                     f"| {fmt_range(walls)} | {med(walls) / ref:.2f}× | {med(r['cpu_s'] for r in rs):.2f} s "
                     f"| {med(r['machine_cpu_s'] for r in rs):.1f} s "
                     f"| {lg_txt} | {rss:.0f} MiB | {tree} | {per} | {ok}/{len(rs)} |")
    return "\n".join(lines)


def in_process_table(results: dict, n: int) -> str:
    med = statistics.median
    rows = ["| in the process (after imports) | connect + job, median (min–max) | imports | RSS after imports "
            "| peak RSS | (peak − after imports) / host | per host: connect / agent / total, median (max) |",
            "|---|---|---|---|---|---|---|"]
    for key in (LIB, FABRIC):
        rs = [r for r in results.get(key, []) if "in_process_s" in r]
        if not rs:
            continue
        ip = [r["in_process_s"] for r in rs]
        base = med(r["base_rss_kib"] for r in rs) / 1024
        peak = max(r["peak_rss_kib"] for r in rs) / 1024
        per = " / ".join(f"{med(r[k][0] for r in rs):.2f} ({max(r[k][1] for r in rs):.2f}) s"
                         for k in ("host_connect_s", "host_agent_s", "host_total_s") if all(k in r for r in rs))
        rows.append(f"| {LABELS[key].format(n=n)} | {fmt_range(ip)} | {med(r['import_s'] for r in rs):.2f} s "
                    f"| {base:.0f} MiB | {peak:.0f} MiB | {(peak - base) / n:.2f} MiB | {per or '–'} |")
    return "\n".join(rows)


def goals(results: dict, mem: dict, n: int) -> list[str]:
    med = statistics.median
    lib = med(r["wall"] for r in results[LIB])
    out = []
    for key in (ANSIBLE, PYINFRA_T):
        other = med(r["wall"] for r in results[key])
        out.append(f"* faster than {key}: **{'met' if lib < other else 'NOT met'}** "
                   f"(mla-doctor {lib:.2f} s vs {other:.2f} s: {lib / other:.2f}× its time)")
    fab = med(r["wall"] for r in results[FABRIC])
    verdict = "met" if lib <= 1.3 * fab else "NOT met"
    out.append(f"* within 1.3× of the bare fabric greps (fresh process): **{verdict}** "
               f"({lib / fab:.2f}×: {lib:.2f} s vs {fab:.2f} s)")
    lib_ip = [r["in_process_s"] for r in results[LIB] if "in_process_s" in r]
    fab_ip = [r["in_process_s"] for r in results[FABRIC] if "in_process_s" in r]
    if lib_ip and fab_ip:
        out.append(f"  * in the process, after imports: {med(lib_ip) / med(fab_ip):.2f}× "
                   f"({med(lib_ip):.2f} s vs {med(fab_ip):.2f} s)")
    peak = max(r["maxrss_kib"] for r in results[LIB]) / 1024
    m = mem.get(LIB)
    tree = f"; sampled tree peak {m['rss_kib'] / 1024 / n:.2f} MiB/host" if m else ""
    out.append(f"* memory under 5 MiB per host in flight: **{'met' if peak / n < 5 else 'NOT met'}** "
               f"(peak RSS {peak:.0f} MiB / {n} hosts = {peak / n:.2f} MiB/host{tree})")
    return out


# ---------------------------------------------------------------------------------------- main

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hosts", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--forks", type=int, default=None, help="parallelism of every tool (default: --hosts)")
    ap.add_argument("--out", default=str(REPO / "bench" / "RESULTS.md"), help="Markdown results file ('' = none)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds for one tool run")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("spec", nargs="?", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return run_child(args.child, args.spec)
    sys.path.insert(0, str(REPO))
    from tests.support import corpus
    from tests.support import fleet as fs

    forks = args.forks or args.hosts
    ensure_time()
    ansible_venv = ensure_venv("ansible", f"ansible-core=={ANSIBLE_CORE}", "ansible")
    pyinfra_venv = ensure_venv("pyinfra", f"pyinfra=={PYINFRA}", "pyinfra")
    with_cli = sh(
        [sys.executable, "-m", "mla_doctor", "audit", "--help"], cwd=REPO).returncode == 0
    tree = corpus.ensure("vllm", VERSION)
    vers = versions(ansible_venv, pyinfra_venv)
    started = datetime.datetime.now().astimezone()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="mla-bench-") as tmp:
        work = Path(tmp) / "work"
        work.mkdir()
        t0 = time.monotonic()
        fleet = fs.start_fleet(args.hosts, Path(tmp) / "fleet", mode="netns")
        print(f"fleet of {args.hosts} up in {time.monotonic() - t0:.1f} s (incl. waiting for the lock)",
              file=sys.stderr)
        try:
            t0 = time.monotonic()
            seed(fleet, tree)
            expected = expected_answers(fleet)
            assert all(any(VERSION in line for line in v) and len(v) > 1 for v in expected.values()), expected
            print(f"seeded {args.hosts} hosts with vLLM {VERSION} in {time.monotonic() - t0:.1f} s; "
                  f"{len(expected[fleet.names[0]])} answer lines per host", file=sys.stderr)
            tools = build_tools(fleet, work, ansible_venv, pyinfra_venv, forks, expected, with_cli)
            for t in tools:   # warm-up (page cache, .pyc files); not counted
                r = timed_run(t, fleet, work, args.timeout)
                print(f"warm-up {t.key}: {r['wall']:.2f} s, bad={r['bad'] or 'none'}", file=sys.stderr)
                if r["bad"]:
                    print(r.get("stderr_tail", ""), file=sys.stderr)
            results: dict[str, list[dict]] = {t.key: [] for t in tools}
            for rnd in range(args.rounds):
                order = tools[rnd % len(tools):] + tools[:rnd % len(tools)]
                for t in order:
                    r = timed_run(t, fleet, work, args.timeout)
                    results[t.key].append(r)
                    extra = f" (in process {r['in_process_s']:.2f} s)" if "in_process_s" in r else ""
                    print(f"round {rnd + 1} {t.key}: {r['wall']:.2f} s{extra}, logins/host "
                          f"{statistics.median(r['logins'])}, maxrss {r['maxrss_kib'] / 1024:.0f} MiB, "
                          f"bad={len(r['bad'])}", file=sys.stderr)
                    if r["bad"]:
                        print(json.dumps(r["bad"])[:1500], r.get("stderr_tail", "")[-800:], file=sys.stderr)
            mem = {}
            for t in tools:
                mem[t.key] = memory_run(t, fleet, args.timeout)
                print(f"memory {t.key}: {mem[t.key]}", file=sys.stderr)
        finally:
            fs.stop_fleet(fleet)
    load_after = os.getloadavg()
    meta = {"hosts": args.hosts, "rounds": args.rounds}
    table = render(results, tools, mem, meta)
    ipt = in_process_table(results, args.hosts)
    gl = goals(results, mem, args.hosts)
    print(table)
    print()
    print(ipt)
    print()
    print("\n".join(gl))
    if args.out:
        write_results(Path(args.out), table, ipt, gl, vers, started, meta, forks, load_before, load_after, results)
        print(f"\nwritten to {args.out}", file=sys.stderr)
    failed = [k for k, rs in results.items() if any(r["bad"] for r in rs)]
    return 1 if failed else 0


NOTES_MARKER = "<!-- notes below are kept when fleet_compare.py rewrites this file -->"


def write_results(path: Path, table, ipt, gl, vers, started, meta, forks, load_before, load_after, results) -> None:
    n = meta["hosts"]
    old = path.read_text() if path.exists() else ""
    notes = old[old.index(NOTES_MARKER):] if NOTES_MARKER in old else NOTES_MARKER + "\n"
    raw = {k: [round(r["wall"], 3) for r in rs] for k, rs in results.items()}
    text = f"""# Fleet audit benchmark: mla-doctor versus Ansible, pyinfra and bare fabric

Written by `bench/fleet_compare.py` (`.venv/bin/python bench/fleet_compare.py --hosts {n} --rounds {meta['rounds']}`),
{started:%Y-%m-%d %H:%M %Z}. Issue "Fleet audits", benchmark section.

**Machine:** {machine()}. The controller and all {n} sshd hosts share these cores.
Load average before / after the run: {' '.join(f'{x:.2f}' for x in load_before)} / \
{' '.join(f'{x:.2f}' for x in load_after)}.

**Fleet:** {n} real OpenSSH hosts (`tests/fleet/up.sh`, netns mode: own network namespace and address
198.18.0.x:22 each), every host with a venv at `/opt/ml-env` holding the real vLLM {VERSION} sources
(`make_venv` + `install_tree`, about 3200 files, 57 MB per host).

**Versions:** {'; '.join(f'{k} {v}' for k, v in vers.items())}.

**The question the peers are asked** (identical for Ansible, pyinfra and fabric; as a person would type it):

```sh
{QUESTION}
```

mla-doctor does its **full static audit** instead: version and distribution, the MLA dispatch / prefill / decode
entries and sparse gate verified in the installed files, integrity of every vLLM file against the wheel's RECORD
(hashes all ~3200 files), the running server, model and log — one SSH connection and one remote execution per host.

**Method:** every tool runs as a fresh process per run (interpreter start-up and imports count for all), {forks}
hosts at once, {meta['rounds']} rounds in rotated order after one uncounted warm-up run of each tool. No caching
across runs: no ControlPersist (Ansible's `ssh_args = -F <fleet ssh_config> -o ControlMaster=no`), no fact cache,
nothing kept on the hosts. Host keys are verified everywhere: mla-doctor through the fleet's ssh_config
(`StrictHostKeyChecking yes`), fabric with `RejectPolicy` + the fleet's known_hosts (`in_stream=False`), pyinfra
with `ssh_known_hosts_file` + `ssh_strict_host_key_checking=yes`, Ansible with `host_key_checking = True` and the
fleet's ssh_config (`UserKnownHostsFile`, strict). Ansible: `-m shell`, `pipelining = True`, `forks = {forks}`,
interpreter given (no discovery). pyinfra: `pyinfra -y --parallel {forks} inventory.py exec -- QUESTION`.
fabric: `ThreadingGroup(...).run(QUESTION, hide=True, in_stream=False, warn=True)`. mla-doctor library:
`audit_host` per host in a `ThreadPoolExecutor({forks})`; CLI: `mla-doctor audit -i inventory.yaml --forks {forks}
--format json -o FILE --progress none`.

* **wall** = process start to exit (`/usr/bin/time` around it); **client CPU** = user + sys of the tool's process tree;
  **machine CPU** = all CPU on the machine during the run (/proc/stat): controller + every host's sshd and commands
  (mla-doctor's agent included).
* **logins/host** = `Accepted publickey` lines added to each host's sshd log by the run.
* **peak RSS, largest process** = `/usr/bin/time -f %M` (for Ansible: its largest single process, not the sum).
* **tree peak RSS / PSS** = one extra, untimed run per tool, summing RSS and PSS over the tool's whole process tree
  (Ansible's forked workers and ssh clients included) every 50 ms; RSS counts pages shared between forked
  workers once per process, PSS splits them. MiB/host divides by {n}.
* **correct**: every host answered; the peers' lines equal (as a set) what the same command prints against that host's
  tree run locally on the controller; mla-doctor: status ok, version {VERSION}, prefill/decode entries confirmed,
  no modified or missing files.

## Results

{table}

{ipt}

## Goals (reported figures, not test gates)

{chr(10).join(gl)}

Raw walls per run (s): `{json.dumps(raw)}`

"""
    path.write_text(text + notes)


if __name__ == "__main__":
    sys.exit(main())
