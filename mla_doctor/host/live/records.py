"""The probe's records checked by type before the controller uses them.

A record is written by the server's own processes (the service user can write anything there, forged or
broken): each field the controller reads has one type, checked here once, so a malformed record is counted
and reported (a finding, a restore problem), never a traceback (exit 70) deeper in the run. The agent
filters the same way (agent/change/records.py); this is the controller's own check, not a trust in it.
"""
from __future__ import annotations

from typing import Any

from mla_doctor.results import Finding, Severity

EVENTS = ("armed", "call", "counters", "attached", "detached")
_INT = ("pid", "epoch", "seq", "calls", "q_rows", "unknown_rows", "since_detail", "ppid", "tp_rank", "restored",
        "caches", "caches_skipped", "caches_restored", "loggers_restored")
_STR = ("event", "role", "function", "target", "layer", "run", "class", "process", "comm", "python", "argv0",
        "reason", "error")
_BOOL = ("layer_inferred", "capturing", "nested", "debug_logs")
_NUM = ("ts", "wrap_ms")
_STR_LISTS = ("wrapped", "still_wrapped", "modules_not_loaded")
_DYNAMO = ("dynamo", "dynamo_before", "dynamo_after")
# the detach answer's rows (the agent's, about processes the service user runs)
_ROW_INT = ("pid", "pid_before", "pid_after")
_ROW_TIME = ("start_time_before", "start_time_after")
_ROW_BOOL = ("attached", "detached")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and v == v and abs(v) != float("inf")


def _dynamo_problem(v: Any) -> str | None:
    """torch.compile's counters: {"stats"|"frames"|"recompiles": {name: int}, "compiled_frames": int|None}."""
    if v is None:
        return None
    if not isinstance(v, dict):
        return f"a mapping, not {type(v).__name__}"
    for k, d in v.items():
        if k == "compiled_frames":
            if d is not None and not _is_int(d):
                return f"compiled_frames an integer, not {type(d).__name__}"
            continue
        if not isinstance(d, dict) or not all(isinstance(n, str) and _is_int(c) for n, c in d.items()):
            return f"{k!s:.40}: a mapping of names to integers"
    return None


def _scalar_counts(d: dict) -> bool:
    """Counts as the probe takes them from the call's locals: integers, a flag, or unknown (None)."""
    return all(isinstance(n, str) and (c is None or isinstance(c, int)) for n, c in d.items())


def _tokens_problem(v: Any) -> str | None:
    """A call's sizes: {"q_rows": int|None, "q_from": str, COUNT: int|bool, "metadata": {NAME: int|bool|None}}."""
    if v is None:
        return None
    if not isinstance(v, dict):
        return f"a mapping, not {type(v).__name__}"
    if v.get("q_rows") is not None and not _is_int(v.get("q_rows")):
        return "q_rows is not an integer"
    if v.get("q_from") is not None and not isinstance(v.get("q_from"), str):
        return "q_from is not a string"
    meta = v.get("metadata")
    if meta is not None and not (isinstance(meta, dict) and _scalar_counts(meta)):
        return "metadata is not a mapping of names to counts"
    if not _scalar_counts({k: c for k, c in v.items() if k not in ("q_from", "metadata")}):
        return "a count is not an integer"
    return None


def record_problem(rec: Any, event: str | None = None) -> str | None:
    """Why `rec` is not a probe record as the probe writes it (of `event` when given), or None."""
    if not isinstance(rec, dict):
        return f"not an object but {type(rec).__name__}"
    if rec.get("event") not in EVENTS or (event is not None and rec.get("event") != event):
        return f"event {str(rec.get('event'))[:40]!r} is not {event or ' / '.join(EVENTS)}"
    if not _is_int(rec.get("pid")):
        return "pid is not an integer"
    for keys, ok, what in ((_INT, _is_int, "an integer"), (_STR, lambda v: isinstance(v, str), "a string"),
                           (_BOOL, lambda v: isinstance(v, bool), "true/false"), (_NUM, _is_num, "a number")):
        for k in keys:
            v = rec.get(k)
            if v is not None and not ok(v):
                return f"{k} is not {what} ({type(v).__name__})"
    for k in _STR_LISTS:
        v = rec.get(k)
        if v is not None and not (isinstance(v, list) and all(isinstance(x, str) for x in v)):
            return f"{k} is not a list of strings"
    why = _tokens_problem(rec.get("tokens"))
    if why:
        return f"tokens: {why}"
    for k in _DYNAMO:
        why = _dynamo_problem(rec.get(k))
        if why:
            return f"{k}: {why}"
    return None


def well_typed(rec: Any) -> bool:
    return record_problem(rec) is None


def process_row_problem(p: Any) -> str | None:
    """Why one process row of an attach/detach answer cannot be used, or None. Its `attached_record` and
    `detached_record` are the probe's own records (written by the service user): checked as records."""
    if not isinstance(p, dict):
        return f"not an object but {type(p).__name__}"
    for k in _ROW_INT:
        if p.get(k) is not None and not _is_int(p.get(k)):
            return f"{k} is not an integer"
    for k in _ROW_TIME:
        if p.get(k) is not None and not (_is_num(p.get(k)) or isinstance(p.get(k), str)):
            return f"{k} is not a time"
    for k in _ROW_BOOL:
        if p.get(k) is not None and not isinstance(p.get(k), bool):
            return f"{k} is not true/false"
    if p.get("comm") is not None and not isinstance(p.get("comm"), str):
        return "comm is not a string"
    for k, event in (("attached_record", "attached"), ("detached_record", "detached")):
        if p.get(k) is not None:
            rec = p[k]  # the agent picked it by its event and pid: those two may be left out of a row
            why = record_problem({"event": event, "pid": 0, **rec} if isinstance(rec, dict) else rec, event)
            if why:
                return f"its {event} record: {why}"
    return None


def malformed_findings(live: dict) -> list[Finding]:
    """The run's malformed records (counted by `LiveRun.records`), said in the report."""
    bad = live.get("records_malformed")
    if not bad:
        return []
    return [Finding("PROBE_RECORDS_MALFORMED", Severity.WARN,
                    f"{bad['count']} probe record(s) from the server's processes were malformed and left out of "
                    "the verdict (the service user can write the records)", evidence=list(bad["examples"]))]
