"""Progress of a fleet run on stderr: a live table on a terminal (rich), plain lines otherwise."""
from __future__ import annotations

import sys
import threading
import time

from mla_doctor import terminal
from mla_doctor.exit_codes import ExitStatus


class Progress:
    """Live display on a terminal (rich), plain lines otherwise, nothing when quiet."""

    def __init__(self, total: int, mode: str, stream=None):
        self.total, self.mode = total, mode  # mode: live | plain | quiet
        self.stream = stream or sys.stderr
        self.lock = threading.Lock()
        self.running: dict[str, str] = {}
        self.done = self.failed = 0
        self.t0 = time.monotonic()
        self.live = None
        if mode == "live":
            from rich.console import Console
            from rich.live import Live

            self.live = Live(self._render(), console=Console(file=self.stream), refresh_per_second=8,
                             transient=False)
            self.live.start()

    def _render(self):
        from rich.console import Group
        from rich.table import Table
        from rich.text import Text

        head = Text(f"mla-doctor audit: {self.done}/{self.total} done, {self.failed} not ok, "
                    f"{len(self.running)} running  ({time.monotonic() - self.t0:.0f}s)", style="bold")
        t = Table(show_edge=False, pad_edge=False)
        t.add_column("host")
        t.add_column("current step")
        for h, step in sorted(self.running.items())[:20]:
            t.add_row(Text(terminal.line(h)), Text(terminal.line(step)))  # Text: no rich markup ([link=...])
        if len(self.running) > 20:
            t.add_row(f"... {len(self.running) - 20} more", "")
        return Group(head, t) if self.running else head

    def _line(self, text: str) -> None:
        if self.mode == "plain":
            self.stream.write(f"[{time.strftime('%H:%M:%S')}] {terminal.line(text)}\n")  # host-provided text
            self.stream.flush()
        elif self.live is not None:
            self.live.update(self._render())

    def started(self, host: str) -> None:
        with self.lock:
            self.running[host] = "start"
            self._line(f"{host}: start")

    def step(self, host: str, msg: str) -> None:
        with self.lock:
            if host in self.running:
                self.running[host] = msg
            if not (isinstance(msg, terminal.Note) and self.mode == "plain"):  # a log gets the step once
                self._line(f"{host}: {msg}")

    def finished(self, host: str, report) -> None:
        with self.lock:
            self.running.pop(host, None)
            self.done += 1
            if report.exit_status() != ExitStatus.OK:
                self.failed += 1
            why = f" - {report.error}" if report.error else ""
            self._line(f"{host}: {report.verdict().upper()}{why} ({self.done}/{self.total} done, "
                       f"{self.failed} not ok)")

    def close(self) -> None:
        if self.live is not None:
            self.live.update(self._render())
            self.live.stop()


_DOING = {"static": "connecting, reading the install, hashing its files, resolving the attention code",
          "patch": "connecting, reading the install, hashing its files, resolving the patch targets"}


class Status:
    """One line on a terminal's stderr while a one-host command works: the command, the host, what it does and
    for how long (redrawn every `interval` s, so a long phase is seen to go on), erased before the report. Said
    within the first second of the command; nothing when stderr is no terminal or the output is JSON."""

    def __init__(self, command: str, host: str, stream=None, interval: float = 0.5):
        self.command, self.host = command, terminal.line(host)  # a host name from ssh_config: no escapes
        self.stream = stream or sys.stderr
        self.interval = interval
        self.doing = _DOING.get(command, "working")
        self.t0 = time.monotonic()
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._tick, name="mla-doctor-status", daemon=True)

    @classmethod
    def for_command(cls, command: str, host: str, fmt: str, stream=None) -> Status | None:
        stream = stream or sys.stderr
        try:
            tty = stream.isatty()
        except (AttributeError, ValueError):
            tty = False
        return cls(command, host, stream).start() if tty and fmt != "json" else None

    def _draw(self) -> None:
        import shutil

        text = (f"mla-doctor {self.command} on {self.host}: {self.doing} "
                f"({time.monotonic() - self.t0:.0f}s)")
        width = shutil.get_terminal_size((80, 24)).columns - 1
        self.stream.write("\r\x1b[2K" + text[:max(width, 20)])
        self.stream.flush()

    def _erase(self) -> None:
        self.stream.write("\r\x1b[2K")
        self.stream.flush()

    def _tick(self) -> None:
        while not self.done.wait(self.interval):
            with self.lock:
                if not self.done.is_set():
                    self._draw()

    def start(self) -> Status:
        with self.lock:
            self._draw()
        self.thread.start()
        return self

    def say(self, progress):
        """`progress` (a step's own lines) printed above the status line, which goes on below them; a Note
        (a wait's seconds and the server's newest line) is shown on the status line itself, until the next step."""
        def said(msg: str) -> None:
            with self.lock:
                self._erase()
                if isinstance(msg, terminal.Note):
                    self.doing = terminal.line(msg)
                else:
                    self.doing = _DOING.get(self.command, "working")
                    if progress is not None:
                        progress(msg)
                if not self.done.is_set():
                    self._draw()
        return said

    def stop(self) -> None:
        with self.lock:
            if not self.done.is_set():
                self.done.set()
                self._erase()
        if self.thread.is_alive() and self.thread is not threading.current_thread():
            self.thread.join(timeout=1)


def without_notes(progress):
    """`progress` for a plain log (no terminal): each step once, never a wait's Note every few seconds."""
    if progress is None:
        return None
    return lambda msg: None if isinstance(msg, terminal.Note) else progress(msg)
