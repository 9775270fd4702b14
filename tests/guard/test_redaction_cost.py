"""Speed guard: the redaction under every report runs its patterns only on strings that could hold a secret.

A static report holds thousands of strings (paths, symbols, versions) and is redacted more than once on its way
out; running every pattern on each of them was a tenth of a `static --local` process. Counted, not timed: the
strings that reach the first pattern, over the real vLLM 0.33.0 report recorded for the speed tests."""
from __future__ import annotations

import json
from pathlib import Path

from mla_doctor import redact

ROOT = Path(__file__).resolve().parents[2]
REPORT = ROOT / "tests" / "fixtures" / "speed" / "static_vllm_0.33.0.json"


class _Counting:
    def __init__(self, pattern):
        self.pattern, self.calls = pattern, 0

    def sub(self, *a, **kw):
        self.calls += 1
        return self.pattern.sub(*a, **kw)


def _count_strings(node) -> int:
    if isinstance(node, dict):
        return sum(_count_strings(v) for v in node.values())
    if isinstance(node, list):
        return sum(_count_strings(v) for v in node)
    return isinstance(node, str)


def test_the_patterns_run_on_few_of_a_reports_strings(monkeypatch):
    doc = json.loads(REPORT.read_text())
    counting = _Counting(redact._SHAPES)
    monkeypatch.setattr(redact, "_SHAPES", counting)
    assert redact.redact_tree(doc) == doc  # a report with no secret comes back the same
    strings = _count_strings(doc)
    assert strings > 200
    assert counting.calls <= strings // 20, "%d of %d strings went through every pattern" % (counting.calls, strings)
