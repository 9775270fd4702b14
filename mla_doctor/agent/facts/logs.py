"""The server's log (a file, the unit's journal, the container's log) filtered to the lines the
plan's patterns select: the zero-patch evidence.
"""
from __future__ import annotations

import re
import sys

from ..common import time_now, read_regular, run_argv, find_executable
from .log_formats import compact, harvest_tree


MAX_LOG_LINES = 400


def filter_lines(lines, patterns, source):
    regs = {}
    for pid, rx in (patterns or {}).items():
        try:
            regs[pid] = re.compile(rx)
        except re.error:
            continue
    out = []
    last_start, seen = None, set()  # where the newest server process begins in out; its start ids so far
    for i, line in enumerate(lines, 1):
        ids = [pid for pid, r in regs.items() if r.search(line)]
        if ids:
            starts = [x for x in ids if x.startswith(RUN_START)]
            # a process logs each start line once: one seen again begins the next process (the controller
            # splits exactly, log_reading.split_runs; this only keeps the newest process whole)
            if starts and (last_start is None or seen.intersection(starts)):
                last_start, seen = len(out), set()
            seen.update(starts)
            out.append({"n": i, "text": line.rstrip()[:600], "ids": ids})
    return {"source": source, "total_lines": len(lines), "lines": _cap(out, last_start)}


# Pattern ids of the lines a server process logs once, as it starts (the controller's knowledge/log_runs.yaml):
# a log holding several processes (restarts append) is cut so that the newest process's lines are kept.
RUN_START = "run_start_"


