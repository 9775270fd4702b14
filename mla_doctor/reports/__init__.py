"""Fleet reports: the JSON document (RunReport's contract + a `fleet` key), its merge, and writers.

Every writer takes the JSON document (a dict), so `report merge` of shard reports renders the
same formats as an audit: json, text, markdown, junit, html.
"""
from __future__ import annotations

import contextlib
import errno
import importlib
import json
import os
import stat
import time
from collections import Counter
from typing import Any

from mla_doctor.errors import UsageError
from mla_doctor.exit_codes import ExitStatus, worst
from mla_doctor.redact import redact_tree
from mla_doctor.report_sections import ModelSection, StaticSection, VllmSection
from mla_doctor.results import HostReport, RunReport, backend_of

FORMATS = ("text", "json", "junit", "markdown", "html")
_WRITERS = {"text": "mla_doctor.reports.fleet_text", "junit": "mla_doctor.reports.junit",
            "markdown": "mla_doctor.reports.markdown", "html": "mla_doctor.reports.html"}
_OVERALL_ORDER = ("unreachable", "error", "fail", "warn")
# keys that differ between two runs of the same audit (times, sizes on the wire)
VOLATILE_HOST_KEYS = ("timings", "transport", "steps")


def fleet_document(reports: list[HostReport], meta: dict[str, Any], started: float, duration: float) -> dict:
    run = RunReport(command="audit", hosts=sorted(reports, key=lambda h: h.host), started=started,
                    duration_s=duration)
    doc = run.to_dict()
    doc["fleet"] = dict(meta)
    finish(doc)
    return doc


def _status(value) -> ExitStatus:
    try:
        return ExitStatus(int(value or 0))
    except (TypeError, ValueError):
        return ExitStatus.INTERNAL


def finish(doc: dict) -> dict:
    """(Re)compute everything derived from the hosts: overall, exit status, fleet summary, retry list.
    A shard whose audit failed as a whole (`fleet.failed_shards`) keeps the result from ever being OK."""
    hosts = doc["hosts"]
    verdicts = [h.get("verdict") for h in hosts]
    failed_shards = (doc.get("fleet") or {}).get("failed_shards") or []
    if failed_shards:
        verdicts.append("error")
    doc["overall"] = next((v for v in _OVERALL_ORDER if v in verdicts), "ok")
    status = worst([_status(h.get("exit_status", 0)) for h in hosts]
                   + [_status(s.get("exit_status")) for s in failed_shards])
    doc["exit_status"], doc["exit_name"] = int(status), status.name
    fleet = doc.setdefault("fleet", {})
    fleet["summary"] = summary(hosts)
    fleet["retry"] = retry_hosts(doc)
    return doc


def retry_hosts(doc: dict) -> list[str]:
    """Hosts that did not end OK: a fault, an error, unreachable, not restored, or not run."""
    return sorted(h["host"] for h in doc["hosts"] if h.get("exit_status", 0) != 0)


def host_version(h: dict) -> str:
    v = VllmSection.of(h.get("vllm"))
    if not v.version:
        return "-"
    return v.version if v.distribution in (None, "vllm") else f"{v.version} ({v.distribution})"


def host_backend(h: dict) -> str | None:
    return backend_of(h)


def _version_key(text: str):
    from packaging.version import InvalidVersion, Version

    try:
        return (0, Version(text.split()[0]), text)
    except (InvalidVersion, IndexError):
        return (1, None, text)


def summary(hosts: list[dict]) -> dict[str, Any]:
    verdicts = Counter(h.get("verdict") for h in hosts)
    return {
        "hosts": len(hosts),
        "verdicts": {k: verdicts.get(k, 0) for k in ("ok", "warn", "fail", "error", "unreachable")},
        "vllm_versions": dict(sorted(Counter(host_version(h) for h in hosts if h.get("vllm")).items(),
                                     key=lambda kv: _version_key(kv[0]))),
        "backends": dict(sorted(Counter(host_backend(h) or "not observed" for h in hosts
                                        if h.get("status") == "ok").items())),
        "modified_files": {h["host"]: StaticSection.of(h.get("static")).get("modified_files") for h in hosts
                           if StaticSection.of(h.get("static")).modified_files},
        "unreachable": sorted(h["host"] for h in hosts if h.get("status") == "unreachable"),
        "not_run": sorted(h["host"] for h in hosts if h.get("error_kind") == "NotRun"),
    }


