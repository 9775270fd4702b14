"""The reader's pre-filter over the real-log corpus: every real log (tests/fixtures/real_logs, tests/fixtures/logs)
with a short quiet run, a busy server's serving lines (tests/support/serving_log.py) and a long quiet run put
inside it, at a place of its own (before, in the middle of a traceback, after), reads the same through the
pre-filter as with every line read: the whole `explain` answer (facts, decisions, fatal lines, the process-life
reading, processes and their line counts, what was normalised, unmatched lines)."""
from __future__ import annotations

import json
import zlib
from pathlib import Path

import pytest

from mla_doctor.diagnosis import log_prefilter, log_reading
from mla_doctor.diagnosis.explain import explain
from tests.support.serving_log import serving_run

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
LOGS = sorted((FIXTURES / "real_logs").glob("*.log")) + sorted((FIXTURES / "logs").glob("*.log"))


def quiet_run(n: int) -> list:
    return ["INFO 01-01 00:00:%02d [loader.py:42] loading shard %d of the weights, nothing to see here" % (i % 60, i)
            for i in range(n)]


def answer(lines, fast: bool, monkeypatch) -> str:
    monkeypatch.setattr(log_prefilter, "MIN_LINES", 0 if fast else 10 ** 12)
    return json.dumps(explain(lines).to_dict(), sort_keys=True, default=str)


@pytest.mark.parametrize("path", LOGS, ids=lambda p: p.name[:40])
def test_a_real_log_in_a_long_paste_reads_the_same(path, monkeypatch):
    real = path.read_text(encoding="utf-8", errors="replace").splitlines()
    at = zlib.crc32(path.name.encode()) % (len(real) + 1)   # a place of its own, the same on every run
    # ~105 serving lines (requests, access and metrics lines) MARGIN quiet lines deep: none of them is left out,
    # where a pre-filter that took them for quiet would leave them out with the quiet run after them
    busy = serving_run(at, 25)
    lines = real[:at] + quiet_run(log_prefilter.MARGIN) + busy + quiet_run(2 * log_prefilter.MARGIN + 64) + real[at:]
    monkeypatch.setattr(log_prefilter, "MIN_LINES", 0)
    plan = log_prefilter.plan(lines, log_reading._prefilter_heads(None),
                              (log_reading._VERSION_LINE, log_reading._EXC))
    assert plan is not None and len(plan.skipped.ns) >= 64
    first = at + log_prefilter.MARGIN + 1
    assert not set(plan.skipped.ns) & set(range(first, first + len(busy)))
    assert answer(lines, True, monkeypatch) == answer(lines, False, monkeypatch)
