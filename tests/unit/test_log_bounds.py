"""Bounded work and memory for any log (issue 18/20): a 100 MB log and a 1 MB single line. Asserted on what
is bounded (memory peaks under tracemalloc, the matcher's step counter, what the read says it cut), never on
wall time: timing numbers live in bench/log_reading_bench.py."""
from __future__ import annotations

import io
import tracemalloc

from mla_doctor.diagnosis import log_reading
from mla_doctor.diagnosis.log_normalise import MAX_LINE, MAX_LOG_BYTES, bounded_lines, normalise
from mla_doctor.diagnosis.log_reading import matcher, read_log

LINE = (b"(EngineCore_DP0 pid=7) INFO 12-01 10:00:00 [loggers.py:1] Engine 000: Avg prompt throughput: 0.0 "
        b"tokens/s, Running: 0 reqs\n")
WIDE = LINE[:-1] + b" " + b"x" * 3900 + b"\n"   # ~4 KB lines: 100 MB is ~25,000 of them


class _Made(io.RawIOBase):
    """A log of ``total`` bytes made on the fly (never held whole): ``line`` repeated, or one line of ``total``."""

    def __init__(self, total: int, line: bytes):
        self.left, self.pos = total, 0
        self.block = line * max(1, (1 << 20) // len(line))   # whole lines, so the pattern wraps cleanly

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        n = min(len(buf), self.left, len(self.block) - self.pos)
        if n <= 0:
            return 0
        buf[:n] = self.block[self.pos:self.pos + n]
        self.pos = (self.pos + n) % len(self.block)
        self.left -= n
        return n


def _peak(fn):
    tracemalloc.start()
    try:
        got = fn()
        return got, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_100_mb_log_streams_in_memory_bounded_by_the_cap_not_the_input():
    size, cap = 100 << 20, 4 << 20
    stream = io.BufferedReader(_Made(size, WIDE), 1 << 16)
    kept, peak = _peak(lambda: bounded_lines(stream, max_bytes=cap))
    assert kept.total_bytes == size and kept.dropped_lines > 0
    assert sum(len(t) + 1 for t in kept.lines) <= cap
    assert kept.first_line == kept.dropped_lines + 1 and kept.numbered()[0]["n"] == kept.first_line
    assert peak < 4 * cap, "peak %d bytes for a %d-byte cap" % (peak, cap)   # was the whole file (5 GB for 100 MB)
    assert MAX_LOG_BYTES <= 64 << 20   # the default cap explain streams with


def test_a_1_mb_single_line_is_cut_while_streaming_and_read_in_bounded_steps():
    stream = io.BufferedReader(_Made(1 << 20, b"Using " + b"(x" * 100))
    kept, peak = _peak(lambda: bounded_lines(stream))
    assert kept.cut_lines == 1 and len(kept.lines) == 1 and len(kept.lines[0]) == MAX_LINE
    assert peak < 8 * MAX_LINE + (1 << 20) // 8, peak
    m = matcher()
    before = m.steps
    r = read_log(kept.lines)
    assert r.stopped is None and m.steps - before <= 64 * MAX_LINE


def test_read_log_cuts_a_huge_line_itself_and_says_so():
    line = "INFO 12-01 10:00:00 [x.py:1] Using " + "%s backend (" * 90000
    r, peak = _peak(lambda: read_log([line]))
    assert r.normalised["stripped"]["cut"]["count"] == 1
    assert peak < 64 * MAX_LINE + (8 << 20), peak   # the formats' cached data are a few MB; never O(line)


def test_the_step_budget_stops_the_read_and_says_where():
    lines = [LINE.decode().rstrip("\n")] * 2000
    r = read_log(lines, scope=False, max_steps=20_000)
    assert r.stopped is not None and 1 < r.stopped["at_line"] < 2000
    assert "budget" in r.stopped["why"] and r.stopped["records_read"] == r.stopped["at_line"] - 1
    assert read_log(lines[:10], scope=False).stopped is None


def test_matching_never_runs_the_backtracking_format_regexes(monkeypatch):
    # the compiled regexes of a format (nested lazy `(.*?)` groups: minutes on a 15 KB paste) are kept for
    # callers that want them, but the matcher reads lines with the linear str.find plan
    def boom(self):
        raise AssertionError("the matcher used a backtracking regex")

    monkeypatch.setattr(log_reading.Format, "regexes", boom)
    lines = ["INFO 12-01 10:00:00 [cuda.py:1] Using FLASHMLA attention backend out of potential backends: "
             "['FLASHMLA'].", "ValueError: " + "Selected backend " * 2000]
    r = read_log(lines)
    assert r.attention_backend.value == "FLASHMLA"


def test_the_normaliser_is_bounded_on_adversarial_lines():
    for junk in ("(" * MAX_LINE, "[" * MAX_LINE, " " * MAX_LINE + "x", "a@b:" * (MAX_LINE // 4), "\x1b[" * MAX_LINE,
                 "(pid=1) " * (MAX_LINE // 8), "INFO 12-01 10:00:00 " * (MAX_LINE // 20)):
        norm, peak = _peak(lambda j=junk: normalise([j * 4]))
        assert len(norm.lines) <= 257 and peak < 64 * MAX_LINE, (junk[:10], peak)
