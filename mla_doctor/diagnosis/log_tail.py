"""The newest part of a big paste without reading the rest as lines: what `bounded_lines` keeps, found by
seeking.

`bounded_lines` keeps the newest MAX_LOG_BYTES of a log; on a 50 MB paste it decoded and queued 40 MB of lines
only to drop them. For a regular file, `tail_lines` gives the very same `Bounded` (the same lines kept, the same
counts) but streams lines only from a little before the kept part: the part before is counted in raw chunks
(its newlines, and its lines over the line cap, by `bytes.find`), never decoded. When the kept part reaches back
to where the streaming started (text whose characters are fewer than its bytes, a cut line), it starts again
further back, so the answer never depends on the guess.
"""
from __future__ import annotations

import os
from typing import BinaryIO

from mla_doctor.diagnosis.log_normalise import MAX_LINE, MAX_LOG_BYTES, Bounded, bounded_lines

CHUNK = 1 << 20


def _count(f: BinaryIO, end: int, max_line: int) -> tuple[int, int]:
    """(lines, lines over `max_line` bytes) in [0, end) of `f`, which ends just after a newline."""
    f.seek(0)
    lines = long = 0
    run = 0           # bytes of the line still open at the chunk's start
    half = max(1, (max_line + 1) // 2)
    pos = 0
    while pos < end:
        c = f.read(min(CHUNK, end - pos))
        if not c:
            break
        first = c.find(b"\n")
        if first < 0:
            run += len(c)
            pos += len(c)
            continue
        if run + first > max_line:
            long += 1
        n = c.count(b"\n")
        lines += n
        last = c.rfind(b"\n")
        last_long = -1  # the start of the last line counted as long here (seen in several windows: counted once)
        # a line of more than max_line bytes holds a whole aligned window of `half` bytes without a newline
        p = first + 1
        while p < last:
            if c.find(b"\n", p, min(p + half, last)) < 0:
                st = c.rfind(b"\n", 0, p) + 1
                en = c.find(b"\n", p)
                if en - st > max_line and st != last_long:
                    long += 1
                    last_long = st
            p += half
        run = len(c) - last - 1
        pos += len(c)
    return lines, long


def tail_lines(f: BinaryIO, max_bytes: int = MAX_LOG_BYTES, max_line: int = MAX_LINE) -> Bounded:
    """`bounded_lines(f)` of a seekable regular file, reading as lines only its newest part."""
    size = os.fstat(f.fileno()).st_size
    back = max_bytes + 4 * max_line + 4096
    while True:
        start = size - back
        if start <= 0:
            f.seek(0)
            return bounded_lines(f, max_bytes, max_line)
        # the streaming starts on a line's start: after the first newline at or past start - 1
        f.seek(start - 1)
        skipped = 0
        while True:
            piece = f.readline(CHUNK)
            skipped += len(piece)
            if not piece or piece.endswith(b"\n"):
                break
        begin = start - 1 + skipped
        tail = bounded_lines(f, max_bytes, max_line)
        if tail.dropped_lines == 0 and begin > 0:
            back *= 4  # the kept part may reach further back than streamed: start again, further
            continue
        lines, long = _count(f, begin, max_line)
        return Bounded(tail.lines, tail.first_line + lines, tail.total_lines + lines, begin + tail.total_bytes,
                       tail.dropped_lines + lines, tail.cut_lines + long)
