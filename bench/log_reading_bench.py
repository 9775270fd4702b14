#!/usr/bin/env python3
"""Benchmark: the one log reader on the inputs issue 18/20 name, in CPU time (process_time) and peak memory.

  (a) a 100 MB log through `explain`'s path: streamed (log_normalise.bounded_lines: the newest 8 MiB, lines cut
      at 16 KiB), then read (read_log: normaliser, matcher with its step budget) and explained;
  (b) a 1 MB single line, the same way;
  (c) a 15 KB paste and 100 long lines that made the old nested-lazy regexes backtrack for minutes: the old
      regex (Format.regexes, what the matcher used to run) in a child process with a time limit, against the
      linear matcher now used;
  (d) every real log of tests/fixtures/real_logs, read one by one.

Prints a Markdown table. Numbers are this machine's; the tests assert only bounded work and memory.
Measured 2026-12-01 on the shared 2-core dev machine (CPU seconds; peak traced in a second, traced run):

| input | CPU | peak (tracemalloc) | note |
|---|---|---|---|
| (a) 100 MB log, explain | 5.0 s | 82 MiB | kept lines 584662-635501 (the newest 8 MiB), not stopped |
| (b) 1 MB single line, explain | 0.01 s | 1.3 MiB | cut lines: 1 |
| (c) 1000-char adversarial line, 10 formats: old regex | 0.009 s | - | linear matcher: 0.0001 s |
| (c) 4000-char adversarial line, 10 formats: old regex | 0.392 s | - | linear matcher: 0.0002 s |
| (c) 15000-char adversarial line, 10 formats: old regex | > 30 s (stopped) | - | linear matcher: 0.0002 s |
| (d) real logs, each read | 0.001 s | - | 64 logs |

Before (issue 18): `explain` read the whole file (a 100 MB log took ~5 GB) and the nested-lazy regexes took
minutes on a 15 KB paste.

    .venv/bin/python bench/log_reading_bench.py [--old-limit 20]
"""
from __future__ import annotations

import argparse
import io
import multiprocessing
import sys
import time
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mla_doctor.diagnosis.explain import explain  # noqa: E402
from mla_doctor.diagnosis.log_normalise import bounded_lines  # noqa: E402
from mla_doctor.diagnosis.log_reading import matcher, read_log  # noqa: E402

LINE = (b"(EngineCore_DP0 pid=7) INFO 12-01 10:00:00 [loggers.py:1] Engine 000: Avg prompt throughput: 0.0 "
        b"tokens/s, Avg generation throughput: 12.3 tokens/s, Running: 1 reqs\n")


class Made(io.RawIOBase):
    def __init__(self, total: int, line: bytes):
        self.left, self.pos = total, 0
        self.block = line * max(1, (1 << 20) // len(line))

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


def measure(fn):
    """(result, CPU seconds without tracing, peak traced bytes of a second, traced run)."""
    t0 = time.process_time()
    got = fn()
    cpu = time.process_time() - t0
    tracemalloc.start()
    fn()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return got, cpu, peak


def explain_stream(size: int, line: bytes):
    kept = bounded_lines(io.BufferedReader(Made(size, line), 1 << 16))
    ex = explain(kept.numbered())
    return kept, ex


def _many(f) -> bool:
    chunks = f.plan()[0]
    return len(chunks) >= 4 and all(len(c) >= 2 for c in chunks)


def adversarial(f, size: int) -> str:
    """The format's first literal, its middle literals repeated, and never its last: every split of the lazy
    groups is tried before the regex fails (the old matcher's blow-up)."""
    chunks = f.plan()[0]
    mid = "".join(chunks[1:-1])
    return chunks[0] + mid * max(1, (size - len(chunks[0])) // max(1, len(mid)))


def _old_regex(size: int, q) -> None:
    fmts = [f for f in matcher().formats if _many(f)][:10]
    t0 = time.process_time()
    for f in fmts:
        rx = f.regexes()[0][0]
        rx.match(adversarial(f, size))
    q.put(time.process_time() - t0)


def old_vs_new(size: int, limit: float) -> tuple:
    q = multiprocessing.Queue()
    p = multiprocessing.Process(target=_old_regex, args=(size, q))
    p.start()
    p.join(limit)
    if p.is_alive():
        p.terminate()
        p.join()
        old = "> %.0f s (stopped)" % limit
    else:
        old = "%.3f s" % q.get()
    fmts = [f for f in matcher().formats if _many(f)][:10]
    from mla_doctor.diagnosis.log_reading import _linear

    t0 = time.process_time()
    for f in fmts:
        chunks, kinds, heads, _partials = f.plan()
        text = adversarial(f, size)
        _linear(text, chunks, kinds)
        for upto, _lit in heads:
            _linear(text, chunks, kinds, upto)
    return old, "%.4f s" % (time.process_time() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old-limit", type=float, default=20.0)
    args = ap.parse_args()
    rows = []
    (kept, ex), cpu, peak = measure(lambda: explain_stream(100 << 20, LINE))
    rows.append(("(a) 100 MB log, explain", "%.1f s" % cpu, "%.0f MiB" % (peak / 2 ** 20),
                 "kept lines %d-%d, stopped: %s" % (kept.first_line, kept.total_lines,
                                                    (ex.reading.stopped or {}).get("at_line", "no"))))
    (kept, ex), cpu, peak = measure(lambda: explain_stream(1 << 20, b"Using " + b"(x%s " * 100))
    rows.append(("(b) 1 MB single line, explain", "%.2f s" % cpu, "%.1f MiB" % (peak / 2 ** 20),
                 "cut lines: %d" % kept.cut_lines))
    for size in (1000, 4000, 15000):
        old, new = old_vs_new(size, args.old_limit)
        rows.append(("(c) %d-char adversarial line, 10 formats (3+ placeholders): old regex" % size, old, "-",
                     "linear matcher: " + new))
    logs = sorted((ROOT / "tests/fixtures/real_logs").glob("*.log"))
    t0 = time.process_time()
    for p in logs:
        read_log(p.read_text(encoding="utf-8", errors="replace").splitlines())
    rows.append(("(d) real logs, each read", "%.3f s" % ((time.process_time() - t0) / max(1, len(logs))), "-",
                 "%d logs" % len(logs)))
    print("| input | CPU | peak (tracemalloc) | note |\n|---|---|---|---|")
    for r in rows:
        print("| %s | %s | %s | %s |" % r)


if __name__ == "__main__":
    main()
