"""What a pasted log carries around vLLM's own lines, recognised, stripped and reported. Pure.

Real pastes are rarely what vLLM wrote: a launcher puts ``[0] `` or ``[rank0]:`` in front, ``docker logs
--timestamps`` / journald / Ray put a time (any format, with an offset) and a host, vLLM's own processes
put one or more ``(EngineCore_DP0 pid=…)`` tags (Ray nests them: ``(EngineCore pid=1) (RayWorkerWrapper
pid=2)``), terminals leave colour escapes (real ``\\x1b[…m``, or pasted as ``^[[0;36m`` / ``[0;36m``),
a paste starts with the shell prompt that ran the server, a terminal or an issue body wraps a long line
(or glues several lines into one), and progress bars arrive as mojibake (``â–ˆ``).

``normalise`` turns such lines into vLLM's own records, each with the ORIGINAL line number(s) it came
from, its process tags, and a summary of what it stripped (``Normalised.stripped``), so the reader's
evidence still points at the pasted line. Every pattern here is linear in the line's length (no nested
lazy groups), and a line longer than ``MAX_LINE`` is cut (and said to be).
"""
from __future__ import annotations

import re
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Deque, Dict, Iterable, List, Optional, Sequence, Tuple

__all__ = ["MAX_LINE", "MAX_LOG_BYTES", "NormLine", "Normalised", "normalise", "clean_line", "bounded_lines",
           "Bounded", "WRAP_WIDTH", "split_record"]

MAX_LINE = 16384          # characters of one line read; the rest is cut (a 1 MB line is a paste accident)
MAX_LOG_BYTES = 8 << 20   # bytes of a log kept (the newest); a 100 MB log is read for its last 8 MiB
WRAP_WIDTH = 160          # a line at least this long, followed by a bare fragment, was wrapped by the paste

# real escapes, caret notation (^[[0;36m), and bare remnants whose ESC was lost ([0;36m, [0m, [1m)
_ESC = re.compile(r"(?:\x1b|\^\[)\[[0-9;?]*[A-Za-z]|\[(?:\d{1,3};)*\d{1,3}m|\x1b\(B|\x1b[=>]")
_GLOG = {"I": "INFO", "W": "WARNING", "E": "ERROR", "F": "CRITICAL"}
_CR = re.compile(r"(?:\^M|\r)+$")
# the launcher's rank: "[0] ", "[rank0]: ", "[default3]:", "[1,0]<stdout>:"
_LAUNCHER = re.compile(r"^\[(?:rank|default)?\d{1,5}(?:,\d{1,5})?\](?:<std(?:out|err)>)?:? ?")
# docker compose / kubectl --prefix: "vllm-1  | ", "[pod/vllm-0/vllm] " (alone when a glued split cut it off)
_SERVICE = re.compile(r"^(?:[\w.-]{1,64} {1,8}\|(?: |$)|\[pod/[\w./-]{1,200}\](?: |$))")
# a time in front of the record: ISO 8601 / RFC 3339 (T or space, fraction, Z or offset), bracketed or not,
# journald/syslog short ("Dec 01 01:16:19 host python[61]: ", the month in the host's locale: "авг 18 14:15:04 …",
# "déc. 01 …", "12月 01 …"), a bare clock ("10:00:01.123 ")
_TS = re.compile(
    r"^\[?(?:\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}:\d{2}(?:[.,]\d{1,9})?(?: ?(?:Z|UTC|[+-]\d{2}:?\d{2}))?"
    r"|(?:[^\W\d_]{3,5}\.?|\d{1,2}\u6708) [ \d]\d \d{2}:\d{2}:\d{2}(?:\.\d{1,9})?)\]?"
    r"(?: [\w.-]{1,64} [\w./-]{1,64}(?:\[\d{1,10}\])?:)?(?: |$)")
# the kernel's clock on a dmesg line pasted with the log: seconds since boot ("[ 8123.456789] "), or dmesg -T's
# wall clock ("[Sun Mar 24 23:54:53 2024] "); journalctl -k's "Mar 24 23:54:53 host kernel: " is _TS's
_KERNEL_TS = re.compile(r"^\[(?: {0,12}\d{1,10}\.\d{3,9}"
                        r"|[A-Z][a-z]{2} [A-Z][a-z]{2} [ \d]\d \d{2}:\d{2}:\d{2} \d{4})\](?: |$)")