def _cap(out, last_start):
    """At most MAX_LOG_LINES: the newest process's lines first (its start-up, then its most recent), then
    the earlier processes' first and last lines."""
    if len(out) <= MAX_LOG_LINES:
        return out
    cur = out[last_start:] if last_start is not None else out
    old = out[:last_start] if last_start is not None else []
    room = MAX_LOG_LINES - min(len(old), MAX_LOG_LINES // 4)
    if len(cur) > room:
        cur = cur[: room // 2] + cur[-(room - room // 2):]
    left = MAX_LOG_LINES - len(cur)
    if len(old) > left:
        old = old[: left // 2] + old[-(left - left // 2):] if left else []
    return old + cur


def installed_formats(vdir, plan=None, digests=None):
    """The log formats of the installed ``vllm/`` (``log_formats.harvest_tree``), stored compactly like the
    shipped data: each format and file once, a site as ``[format, file, line, level[:exc]]``.

    The controller's cache (remote/formats_cache.py): the modules whose digest prefix the plan's
    ``formats_known`` holds for this interpreter are not harvested, only named with their full digest
    (``cached``); with ``formats_digests`` (an agent on the controller's own machine) every harvested module's
    digest is sent too (``harvested``), for the controller to keep. ``digests``: the integrity pass's."""
    t0 = time_now()
    plan = plan or {}
    known = frozenset(((plan.get("formats_known") or {}).get("%d.%d" % sys.version_info[:2])) or ())
    cached, hashed = {}, ({} if plan.get("formats_digests") else None)
    recs = harvest_tree(vdir, known=known, digests=digests, cached=cached, hashed=hashed)
    out = compact(recs)
    if cached:
        out["cached"] = cached
    if hashed:
        out["harvested"] = hashed
    out["elapsed_s"] = round(time_now() - t0, 4)
    return out


def log_section(plan, server, vdir=None, digests=None):
    """The log's selected lines; with ``vdir`` (the installed ``vllm/``) and a log found, the formats
    harvested from that install, which the controller reads the lines with."""
    res = _log_lines(plan, server)
    if vdir and res.get("found"):
        try:
            res["formats"] = installed_formats(vdir, plan, digests)
        except Exception as e:  # the lines are still read with the shipped formats
            res["formats_error"] = "%s: %s" % (type(e).__name__, e)
    return res


def _read_stdout(link, tail):
    """The server's stdout through /proc/PID/fd/1, only while that descriptor is open for writing (fd_writable)
    and is the very file opened here: checked after the open, so a descriptor swapped in (dup2) meanwhile is
    caught, and read through our own descriptor (/proc/self/fd/N: the same file)."""
    import errno
    import os

    from .processes import fd_writable

    fd = os.open(link, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0))
    try:
        mine, now = os.fstat(fd), os.stat(link)
        if (mine.st_dev, mine.st_ino) != (now.st_dev, now.st_ino) or not fd_writable(link):
            raise OSError(errno.EPERM, "the server's stdout is not a file it writes (held by path or for reading "
                          "only): not read as root")
        return read_regular("/proc/self/fd/%d" % fd, tail=tail)
    finally:
        os.close(fd)


def descriptor_ident(link):
    """[st_dev, st_ino] of the file the server's descriptor /proc/PID/fd/N is open on (that very file: the magic
    link is resolved by the kernel to the open file, never by its name), or None."""
    import os

    try:
        st = os.stat(link)
    except OSError:
        return None
    return [st.st_dev, st.st_ino, st.st_size]


def read_descriptor_from(link, ident, offset, limit):
    """The server's log from a byte offset, read through its own descriptor /proc/PID/fd/N only while that is
    still the very file recorded at attach (`ident`: device and inode), a regular file, open by the server for
    writing: never re-opened by its name (a deleted log's "<name> (deleted)" planted by another user), so no
    other file's bytes reach the report. b"" otherwise."""
    import os
    import stat

    from .processes import fd_writable

    try:
        fd = os.open(link, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return b""
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or [st.st_dev, st.st_ino] != list(ident or [])[:2] or not fd_writable(link):
            return b""
        os.lseek(fd, int(offset), os.SEEK_SET)
        chunks, left = [], int(limit)
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _log_lines(plan, server):
    patterns = plan.get("log_patterns") or {}
    tail = int(plan.get("log_tail_bytes") or 8 * 1024 * 1024)
    sources = []
    if plan.get("log"):
        sources.append(("file", plan["log"]))
    elif server:
        sup = server.get("supervisor") or {}
        if server.get("stdout_fd"):  # /proc/PID/fd/1: the file it writes, never re-found by its name
            sources.append(("stdout", server["stdout_fd"]))
        if sup.get("kind") == "systemd" and sup.get("unit"):
            sources.append(("journal", sup["unit"]))
        if sup.get("kind") in ("docker", "kubernetes") and sup.get("container") and \
                sup.get("runtime", "docker") == "docker":  # docker's log; another runtime's is the stdout file
            sources.append(("docker", sup["container"]))
    if not sources:
        return {"found": False, "reason": "no --log given and no log source found for the server"}
    errors = []
    for kind, where in sources:
        if kind in ("file", "stdout"):
            try:  # the log is the service user's: a FIFO there must not hang the agent (read_regular)
                text = (_read_stdout(where, tail) if kind == "stdout" else
                        read_regular(where, tail=tail)).decode("utf-8", "replace")
            except OSError as e:
                errors.append("%s: %s" % (where, e.strerror or e))
                continue
            res = filter_lines(text.splitlines(), patterns, where)
            if kind == "stdout":  # shown by the name it has, read only through the descriptor
                res["source"], res["read_via"] = server.get("stdout_file") or where, where
        elif kind == "journal":
            rc, out, err = run_argv(["journalctl", "-u", where, "--no-pager", "-o", "cat", "-n", "50000"], timeout=20)
            if rc != 0:
                errors.append("journalctl -u %s: %s" % (where, err.strip()[:200]))
                continue
            res = filter_lines(out.splitlines(), patterns, "journal:" + where)
        else:
            import subprocess  # only for a container's log (common.py: not imported at start)

            p = subprocess.run(["docker", "logs", "--tail", "50000", where], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, timeout=20) if find_executable("docker") else None
            if p is None or p.returncode != 0:
                errors.append("docker logs %s failed" % where)
                continue
            res = filter_lines(p.stdout.decode("utf-8", "replace").splitlines(), patterns, "docker:" + where)
        res["found"] = True
        res["errors"] = errors
        res["origin"] = "--log" if plan.get("log") else "server"  # the server's: its install's evidence
        return res
    return {"found": False, "reason": "; ".join(errors)}
