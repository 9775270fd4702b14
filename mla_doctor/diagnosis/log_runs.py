"""The server processes in one log: a restart appends, so one file can hold several; each is cut at its
start line (``knowledge/log_runs.yaml``). Pure."""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Pattern, Sequence, Tuple

from mla_doctor.diagnosis.knowledge import load_data
from mla_doctor.diagnosis.log_normalise import MAX_LINE, clean_line, split_record

__all__ = ["ProcessRun", "load_run_starts", "run_start_patterns", "split_runs", "numbered", "RUNS_FILE"]

RUNS_FILE = Path(__file__).with_name("knowledge") / "log_runs.yaml"


@functools.lru_cache(maxsize=1)
def load_run_starts() -> List[Tuple[str, str, Pattern[str]]]:
    """(id, kind, regex over the message) of the lines a server process logs once, as it starts."""
    data = load_data(RUNS_FILE)
    return [(s["id"], s["kind"], re.compile(s["text"])) for s in data["starts"]]


def run_start_patterns() -> Dict[str, str]:
    """The start lines as the agent's unanchored log patterns (ids ``run_start_<id>``): the agent sends them
    with the evidence lines, and keeps the newest process's lines first when it must cut."""
    return {"run_start_" + sid: rx.pattern.lstrip("^") for sid, _kind, rx in load_run_starts()}


@dataclass
class ProcessRun:
    """One server process's lines in a log: from its start line to the next process's."""
    index: int                             # 0 = the oldest in the log
    first_line: int                        # log line number (the agent's ``n``) of its first line
    last_line: int
    lines: int                             # how many of the given lines are its
    started: bool                          # its start line is in the log (False: started before the log begins)
    start_line: Optional[int] = None
    start: Optional[str] = None            # the start's id (knowledge/log_runs.yaml)
    pids: Dict[str, int] = field(default_factory=dict)   # process tag -> pid: {"APIServer": 61, "EngineCore": 82}
    version: Optional[str] = None          # as its engine line states it

    def to_dict(self) -> dict:
        return {"index": self.index, "first_line": self.first_line, "last_line": self.last_line,
                "lines": self.lines, "started": self.started, "start_line": self.start_line, "start": self.start,
                "pids": dict(self.pids), "version": self.version}


def _items(lines: Sequence[Any]) -> List[Tuple[int, str]]:
    out = []
    for i, item in enumerate(lines or [], 1):
        if isinstance(item, dict):
            out.append((int(item.get("n") or i), str(item.get("text") or "")))
        else:
            out.append((i, str(item)))
    return out


def numbered(lines: Sequence[Any]) -> List[dict]:
    """The lines as the agent sends them, ``{"n", "text"}``: a slice of them keeps the log's line numbers."""
    return [{"n": n, "text": t} for n, t in _items(lines)]


def split_runs(lines: Sequence[Any]) -> List[Tuple[ProcessRun, List[Any]]]:
    """The log cut into server processes, oldest first, each with its own items (as given).

    A process starts at its API server's start line (``vLLM API server version``, the logo's version line,
    ``non-default args``) or, where the log has none, its engine's (``Initializing a V1 LLM engine``); one
    process logs each of these once (per process tag: data-parallel engines each log theirs), so a start line
    already seen in the current process, or a server start after the engine's, begins the next. PIDs alone
    cannot tell: a container's server is PID 1 after every restart. Lines before the first start belong to a
    process that started before the log begins."""
    starts = load_run_starts()
    runs: List[Tuple[ProcessRun, List[Any]]] = []
    seen: set = set()
    has_engine = False
    pre: List[Tuple[Optional[str], Optional[str]]] = []   # (tag, pid) of the lines before the first start
    for (n, raw), item in zip(_items(lines), lines or []):
        text, tags, pid = clean_line(raw[:MAX_LINE])
        msg = split_record(text)[0]
        hit = next(((sid, kind) for sid, kind, rx in starts if rx.match(msg)), None)
        tag = tags[-1] if tags else None
        if hit is not None and runs:
            # data-parallel engines (EngineCore_DP0, _DP1) each log their start: the same start counts again
            # only from the same process tag
            new = (hit[0], tag) in seen or (hit[1] == "server" and has_engine)
        else:
            new = not runs
        if new:
            run = ProcessRun(len(runs), n, n, 0, hit is not None)
            runs.append((run, []))
            seen, has_engine = set(), False
        run, items = runs[-1]
        items.append(item)
        run.lines += 1
        run.last_line = n
        if hit is not None:
            sid, kind = hit
            seen.add((sid, tag))
            if run.start_line is None:
                run.started, run.start_line, run.start = True, n, sid
            if kind == "engine":
                has_engine = True
                vm = re.match(r"^Initializing an? (?:V[01] )?LLM engine \(v([^)\s]+)\)", msg)
                if vm and run.version is None:
                    run.version = vm.group(1)
        if tag and tag != "pid" and pid is not None:
            if run.index == 0 and run.start_line is None:
                pre.append((tag, str(pid)))
            else:
                run.pids.setdefault(tag, pid)
    return _split_head(runs, pre)


def _split_head(runs: List[Tuple[ProcessRun, List[Any]]],
                pre: List[Tuple[Optional[str], Optional[str]]]) -> List[Tuple[ProcessRun, List[Any]]]:
    """The lines before the log's first start line are the first process's own preamble (Python warnings, the
    logo's first lines, the platform detection) unless one of them names a process tag with another PID than
    that process has: then they are the end of a process that started before the log begins."""
    if not runs:
        return runs
    first, items = runs[0]
    if first.start_line is None or not any(tag in first.pids and int(str(pid)) != first.pids[tag]
                                           for tag, pid in pre):
        for tag, pid in pre:
            first.pids.setdefault(str(tag), int(str(pid)))
        return runs
    head_n = sum(1 for it_n, _t in _items(items) if it_n < (first.start_line or 0))
    head = ProcessRun(0, first.first_line, 0, head_n, False)
    head_items = items[:head_n]
    head.last_line = _items(head_items)[-1][0] if head_items else first.first_line
    for tag, pid in pre:
        head.pids.setdefault(str(tag), int(str(pid)))
    first.first_line, first.lines = first.start_line or first.first_line, first.lines - head_n
    out = [(head, head_items), (first, items[head_n:])] + runs[1:]
    for i, (run, _its) in enumerate(out):
        run.index = i
    return out


