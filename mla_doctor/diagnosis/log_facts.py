"""Each fact of a log from ALL its evidence, with the line(s) that decided it and the rule used. Pure.

``log_reading.read_log`` matches every normalised record against the release's formats; this module turns
those matches (and what the formats cannot say: process tags, traceback frames, capture progress bars,
``use_sparse=True`` in an exception) into the facts, by these precedence rules (each has a test that fails
when it is swapped, tests/unit/test_log_facts.py):

- engine: an ``Initializing a V0/V1 LLM engine`` line, else a backend line that states its engine
  (``... on V1 engine.``), else engine-only markers (``knowledge/log_markers.yaml``; conflicting markers:
  the majority, a tie stays unknown). A later kind never overrides an earlier one.
- CUDA-graph mode: the REQUESTED mode (engine config line, ``enforce_eager``, the command in a shell prompt),
  then what RAN: every downgrade, eager, profiling or capture line in order, the last one wins (consecutive
  capture bars combine: ``(mixed prefill-decode, PIECEWISE)`` + ``(decode, FULL)`` = FULL_AND_PIECEWISE).
- sparse: any proof of sparse (a sparse format, a sparse model backend, ``use_sparse=True``, "sparse not
  supported", "has no dense-MHA prefill path", an exception naming sparse) wins over ``use_sparse=False``.
- the model's attention / prefill backend: the last selection line outside the drafter's phase; a
  drafter's, encoder's or indexer's backend is reported in ``other_backends``, never as the model's.
- fatal: every fatal-format line and every traceback (with a header, frames only, V0/V1 worker ERROR tags,
  Python 3.13, pytest's ``E   X: y``) that ends in its exception line outside a WARNING/INFO record; the
  cause (``fatal_error``) is the first such exception that is not a wrapper ("See root cause above").
- unknown stays unknown: a field no line decided is ``None`` and ``unknown[field]`` says what was looked for.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Pattern, Tuple

from mla_doctor.diagnosis.knowledge import load_data

__all__ = ["Decision", "Record", "load_markers", "decide", "LOOKED_FOR", "combine_captures"]

MARKERS_FILE = Path(__file__).with_name("knowledge") / "log_markers.yaml"

# what a field needs, said when no line decided it (explain prints it with what to paste)
LOOKED_FOR = {
    "engine": "an 'Initializing a V0/V1 LLM engine' line, a backend line '... on V1 engine', or an engine-only "
              "marker (EngineCore/Worker_TP/APIServer vs VllmWorkerProcess tags, vllm/v1/ vs V0-only paths, "
              "V1-only messages); paste the server's first lines (they hold the engine line)",
    "attention_backend": "the attention backend selection line ('Using X backend', '... out of potential "
                         "backends'); paste the engine core's INFO lines while the model loads",
    "prefill_backend": "an MLA prefill line ('Using X MLA prefill backend', 'Using FlashAttention prefill for "
                       "MLA'); vLLM >= 0.22 logs it while the model loads",
    "cudagraph_mode": "the engine config line (compilation_config cudagraph_mode / enforce_eager), a downgrade "
                      "('setting cudagraph_mode=...'), 'Profiling CUDA graph memory' or 'Capturing CUDA graphs "
                      "(...)' lines; paste the start-up up to 'Graph capturing finished'",
    "sparse": "a sparse (DSA) line: a sparse backend, use_sparse=True/False in the selector's config, 'sparse "
              "not supported', 'has no dense-MHA prefill path', an indexer line",
    "fatal": "nothing: no fatal line, traceback or exception was read (fatal is empty, not unknown)",
}

_CAPTURE = re.compile(r"^Capturing CUDA graphs? \((?P<kind>mixed prefill-decode|uniform decode|decode|prefill)"
                      r", (?P<mode>PIECEWISE|FULL)\)")
_PROFILE = re.compile(r"^Profiling CUDA graph memory: ")
_PROFILE_MODE = re.compile(r"\b(PIECEWISE|FULL)=")
_TRACEBACK = re.compile(r"^(?:\+ |\| )?(?:Exception Group )?Traceback \(most recent call last\):")
_FRAME = re.compile(r"^(?:\| )?File \"[^\"]{1,1024}\", line \d{1,7}(?:, in \S{1,256})?")
_CHAINED = re.compile(r"^(?:During handling of the above exception|The above exception was the direct cause)")
_PYTEST = re.compile(r"^(?:E {1,16}(?=\S)|FAILED \S{1,512} - )")
_EXC_LINE = re.compile(r"^(?:\| )?(?P<exc>(?:[A-Za-z_]\w{0,63}\.){0,8}[A-Z]\w{0,80}?"
                       r"(?:Error|Exception|Exit|Interrupt|Warning|Group|Timeout))(?:: ?(?P<msg>.*))?$")
_CG_JSON = re.compile(r"""['"]?cudagraph_mode['"]?\s{0,4}[:=]\s{0,4}"""
                      r"""(<CUDAGraphMode\.(\w{1,32})[^>]{0,40}>|\[[\d,\s]{0,20}\]|\d{1,2}|'?"?([A-Z_]{1,32}))""")
