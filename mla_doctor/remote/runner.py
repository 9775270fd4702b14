"""Ship the remote agent over an existing transport and run one phase: one remote execution.

The agent's payload (its package's sources, framed and compressed: remote/bundle.py) and the JSON
plan travel on stdin to `python3 -I -S -B -c BOOTSTRAP`; nothing is written on the host. The interpreter
is found on the host by a fixed POSIX sh script whose only variable parts are shlex-quoted.
"""
from __future__ import annotations

import json
import shlex
from typing import Any

from mla_doctor.agent.protocol import BOOTSTRAP, OLD_PYTHON_RC
from mla_doctor.errors import NoPythonError, RemoteError, SudoError
from mla_doctor.remote.bundle import agent_stdin
from mla_doctor.ssh.local import LocalTransport, Transport

NO_PYTHON_RC = 127
FALLBACK_PYTHONS = ("python3", "python", "/usr/bin/python3", "/usr/local/bin/python3")


# The root agent runs only on an interpreter root controls (README "Security", agent/privilege.py): as root
# (uid 0, or sudo), a candidate is skipped unless it and every directory above it -- as named and as resolved
# -- belong to root and are not writable by group or others (a sticky directory excepted). POSIX sh + stat(1);
# fail closed: no `id` means root, no `stat`/`readlink` means not trusted. Every path is listed first (parents by
# ${f%/*}: a trailing or doubled slash only adds the same directory once more) and stat'ed in one process: two
# processes per candidate, where a stat and a dirname per directory were ~25 on a venv under /root.
_TRUSTED_FN = (
    "ok() { [ \"$r\" = 1 ] || return 0; a=$1; b=$(readlink -f -- \"$1\"); set --; for f in \"$a\" \"$b\"; do "
    "while :; do set -- \"$@\" \"$f\"; [ \"$f\" = / ] && break; f=${f%/*}; [ -n \"$f\" ] || f=/; done; done; "
    "o=$(stat -c '%u %A' -- \"$@\" 2>/dev/null) || return 1; set -- $o; [ $# -gt 0 ] || return 1; "
    "while [ $# -gt 1 ]; do [ \"$1\" = 0 ] || return 1; "
    "case $2 in l*) ;; ?????w*|????????w?) case $2 in *[tT]) ;; *) return 1;; esac;; esac; shift 2; done; "
    "[ $# = 0 ]; }; "
)


def agent_command(python: str | None = None, sudo: bool = False, bootstrap: str = BOOTSTRAP) -> str:
    """The single shell command that finds an interpreter and runs the agent from stdin (`bootstrap`: the
    one-shot BOOTSTRAP, or SERVE_BOOTSTRAP for an agent serving a run: remote/session.py): always isolated
    (`-I -S -B`: no site, no environment, no cwd on sys.path), from cwd /, and as root only on a trusted
    interpreter (an untrusted `--python` is still the one vLLM is looked up with, by its owner, on the host)."""
    candidates = ([python] if python else []) + list(FALLBACK_PYTHONS)
    prefix = "sudo -n " if sudo else ""
    script = (
        # the checks' own tools (id, stat, readlink, dirname) from the system's directories only: the caller's
        # PATH may hold another user's directory; it is still the one an interpreter's name is looked up in,
        # and the one the agent inherits
        "u=$PATH; PATH=/usr/sbin:/usr/bin:/sbin:/bin; export PATH; "
        + _TRUSTED_FN + ("r=1; " if sudo else 'r=1; case $(id -u 2>/dev/null) in ""|0) ;; *) r=0;; esac; ') + "s=; "
        "for p in " + " ".join(shlex.quote(c) for c in candidates) + "; do "
        'if x=$(PATH=$u; command -v "$p" 2>/dev/null); then '
        'case $x in /*) ;; *) x=$PWD/$x;; esac; '
        f'if ok "$x"; then cd / && PATH=$u && exec {prefix}"$x" -I -S -B -c {shlex.quote(bootstrap)}; fi; '
        's="$s $x"; '
        "fi; done; "
        "echo 'mla-doctor: no Python interpreter found on this host (tried: "
        + " ".join(candidates).replace("'", "") + ")'\"${s:+; refused to run as root on an interpreter another "
        "user can change:$s}\" >&2; "
        f"exit {NO_PYTHON_RC}"
    )
    # Run under sh whatever the login shell is (bash, zsh, fish, csh...).
    return "exec /bin/sh -c " + shlex.quote(script)


def describe_answer(data: bytes, edge: int = 120) -> str:
    """An answer that did not parse, so that a cut, doubled or mixed one can be told apart: its length, its
    head and its tail."""
    if len(data) <= 2 * edge:
        return f"{len(data)} bytes: {data!r}"
    return f"{len(data)} bytes: head {data[:edge]!r} ... tail {data[-edge:]!r}"


def run_agent(transport: Transport, plan: dict, *, python: str | None = None, sudo: bool = False,
              timeout: float | None = None, session: Any = None) -> dict:
    """One op's answer. With `session` (remote/session.py AgentSession, made for this transport, python and
    sudo), on the run's serving agent; else one remote execution (run_once)."""
    if session is not None:
        return session.run_agent(plan, timeout=timeout)
    return run_once(transport, plan, python=python, sudo=sudo, timeout=timeout)


def run_once(transport: Transport, plan: dict, *, python: str | None = None, sudo: bool = False,
             timeout: float | None = None) -> dict:
    """Start the agent, send the payload and the plan, read the one answer: one remote execution."""
    # an agent on this machine (--local) gets this interpreter's compiled modules: no compile of its own
    local = isinstance(transport, LocalTransport)
    res = transport.run(agent_command(python, sudo), stdin=agent_stdin(plan, compiled=local), timeout=timeout)
    err = res.stderr.decode("utf-8", "replace").strip()
    if res.rc == NO_PYTHON_RC and "no Python interpreter" in err:
        raise NoPythonError(err.replace("mla-doctor: ", ""), host=transport.name)
    if res.rc == OLD_PYTHON_RC:
        raise NoPythonError(err.replace("mla-doctor: ", "") + " (point --python at a newer interpreter)",
                            host=transport.name)
    if sudo and res.rc != 0 and "sudo:" in err:
        raise SudoError(f"sudo -n failed (passwordless sudo is required with --sudo): {err.splitlines()[-1]}",
                        host=transport.name)
    try:
        out = json.loads(res.stdout.decode("utf-8", "replace") or "null")
    except ValueError as e:
        status = "no exit status: killed by a signal?" if res.rc == -1 else f"exit {res.rc}"
        raise RemoteError(f"agent answered no JSON ({status}): {describe_answer(res.stdout)}"
                          + (f"; stderr: {err[-400:]}" if err else ""), host=transport.name) from e
    if not isinstance(out, dict):
        raise RemoteError(f"agent answered nothing (exit {res.rc}): {err[-400:]}", host=transport.name)
    if out.get("fatal"):
        raise RemoteError(f"agent failed: {out['fatal']}", host=transport.name)
    out["_elapsed_s"] = round(res.elapsed, 4)
    return out
