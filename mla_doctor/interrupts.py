"""Ctrl-C and SIGTERM: end what runs at once, put back what was changed, say what is left.

A command runs under `handling()`. There SIGINT and SIGTERM both raise `Interrupted` (a KeyboardInterrupt, so
every `finally` and every existing Ctrl-C path runs) in the main thread, and fire every cancel registered with
`on_cancel` or `watch` first: a fleet's host connections are closed, so its workers' reads (connect, banner, auth, an
agent's answer, HTTP through the tunnel) end at once instead of at their timeouts.

Inside `restoring(...)` (a live run putting its host back) a signal does not interrupt: the first says that the
restore goes on, how long it may take, and that another Ctrl-C stops it; the second stops it, saying what is left
on the host and how to undo it. Once the restore is done, the interrupt that came during it is raised.
A fleet run (fleet/scheduler.py) puts its running hosts back the same way: one `restoring(...)` in the main
thread around all of them, the restores themselves in parallel threads, each over a new connection.

A last guard: `GUARD_S` seconds after an interrupt outside a restore the process exits (status 130) even if
something still blocks, so Ctrl-C always gives the prompt back. Stdlib only; nothing here prints but the two
messages on stderr.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
import weakref
from contextlib import contextmanager
from typing import Callable, Iterator

GUARD_S = 10.0  # normal stops take well under a second; this only bounds a stop that something blocks
EXIT_INTERRUPTED = 130


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) or SIGTERM, raised in the main thread."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(signal.Signals(signum).name)


class _State:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.cancels: dict[int, Callable[[], None]] = {}
        self.watched: weakref.WeakSet = weakref.WeakSet()  # objects with fire(): a fleet's per-host cancels
        self.signum: int | None = None  # the first interrupt's signal
        self.count = 0
        self.restore: list[tuple[str, Callable[[], str], float]] = []  # (host, what is left, expected seconds)
        self.pending: int | None = None  # a signal that came during a restore
        self.guard: threading.Thread | None = None
        self.generation = 0  # bumped by reset(): a guard armed before it stands down


_S = _State()


def interrupted() -> int | None:
    """The signal that interrupted this command, or None."""
    return _S.signum


def _say(text: str) -> None:
    try:
        sys.stderr.write(f"mla-doctor: {text}\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def _fire_cancels() -> None:
    with _S.lock:
        fns = list(_S.cancels.values()) + [c.fire for c in list(_S.watched)]
    for fn in fns:
        try:
            fn()
        except Exception:  # noqa: BLE001 - best effort: one cancel's failure must not stop the others
            pass


def _guard(generation: int) -> None:
    """Exit GUARD_S after the interrupt, unless a restore is running (then GUARD_S after it ends)."""
    deadline = time.monotonic() + GUARD_S
    while True:
        time.sleep(max(0.05, min(0.5, deadline - time.monotonic())))
        if _S.generation != generation:
            return
        if _S.restore:
            deadline = time.monotonic() + GUARD_S
            continue
        if time.monotonic() >= deadline:
            _say(f"still stopping {GUARD_S:g}s after the interrupt: exiting now")
            os._exit(EXIT_INTERRUPTED)


def _arm_guard() -> None:
    if _S.guard is None:
        _S.guard = threading.Thread(target=_guard, args=(_S.generation,), name="mla-doctor interrupt guard",
                                    daemon=True)
        _S.guard.start()


def _handler(signum: int, frame) -> None:
    _S.count += 1
    if _S.signum is None:
        _S.signum = signum
    if _S.restore:
        host, left, expected = _S.restore[-1]
        if _S.pending is None:
            _S.pending = signum
            _say(f"interrupted ({signal.Signals(signum).name}): still restoring {host} (up to ~{expected:.0f}s; "
                 f"progress above); Ctrl-C again to stop restoring and leave {host} as it is now")
            return
        _say(f"interrupted again: the restore of {host} is stopped. {left()}")
        _arm_guard()
        raise Interrupted(signum)
    # in a thread: a cancel takes locks (a transport's, a Cancel's) that the code just interrupted may hold
    threading.Thread(target=_fire_cancels, name="mla-doctor cancel", daemon=True).start()
    _arm_guard()
    raise Interrupted(signum)


@contextmanager
def handling() -> Iterator[None]:
    """SIGINT and SIGTERM raise Interrupted in the main thread for the duration (elsewhere: nothing changes)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, _handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, h in previous.items():
            signal.signal(sig, h)


@contextmanager
def on_cancel(fn: Callable[[], None]) -> Iterator[None]:
    """Call fn (from the signal handler, before Interrupted is raised) when the command is interrupted."""
    key = id(fn)
    with _S.lock:
        _S.cancels[key] = fn
    try:
        if _S.signum is not None and not _S.restore:
            fn()  # interrupted already
        yield
    finally:
        with _S.lock:
            _S.cancels.pop(key, None)


def watch(cancel) -> None:
    """Fire `cancel` (anything with fire(): mla_doctor's per-host Cancel) when the command is interrupted; kept
    only while something else keeps it (a weak reference: nothing to unregister)."""
    with _S.lock:
        _S.watched.add(cancel)
    if _S.signum is not None and not _S.restore:
        cancel.fire()  # interrupted already


@contextmanager
def restoring(host: str, left: Callable[[], str], expected_s: float,
              outcome: Callable[[], str] | None = None) -> Iterator[None]:
    """A restore that a first signal does not interrupt (see the module's docstring). `left()` says what is left
    on the host and the command that undoes it; `expected_s` is how long the restore may take; `outcome()`, said
    once a restore that an interrupt led to has ended, whether it put the host back (the report that would say
    so is not written). In the main thread only (signals are handled there); elsewhere (a fleet's workers) it
    changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    if _S.signum is not None:  # the interrupt that led here: say that the host is put back first
        _say(f"interrupted: restoring {host} before exiting (up to ~{expected_s:.0f}s; progress below); "
             f"Ctrl-C again to stop restoring and leave {host} as it is now")
        _S.pending = _S.signum
    _S.restore.append((host, left, expected_s))
    try:
        yield
    except Exception:  # the restore itself failed (Interrupted, a second signal, is no Exception: it said what is left)
        _say_outcome(host, outcome)  # still say whether the host is back: the operator must learn it
        raise
    else:
        _say_outcome(host, outcome)
    finally:
        _S.restore.pop()
    if _S.pending is not None and not _S.restore:
        signum, _S.pending = _S.pending, None
        raise Interrupted(signum)


def _say_outcome(host: str, outcome: Callable[[], str] | None) -> None:
    """Once an interrupted run's restore has ended, whether it put the host back. Said while the restore is still
    registered, so the exit guard (armed by the interrupt, waiting for no restore) cannot cut it; only by the
    outermost restore, and only when an interrupt led here."""
    if _S.pending is None or len(_S.restore) != 1 or outcome is None:
        return
    try:
        _say(outcome())
    except Exception as e:  # noqa: BLE001 - the outcome is a message; never hide the restore's own error
        _say(f"{host}: could not tell whether the restore put it back ({type(e).__name__}: {e})")


def reset() -> None:
    """Forget an interrupt (tests, and a long-running controller that handles one and goes on)."""
    with _S.lock:
        _S.signum, _S.count, _S.pending, _S.guard = None, 0, None, None
        _S.generation += 1
