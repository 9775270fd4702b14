"""The lines that start a server process (knowledge/log_runs.yaml) are real: every start's format is a string
in the real sources of the corpus releases, its regex reads the line rendered from that format with vLLM's own
prefix, and every release of the corpus logs at least one server start and one engine start, so every release's
log can be cut into processes."""
from __future__ import annotations

import ast
import inspect
import re
from functools import lru_cache
from pathlib import Path

import pytest
import yaml

from mla_doctor.diagnosis.log_reading import RUNS_FILE, load_run_starts, message_of, split_runs
from tests.support.corpus import RELEASES, cached_json, ensure

pytestmark = pytest.mark.corpus

STARTS = yaml.safe_load(RUNS_FILE.read_text(encoding="utf-8"))["starts"]
DIRS = ("entrypoints", "engine", "v1/engine")
_TEMPLATE_VAR = re.compile(r"\$\{\w+\}")   # the logo's colour variables (string.Template), empty without a TTY


def _needle(fmt: str) -> str:
    return max(fmt.strip().split("%s"), key=len)


NEEDLES = sorted({_needle(s["format"]) for s in STARTS})


def _all_strings(root: str) -> list[str]:
    """Every string constant (adjacent literals joined, as Python joins them) of the release's entrypoint and
    engine modules that hold a start's longest literal part (only those are parsed), colour variables removed."""
    out = []
    for d in DIRS:
        base = Path(root) / d
        for p in sorted(base.rglob("*.py")) if base.is_dir() else []:
            text = _TEMPLATE_VAR.sub("", p.read_text(encoding="utf-8", errors="replace"))
            if not any(n in text for n in NEEDLES):
                continue
            for node in ast.walk(ast.parse(p.read_text(encoding="utf-8", errors="replace"))):
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    out.append(_TEMPLATE_VAR.sub("", node.value))
    return out


_SALT = inspect.getsource(_all_strings) + repr(DIRS) + _TEMPLATE_VAR.pattern + repr(NEEDLES)


@lru_cache(maxsize=None)
def _strings(dist: str, version: str) -> tuple:
    # read once per release and cached beside the other derived corpus data (the tree never changes)
    return tuple(cached_json("start-strings", dist, version, _SALT,
                             lambda: _all_strings(str(ensure(dist, version) / "vllm"))))


def strings_of(dist: str, version: str, needle: str) -> list[str]:
    """The release's entrypoint and engine strings that hold ``needle``."""
    return [s for s in _strings(dist, version) if needle in s]


def in_sources(dist: str, version: str, fmt: str) -> bool:
    return any(fmt.strip() in s for s in strings_of(dist, version, _needle(fmt)))


@pytest.mark.parametrize("dist, version", RELEASES)
def test_every_release_logs_a_server_and_an_engine_start(dist, version):
    kinds = {s["kind"] for s in STARTS if in_sources(dist, version, s["format"])}
    assert kinds == {"server", "engine"}, (dist, version, kinds)


def test_every_start_is_a_real_format_and_reads_its_rendered_line():
    found = {s["id"]: [f"{d}-{v}" for d, v in RELEASES if in_sources(d, v, s["format"])] for s in STARTS}
    assert all(found.values()), {k: v for k, v in found.items() if not v}
    for s in STARTS:
        line = "(APIServer pid=7) INFO 12-01 01:16:19 [api_server.py:1] " + s["format"].replace("%s", "0.9.2")
        msg = message_of(line)[0]
        assert [sid for sid, _k, rx in load_run_starts() if rx.match(msg)] == [s["id"]], (s["id"], msg)
        # the same process logging it again is the next process
        assert len(split_runs([line, line])) == 2
