"""Recorded fixtures stay readable in a diff: the agent recordings in the recorder's layout (tests/support/
fixture_json.py: indented, small values on one line, long texts line by line), and no fixture line anywhere
over MAX_LINE. A line longer than fixture_json.WIDTH holds one string JSON cannot break (a log line, an HTTP
body); the server logs (tests/fixtures/logs) are verbatim, so their longest line is the server's own (vLLM's
engine config line, ~3.4 kB)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.support import fake_agent, record_agent
from tests.support.fixture_json import WIDTH, dumps, join_text, split_text

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
AGENT = sorted((FIXTURES / "agent").glob("*.json"))
MAX_LINE = 4096
_STRING = r'"(?:[^"\\]|\\.)*"'
# a line of one scalar under a key, or one string: what is wide there is a string (the key or the value)
ONE_STRING = re.compile(rf"^ *(({_STRING}: )?{_STRING}|{_STRING}: ([-+.\deE]+|true|false|null|\[\]|{{}})),?$")


def test_no_fixture_line_is_over_the_limit():
    files = [p for p in FIXTURES.rglob("*") if p.is_file()]
    assert AGENT and len(files) > len(AGENT)
    long = [f"{p.relative_to(FIXTURES)}:{i}: {len(line)} chars"
            for p in files for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
            if len(line) > MAX_LINE]
    assert not long, long


@pytest.mark.parametrize("path", AGENT, ids=lambda p: p.name)
def test_agent_recordings_are_in_the_recorders_layout(path):
    text = path.read_text()
    assert text == dumps(split_text(json.loads(text))), f"{path.name}: not as record_agent.save writes it"
    lines = text.splitlines()
    wide = [i for i, line in enumerate(lines, 1) if len(line) > WIDTH and not ONE_STRING.match(line)]
    assert not wide, f"{path.name}: lines over {WIDTH} holding more than one scalar: {wide[:5]}"
    assert len(lines) > 10 * len(json.loads(text)["exchanges"])  # far finer than one exchange per line


def test_the_recorder_writes_what_is_committed(tmp_path, monkeypatch):
    """Re-recording keeps the layout: save() of a recording's content writes its committed bytes again."""
    monkeypatch.setattr(record_agent, "FIXTURES", tmp_path)
    for path in AGENT:
        doc = join_text(json.loads(path.read_text()))  # what the recorder holds: texts whole
        assert record_agent.save(path.stem, doc).read_bytes() == path.read_bytes(), path.name


def test_split_texts_come_back_whole():
    probe = "\n".join(f"line {i}  \t with \\ and \"quotes\"" for i in range(40)) + "\n"
    doc = {"plan": {"source": probe, "short": "a\nb", "n": [1, {"x": probe}]}, "kind": "agent"}
    stored = split_text(doc)
    assert stored["plan"]["source"] == {"$lines": probe.split("\n")} and stored["plan"]["short"] == "a\nb"
    assert join_text(json.loads(dumps(stored))) == doc
    # the replay reads texts whole: a recorded probe source (stored line by line) is one string again
    plans = [ex["plan"] for ex in fake_agent.load("run_local")["exchanges"] if ex.get("kind") == "agent"]
    sources = [p["probe"]["source"] for p in plans if p["op"] == "patch"]
    assert sources and all(isinstance(s, str) and s.count("\n") > 10 for s in sources)