# one process tag: "(EngineCore_DP0 pid=42)", "(pid=591)", "(pid=244, ip=10.0.0.1)", "(VllmWorker TP0 pid=3)";
# the opening "(" may have been cut off by the paste ("EngineCore_0 pid=1248800) ValueError: ...")
_TAG = re.compile(r"^\(?(?P<proc>[A-Za-z][\w.:=-]{0,63}(?: [\w.:=-]{1,32}){0,3})? ?pid=(?P<pid>\d{1,10})"
                  r"(?:, ip=[\w.:-]{1,64})?\) ?")
# a Markdown quote ("> INFO ..."): an issue comment quoting another's log
_QUOTE = re.compile(r"^>(?: |$)")
# Markdown emphasis / inline code a user wrapped a line in ("**(VllmWorker rank=5 pid=1) ERROR ...**")
_MD_OPEN = re.compile(r"^(?:\*\*|__|`{1,3})(?=[(\[A-Za-z])")
_MD_CLOSE = re.compile(r"(?<=\S)(?:\*\*|__|`{1,3}) {0,4}$")
# a terminal UI's pane border (k9s / kubectl in a TUI): "│ INFO ... │"
_PANE = re.compile(r"^[\u2502\u2503|] ")
# a tag whose "pid=… LEVEL" a launcher's re-formatting swallowed: "(VllmWorkerProcess 03-31 03:33:02 x.py:1]"
_TAG_NOPID = re.compile(r"^\((?P<proc>[A-Za-z]\w{0,63}) (?=\d{2}-\d{2} \d{1,2}:\d{2}:\d{2})")
# a launcher's own log record around vLLM's line: Rust tracing ("INFO dynamo_llm::engines::vllm::worker: VLLM: ")
_HOST_LOG = re.compile(r"^(?:TRACE|DEBUG|INFO|WARN|ERROR) {1,4}[a-z_][\w]{0,40}(?:::[\w]{1,40}){1,8}: "
                       r"(?:[A-Za-z]{1,16}: )?")
# Ray's de-duplication note at the end of a line
_RAY_REPEAT = re.compile(r" ?\[repeated \d+x across cluster\]")
# a record starting in the middle of a line (an issue body that lost its newlines, Ray's glued lines)
# vLLM's record prefix ("INFO 11-29 10:00:00 [core.py:110] ", <= 0.7 "INFO ... core.py:110] ", path-qualified
# "[v1/engine/core.py:966]"), or Ray's own ("INFO worker.py:1749 -- "); bounded classes only: linear
# The header grammar, one for every release: LEVEL, a date (MM-DD, or an ISO YYYY-MM-DD some builds and forks
# log), a time with or without a fraction, the call site with or without brackets, path-qualified or not:
#   "INFO 11-29 10:00:00 [core.py:110] ", "INFO 11-29 10:00:00 core.py:110] " (<= 0.7),
#   "INFO 2025-11-07 17:17:41.814 cuda.py:216] ", a logging config's minutes-only date format ("ERROR 02-13 18:05
#   [multiproc_executor.py:852] "), "[v1/engine/core.py:966]"; Ray's ("INFO worker.py:1749 -- ");
#   uvicorn's own ("INFO:     Shutting down"); Python's warnings ("/x/api_server.py:24: DeprecationWarning: ").
#   PyTorch's glog ("W1203 18:07:28.239000 10447 torch/_library/triton.py:53] "). Bounded classes only: linear.
_RECORD = re.compile(
    r"^(?:\[?(?:(?P<level>DEBUG|INFO|WARNING|WARN|ERROR|CRITICAL|FATAL) {1,4})?(?:\d{4}-)?\d{2}-\d{2}(?: {1,4}|T)"
    r"\d{1,2}:\d{1,2}(?::\d{1,2}(?:[.,]\d{1,9})?)?"
    r" {1,4}\[?(?P<where>[^\]\s]{0,256})\] {0,8}"
    r"|(?P<rlevel>DEBUG|INFO|WARNING|ERROR|CRITICAL) (?P<rwhere>[\w.]{1,64}\.py:\d{1,7}) -- "
    r"|(?P<ulevel>DEBUG|INFO|WARNING|ERROR|CRITICAL):(?: {1,8}|$)"
    r"|(?P<pwhere>[^\s:]{0,512}\.py:\d{1,7}): (?=[A-Z]\w{0,80}Warning: )"   # Python's warnings module
    r"|\[?(?P<glevel>[IWEF])\d{4} \d{2}:\d{2}:\d{2}(?:\.\d{1,9})?(?: {1,4}\d{1,10})? "
    r"(?P<gwhere>[^\]\s]{1,256}:\d{1,7})\] )?")
