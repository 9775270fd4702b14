"""Process exit status: one enum, documented in docs/usage.md (Exit status), decided by the worst host."""
from __future__ import annotations

import enum


class ExitStatus(enum.IntEnum):
    OK = 0  # audit/diagnosis ran; nothing at severity "fail"
    FAULT = 1  # a diagnosis found a fault (a "fail" finding, an unmet --expect)
    USAGE = 2  # bad options, bad inventory/config file (same as click's usage errors)
    UNREACHABLE = 3  # a host could not be reached or authenticated (incl. a changed host key)
    HOST_ERROR = 4  # reached the host but could not audit it (no Python, no vLLM, agent failure)
    NOT_RESTORED = 5  # a server or file could not be restored as found (most severe)
    INTERNAL = 70  # a bug in mla-doctor (an unexpected exception; EX_SOFTWARE): rerun with --debug
    INTERRUPTED = 130  # Ctrl-C


# Which status wins when hosts differ: the most severe for an operator comes last.
_PRECEDENCE = [ExitStatus.OK, ExitStatus.FAULT, ExitStatus.HOST_ERROR, ExitStatus.UNREACHABLE,
               ExitStatus.NOT_RESTORED]


def worst(statuses) -> ExitStatus:
    statuses = list(statuses)
    if not statuses:
        return ExitStatus.OK
    return max(statuses, key=lambda s: _PRECEDENCE.index(s) if s in _PRECEDENCE else len(_PRECEDENCE))
