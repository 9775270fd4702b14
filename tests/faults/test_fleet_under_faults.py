"""One `mla-doctor audit` of a 50+ host fleet of real sshd hosts in network namespaces, while their links and the
controller misbehave, as a user runs it (the CLI, a subprocess):

* packet loss on some hosts' links, both ways (nftables `numgen random` drops in the host's namespace: TCP then
  retransmits and delivers out of order, with RTO stalls: loss, reordering and jitter as the receiver sees them);
* a narrow link on others (`tc qdisc ... tbf`: answers queue, a delay that grows with their size);
* an sshd that accepts and never speaks (the host's listener stopped with SIGSTOP: the kernel still accepts);
* a connection reset mid-answer (the host's sshd session process killed while the answer is half out);
* an agent killed mid-answer (SIGKILL after half its answer);
* an agent that never answers (past the host's command_timeout);
* the controller's cores saturated (two busy loops per core for the whole run).

Every host's report is complete and the same as a quiet host's, or says exactly what failed and why (never a cut
answer read as the host's fault), nothing waits past the timeouts, the exit status and retry file are right, and
nothing is left on the hosts. Latency with jitter has its own test: netem (`tc qdisc ... netem`) where the
kernel has sch_netem, else a userspace delay relay inside each host's namespace plus nftables loss (it prints
which ran and why). Bounds in seconds are generous (a loaded 2-core machine)
and each says what it bounds."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from mla_doctor.exit_codes import ExitStatus

pytestmark = [pytest.mark.fleet, pytest.mark.faults]

REPO = Path(__file__).resolve().parents[2]
PY = "/opt/ml-env/bin/python"
CONNECT_TIMEOUT = 15
COMMAND_TIMEOUT = 90
HANG_TIMEOUT = 20

LOSSY = ["h02", "h03", "h04", "h05", "h06", "h07", "h08", "h09"]  # 4% loss each way
NARROW = ["h10", "h11", "h12"]  # 2 Mbit/s
SILENT, RESET, KILLED, HANGS = "h13", "h14", "h15", "h16"
FAULTED = {SILENT, RESET, KILLED, HANGS}

# The host-side stand-ins. Each runs the real agent first (its real answer), then misbehaves at a set point.
CUT = """#!/bin/sh
# the real agent; half its answer goes out, then the host's sshd session process is killed: a reset mid-answer.
# Only as the agent (python -I -S -B -c ..., remote/runner.py): anything else, a version check, is the real interpreter.
[ "$1 $2 $3 $4" = "-I -S -B -c" ] || exec /opt/ml-env/bin/python "$@"
out=/opt/ml-env/answer.$$
/opt/ml-env/bin/python "$@" > "$out"
head -c $(($(wc -c < "$out") / 2)) "$out"
rm -f "$out"
sleep 0.5  # lets the half answer leave (not a bound: the controller must say "cut" whatever arrived)
exec kill -KILL $PPID
"""
KILLED_AGENT = """#!/bin/sh
# the real agent; half its answer goes out, then the agent is killed (SIGKILL): sshd reports a signal, no status.
# Only as the agent: the interpreter itself works (a version check afterwards must not blame it)
[ "$1 $2 $3 $4" = "-I -S -B -c" ] || exec /opt/ml-env/bin/python "$@"
out=/opt/ml-env/answer.$$
/opt/ml-env/bin/python "$@" > "$out"
head -c $(($(wc -c < "$out") / 2)) "$out"
rm -f "$out"
kill -KILL $$
"""
HANG = """#!/bin/sh
# an agent that reads its payload and never answers
[ "$1 $2 $3 $4" = "-I -S -B -c" ] || exec /opt/ml-env/bin/python "$@"
cat > /dev/null
exec sleep 600
"""


def ns(name: str) -> list[str]:
    return ["ip", "netns", "exec", f"mla-{name}"]


def sh(argv, **kw):
    return subprocess.run(argv, check=True, capture_output=True, text=True, timeout=60, **kw)


def add_loss(name: str, pct: int) -> None:
    rules = (f"table inet mlafaults {{\n"
             f"  chain o {{ type filter hook output priority 0; policy accept; numgen random mod 100 < {pct} drop; }}\n"
             f"  chain i {{ type filter hook input priority 0; policy accept; numgen random mod 100 < {pct} drop; }}\n"
             "}\n")
    sh(ns(name) + ["nft", "-f", "-"], input=rules)


def add_narrow(name: str) -> None:
    sh(ns(name) + ["tc", "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", "2mbit", "burst", "32kbit",
                   "latency", "2s"])


def listener_pid(fleet, name: str) -> int:
    """The host's sshd listener (PID 1 of the host's PID namespace), as this machine numbers it."""
    conf = str(fleet.host_dir(name) / "sshd_config").encode()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        nspid = next((ln.split()[-1] for ln in status.splitlines() if ln.startswith("NSpid:")), "")
        if conf in cmd and nspid == "1":
            return int(pid)
    raise AssertionError(f"{name}: no sshd listener found")


def host_processes(name: str) -> list[tuple[int, str]]:
    """(pid, command line) of every process of the host: in its network namespace and inside its PID namespace
    (not the `unshare` that started it, which is this machine's)."""
    r = subprocess.run(["ip", "netns", "pids", f"mla-{name}"], capture_output=True, text=True, timeout=30)
    out = []
    for pid in r.stdout.split():
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
        except OSError:
            continue
        nspid = next((ln.split()[1:] for ln in status.splitlines() if ln.startswith("NSpid:")), [])
        if len(nspid) > 1:
            out.append((int(pid), cmd))
    return out


def comparable(h: dict) -> dict:
    """What must be the same for every healthy host: the verdict and what was found (not names or timings)."""
    return {"status": h["status"], "exit_status": h.get("exit_status"), "verdict": h.get("verdict"),
            "error": h.get("error"), "vllm": (h.get("vllm") or {}).get("version"),
            "findings": sorted((f.get("code"), f.get("severity")) for f in h.get("findings") or [])}


def busy_loops(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
        p.wait()


@pytest.fixture(scope="module")
def faulted_run(fault_fleet, tmp_path_factory):
    fleet = fault_fleet
    assert len(fleet.names) >= 50, f"the fault tier needs a fleet of at least 50 hosts, has {len(fleet.names)}"
    d = tmp_path_factory.mktemp("faulted")
    # a quiet host's report first: what every healthy host must say
    quiet = subprocess.run([sys.executable, "-m", "mla_doctor", "static", "--host", "h01", "--ssh-config",
                            str(fleet.ssh_config), "--python", PY, "--format", "json"], capture_output=True,
                           text=True, timeout=300, cwd=REPO, stdin=subprocess.DEVNULL)
    baseline = comparable(json.loads(quiet.stdout)["hosts"][0])
    assert baseline["status"] == "ok", quiet.stdout[-2000:]

    for name, script in ((RESET, CUT), (KILLED, KILLED_AGENT), (HANGS, HANG)):
        p = fleet.fs(name, "/opt/ml-env/bin/stand-in")
        p.write_text(script)
        p.chmod(0o755)
    for name in LOSSY:
        add_loss(name, 4)
    for name in NARROW:
        add_narrow(name)
    silent = listener_pid(fleet, SILENT)
    os.kill(silent, signal.SIGSTOP)

    hosts = {}
    for name in fleet.names:
        hv = {}
        if name in (RESET, KILLED, HANGS):
            hv["python"] = "/opt/ml-env/bin/stand-in"
        if name == HANGS:
            hv["command_timeout"] = HANG_TIMEOUT
        hosts[name] = hv or None
    inv = d / "fleet.yaml"
    inv.write_text(yaml.safe_dump({"vars": {"python": PY, "connect_timeout": CONNECT_TIMEOUT,
                                            "command_timeout": COMMAND_TIMEOUT}, "hosts": hosts}, sort_keys=False))
    out, retry = d / "r.json", d / "failed.retry"
    busy = busy_loops(2 * (os.cpu_count() or 2))
    t0 = time.monotonic()
    try:
        p = subprocess.run([sys.executable, "-m", "mla_doctor", "audit", "-i", str(inv), "--ssh-config",
                            str(fleet.ssh_config), "--forks", "16", "--format", "json", "-o", str(out),
                            "--retry-file", str(retry), "--progress", "plain"],
                           capture_output=True, text=True, timeout=600, cwd=REPO, stdin=subprocess.DEVNULL)
    finally:
        elapsed = time.monotonic() - t0
        stop(busy)
        os.kill(silent, signal.SIGCONT)
    # what is left on the hosts, once the run is over (the stand-ins' own sleep excepted: it is the test's)
    left = {}
    for name in fleet.names:
        procs = [(pid, cmd) for pid, cmd in host_processes(name) if pid != listener_pid(fleet, name)]
        mine = [pid for pid, cmd in procs if cmd.startswith("sleep 600")]
        for pid in mine:
            os.kill(pid, signal.SIGKILL)
        rest = [cmd for pid, cmd in procs if pid not in mine and not cmd.startswith("sshd: ")]
        files = sorted(str(x) for x in fleet.fs(name, "/opt/ml-env").glob("answer.*"))
        if rest or files:
            left[name] = rest + files
    return {"proc": p, "doc": json.loads(out.read_text()), "retry": retry.read_text().split(), "elapsed": elapsed,
            "baseline": baseline, "left": left, "fleet": fleet}


def test_every_healthy_host_says_what_a_quiet_host_says(faulted_run):
    r = faulted_run
    hosts = {h["host"]: h for h in r["doc"]["hosts"]}
    assert set(hosts) == set(r["fleet"].names)
    wrong = {n: comparable(h) for n, h in hosts.items() if n not in FAULTED and comparable(h) != r["baseline"]}
    assert not wrong, f"healthy hosts (lossy: {LOSSY}, narrow: {NARROW}, the rest quiet) that differ from a quiet " \
                      f"host's {r['baseline']}: {json.dumps(wrong, indent=1)[:4000]}"


def test_each_faulted_host_says_exactly_what_failed(faulted_run):
    hosts = {h["host"]: h for h in faulted_run["doc"]["hosts"]}
    s = hosts[SILENT]
    assert s["status"] == "unreachable" and "banner" in s["error"].lower(), s
    c = hosts[RESET]  # the cut answer is the connection's failure, never "the agent answered no JSON"
    assert c["status"] == "unreachable", c
    assert "before the command's output ended" in c["error"] and "bytes of stdout" in c["error"], c["error"]
    k = hosts[KILLED]  # the host's own failure: killed, with the answer's length, head and tail
    assert k["status"] == "error" and "no exit status: killed by a signal" in k["error"], k["error"]
    assert "bytes: head" in k["error"] and "tail" in k["error"], k["error"]
    h = hosts[HANGS]
    assert h["status"] == "error" and f"timed out after {HANG_TIMEOUT}s" in h["error"], h["error"]


def test_the_exit_status_and_the_retry_file_are_right(faulted_run):
    r = faulted_run
    assert r["proc"].returncode == ExitStatus.UNREACHABLE == r["doc"]["exit_status"], r["proc"].stderr[-3000:]
    assert sorted(r["retry"]) == sorted(FAULTED)


def test_nothing_waits_past_the_timeouts(faulted_run):
    # the slowest host is bounded by its own timeouts (the silent host's connect, the hanging agent's command),
    # not by the faults of the others: 16 forks over 52 hosts under busy cores; 300 s is several times that
    assert faulted_run["elapsed"] < 300, faulted_run["elapsed"]
    hosts = {h["host"]: h for h in faulted_run["doc"]["hosts"]}
    for name, bound in ((SILENT, CONNECT_TIMEOUT), (HANGS, HANG_TIMEOUT)):
        took = (hosts[name].get("timings") or {}).get("total_s")
        assert took is None or took < bound + 60, (name, took)


def test_nothing_is_left_on_the_hosts(faulted_run):
    assert not faulted_run["left"], faulted_run["left"]


RELAY = REPO / "tests" / "support" / "delay_relay.py"
RELAY_PORT = 2022
DELAYED = [f"h{i:02d}" for i in range(20, 30)]  # latency with jitter (+ loss), each host's link
QUIET = "h30"  # in the same run, untouched: what every delayed host must say
DELAY_MS, JITTER_MS = 40, 20


def netem_available(name: str) -> tuple[bool, str]:
    """Add the netem qdisc to `name`'s link (kept there if it works); else say why it is not there."""
    probe = subprocess.run(ns(name) + ["tc", "qdisc", "add", "dev", "eth0", "root", "netem", "delay",
                                       f"{DELAY_MS}ms", f"{JITTER_MS}ms", "loss", "2%", "reorder", "10%"],
                           capture_output=True, text=True)
    if probe.returncode == 0:
        return True, "sch_netem is available"
    config = ""
    try:
        import gzip

        config = next((ln for ln in gzip.open("/proc/config.gz", "rt") if "NET_SCH_NETEM" in ln), "").strip()
    except OSError:
        pass
    return False, (f"no sch_netem on kernel {os.uname().release} (`tc qdisc add ... netem`: "
                   f"{probe.stderr.strip()!r}" + (f"; /proc/config.gz: {config}" if config else "") + ")")


def start_relay(fleet, name: str) -> subprocess.Popen:
    """The delay relay inside `name`'s network namespace, on its address at RELAY_PORT, to its sshd; returns once
    it listens (its `listening` line: an event, not a sleep)."""
    h = fleet.host(name)
    p = subprocess.Popen(ns(name) + ["python3", str(RELAY), "--listen", f"{h['host']}:{RELAY_PORT}",
                                     "--to", f"{h['host']}:{h['port']}", "--delay-ms", str(DELAY_MS),
                                     "--jitter-ms", str(JITTER_MS), "--split"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    line = p.stdout.readline()
    assert line.startswith("listening "), (name, line, p.poll(), p.stderr.read() if p.poll() is not None else "")
    return p


def stop_relay(p: subprocess.Popen) -> dict | None:
    """SIGTERM: the relay prints what it did (one JSON line) and exits. None if it had to be killed."""
    p.terminate()
    try:
        out, _ = p.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        p.kill()
        p.communicate()
        return None
    lines = out.strip().splitlines()
    return json.loads(lines[-1]) if lines else None


def test_delay_jitter_loss_and_reordering(fault_fleet, tmp_path):
    """Latency with jitter, loss and reordering on ten hosts' links (h20-h29), h30 quiet in the same run: every
    report is the quiet host's and the exit status 0. Two paths, and the test prints which one ran and why:

    * netem, where the kernel has sch_netem (probed by adding it to h20): `tc qdisc ... netem delay 40ms 20ms
      loss 2% reorder 10%` on each host's link;
    * else (this CI machine: CONFIG_NET_SCH_NETEM is not set) a userspace delay relay
      (tests/support/delay_relay.py) run inside each host's network namespace, on the host's address at port
      2022, forwarding to its sshd: every chunk each way is delayed 40 ms ± 20 ms (random per chunk, order
      kept) and split into random pieces, plus 2% nftables loss both ways on the same hosts (the packet-level
      loss and the reordering TCP's retransmits make). The inventory points those hosts at port 2022 and the
      known_hosts gives `[addr]:2022` the host's real key, so host keys are still checked. Each relay must have
      carried that host's connection and delayed its chunks (counted by the relay), and none is left after."""
    fleet = fault_fleet
    netem, why = netem_available(DELAYED[0])
    path = "netem" if netem else "relay"
    print(f"\ndelay/jitter path: {path} ({why})")
    relays: dict[str, subprocess.Popen] = {}
    stats: dict[str, dict | None] = {}
    ssh_config = fleet.ssh_config
    hosts: dict = {n: None for n in DELAYED + [QUIET]}
    try:
        if netem:
            for name in DELAYED[1:]:
                sh(ns(name) + ["tc", "qdisc", "add", "dev", "eth0", "root", "netem", "delay", f"{DELAY_MS}ms",
                               f"{JITTER_MS}ms", "loss", "2%", "reorder", "10%"])
        else:
            # the hosts' real keys under their relay port; the fleet's own files are left as they are
            addrs = {fleet.host(n)["host"]: n for n in DELAYED}
            kh = tmp_path / "known_hosts"
            lines = fleet.known_hosts.read_text().splitlines()
            extra = [f"[{ln.split()[0]}]:{RELAY_PORT} {' '.join(ln.split()[1:])}" for ln in lines
                     if ln.split() and ln.split()[0] in addrs]
            assert len(extra) == len(DELAYED), (extra, addrs)
            kh.write_text("\n".join(lines + extra) + "\n")
            ssh_config = tmp_path / "ssh_config"
            ssh_config.write_text(fleet.ssh_config.read_text().replace(str(fleet.known_hosts), str(kh)))
            assert str(kh) in ssh_config.read_text()
            for name in DELAYED:
                add_loss(name, 2)
                relays[name] = start_relay(fleet, name)
                hosts[name] = {"port": RELAY_PORT}
        inv = tmp_path / "inv.yaml"
        inv.write_text(yaml.safe_dump({"vars": {"python": PY, "connect_timeout": CONNECT_TIMEOUT},
                                       "hosts": hosts}))
        p = subprocess.run([sys.executable, "-m", "mla_doctor", "audit", "-i", str(inv), "--ssh-config",
                            str(ssh_config), "--format", "json"], capture_output=True, text=True,
                           timeout=300, cwd=REPO, stdin=subprocess.DEVNULL)
    finally:
        for name, r in relays.items():
            stats[name] = stop_relay(r)
        for name in DELAYED:
            subprocess.run(ns(name) + ["tc", "qdisc", "del", "dev", "eth0", "root"], capture_output=True)
            subprocess.run(ns(name) + ["nft", "delete", "table", "inet", "mlafaults"], capture_output=True)
    doc = json.loads(p.stdout)
    assert p.returncode == 0, p.stderr[-2000:]
    got = {h["host"]: comparable(h) for h in doc["hosts"]}
    assert set(got) == set(hosts)
    assert got[QUIET]["status"] == "ok", got[QUIET]
    wrong = {n: c for n, c in got.items() if c != got[QUIET]}
    assert not wrong, f"{path}: delayed hosts that differ from the quiet {QUIET}'s {got[QUIET]}: {wrong}"
    if not netem:
        # every relay stopped when told (and printed what it did), and nothing of them is left in the namespaces
        assert all(r.returncode == 0 for r in relays.values()), {n: r.returncode for n, r in relays.items()}
        for name, r in relays.items():
            left = subprocess.run(["ip", "netns", "pids", f"mla-{name}"], capture_output=True, text=True).stdout
            assert str(r.pid) not in left.split(), (name, r.pid)
        # each host's connection went through its relay, and its chunks were delayed (counted, not timed)
        for name in DELAYED:
            s = stats[name]
            assert s is not None and s["connections"] >= 1, (name, s, "the audit did not connect through the relay")
            assert s["chunks"] > 0 and s["added_delay_s"] >= s["chunks"] * (DELAY_MS - JITTER_MS) / 1000, (name, s)
        print(f"relay: {sum(s['chunks'] for s in stats.values())} chunks delayed, "
              f"{sum(s['added_delay_s'] for s in stats.values()):.1f} s added over {len(DELAYED)} hosts")