_GLUED = re.compile(r"(?<!\)) (?=\((?:[A-Za-z][\w]{0,63}(?: [\w=]{1,32}){0,3} )?pid=\d{1,10}(?:, ip=[\w.:-]{1,64})?\) )"
                    r"|(?<!\)) (?=(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) (?:\d{4}-)?\d{2}-\d{2} \d{1,2}:\d{2}:\d{2}"
                    r"(?:\.\d+)? )"
                    r"| (?=\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2},\d{3} (?:INFO|WARNING|ERROR) )")
# a shell prompt that ran something: "user@host:~/dir$ vllm serve …", "root@x:/w# docker logs …", "$ python …"
_PROMPT = re.compile(r"^(?:> ?)?(?:\([\w.-]{1,64}\) ?)?(?:[\w.-]{1,64}@[\w.-]{1,64}:[^\s$#]{0,256} ?[$#]|[$#]) (?=\S)")
# UTF-8 read as cp1252/latin-1: "â–ˆ" (█), "â–" (▏…▉), "Â " (nbsp)
_MOJIBAKE = re.compile("(?:\u00e2[\u0080-\u02ff\u2000-\u20ff]{1,2}|\u00c2(?=[\u00a0 ]))+")
_RECORD_START = re.compile(r"^(?:\[?(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) (?:\d{4}-)?\d{2}-\d{2} |Traceback \("
                           r"|File \"|\d{2}-\d{2} \d{2}:)")
# a line that starts a block of its own by its structure, never the tail of a wrapped line: an exception line,
# a C++ abort and its what(), a fatal signal, multiprocessing's "Process EngineCore_0:"
_STRUCT_START = re.compile(r"^(?:terminate called |what\(\):|Fatal Python error|Process [\w.:-]{1,64}:$"
                           r"|(?:[A-Za-z_]\w{0,63}\.){0,8}[A-Z]\w{0,80}(?:Error|Exception|Exit|Interrupt)(?::|$))")
_WORD = re.compile(r"\w")
_LEVEL_START = re.compile(r"^(?:DEBUG|INFO|WARNING|WARN|ERROR|CRITICAL)\b")
# a line that begins a record of its own (never the tail of a wrapped one)
_OWN_START = re.compile(r"^(?:\s|Traceback|File \"|[A-Z]|\(|\[|\{|$|#|[-=*]{3}|\d{4}-\d{2}-\d{2}|\d{2}-\d{2} )")


@dataclass
class NormLine:
    n: int                                   # the original line number (of the first line joined into it)
    text: str                                # vLLM's record ("INFO 11-29 10:00:00 [core.py:1] msg") or message
    tags: Tuple[str, ...] = ()               # process tags, outermost first ("EngineCore", "RayWorkerWrapper")
    pid: Optional[int] = None                # of the innermost tag
    ns: Tuple[int, ...] = ()                 # every original line it came from (a wrapped line: several)
    cut: bool = False                        # longer than MAX_LINE: the rest was not read
    original: str = ""                       # the pasted line, colour removed, when the record is all of it

    @property
    def process(self) -> Optional[str]:
        return self.tags[-1] if self.tags else None


@dataclass
class Normalised:
    lines: List[NormLine] = field(default_factory=list)
    # kind -> {"count", "first_line", "example"}: what was stripped (launcher, timestamp, process_tag,
    # several_tags, escape, carriage_return, ray_repeat, mojibake, shell_prompt, wrapped, glued, cut, kernel_time)
    stripped: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    prompts: List[Tuple[int, str]] = field(default_factory=list)   # (line, command) of shell prompt lines

    def note(self, kind: str, n: int, example: str) -> None:
        got = self.stripped.get(kind)
        if got is None:
            self.stripped[kind] = {"count": 1, "first_line": n, "example": example[:120]}
        else:
            got["count"] += 1

    def to_dict(self) -> dict:
        return {"stripped": {k: dict(v) for k, v in sorted(self.stripped.items())},
                "shell_prompts": [{"line": n, "command": c[:300]} for n, c in self.prompts],
                "records": len(self.lines)}