def merge(docs: list[tuple[str, dict]]) -> dict:
    """Combine shard reports (path, document) into one; a host in two shards is an error."""
    if not docs:
        raise UsageError("report merge: give at least one report")
    seen: dict[str, str] = {}
    hosts: list[dict] = []
    playbooks = set()
    failed_shards = []
    for path, doc in docs:
        check_report(path, doc)
        shard_status = _status(doc.get("exit_status", 0))
        hosts_status = worst(_status(h.get("exit_status", 0)) for h in doc["hosts"])
        if doc.get("overall") == "error" and not doc["hosts"] or (
                shard_status != hosts_status and shard_status != ExitStatus.OK):
            # the audit of this shard failed as a whole (a usage error, an interruption, a bug): never OK
            failed_shards.append({"path": path, "exit_status": int(shard_status) or int(ExitStatus.HOST_ERROR),
                                  "error": doc.get("error") or f"shard ended {shard_status.name}"})
        if not doc.get("fleet") and not doc["hosts"]:
            continue
        playbooks.add((doc.get("fleet") or {}).get("playbook"))
        for h in doc["hosts"]:
            if h["host"] in seen:
                raise UsageError(f"report merge: host {h['host']} is in both {seen[h['host']]} and {path}")
            seen[h["host"]] = path
            hosts.append(h)
    if len(playbooks) > 1:
        raise UsageError("report merge: the reports ran different playbooks: "
                         + ", ".join(sorted(str(p) for p in playbooks)))
    first = docs[0][1]
    started = min((d.get("started") for _, d in docs if d.get("started")), default=None)
    out = {
        "tool": "mla-doctor", "version": first.get("version"), "command": first.get("command", "audit"),
        "overall": "ok", "exit_status": 0, "exit_name": "OK",
        "started": started or time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "duration_s": max(float(d.get("duration_s") or 0) for _, d in docs),
        "hosts": sorted(hosts, key=lambda h: h["host"]),
    }
    meta = {k: v for k, v in (first.get("fleet") or {}).items() if k not in ("summary", "retry", "shard")}
    meta["shard"] = None
    if "selected" in meta:
        meta["selected"] = len(hosts)
    if "peak_running" in meta:
        meta["peak_running"] = max(int((d.get("fleet") or {}).get("peak_running") or 0) for _, d in docs)
    if "stopped_early" in meta:
        meta["stopped_early"] = any((d.get("fleet") or {}).get("stopped_early") for _, d in docs)
    meta["merged_from"] = [{"path": p, "shard": (d.get("fleet") or {}).get("shard")} for p, d in docs]
    if failed_shards:
        meta["failed_shards"] = failed_shards
    out["fleet"] = meta
    return finish(out)


def comparable(doc: dict) -> dict:
    """The document without what legitimately differs between runs (times, wire sizes, shard info)."""
    d = json.loads(json.dumps(doc))
    for k in ("started", "duration_s"):
        d.pop(k, None)
    fl = d.get("fleet") or {}
    for k in ("shard", "merged_from", "limit", "forks", "peak_running", "retry_file"):
        fl.pop(k, None)
    for h in d["hosts"]:
        for k in VOLATILE_HOST_KEYS:
            h.pop(k, None)
        for k in ("agent_s",):
            (h.get("timings") or {}).pop(k, None)
        v = h.get("vllm") or {}
        v.pop("_elapsed_s", None)
    return d


