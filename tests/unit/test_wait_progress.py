"""The wait while a restarted server loads its model (a minute on a busy CPU host) is seen to go on (issue 32):
every few seconds a Note — the step, the seconds waited, the server's newest log line, redacted — drawn on a
terminal's status line; a piped log gets the step once and no line every 10 s. wait_ready runs for real against a
stand-in run and HTTP door (pure logic: the clock is real, WAIT_NOTE_S made short)."""
from __future__ import annotations

import io

from mla_doctor.cli.progress import Progress, Status, without_notes
from mla_doctor.host.live import steps
from mla_doctor.terminal import Note


class _Tick:
    alive = True


class _Run:
    """What wait_ready uses of a LiveRun: step, tick (reads the log) and the log lines read so far."""

    def __init__(self):
        self.steps: list[str] = []
        self.log_lines: list[dict] = []

    def step(self, msg):
        self.steps.append(msg)

    def tick(self):
        n = len(self.log_lines)
        self.log_lines.append({"n": n, "text": f"INFO loading weights {n} Authorization: Bearer sk-secret{n}"})
        return _Tick()


class _NotUp:
    def try_request(self, *_a, **_k):
        return 503, None, "loading"


class _Facts:
    fatal_patterns: list = []


def test_a_model_load_wait_says_its_seconds_and_the_newest_log_line(monkeypatch):
    monkeypatch.setattr(steps, "WAIT_NOTE_S", 0.9)
    run = _Run()
    ok, why, _info = steps.wait_ready(run, _NotUp(), _Facts(), 3.5)
    assert not ok and "not ready after" in why
    assert run.steps[0] == steps.WAIT_LABEL and not isinstance(run.steps[0], Note), run.steps
    notes = [s for s in run.steps if isinstance(s, Note)]
    assert len(notes) >= 2, run.steps  # one every WAIT_NOTE_S, not one at the end
    assert all(n.startswith(steps.WAIT_LABEL + " — ") and "s waited; server log: INFO loading weights" in n
               for n in notes), notes
    assert "sk-secret" not in " ".join(notes), notes  # a log line is host text: redacted like every progress line


def test_a_note_leaves_out_vllm_s_line_prefix_the_message_needs_the_width():
    line = "(EngineCore pid=3031) INFO 12-03 18:59:57 [default_loader.py:501] Loading weights took 0.01 seconds"
    assert steps.wait_note("wait", 20, [{"text": line}]) == \
        "wait — 20s waited; server log: Loading weights took 0.01 seconds"
    assert steps.wait_note("wait", 20, [{"text": "Traceback (most recent call last):"}]).endswith(
        "server log: Traceback (most recent call last):")


def test_on_a_terminal_a_note_is_the_status_line_not_a_printed_line(monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # a status line is one line, cut to the terminal's width
    stream, printed = io.StringIO(), []
    st = Status("run", "sandbox", stream=stream, interval=60)
    said = st.say(printed.append)
    said("wait for the server (model load)")
    said(Note("wait for the server (model load) — 20s waited; server log: INFO loading weights"))
    assert printed == ["wait for the server (model load)"]
    assert "20s waited; server log: INFO loading weights" in stream.getvalue().rsplit("\r", 1)[-1]
    said("prompt short (1 tokens)")  # the next step: printed, the status line back to what the command does
    assert printed[-1] == "prompt short (1 tokens)"
    assert "waited" not in stream.getvalue().rsplit("\r", 1)[-1]
    st.stop()  # the status line is erased before the report (a Status that cannot stop breaks every command)
    assert stream.getvalue().endswith("\r\x1b[2K")


def test_piped_a_note_is_never_a_line():
    printed = []
    log = without_notes(printed.append)
    log("wait for the server (model load)")
    log(Note("wait for the server (model load) — 10s waited"))
    assert printed == ["wait for the server (model load)"]

    out = io.StringIO()
    fleet = Progress(1, "plain", stream=out)
    fleet.started("gpu-a")
    fleet.step("gpu-a", "wait for the server (model load)")
    fleet.step("gpu-a", Note("wait for the server (model load) — 10s waited"))
    assert "waited" not in out.getvalue() and out.getvalue().count("wait for the server") == 1, out.getvalue()
    assert fleet.running["gpu-a"].endswith("10s waited")  # a live table would show it