def _fix_mojibake(m: "re.Match[str]") -> str:
    s = m.group()
    for enc in ("cp1252", "latin-1"):
        try:
            return s.encode(enc).decode("utf-8")
        except (UnicodeEncodeError, UnicodeDecodeError):
            continue
    return "#" * max(1, len(s) // 3)


def split_record(text: str) -> Tuple[str, Optional[str], Optional[str]]:
    """(message, level, ``file.py:N`` or path-qualified ``v1/engine/core.py:N``) of a record whose outer
    wrappers are already stripped (``log_normalise.clean_line``)."""
    m = _RECORD.match(text)
    if not m or not m.end():
        return text.strip(), None, None
    level = m.group("level") or m.group("rlevel") or m.group("ulevel") or ("WARNING" if m.group("pwhere") else None) \
        or _GLOG.get(m.group("glevel") or "")
    where = m.group("where") or m.group("rwhere") or m.group("pwhere") or m.group("gwhere")
    return text[m.end():].strip(), level, where


def clean_line(raw: str, out: Optional[Normalised] = None, n: int = 0) -> Tuple[str, Tuple[str, ...], Optional[int]]:
    """(vLLM's record, its process tags outermost first, the innermost tag's pid) of one pasted line:
    escapes, carriage returns, launcher / service / time prefixes and process tags stripped, in any order
    and any number (bounded: 12 rounds)."""
    s = raw
    if "\x1b" in s or "[" in s:
        t = _ESC.sub("", s)
        if t != s and out is not None:
            out.note("escape", n, raw)
        s = t
    t = _CR.sub("", s.rstrip("\n"))
    if t != s.rstrip("\n") and out is not None:
        out.note("carriage_return", n, raw)
    s = t.rstrip()
    if "\u00e2" in s or "\u00c2" in s:
        t = _MOJIBAKE.sub(_fix_mojibake, s)
        if t != s and out is not None:
            out.note("mojibake", n, raw)
        s = t
    if s[:1] in "\u2502\u2503" and _PANE.match(s):
        s = s[2:].rstrip()
        s = s[:-1].rstrip() if s.endswith(("\u2502", "\u2503")) else s
        if out is not None:
            out.note("pane_border", n, raw)
    if "repeated" in s:
        t = _RAY_REPEAT.sub("", s)
        if t != s and out is not None:
            out.note("ray_repeat", n, raw)
        s = t
    tags: List[str] = []
    pid: Optional[int] = None
    for _ in range(12):
        s = s.lstrip()
        for kind, rx in (("quote", _QUOTE), ("launcher", _LAUNCHER), ("service", _SERVICE), ("timestamp", _TS),
                         ("kernel_time", _KERNEL_TS), ("host_log", _HOST_LOG), ("markdown", _MD_OPEN)):
            m = rx.match(s)
            # Markdown emphasis only with its closing marker (a kernel call trace's "__handle_mm_fault+0x…" is none)
            if m and m.end() and (kind != "markdown" or _MD_CLOSE.search(s)):
                if out is not None:
                    out.note(kind, n, raw)
                s = s[m.end():]
                if kind == "markdown":
                    s = _MD_CLOSE.sub("", s)
                break
        else:
            m = _TAG.match(s)
            if m and (s.startswith("(") or not tags):
                tags.append(m.group("proc") or "pid")
                pid = int(m.group("pid"))
                s = s[m.end():]
                continue
            m = _TAG_NOPID.match(s)
            if m:
                tags.append(m.group("proc"))
                s = s[m.end():]
                continue
            break
    if tags and out is not None:
        out.note("process_tag", n, raw)
        if len(tags) > 1:
            out.note("several_tags", n, raw)
    return s, tuple(tags), pid


def _items(lines: Iterable[Any]) -> List[Tuple[int, str]]:
    items = []
    for i, item in enumerate(lines or [], 1):
        if isinstance(item, dict):
            items.append((int(item.get("n") or i), str(item.get("text") or "")))
        elif isinstance(item, NormLine):
            items.append((item.n, item.text))
        else:
            items.append((i, str(item)))
    return items


def normalise(lines: Sequence[Any], max_line: int = MAX_LINE, widths: Optional[Dict[int, int]] = None) -> Normalised:
    """The pasted lines (strings or the agent's ``{"n", "text"}``) as vLLM's records with their original
    line numbers: glued records split, wrapped ones joined, shell prompts set apart. ``widths``: the widths
    (>= 60) of lines of the same log left out of ``lines`` (log_prefilter), counted for the wrap width."""
    out = Normalised()
    prev: Optional[NormLine] = None
    prev_len = 0
    items = _items(lines)
    # a terminal or an issue that hard-wraps wraps every long line at one width: a width shared by 2+ lines
    widths = dict(widths or {})
    for _n, raw in items:
        if len(raw) >= 60:
            widths[len(raw)] = widths.get(len(raw), 0) + 1
    wrap_at = {w for w, c in widths.items() if c >= 2}
    for n, raw in items:
        cut = len(raw) > max_line
        if cut:
            out.note("cut", n, raw[:120])
            raw = raw[:max_line]
        # glued records: split where a new record begins mid-line (a bounded number of pieces)
        bare_raw = _ESC.sub("", raw) if ("\x1b" in raw or "[" in raw) else raw
        if bare_raw != raw:
            out.note("escape", n, raw)
        pieces = _GLUED.split(bare_raw, maxsplit=256) if len(raw) > 60 else [raw]
        if len(pieces) > 1:   # a piece that is only a wrapper (a time, a host) belongs to the record after it
            merged: List[str] = []
            for piece in pieces:
                if merged and not _WORD.search(clean_line(merged[-1])[0]):
                    merged[-1] += " " + piece
                else:
                    merged.append(piece)
            pieces = merged
        if len(pieces) > 1:
            out.note("glued", n, raw)
        for k, piece in enumerate(pieces):
            bare = piece.strip()
            pm = _PROMPT.match(_ESC.sub("", bare)) if bare[:1] in "$#>(" or "@" in bare[:130] else None
            if pm:
                out.note("shell_prompt", n, piece)
                out.prompts.append((n, _ESC.sub("", bare)[pm.end():]))
                prev, prev_len = None, 0
                continue
            text, tags, pid = clean_line(piece, out, n)
            length = len(piece)
            own = bool(tags) or text != piece.strip() or _LEVEL_START.match(text) or _RECORD_START.match(text) \
                or _STRUCT_START.match(text)
            # a wrapped line: a bare fragment after a line cut at the paste's wrap width, or after a long line
            if k == 0 and prev is not None and text and not own and n == prev.ns[-1] + 1 and (
                    prev_len in wrap_at or (prev_len >= WRAP_WIDTH and not _OWN_START.match(text))):
                prev.text += text
                prev.ns += (n,)
                prev.original = ""
                out.note("wrapped", n, piece)
                prev_len = length
                continue
            line = NormLine(n, text, tags, pid, (n,), cut, _ESC.sub("", raw).rstrip() if len(pieces) == 1 else "")
            out.lines.append(line)
            prev, prev_len = line, length
    return out


@dataclass
class Bounded:
    lines: List[str]
    first_line: int          # the original number of the first line kept
    total_lines: int
    total_bytes: int
    dropped_lines: int       # the oldest lines not kept (the log was over the byte cap)
    cut_lines: int           # lines longer than the line cap, cut

    def numbered(self) -> List[dict]:
        return [{"n": self.first_line + i, "text": t} for i, t in enumerate(self.lines)]

    def to_dict(self) -> dict:
        return {"total_lines": self.total_lines, "total_bytes": self.total_bytes, "kept_from_line": self.first_line,
                "dropped_lines": self.dropped_lines, "cut_lines": self.cut_lines,
                "cap_bytes": MAX_LOG_BYTES, "cap_line": MAX_LINE}


def bounded_lines(stream: Any, max_bytes: int = MAX_LOG_BYTES, max_line: int = MAX_LINE) -> Bounded:
    """Stream a binary file object line by line, keeping the newest ``max_bytes`` (a restart appends: the
    newest process is what the question is about) and at most ``max_line`` characters of each line; memory
    stays O(max_bytes + max_line) whatever the input's size or its longest line."""
    kept: Deque[str] = deque()
    size = total = n = dropped = cut = 0
    while True:
        chunk = stream.readline(max_line + 1)
        if not chunk:
            break
        total += len(chunk)
        if len(chunk) > max_line and not chunk.endswith(b"\n"):
            cut += 1
            while True:   # skip the rest of this line, in bounded pieces
                more = stream.readline(1 << 16)
                total += len(more)
                if not more or more.endswith(b"\n"):
                    break
        n += 1
        text = chunk[:max_line].decode("utf-8", "replace").rstrip("\r\n")
        kept.append(text)
        size += len(text) + 1
        while size > max_bytes and kept:
            size -= len(kept.popleft()) + 1
            dropped += 1
    return Bounded(list(kept), dropped + 1, n, total, dropped, cut)
