"""Issue 27's outsider red team, saved reports: `report render|merge` of a file another machine wrote (a shard, a
report someone sent). A value of the wrong type inside a host (a finding's severity a list, a prompt's name a
number, timings as text...) was an internal error (exit 70, no report) in every format. Now the sections every
writer reads are checked by type at load (a usage error naming the file, the host and the field), and anything
deeper that still does not fit is a usage error naming the file — never exit 70.

Fast: the real CLI for the two attacks as found, then a sampled fuzz of every host field in-process."""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mla_doctor import reports
from mla_doctor.errors import UsageError
from mla_doctor.host.answer import fill

from tests.unit.test_reports import doc as fleet_doc

REPO = Path(__file__).resolve().parents[2]


def _cli(*args, cwd):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLA_DOCTOR_")}
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run([sys.executable, "-m", "mla_doctor", *args], capture_output=True, text=True, timeout=60,
                          env=env, cwd=cwd)


@pytest.mark.parametrize("host, field", [
    ({"host": "h", "findings": [{"code": 1, "severity": ["fail"], "summary": None}]}, "findings[0]"),
    ({"host": "h", "live": {"restore_problems": "abc"}, "prompts": [{"name": 1, "calls": "x"}]}, "prompts[0]"),
    ({"host": "h", "timings": {"connect_s": "soon"}}, "timings"),
    ({"host": "h", "vllm": {"version": [1]}}, "vllm: version")])
def test_a_hostile_saved_report_is_a_usage_error_naming_file_host_and_field(tmp_path, host, field):
    saved = tmp_path / "shard.json"
    saved.write_text(json.dumps({"tool": "mla-doctor", "hosts": [host]}))
    for args in (("report", "render", str(saved), "--format", "html"), ("report", "merge", str(saved))):
        p = _cli(*args, cwd=tmp_path)
        assert p.returncode == 2, p.stdout + p.stderr
        assert f"{saved}: hosts[0] (h): {field}" in p.stderr, p.stderr
        assert "internal error" not in p.stderr


def _base() -> dict:
    base = json.loads(json.dumps(fleet_doc()))
    base.pop("fleet")
    h = copy.deepcopy(base["hosts"][0])
    h.update(host="live1", live={"method": "attach", "restore_problems": ["x"], "attach": {"processes": []}},
             prompts=[{"name": "short", "calls": {"forward_mqa": {"calls": 1, "tokens": 1}},
                       "expected": {"prefill": "mqa"}, "observed": {"prefill": "mqa", "decode": "mqa"}}],
             answer={"backend": "X"}, model={"config": {}}, server={"pid": 1}, restored=True)
    base["hosts"].append(h)
    return base


HOSTILE = [1, "x", [1], {"a": [1]}, True]


def _trials(base: dict):
    """Each host field, each field one level inside it (a list's first object's too), set to hostile values."""
    for hi, host in enumerate(base["hosts"][:1] + base["hosts"][-1:]):
        hi = base["hosts"].index(host)
        for key in host:
            for v in HOSTILE:
                yield lambda d, k=key, v=v, i=hi: d["hosts"][i].__setitem__(k, v)
            inner = host[key][0] if isinstance(host[key], list) and host[key] and isinstance(host[key][0], dict) \
                else host[key] if isinstance(host[key], dict) else None
            for sub in inner or {}:
                for v in HOSTILE[::2]:
                    def set_sub(d, k=key, s=sub, v=v, i=hi):
                        t = d["hosts"][i][k]
                        (t[0] if isinstance(t, list) else t)[s] = v
                    yield set_sub


def test_no_hostile_value_in_any_host_field_is_an_internal_error():
    """The fuzz that found the crashes (730 of 3,784 trials were exit 70 before): sampled here to stay fast.
    Every trial is refused at load or rendered in every format, or a usage error; none raises anything else."""
    base, n, refused = _base(), 0, 0
    for mutate in _trials(base):
        d = copy.deepcopy(base)
        mutate(d)
        n += 1
        try:
            d = reports.check_report("shard.json", json.loads(json.dumps(d)))
            with reports.saved(["shard.json"]):
                d = reports.finish(fill(d))
                for fmt in ("text", "json", "junit", "markdown"):
                    reports.render(d, fmt, 0)
        except UsageError as e:
            assert "shard.json" in e.message
            refused += 1
    assert n > 200 and refused > 50, (n, refused)


def test_control_the_well_formed_report_renders_in_every_format():
    d = reports.check_report("shard.json", _base())
    with reports.saved(["shard.json"]):
        d = reports.finish(fill(d))
        for fmt in ("text", "json", "junit", "markdown", "html"):
            assert reports.render(d, fmt, 0)