_EAGER = re.compile(r"""\benforce_eager['"]?\s{0,4}[=:]\s{0,4}(True|False|true|false)""")
_CLI_EAGER = re.compile(r"(?:^|\s)--enforce-eager(?:\s|$)")
_CLI_CG = re.compile(r"""cudagraph_mode['"]?\s{0,4}[=:]\s{0,4}['"]?([A-Z_]{2,32})""")
_CG_VALUES = {"0": "NONE", "1": "PIECEWISE", "2": "FULL", "[2, 0]": "FULL_DECODE_ONLY", "[2, 1]": "FULL_AND_PIECEWISE"}
_MODES = ("FULL_AND_PIECEWISE", "FULL_DECODE_ONLY", "PIECEWISE", "FULL", "NONE")


@dataclass
class Decision:
    """How one field was decided: its value, the rule, the deciding line(s) and, for the CUDA-graph mode, the
    whole sequence of events (requested first)."""
    value: Any
    rule: str
    lines: List[int] = field(default_factory=list)
    text: str = ""
    events: List[Dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict:
        out = {"value": self.value, "rule": self.rule, "lines": list(self.lines), "text": self.text[:300]}
        if self.events:
            out["events"] = list(self.events)
        return out


@dataclass
class Record:
    """One normalised record as the reader saw it."""
    n: int
    ns: Tuple[int, ...]
    text: str               # the record (tags stripped)
    msg: str                # its message (level, time, [file:line] split off)
    level: Optional[str]
    where: Optional[str]
    tags: Tuple[str, ...]
    pid: Optional[int]
    fact: Any = None        # the log_reading.Fact its format gave, if any


@functools.lru_cache(maxsize=1)
def load_markers() -> dict:
    data = load_data(MARKERS_FILE)
    data["_engine"] = [(m["id"], m["engine"], m["at"], re.compile(m["text"])) for m in data["engine_markers"]]
    data["_sparse"] = [(m["id"], bool(m["value"]), re.compile(m["text"])) for m in data["sparse_markers"]]
    for key in ("sparse_in_exception", "drafter_start", "drafter_where", "fatal_wrappers", "v1_files", "v0_files"):
        data["_" + key] = re.compile(data[key])
    return data


def _cg_value(raw: Optional[str]) -> Optional[str]:
    if not raw:
        return None
    val = raw.strip().strip("'\"")
    m = re.match(r"^<?CUDAGraphMode\.([A-Z_]+)", val)
    if m:
        return m.group(1)
    val = _CG_VALUES.get(re.sub(r"\s+", "", val).replace(",", ", "), val)
    return val if val in _MODES else None


def requested_mode(text: str) -> Tuple[Optional[str], Optional[bool]]:
    """(cudagraph_mode, enforce_eager) a config line or a command states."""
    mode = None
    m = _CG_JSON.search(text)
    if m:
        mode = m.group(2) or m.group(3) or _CG_VALUES.get(re.sub(r"\s+", "", m.group(1)).replace(",", ", "))
        mode = mode if mode in _MODES else None
    em = _EAGER.search(text)
    eager = (em.group(1).lower() == "true") if em else None
    return mode, eager


def combine_captures(kinds: Dict[str, str]) -> Optional[str]:
    """The mode that captures these graphs: {batch kind: PIECEWISE|FULL} as the progress bars name them."""
    mixed, decode = kinds.get("mixed prefill-decode") or kinds.get("prefill"), kinds.get("decode") or \
        kinds.get("uniform decode")
    if mixed == "PIECEWISE" and decode == "FULL":
        return "FULL_AND_PIECEWISE"
    if mixed == "FULL":
        return "FULL"
    if mixed == "PIECEWISE":
        return "PIECEWISE"
    if decode == "FULL":
        return "FULL_DECODE_ONLY"
    return None


def _engine_markers(rec: Record, markers: dict) -> List[Tuple[str, str]]:
    out = []
    for mid, engine, on, rx in markers["_engine"]:
        if on == "tag":
            hit = any(rx.search(t) for t in rec.tags)
        elif on == "where":
            hit = bool(rec.where) and bool(rx.search(rec.where))
        elif on == "message":
            hit = bool(rx.search(rec.msg))
        else:
            hit = bool(rx.search(rec.text))
        if hit:
            out.append((mid, engine))
    f = rec.fact
    if f is not None and getattr(f, "files", None):
        if all(markers["_v1_files"].search(p) for p in f.files):
            out.append(("format_only_in_v1", "V1"))
        elif all(markers["_v0_files"].search(p) for p in f.files):
            out.append(("format_only_in_v0", "V0"))
    return out


def _exception(rec: Record) -> Optional[Tuple[str, str]]:
    msg = rec.msg
    pm = _PYTEST.match(msg)
    if pm:
        msg = msg[pm.end():]
    m = _EXC_LINE.match(msg)
    if not m:
        return None
    return m.group("exc"), msg


def decide(out: Any, recs: List[Record], prompts: List[Tuple[int, str]]) -> None:
    """Set ``out``'s (a LogReading) facts from the records, each with its Decision in ``out.decided``."""
    markers = load_markers()
    decided: Dict[str, Decision] = out.decided
    # ---- engine
    engine_line = next((r for r in recs if r.fact is not None and r.fact.kind == "engine" and r.fact.engine), None)
    stated = next((r for r in recs if r.fact is not None and r.fact.kind == "attention_backend" and r.fact.engine),
                  None)
    if engine_line is not None:
        out.engine, out.engine_line = engine_line.fact.engine, engine_line.fact
        decided["engine"] = Decision(out.engine, "engine line", [engine_line.n], engine_line.text)
    elif stated is not None:
        out.engine = stated.fact.engine
        decided["engine"] = Decision(out.engine, "backend line states the engine", [stated.n], stated.text)
    else:
        votes: Dict[str, Dict[str, int]] = {}
        for r in recs:
            for mid, eng in _engine_markers(r, markers):
                votes.setdefault(eng, {}).setdefault(mid, r.n)
        if votes:
            ranked = sorted(votes.items(), key=lambda kv: -len(kv[1]))
            if len(ranked) == 1 or len(ranked[0][1]) > len(ranked[1][1]):
                eng, ids = ranked[0]
                first = min(ids.values())
                out.engine = eng
                rule = "engine-only marker%s: %s" % ("s" if len(ids) > 1 else "", ", ".join(sorted(ids)))
                if len(ranked) > 1:
                    rule += " (over %s: %s)" % (ranked[1][0], ", ".join(sorted(ranked[1][1])))
                decided["engine"] = Decision(eng, rule, sorted(set(ids.values())),
                                             next(r.text for r in recs if r.n == first))
            else:
                out.unknown["engine"] = "conflicting engine-only markers: %s" % "; ".join(
                    "%s: %s" % (e, ", ".join(sorted(ids))) for e, ids in ranked)
    # ---- backends: the model's, apart from the drafter's, encoder's, indexer's
    drafting = False
    for r in recs:
        f = r.fact
        if not drafting and (markers["_drafter_start"].search(r.msg)):
            drafting = True
            out.drafter_line = r.n
        if f is None or f.kind not in ("attention_backend", "prefill_backend", "vision"):
            continue
        role = None
        if f.kind == "vision":
            role = "encoder"
        elif "indexer" in r.msg.lower():
            role = "indexer"
        elif drafting or (r.where and markers["_drafter_where"].search(r.where)):
            role = "drafter"
        if role is not None:
            f.role = role
            out.other_backends.append(f)
            continue
        if f.kind == "attention_backend":
            out.attention_backend = f
        else:
            out.prefill_backend = f
    for key, f in (("attention_backend", out.attention_backend), ("prefill_backend", out.prefill_backend)):
        if f is not None:
            f.role = "model"
            decided[key] = Decision(f.value, "last model %s line%s" % (
                key.replace("_", " "), " (before the drafter's phase)" if out.drafter_line else ""), [f.n], f.text)
    # ---- CUDA graphs: requested, then what ran
    _cudagraph(out, recs, prompts)
    # ---- chunked prefill
    for r in recs:
        f = r.fact
        if f is None or f.kind == "fatal":
            continue
        sets = f.sets
        if f.kind == "chunked_prefill" and sets.get("chunked_prefill") and f.groups:
            try:
                out.max_num_batched_tokens = int(f.groups[0])
            except ValueError:
                pass
        if "chunked_prefill" in sets:
            out.chunked_prefill = bool(sets["chunked_prefill"])
    # ---- sparse
    _sparse(out, recs, markers)
    # ---- fatal
    _fatal(out, recs, markers)
    for key in ("engine", "attention_backend", "prefill_backend", "cudagraph_mode", "sparse"):
        if getattr(out, key) is None and key not in out.unknown:
            out.unknown[key] = LOOKED_FOR[key]


def _cudagraph(out: Any, recs: List[Record], prompts: List[Tuple[int, str]]) -> None:
    events: List[Dict[str, Any]] = []
    req: Optional[Decision] = None
    for n, cmd in prompts:
        mode = "NONE" if _CLI_EAGER.search(cmd) else None
        cm = _CLI_CG.search(cmd)
        mode = mode or (cm.group(1) if cm and cm.group(1) in _MODES else None)
        if mode:
            req = Decision(mode, "the command in the shell prompt", [n], cmd)
            if mode == "NONE":
                out.eager = True
    for r in recs:
        f = r.fact
        kind = f.kind if f is not None else None
        if kind == "engine" or "compilation_config" in r.msg or "non-default args" in r.msg \
                or "enforce_eager" in r.msg:
            if kind == "fatal":
                continue
            mode, eager = requested_mode(r.msg)
            if eager is not None:
                out.eager = eager
            if eager:
                mode = "NONE"
            if mode:
                req = Decision(mode, "requested: %s" % ("enforce_eager=True" if eager else "cudagraph_mode in the "
                                                        "config line"), [r.n], r.text)
            continue
        run = None
        cm = _CAPTURE.match(r.msg)
        if cm:
            kinds = {cm.group("kind"): cm.group("mode")}
            if events and events[-1]["rule"] == "capture progress bars":
                kinds = dict(events[-1]["kinds"], **kinds)
                events[-1].update(kinds=kinds, value=combine_captures(kinds), lines=events[-1]["lines"] + [r.n])
                continue
            events.append({"value": combine_captures(kinds), "rule": "capture progress bars", "lines": [r.n],
                           "text": r.text[:300], "kinds": kinds})
            continue
        if _PROFILE.match(r.msg):
            modes = set(_PROFILE_MODE.findall(r.msg))
            prior = (events[-1]["value"] if events else (req.value if req else None))
            if modes == {"PIECEWISE", "FULL"}:
                run = "FULL_AND_PIECEWISE"
            elif modes == {"PIECEWISE"}:
                run = "PIECEWISE"
            elif modes == {"FULL"}:
                run = prior if prior in ("FULL", "FULL_DECODE_ONLY") else "FULL"
            if run:
                events.append({"value": run, "rule": "CUDA graph memory profiling", "lines": [r.n],
                               "text": r.text[:300]})
            continue
        if kind == "eager":
            out.eager = True
            events.append({"value": "NONE", "rule": "eager mode line", "lines": [r.n], "text": r.text[:300]})
        elif kind == "cudagraph" and f.value and f.value in _MODES:
            events.append({"value": f.value, "rule": "downgrade / override line", "lines": [r.n],
                           "text": r.text[:300]})
    for e in events:
        e.pop("kinds", None)
    out.cudagraph_events = events
    if req is not None:
        out.cudagraph_mode_requested = req.value
        out.decided["cudagraph_mode_requested"] = req
    last = next((e for e in reversed(events) if e["value"]), None)
    seq = ([{"value": req.value, "rule": req.rule, "lines": req.lines, "text": req.text[:300]}] if req else []) + events
    if last is not None:
        out.cudagraph_mode = last["value"]
        out.decided["cudagraph_mode"] = Decision(last["value"], "ran: last %s" % last["rule"], last["lines"],
                                                 last["text"], seq)
    elif req is not None:
        out.cudagraph_mode = req.value
        out.decided["cudagraph_mode"] = Decision(req.value, "as requested (no later downgrade, profiling or "
                                                 "capture line)", req.lines, req.text, seq)
    if out.cudagraph_mode == "NONE" and out.eager is None and req is not None and req.value == "NONE":
        out.eager = True
    if out.eager is None and out.cudagraph_mode and out.cudagraph_mode != "NONE":
        out.eager = False


def _sparse(out: Any, recs: List[Record], markers: dict) -> None:
    yes: Optional[Decision] = None
    no: Optional[Decision] = None
    ab = out.attention_backend
    if ab is not None and ab.value and "SPARSE" in ab.value.upper():
        yes = Decision(True, "the model's attention backend is sparse (%s)" % ab.value, [ab.n], ab.text)
    for r in recs:
        if yes is not None:
            break
        f = r.fact
        if f is not None and f.sets.get("sparse") and f.kind != "fatal":
            yes = Decision(True, "sparse format line (%s)" % f.kind, [r.n], r.text)
            break
        for mid, value, rx in markers["_sparse"]:
            if rx.search(r.msg):
                if value and yes is None:
                    yes = Decision(True, mid, [r.n], r.text)
                elif not value and no is None:
                    no = Decision(False, mid, [r.n], r.text)
                break
        else:
            if yes is None and _exception(r) and markers["_sparse_in_exception"].search(r.msg) \
                    and "use_sparse=False" not in r.msg:
                yes = Decision(True, "exception names sparse attention", [r.n], r.text)
    got = yes or no
    if got is not None:
        out.sparse = got.value
        out.decided["sparse"] = got
        out.sparse_lines = got.lines


def _fatal(out: Any, recs: List[Record], markers: dict) -> None:
    from mla_doctor.diagnosis.log_reading import Fact

    open_tb: Dict[Any, int] = {}          # process key -> first line of the traceback being read
    causes: List[Any] = []
    for r in recs:
        key = (r.tags, r.pid)
        f = r.fact
        if _TRACEBACK.match(r.msg):
            open_tb[key] = r.n
            continue
        if _FRAME.match(r.msg):
            open_tb.setdefault(key, r.n)
            continue
        if _CHAINED.match(r.msg):
            continue
        exc = _exception(r)
        pytest_form = bool(_PYTEST.match(r.msg))
        if exc is not None and (key in open_tb or pytest_form or (f is not None and f.kind == "fatal")):
            start = open_tb.pop(key, r.n)
            quiet = r.level in ("WARNING", "WARN", "INFO", "DEBUG")
            if quiet and (f is None or f.kind != "fatal"):
                continue
            if f is not None and f.kind == "fatal":
                f.value = f.value or exc[0]
                fact = f
            else:
                fact = Fact(r.n, r.text, "fatal", exc[0], "", "", [], r.tags[-1] if r.tags else None)
                out.facts.append(fact)
            fact.rule = "traceback (%s) ending in its exception line" % (
                "pytest short form" if pytest_form else "frames from line %d" % start if start != r.n else
                "exception line")
            fact.lines = sorted({start, r.n})
            if fact not in out.fatal:
                out.fatal.append(fact)
            causes.append(fact)
            continue
        if f is not None and f.kind == "fatal":
            f.rule = f.rule or "fatal format line"
            if f not in out.fatal:
                out.fatal.append(f)
            continue
        if f is None and ("EngineDeadError" in r.msg or "CUDA out of memory" in r.msg
                          or "torch.OutOfMemoryError" in r.msg):
            fact = Fact(r.n, r.text, "fatal", "engine_dead" if "EngineDead" in r.msg else "cuda_oom", "", "", [],
                        r.tags[-1] if r.tags else None)
            fact.rule = "fatal wording"
            out.facts.append(fact)
            out.fatal.append(fact)
    for key, start in open_tb.items():   # a traceback cut before its exception line
        r = next(x for x in recs if x.n == start and (x.tags, x.pid) == key)
        if r.level in ("WARNING", "WARN", "INFO", "DEBUG"):
            continue
        fact = Fact(r.n, r.text, "fatal", "traceback", "", "", [], r.tags[-1] if r.tags else None)
        fact.rule = "traceback without its exception line (the paste ends first)"
        out.facts.append(fact)
        out.fatal.append(fact)
    out.fatal.sort(key=lambda x: x.n)
    wrappers = markers["_fatal_wrappers"]
    cause = next((c for c in causes if not wrappers.search(c.text)), None) or (causes[0] if causes else None)
    if cause is None and out.fatal:
        cause = next((c for c in out.fatal if not wrappers.search(c.text)), out.fatal[0])
    if cause is not None:
        out.fatal_error = cause
        out.decided["fatal"] = Decision(cause.value, "the first fatal exception that is not a wrapper "
                                        "(%s)" % (cause.rule or "fatal line"), list(cause.lines or [cause.n]),
                                        cause.text)
