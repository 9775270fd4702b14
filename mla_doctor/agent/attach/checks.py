"""Whether this host lets root attach to a process, checked before anything changes; each refusal names
its cause and its fix (the restart-based run never needs ptrace)."""
from __future__ import annotations

import os
import subprocess

from ..privilege import call_as, proc_ids
from .elf import ElfError, defined_symbols
from .inject import GDB_TIMEOUT, gdb_argv, interpret, run_gdb
from .procs import CPYTHON_SYMBOLS, INTERPRETER_SYMBOLS

CAP_SYS_PTRACE = 19
PATCH_FIX = "or diagnose with a restart: --method patch --yes"


def _read(path):
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def own_status():
    out = {}
    for line in (_read("/proc/self/status") or "").splitlines():
        k, _, v = line.partition(":")
        out[k] = v.strip()
    return out


def has_cap(status, cap):
    try:
        return bool(int(status.get("CapEff", "0"), 16) >> cap & 1)
    except ValueError:
        return False


YAMA_PATH = "/proc/sys/kernel/yama/ptrace_scope"  # absent where the kernel has no Yama


def yama_scope(path=None):
    v = _read(path or YAMA_PATH)
    return int(v) if v and v.strip().isdigit() else None


def ptrace_refusals(target_uids, gdb, scope=None, status=None):
    """Yama, the capability, then a real attach by gdb to a child of ours (seccomp, LSMs, a container).
    `scope`/`status`: Yama's setting and our /proc/self/status as read here unless given (a host without Yama
    checks the rule all the same)."""
    scope = yama_scope() if scope is None else scope
    if scope == 3:
        return ["ptrace is disabled on this host (kernel.yama.ptrace_scope = 3: no process may be traced, and "
                "only a reboot lowers it): attach is impossible here; " + PATCH_FIX]
    st = own_status() if status is None else status
    cap = has_cap(st, CAP_SYS_PTRACE)
    if not cap and (scope in (1, 2) or any(u != os.geteuid() for u in target_uids)):
        why = {2: "kernel.yama.ptrace_scope = 2 needs it",
               1: "kernel.yama.ptrace_scope = 1 lets others trace only their own descendants"}.get(
                   scope, "the server runs as another user")
        return ["the agent lacks CAP_SYS_PTRACE (%s): run it as root with the capability (a container: "
                "--cap-add SYS_PTRACE; Kubernetes: an ephemeral debug container with SYS_PTRACE), %s"
                % (why, PATCH_FIX)]
    child = subprocess.Popen(["/bin/sleep", "30"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, cwd="/", env={})
    try:
        ok, detail = interpret(*run_gdb(gdb_argv(gdb, child.pid, ["print 0"]), timeout=GDB_TIMEOUT))
    finally:
        child.kill()
        child.wait()
    if not ok and detail.startswith("gdb timed out"):  # slow, not refused: say so (a loaded host), never blame ptrace
        return ["gdb did not finish a test attach to a process of the agent's own within %d s (%s): the host may be "
                "overloaded; try again, or %s" % (GDB_TIMEOUT, detail, PATCH_FIX)]
    if not ok:
        seccomp = st.get("Seccomp", "0")
        cause = "a seccomp filter (Seccomp: %s in /proc/self/status)" % seccomp if seccomp == "2" else \
            "the kernel or a security module (LSM) or a container without SYS_PTRACE"
        return ["ptrace is refused to the agent by %s: %s; allow ptrace for the agent (a container: "
                "--cap-add SYS_PTRACE --security-opt seccomp=unconfined), %s" % (cause, detail, PATCH_FIX)]
    return []


def _symbols_list(path):
    return sorted(defined_symbols(path, INTERPRETER_SYMBOLS + CPYTHON_SYMBOLS))


def interpreter_refusals(proc):
    """The process must be a CPython whose dynamic symbols include the two the injection calls."""
    pid = proc["pid"]
    lib = proc.get("libpython")
    # the mapping itself (map_files) or the process's own executable: never the library's name, which the
    # service user controls (a FIFO there hung the agent)
    path = proc.get("libpython_map") if lib else "/proc/%d/exe" % pid
    try:
        try:
            found = defined_symbols(path, INTERPRETER_SYMBOLS + CPYTHON_SYMBOLS)
        except PermissionError:
            if not lib:
                raise
            # map_files needs CAP_SYS_ADMIN (a container granted SYS_PTRACE only): then by its name, but as the
            # server's own user, bounded -- never by a name it controls as root
            found = set(call_as(proc_ids(pid), _symbols_list, ("/proc/%d/root%s" % (pid, lib),), timeout=20.0))
    except (OSError, ElfError) as e:
        return ["pid %d (%s): cannot read its interpreter's symbols (%s): %s" % (pid, proc.get("comm"), e, PATCH_FIX)]
    if not found & set(CPYTHON_SYMBOLS):
        return ["pid %d (%s) is not a CPython (%s defines none of %s): attach needs CPython; %s"
                % (pid, proc.get("comm"), lib or proc.get("exe"), ", ".join(CPYTHON_SYMBOLS), PATCH_FIX)]
    missing = [s for s in INTERPRETER_SYMBOLS if s not in found]
    if missing:
        return ["pid %d (%s): its interpreter %s does not export %s (a static build without the C-API in its "
                "dynamic symbols): %s" % (pid, proc.get("comm"), lib or proc.get("exe"), ", ".join(missing),
                                          PATCH_FIX)]
    return []
