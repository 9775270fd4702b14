"""A pytest plugin that keeps every report the tests make, to compare before and after a refactor.

    REPORT_CAPTURE_DIR=/tmp/cap1 pytest -p tests.support.report_capture tests/unit/test_live_steps.py ...

Each `RunReport.to_dict()` (the JSON contract) and each one-host text rendering (`host_text.render`) a test makes
is written to DIR/<test>.<n>.<kind>, with what differs between two runs of the same test masked: the start time and
durations, every `timings` value, pytest's temporary directories and process ids. Then `diff -r` two DIRs.
tests/support/report_corpus.py covers the static reports; this covers the live, patch and fleet ones the unit
tier builds with the recorded agent."""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

_DIR = os.environ.get("REPORT_CAPTURE_DIR")
_RUN_ID = re.compile(r"\b\d{8}T\d{6}-[0-9a-f]{6}\b")
_SECONDS = re.compile(r" in \d+\.\d+s ")
_TMP = re.compile(r"/tmp/pytest-of-[^/]+/pytest-\d+/[^/\s\"']*?\d*/|/tmp/tmp[\w]{6,}")
_NUM_KEYS = {"started", "duration_s", "elapsed_s", "_elapsed_s", "wall_s", "timings", "pid", "server_pid",
             "watchdog_pid", "expires", "run_id"}
_state = {"test": "none", "n": 0}


def _mask(node, key=None):
    if key == "timings" and isinstance(node, dict):  # which times were taken, in which order: kept
        return {k: "<masked>" for k in node}
    if key in _NUM_KEYS:
        return "<masked>"
    if isinstance(node, dict):
        return {k: _mask(v, k) for k, v in node.items()}
    if isinstance(node, list):
        return [_mask(v) for v in node]
    if isinstance(node, str):
        return _RUN_ID.sub("<run-id>", _TMP.sub("<tmp>/", node))
    return node


def _save(kind: str, text: str) -> None:
    _state["n"] += 1
    name = re.sub(r"[^\w.\-\[\]]", "_", _state["test"])[-180:]
    Path(_DIR, f"{name}.{_state['n']:03d}.{kind}").write_text(text, encoding="utf-8")


def pytest_configure(config):
    if not _DIR:
        return
    Path(_DIR).mkdir(parents=True, exist_ok=True)
    from mla_doctor.reports import host_text
    from mla_doctor.results import RunReport

    to_dict, render = RunReport.to_dict, host_text.render

    def to_dict_kept(self):
        d = to_dict(self)
        _save("json", json.dumps(_mask(d), indent=1, ensure_ascii=False, default=str))
        return d

    def render_kept(report, *a, **kw):
        text = render(report, *a, **kw)
        text = _RUN_ID.sub("<run-id>", _SECONDS.sub(" in <s>s ", _TMP.sub("<tmp>/", text)))
        _save("txt", re.sub(r"\b(pid|run) \S+", r"\1 <masked>", text))
        return text

    RunReport.to_dict = to_dict_kept
    host_text.render = render_kept


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    _state["test"], _state["n"] = item.nodeid.split("::", 1)[-1], 0