def render(doc: dict, fmt: str, width: int = 0) -> str:
    """The report in `fmt`; `width` fits the text page to a terminal (0: not wrapped; other formats ignore it)."""
    doc = redact_tree(doc)  # the last net: a saved report (`report render|merge`) is redacted like a live one
    if fmt == "json":
        return json.dumps(doc, indent=2) + "\n"
    if fmt not in _WRITERS:
        raise UsageError(f"unknown report format {fmt!r} ({', '.join(FORMATS)})")
    # writers load on demand (jinja2 only for html); each imports its rows from this module
    writer = importlib.import_module(_WRITERS[fmt])
    return writer.render(doc, width) if fmt == "text" else writer.render(doc)


MAX_JSON_DEPTH = 100  # a report nests ~10 deep; every walker (redaction, writers, json.dumps) recurses


def load_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except OSError as e:
        raise UsageError(f"{path}: cannot read report: {e.strerror or e}") from e
    except json.JSONDecodeError as e:
        raise UsageError(f"{path}:{e.lineno}: not JSON: {e.msg}") from e
    except RecursionError:
        raise UsageError(f"{path}: not an mla-doctor report: JSON nested too deeply to parse "
                         f"(a report nests at most {MAX_JSON_DEPTH} levels)") from None
    if json_depth(doc, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
        raise UsageError(f"{path}: not an mla-doctor report: JSON nested deeper than {MAX_JSON_DEPTH} levels")
    return doc


def json_depth(doc: Any, stop: int) -> int:
    """The nesting depth of a parsed JSON value, walked without recursion; counting stops past `stop`."""
    deepest, todo = 0, [(doc, 1)]
    while todo:
        node, d = todo.pop()
        if isinstance(node, (dict, list)):
            deepest = max(deepest, d)
            if d > stop:
                return d
            todo.extend((v, d + 1) for v in (node.values() if isinstance(node, dict) else node))
    return deepest


# a saved report's sections by type (the writers read them as such; another machine's file may not be)
_HOST_KINDS = (("findings", list), ("static", dict), ("vllm", dict), ("groups", list), ("model", dict),
               ("server", dict), ("live", dict), ("answer", dict), ("log", dict), ("timings", dict),
               ("transport", dict), ("evidence", dict), ("prompts", list), ("steps", list), ("error", str),
               ("error_kind", str), ("status", str), ("verdict", str), ("address", str))


def _strs(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


def _host_fields_problem(h: dict) -> str | None:
    """The fields inside a host's sections that every writer reads, by type (a finding's code and summary, a
    prompt's name, the timings' numbers, the release's version...)."""
    for j, f in enumerate(h.get("findings") or []):
        if not isinstance(f, dict) or not all(isinstance(f.get(k), str) for k in ("code", "severity", "summary")):
            return f"findings[{j}] is not a finding (an object with string code, severity and summary)"
        if f.get("evidence") is not None and not _strs(f["evidence"]):
            return f"findings[{j}]: evidence is not a list of strings"
        if f.get("action") is not None and not isinstance(f["action"], str):
            return f"findings[{j}]: action is not a string"
    for j, pr in enumerate(h.get("prompts") or []):
        if not isinstance(pr, dict) or not isinstance(pr.get("name", ""), str):
            return f"prompts[{j}] is not a prompt (an object with a string name)"
        for k in ("calls", "expected", "observed", "per_rank", "drafter_calls", "routing"):
            if pr.get(k) is not None and not isinstance(pr[k], dict):
                return f"prompts[{j}]: {k} is not an object"
    for k, v in (h.get("timings") or {}).items():
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            return f"timings: {k} is not a number"
    for k in ("version", "distribution", "install_kind", "path", "python"):
        v = (h.get("vllm") or {}).get(k)
        if v is not None and not isinstance(v, str):
            return f"vllm: {k} is not a string"
    for k in ("modified_files", "missing_files"):
        v = (h.get("static") or {}).get(k)
        if v is not None and not _strs(v):
            return f"static: {k} is not a list of strings"
    live = h.get("live") or {}
    if live.get("restore_problems") is not None and not _strs(live["restore_problems"]):
        return "live: restore_problems is not a list of strings"
    if any(not isinstance(st, dict) for st in h.get("steps") or []):
        return "steps: a step is not an object"
    return None


def check_report(path: str, doc) -> dict:
    """A saved mla-doctor JSON report, or a usage error naming the file and what is wrong."""
    if not isinstance(doc, dict) or doc.get("tool") != "mla-doctor" or not isinstance(doc.get("hosts"), list):
        raise UsageError(f"{path}: not an mla-doctor JSON report (expected an object with \"tool\": "
                         "\"mla-doctor\" and a \"hosts\" list)")
    for i, h in enumerate(doc["hosts"]):
        if not isinstance(h, dict) or not isinstance(h.get("host"), str):
            raise UsageError(f"{path}: hosts[{i}] is not a host report (an object with a \"host\" name)")
        for key, kind in _HOST_KINDS:
            if h.get(key) is not None and not isinstance(h[key], kind):
                what = "an object" if kind is dict else "a list" if kind is list else "a string"
                raise UsageError(f"{path}: hosts[{i}] ({h['host']}): {key!r} is not {what}")
        why = _host_fields_problem(h)
        if why:
            raise UsageError(f"{path}: hosts[{i}] ({h['host']}): {why}")
        try:
            ExitStatus(h.get("exit_status") or 0)
        except (TypeError, ValueError) as e:
            raise UsageError(f"{path}: hosts[{i}] ({h['host']}): exit_status {h.get('exit_status')!r} is not an "
                             "mla-doctor exit status") from e
    if doc.get("fleet") is not None and not isinstance(doc["fleet"], dict):
        raise UsageError(f"{path}: \"fleet\" is not an object")
    d = doc.get("duration_s")
    if d is not None and (isinstance(d, bool) or not isinstance(d, (int, float))):
        raise UsageError(f"{path}: 'duration_s' is not a number")
    if doc.get("started") is not None and not isinstance(doc["started"], str):
        raise UsageError(f"{path}: 'started' is not a time (a string)")
    return doc


@contextlib.contextmanager
def saved(paths: list[str]):
    """Reading and rendering saved reports (a shard another machine wrote, a file someone sent): a value of a
    wrong type deeper than `check_report` looks is that file's fault, a usage error naming it (exit 2), never an
    internal error (exit 70). Only around saved documents: the tool's own reports are never caught here."""
    try:
        yield
    except (TypeError, AttributeError, ValueError, KeyError, IndexError) as e:
        raise UsageError(f"{', '.join(paths)}: not a well-formed mla-doctor report ({type(e).__name__}: "
                         f"{str(e)[:200]})") from e


def load_report(path: str) -> dict:
    return check_report(path, _no_lone_surrogates(load_json(path)))


def _no_lone_surrogates(v: Any) -> Any:
    """A saved report is any JSON: "\\ud800" alone decodes to a str no writer (or terminal) can encode: kept
    visible as the escape it was, never a UnicodeEncodeError (exit 70) in every format."""
    if isinstance(v, str):
        return v.encode("utf-8", "backslashreplace").decode("utf-8") if any(
            "\ud800" <= c <= "\udfff" for c in v) else v
    if isinstance(v, list):
        return [_no_lone_surrogates(x) for x in v]
    if isinstance(v, dict):
        return {_no_lone_surrogates(k): _no_lone_surrogates(x) for k, x in v.items()}
    return v


def open_report(path: str):
    """FILE for writing a report, never through a link another user planted: a final symlink is followed only
    when it is ours or root's (an operator's own link), otherwise refused -- `-o /tmp/report.txt` as root must not
    write /etc/shadow through a link a local user put there (fs.protected_symlinks is not on everywhere)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    follow = st is not None and stat.S_ISLNK(st.st_mode) and st.st_uid in (os.geteuid(), 0)
    if st is not None and stat.S_ISLNK(st.st_mode) and not follow:
        raise OSError(errno.ELOOP, f"a symlink owned by uid {st.st_uid}: not followed")
    # no O_TRUNC before the owner is known (another user's file keeps its bytes); O_NONBLOCK: a FIFO without a
    # reader is ENXIO, never a hang
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK | (0 if follow else os.O_NOFOLLOW)
                 | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        why = foreign_output(os.fstat(fd), _anonymous_pipe(fd))
        if why:
            raise OSError(errno.EPERM, why)
        os.set_blocking(fd, True)
        if stat.S_ISREG(os.fstat(fd).st_mode):
            os.ftruncate(fd, 0)
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "w", encoding="utf-8", errors="backslashreplace")  # a lone surrogate from JSON: no crash


def _anonymous_pipe(fd: int) -> bool:
    """`-o /dev/stdout` into `| less`: a pipe the invoking shell made (owned by whoever ran `sudo`), no file."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}").startswith("pipe:")
    except OSError:
        return False


def foreign_output(st: os.stat_result, anonymous_pipe: bool = False) -> str | None:
    """Why a report must not go to this existing file, or None. Another user's regular file or named FIFO (a
    `/tmp/x.json` a local user pre-created to read the report or to have root write into a file of theirs) is
    refused; devices (`/dev/null`, a terminal) and anonymous pipes are not files anyone plants."""
    if stat.S_ISCHR(st.st_mode) or anonymous_pipe:
        return None
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISFIFO(st.st_mode)):
        return "not a regular file"
    if st.st_uid != os.geteuid():
        return f"an existing file owned by uid {st.st_uid}, not by us (uid {os.geteuid()}): not written"
    return None


def write(path: str, text: str) -> None:
    try:
        with open_report(path) as f:
            f.write(text)
    except OSError as e:
        raise UsageError(f"{path}: cannot write report: {e.strerror or e}") from e


def entry_cell(st: StaticSection, key: str) -> str:
    """One top-level entry for a table cell: the served model's (static.entries_from), per platform when the
    host's platform is unknown and its family builds a layer per platform, 'none' where its layer has none."""
    src = st.extra_.get("entries_from")
    src = src if isinstance(src, dict) else {}
    per = src.get("per_platform") if src.get("depends_on_platform") else None
    if isinstance(per, dict):
        def one(v: Any) -> str:
            return "shared split" if v == "generic" else (v.get("symbol") if isinstance(v, dict) else "none")
        cells = {p: one(e.get(key)) for p, e in per.items()}
        if len(set(cells.values())) == 1:
            return next(iter(cells.values()))
        return "by platform: " + ", ".join(f"{p} {c}" for p, c in cells.items())
    return st.symbol(key) or ("none" if src else "-")


def host_rows(doc: dict) -> list[dict[str, Any]]:
    """One flat row per host, shared by the text, Markdown and HTML writers."""
    from mla_doctor.reports import first_screen
    rows = []
    for h in doc["hosts"]:
        st = StaticSection.of(h.get("static"))
        fails = [f["code"] for f in h.get("findings") or [] if f.get("severity") == "fail"]
        warns = [f["code"] for f in h.get("findings") or [] if f.get("severity") == "warn"]
        cls = ModelSection.of(h.get("model")).classification
        rows.append({
            "host": h["host"], "verdict": h.get("verdict"), "exit": h.get("exit_status"),
            "version": host_version(h), "backend": host_backend(h) or "-",
            "prefill": entry_cell(st, "prefill_entry"),
            "decode": entry_cell(st, "decode_entry"),
            # sparse about the served model (DSA or not), not about the release's gate
            "sparse": "-" if cls.get("is_sparse") is None else ("yes" if cls["is_sparse"] else "no"),
            "sparse_gate": "yes" if st.sparse_gate.get("present") else ("no" if st else "-"),
            "warns": warns,
            # the problem column: the error, else the failures, then the warnings
            "problem": h.get("error") or ", ".join(fails + [f"warn {w}" for w in warns]),
            # the answer: the live verdict per prompt where the host ran one, else the static one
            "path_verdict": first_screen.verdict_cell(h),
            "modified": list(st.modified_files),
            "error": h.get("error"), "fails": fails, "groups": h.get("groups") or [],
        })
    return rows
