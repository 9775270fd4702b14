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
from typing import Any, Dict, List, Optional, Tuple

from mla_doctor.diagnosis.knowledge import load_data
from mla_doctor.diagnosis.log_life import (ABORT_START, ABORT_WHAT, KERNEL_OOM_KILL, KERNEL_OOM_REPORT, SIGNAL_DEATH,
                                           Death, announced, read_life)
from mla_doctor.diagnosis.log_names import Fact, backend_code_names, backend_name, display_names

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

_ENGINE_LINE = re.compile(r"^Initializing an? (?:(V[01]) )?LLM engine \(v")
_BACKEND_WORD = re.compile(r"\b(?:AttentionBackendEnum\.|_Backend\.)?([A-Z][A-Z0-9]{1,20}(?:_[A-Z0-9]{1,20}){0,6})\b")
_DOWNGRADE = re.compile(r"(?i:setting|overriding|fallback to|falling back to) cudagraph[_ ]mode"
                        r"(?: from \w{1,32})? ?(?:to |=)"
                        r"(FULL_AND_PIECEWISE|FULL_DECODE_ONLY|PIECEWISE|FULL|NONE)\b")
_ARCHS = re.compile(r"""\barchitectures['"]?\s{0,4}[=:]\s{0,4}\[['"](\w{1,80})['"]\]""")
_REJECTED_MODE = re.compile(r"\bCUDAGraphMode\.([A-Z_]{2,32}) is not supported\b")
_V0_WORKER_EXC = re.compile(r"^Exception in worker \S{1,128} while processing method \S{1,128}: (?P<msg>.*), Traceback "
                            r"\(most recent call last\):$")
_REPR_EXC = re.compile(r"^(?P<exc>[A-Z]\w{0,80}?(?:Error|Exception))\((?P<msg>.*)\)$")
_CAPTURE = re.compile(r"^Capturing CUDA graphs? \((?P<kind>mixed prefill-decode|uniform decode|decode|prefill)"
                      r", (?P<mode>PIECEWISE|FULL)\)")
_PROFILE = re.compile(r"^Profiling CUDA graph memory: ")
_PROFILE_MODE = re.compile(r"\b(PIECEWISE|FULL)=")
_TRACEBACK = re.compile(r"^(?:\+ |\| )?(?:Exception Group )?Traceback \(most recent call last\):")
_FRAME = re.compile(r"^(?:\| )?File \"[^\"]{1,1024}\", line \d{1,7}(?:, in \S{1,256})?")
_ASGI = re.compile(r"^Exception in ASGI application$")
_CHAINED = re.compile(r"^(?:During handling of the above exception|The above exception was the direct cause)")
_PYTEST = re.compile(r"^(?:E {1,16}(?=\S)|FAILED \S{1,512} - )")
_EXC_LINE = re.compile(r"^(?:\| )?(?P<exc>(?:[A-Za-z_]\w{0,63}\.){0,8}(?:[A-Z]\w{0,80}?"
                       r"(?:Error|Exception|Exit|Interrupt|Warning|Group|Timeout)|Exception))(?:: ?(?P<msg>.*))?$")
_CG_JSON = re.compile(r"""['"]?cudagraph_mode['"]?\s{0,4}[:=]\s{0,4}"""
                      r"""(<CUDAGraphMode\.(\w{1,32})[^>]{0,40}>|\[[\d,\s]{0,20}\]|\d{1,2}|'?"?([A-Z_]{1,32}))""")
_EAGER = re.compile(r"""(?<!\w)['"]?enforce_eager['"]?\s{0,4}[=:]\s{0,4}(True|False|true|false)(?![\w'"])""")
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
    text: str               # what a fact quotes: the pasted line, or the record when it was split / joined
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
    # one search a record before the per-marker ones (a 100,000-line log is mostly lines no marker names)
    data["_engine_any"] = _any(m["text"] for m in data["engine_markers"] if m["at"] in ("text", "message"))
    data["_sparse_any"] = _any(m["text"] for m in data["sparse_markers"])
    data["_statements"] = [(m["id"], m["engine"], re.compile(m["text"])) for m in data["engine_statements"]]
    for key in ("sparse_in_exception", "drafter_start", "drafter_where", "fatal_wrappers", "v1_files", "v0_files",
                "death_wording", "dsa_architectures", "architecture_line", "model_named", "dense_model_names",
                "model_module", "model_module_undecided"):
        data["_" + key] = re.compile(data[key])
    return data


def _any(patterns: Any) -> "re.Pattern[str]":
    def one(p: str) -> str:
        return "(?i:%s)" % p[4:].lstrip("^") if p.startswith("(?i)") else "(?:%s)" % p.lstrip("^")

    return re.compile("|".join(one(p) for p in patterns))


def cg_mode(raw: Optional[str]) -> Optional[str]:
    """A mode as a line prints it (``PIECEWISE``, ``CUDAGraphMode.FULL``, ``<CUDAGraphMode.NONE: 0>``, ``2``)
    as its name; None when it does not look like a mode."""
    if not raw:
        return None
    val = raw.strip().strip("'\"")
    m = re.match(r"^<?CUDAGraphMode\.([A-Z_]+)", val)
    if m:
        return m.group(1)
    val = _CG_VALUES.get(re.sub(r"\s+", "", val).replace(",", ", "), val)
    return val if re.match(r"^[A-Z][A-Z_]*$", val) else None


def _cg_value(raw: Optional[str]) -> Optional[str]:
    """cg_mode, and only the modes vLLM has."""
    val = cg_mode(raw)
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


@functools.lru_cache(maxsize=1)
def _engine_wording() -> Dict[str, Tuple[str, Tuple[str, ...]]]:
    """Selection formats only one engine prints (the knowledge's log entries: "Using Triton MLA backend." is V0's,
    V1 said "... on V1 engine." in the same releases), with the platform files the entries saw it in (ROCm's V1
    printed the V0 wording from rocm.py); a format the entries give two engines is left out."""
    from mla_doctor.diagnosis.knowledge import load_knowledge

    seen: Dict[str, set] = {}
    files: Dict[str, set] = {}
    for e in load_knowledge().data.get("logs") or []:
        if isinstance(e, dict) and e.get("format") and e.get("kind") == "decode_backend" \
                and not re.search(r"%|\{", e["format"]):
            seen.setdefault(str(e["format"]).strip(), set()).add(e.get("engine"))
            if e.get("file"):
                files.setdefault(str(e["format"]).strip(), set()).add(str(e["file"]).rsplit("/", 1)[-1])
    return {f: (next(iter(engines)), tuple(sorted(files.get(f, ())))) for f, engines in seen.items()
            if len(engines) == 1 and None not in engines}


def _worded(rec: Record, worded: Dict[str, Tuple[str, Tuple[str, ...]]]) -> Optional[str]:
    """The engine a backend line's wording implies, where the line was logged from the platform file the wording
    is known in (or does not say where)."""
    got = worded.get(rec.fact.format.strip()) if rec.fact is not None and rec.fact.format else None
    if got is None:
        return None
    where = (rec.where or "").rsplit("/", 1)[-1].split(":", 1)[0]
    return got[0] if not where or not got[1] or where in got[1] else None


def _release_without_sparse(version: str) -> bool:
    from mla_doctor.diagnosis.knowledge import load_knowledge

    base = re.match(r"v?(\d+\.\d+(?:\.\d+)?)", str(version).strip())
    if not base:
        return False
    try:
        facts = load_knowledge().for_version(base.group(1))
    except Exception:   # noqa: BLE001 - an unparseable version tells nothing
        return False
    return bool(getattr(facts, "known", False)) and getattr(facts, "sparse_mode", None) == "none"


def _backend_in(msg: str) -> Optional[str]:
    """The backend an encoder / indexer line names (its format states no placeholder for it)."""
    for m in _BACKEND_WORD.finditer(msg):
        name = backend_name(m.group(1))
        if name and ("ATTN" in name or "MLA" in name or name in ("FLASHINFER", "TORCH_SDPA", "XFORMERS")):
            return name
    um = re.search(r"\bUsing ([\w ./-]{2,40}?) (?:attention )?(?:backend|for )", msg)
    return backend_name(um.group(1)) if um else None


_NAMED_BACKEND = re.compile(r"\b(?:with|for)(?: attention)? backend ([A-Za-z][\w]{2,80})\b"
                            r"|\bwith ([A-Za-z][\w]{2,80}) backend\b")
_FRAME_FILE = re.compile(r"^File \"[^\"]{0,1024}?([\w]{1,80})\.py\"")


def _backend_elsewhere(out: Any, recs: List[Record], markers: dict) -> None:
    """No selection line: the backend a CUDA-graph check names as the one in use ("... not supported with
    FlashInferBackend backend"), else the backend whose own code raised the fatal exception (its module in the
    traceback's frames, its enum or display name opening the exception's message). A backend that validation
    rejected ("Selected backend X is not valid", "No valid attention backend") is never the model's."""
    modules = backend_code_names()[1]
    enums = set(modules.values()) | set(backend_code_names()[0].values()) | set(display_names().values())
    # only a display text that names an attention kernel ("Aiter MLA", "Torch SDPA"), never a bare "Triton"
    displays = sorted((d for d in display_names() if " " in d and re.search(r"(?i)MLA|SDPA|Attention", d)),
                      key=len, reverse=True)
    found = None
    for r in recs:
        if "not supported with" in r.msg or "is not supported for attention backend" in r.msg:
            m = _NAMED_BACKEND.search(r.msg)
            name = backend_name(m.group(1) or m.group(2)) if m else None
            if name and name in enums:
                found = (r, name, "the backend a CUDA-graph support check names as in use")
                break
    if found is None:
        frames: Dict[Any, List[Tuple[Record, str]]] = {}
        for r in recs:
            fm = _FRAME_FILE.match(r.msg)
            if fm and fm.group(1) in modules:
                frames.setdefault((r.tags, r.pid), []).append((r, modules[fm.group(1)]))
        by_n = {r.n: r for r in recs}
        fatal = [(by_n[f.n], _exception(by_n[f.n])) for f in out.fatal if f.n in by_n]
        for r, exc in fatal:   # the backend's enum name opens the exception: "FLASHINFER_MLA_SPARSE_DSV4 on SM120 ..."
            body = exc[1].split(": ", 1)[-1] if exc else ""
            first = re.match(r"[A-Z][A-Z0-9_]{2,80}\b", body)
            if first and (first.group() in enums or re.search(r"_(?:MLA|ATTN)|MLA_|SPARSE", first.group())) \
                    and " is not valid" not in body:
                found = (r, first.group(), "the backend its own exception names")
                break
        for r, exc in fatal if found is None else []:   # "Aiter MLA only supports 16 or 128 number of heads."
            body = exc[1].split(": ", 1)[-1].lower() if exc else ""
            disp = next((d for d in displays if body.startswith(d.lower() + " ")), None)
            if disp:
                found = (r, display_names()[disp], "the backend whose display name opens the fatal exception")
                break
        for r, exc in fatal if found is None else []:
            own = [x for x in frames.get((r.tags, r.pid), []) if x[0].n < r.n]
            if own and exc:
                found = (own[-1][0], own[-1][1], "the backend whose module the fatal traceback runs in")
                break
    if found is not None:
        r, name, rule = found
        fact = Fact(r.n, r.text, "attention_backend", name, "", "", [], r.tags[-1] if r.tags else None)
        fact.rule, fact.role = rule, "model"
        if rule.startswith("the backend a CUDA-graph"):   # a check of the backend in use: it was selected
            out.attention_backend = fact
            out.decided["attention_backend"] = Decision(name, rule, [r.n], r.text)
        else:   # only a crash names it: shown as the backend that crashed, never passed off as the selection
            fact.kind = "crashed_backend"
            out.crashed_backend = fact
            out.decided["crashed_backend"] = Decision(name, rule, [r.n], r.text)


@functools.lru_cache(maxsize=1)
def _logger_file_index() -> Tuple[Tuple[str, Tuple[str, ...]], ...]:
    """(file name, its paths) of every vLLM source file with a log format in the shipped releases."""
    import json

    try:
        with open(MARKERS_FILE.with_name("log_formats.json"), encoding="utf-8") as fh:
            paths = json.load(fh).get("files") or []
    except (OSError, ValueError):
        return ()
    by: Dict[str, set] = {}
    for p in paths:
        by.setdefault(str(p).rsplit("/", 1)[-1], set()).add(str(p))
    return tuple((k, tuple(sorted(v))) for k, v in by.items())


def _logger_files(markers: dict) -> Dict[str, str]:
    """Logger file name -> the engine whose files alone have that name, across the shipped releases (``engine.py``
    is only V0's engine/multiprocessing/engine.py; ``core_client.py`` only V1's); a name both have: absent."""
    out = {}
    for name, paths in _logger_file_index():
        if all(markers["_v1_files"].search(p) for p in paths):
            out[name] = "V1"
        elif all(markers["_v0_files"].search(p) for p in paths):
            out[name] = "V0"
    return out


def _engine_markers(rec: Record, markers: dict) -> List[Tuple[str, str]]:
    out = []
    texty = bool(markers["_engine_any"].search(rec.text))
    for mid, engine, on, rx in markers["_engine"]:
        if on in ("text", "message") and not texty:
            continue
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
    cut_line = None
    if engine_line is None:
        for r in recs:
            em = _ENGINE_LINE.match(r.msg)
            if em:
                cut_line = (r, em.group(1) or "V0")   # "Initializing an LLM engine (v0.4.2)": V0, before V1 existed
                break
    worded = _engine_wording()
    stated = next((r for r in recs if r.fact is not None and r.fact.kind == "attention_backend"
                   and (r.fact.engine or _worded(r, worded))), None)
    statements = [(n, mid, eng, cmd) for n, cmd in prompts for mid, eng, rx in markers["_statements"] if rx.search(cmd)]
    statements += [(r.n, mid, eng, r.text) for r in recs for mid, eng, rx in markers["_statements"]
                   if rx.search(r.msg)]
    statements.sort(key=lambda x: x[0])
    if engine_line is not None:
        out.engine, out.engine_line = engine_line.fact.engine, engine_line.fact
        decided["engine"] = Decision(out.engine, "engine line", [engine_line.n], engine_line.text)
    elif cut_line is not None:
        out.engine = cut_line[1]
        decided["engine"] = Decision(out.engine, "engine line (%s)" % (
            "read by its opening words: cut by the paste, or a release outside the formats"
            if "V" in cut_line[0].msg[:16] else "before V1 existed: 'an LLM engine' is V0's"),
            [cut_line[0].n], cut_line[0].text)
    elif stated is not None:
        out.engine = stated.fact.engine or _worded(stated, worded)
        decided["engine"] = Decision(out.engine, "backend line states the engine" if stated.fact.engine else
                                     "backend line in the engine's own wording (knowledge: %s only)" % out.engine,
                                     [stated.n], stated.text)
    elif statements:
        n, mid, eng, text = statements[-1]
        out.engine = eng
        decided["engine"] = Decision(eng, "engine statement: %s (the last one)" % mid, [n], text)
    else:
        votes: Dict[str, Dict[str, int]] = {}
        logger_files = _logger_files(markers)
        for r in recs:
            for mid, eng in _engine_markers(r, markers):
                votes.setdefault(eng, {}).setdefault(mid, r.n)
            eng = logger_files.get((r.where or "").rsplit("/", 1)[-1].split(":", 1)[0]) if r.where else None
            if eng:   # logged from a file only one engine has ([multiproc_executor.py:49] V1, [engine.py:506] V0)
                votes.setdefault(eng, {}).setdefault("logger_file_only_in_%s" % eng.lower(), r.n)
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
            if not f.value:
                f.value = _backend_in(r.msg)
            if not any((o.role, o.value) == (f.role, f.value) for o in out.other_backends):
                out.other_backends.append(f)   # every TP worker logs its own: one fact per (role, backend)
            continue
        if f.kind == "attention_backend":
            out.attention_backend = f
        else:
            out.prefill_backend = f
    # ---- fatal (before the backend fallbacks: a crashing backend is read from the fatal traceback)
    placed = _fatal(out, recs, markers)
    _unplaced(out, recs, placed)
    if out.attention_backend is None:
        _backend_elsewhere(out, recs, markers)
    for key, f in (("attention_backend", out.attention_backend), ("prefill_backend", out.prefill_backend)):
        if key in decided:
            continue
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
    _sparse(out, recs, markers, prompts)
    for key in ("engine", "attention_backend", "prefill_backend", "cudagraph_mode", "sparse"):
        if getattr(out, key) is None and key not in out.unknown:
            out.unknown[key] = LOOKED_FOR[key]


def _cudagraph(out: Any, recs: List[Record], prompts: List[Tuple[int, str]]) -> None:
    events: List[Dict[str, Any]] = []
    req: Optional[Decision] = None
    rejected: Optional[int] = None     # an exception rejected the requested mode: it never ran
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
        dm = _DOWNGRADE.search(r.msg) if kind not in ("fatal", "eager") else None
        if dm:
            rj = _REJECTED_MODE.search(r.msg)
            if rj and rj.group(1) in _MODES and req is None:   # "CUDAGraphMode.X is not supported ...; setting Y"
                req = Decision(rj.group(1), "requested: the mode the downgrade line rejects", [r.n], r.text)
            events.append({"value": dm.group(1), "rule": "downgrade / override line", "lines": [r.n],
                           "text": r.text[:300]})
            continue
        rj = _REJECTED_MODE.search(r.msg) if kind == "fatal" or _exception(r) else None
        if rj and rj.group(1) in _MODES:
            req = Decision(rj.group(1), "requested: the mode an exception rejects", [r.n], r.text)
            rejected = r.n
            continue
        if kind == "engine" or (kind not in ("cudagraph", "eager", "fatal") and (
                "compilation_config" in r.msg or "non-default args" in r.msg or "enforce_eager" in r.msg
                or "cudagraph_mode" in r.msg)):
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
            rj = _REJECTED_MODE.search(r.msg)
            if rj and rj.group(1) in _MODES and req is None:   # "CUDAGraphMode.X is not supported ...; setting Y"
                req = Decision(rj.group(1), "requested: the mode the downgrade line rejects", [r.n], r.text)
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
    elif req is not None and rejected is not None:
        out.unknown["cudagraph_mode"] = ("the requested mode %s was rejected (line %d) and no later line says what "
                                         "ran" % (req.value, rejected))
    elif req is not None:
        out.cudagraph_mode = req.value
        out.decided["cudagraph_mode"] = Decision(req.value, "as requested (no later downgrade, profiling or "
                                                 "capture line)", req.lines, req.text, seq)
    if out.cudagraph_mode == "NONE" and out.eager is None and req is not None and req.value == "NONE":
        out.eager = True
    if out.eager is None and out.cudagraph_mode and out.cudagraph_mode != "NONE":
        out.eager = False


def _sparse_by_module(recs: List[Record], markers: dict) -> Optional[Decision]:
    """Not sparse from the model's code the paste shows: a traceback frame in a model module of a family without
    DSA (model_executor/models/llama.py). Modules of DSA-capable families decide nothing."""
    for r in recs:
        mm = markers["_model_module"].match(r.msg)
        if mm and not markers["_model_module_undecided"].match(mm.group(1)):
            return Decision(False, "a frame in the model's module (%s.py): a family without sparse attention"
                            % mm.group(1), [r.n], r.text)
    return None


def _sparse_by_name(recs: List[Record], prompts: List[Tuple[int, str]], markers: dict) -> Optional[Decision]:
    """Not sparse from the model's NAME where a line states it (model='Qwen/Qwen2.5-3B', a shell prompt's
    ``vllm serve X``) in a family without DSA: the weakest evidence, read only where no line states the backend,
    the architecture, the release or the engine. A DSA-capable family (DeepSeek-V3.2/V4, GLM-5) decides nothing:
    whether the sparse path runs is for a line to say."""
    named = [(n, cmd) for n, cmd in prompts] + [(r.n, r.msg) for r in recs]
    for n, text in sorted(named, key=lambda x: x[0]):
        nm = markers["_model_named"].search(text)
        if nm is None:
            continue
        name = nm.group(1).rstrip(".").rstrip("/").rsplit("/", 1)[-1]
        if markers["_dense_model_names"].match(name):
            return Decision(False, "from the model's name: %s, a family without sparse attention (the name only, "
                            "by the tool's hand-kept list of families, knowledge/log_markers.yaml dense_model_names: "
                            "no line states the backend or the architecture)" % name, [n],
                            next((r.text for r in recs if r.n == n), text))
    return None


def _sparse(out: Any, recs: List[Record], markers: dict, prompts: Optional[List[Tuple[int, str]]] = None) -> None:
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
        for mid, value, rx in markers["_sparse"] if markers["_sparse_any"].search(r.msg) else ():
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
    if yes is None and no is None:
        for r in recs:
            am = markers["_architecture_line"].match(r.msg) or _ARCHS.search(r.msg)
            if am and not markers["_dsa_architectures"].match(am.group(1)):
                no = Decision(False, "the model's architecture (%s) has no sparse attention" % am.group(1), [r.n],
                              r.text)
                break
    if yes is None and no is None:
        no = _sparse_by_module(recs, markers)
    if yes is None and no is None:
        cb = out.crashed_backend
        if ab is not None and ab.value and ab.role in (None, "model") \
                and (ab.format or (ab.rule or "").startswith("the backend a CUDA-graph")):
            # a selection line, or a CUDA-graph check of the backend in use (it names the backend that runs)
            no = Decision(False, "the model's attention backend is dense (%s)" % ab.value, [ab.n], ab.text)
        elif ab is None and cb is not None and cb.value and "MLA" in cb.value and "SPARSE" not in cb.value.upper():
            # no selection line: the MLA layers were being built on the dense MLA backend whose own code raised
            no = Decision(False, "the MLA backend whose own code raised is dense (%s)" % cb.value, [cb.n], cb.text)
        elif out.version and _release_without_sparse(out.version):
            no = Decision(False, "the stated release (%s) has no sparse (DSA) attention path" % out.version,
                          [out.version_line] if out.version_line else [],
                          next((r.text for r in recs if r.n == out.version_line), ""))
        elif out.engine == "V0":
            d = out.decided.get("engine")
            no = Decision(False, "V0 engine: no sparse (DSA) attention path exists in V0",
                          list(d.lines) if d else [], d.text if d else "")
        else:
            no = _sparse_by_name(recs, prompts or [], markers)
    got = yes or no
    if got is not None:
        out.sparse = got.value
        out.decided["sparse"] = got
        out.sparse_lines = got.lines


def _unplaced(out: Any, recs: List[Record], placed: set) -> None:
    """The lines the header grammar could not place: no vLLM header, no process tag, no format matched, not part
    of a traceback or an abort. Counted and reported (never dropped silently): they are read as plain text."""
    after_warning = {b.n for a, b in zip(recs, recs[1:]) if a.level == "WARNING" and "Warning: " in a.msg}
    lines = [r for r in recs if r.msg and r.level is None and r.where is None and not r.tags and r.fact is None
             and r.n not in placed and r.n not in after_warning and not r.text[:1].isspace()]
    if lines:
        out.normalised["unplaced"] = {"count": len(lines), "lines": [r.n for r in lines[:10]],
                                      "example": lines[0].text[:160]}


def _fatal(out: Any, recs: List[Record], markers: dict) -> set:
    """Fatal lines, read by structure: a traceback block (a ``Traceback`` header, or frames only, up to its
    exception line, per process), a raised format, an exception logged at ERROR or printed bare on stderr, a
    C++ abort (``terminate called …`` and its ``what():``), a death by signal, a death message. Then the
    process-life model (``log_life``) decides the cause, which process died and whether a requested shutdown
    makes the errors after it teardown (not fatal). ``fatal_error``: the LAST exception that ended a process;
    ``fatal_cause``: the line that says WHY (never a wrapper when the paste holds the real cause). Returns the
    line numbers read as parts of a traceback or an abort (placed, for the unplaced-lines count)."""
    open_tb: Dict[Any, int] = {}          # process key -> first line of the traceback being read
    exceptions: List[Any] = []
    found: List[Death] = []
    placed: set = set()
    abort: Dict[Any, Death] = {}          # process key -> a "terminate called ..." waiting for its what()
    wrappers = markers["_fatal_wrappers"]
    in_fatal: set = set()                 # id() of the facts in out.fatal
    death_lines: set = set()              # line numbers of the failures found

    def add(r: Record, value: str, rule: str, start: int, fact: Any = None, kind: str = "exception") -> Any:
        if fact is None:
            fact = Fact(r.n, r.text, "fatal", value, "", "", [], r.tags[-1] if r.tags else None)
            out.facts.append(fact)
        fact.value = fact.value or value
        fact.rule = rule
        fact.lines = sorted({start, r.n})
        if id(fact) not in in_fatal:   # by identity: a dataclass's == compares every field (quadratic on big logs)
            in_fatal.add(id(fact))
            out.fatal.append(fact)
        found.append(Death(fact, start, (r.tags, r.pid), bool(wrappers.search(r.text)), kind))
        death_lines.add(r.n)
        return fact

    last_rec: Dict[Any, Record] = {}      # process key -> its previous record
    request_tb: set = set()               # process keys whose traceback is a request's error (ASGI)
    msg_start: Dict[int, Record] = {}     # line -> the first record of the multi-line message it continues
    for r in recs:
        key = (r.tags, r.pid)
        f = r.fact
        fatal_fmt = f is not None and f.kind == "fatal"
        quiet = r.level in ("WARNING", "WARN", "INFO", "DEBUG")
        if not _TRACEBACK.match(r.msg):
            before = last_rec.get(key)
            if before is not None and before.msg and r.msg and before.level == r.level and before.where == r.where \
                    and r.level in ("ERROR", "CRITICAL"):   # one logged message over several records
                msg_start[r.n] = msg_start.get(before.n, before)
            last_rec[key] = r
        if key in open_tb:
            placed.add(r.n)
        pending = abort.pop(key, None)
        if pending is not None:
            wm = ABORT_WHAT.match(r.msg)
            if wm:   # the C++ exception's message: the line that says why; the terminate line is its context
                out.fatal = [x for x in out.fatal if x is not pending.fact]
                out.facts = [x for x in out.facts if x is not pending.fact]
                in_fatal.discard(id(pending.fact))
                found.remove(pending)
                add(r, "abort", "C++ abort: terminate called, what() (line %d)" % pending.start, pending.start,
                    kind="abort")
                placed.add(r.n)
                continue
        if ABORT_START.match(r.msg) and not quiet:
            add(r, "abort", "C++ abort: terminate called", r.n, kind="abort")
            abort[key] = found[-1]
            placed.add(r.n)
            continue
        vw = _V0_WORKER_EXC.match(r.msg)
        if vw:   # V0's worker: "Exception in worker X while processing method m: <message>, Traceback (...)"
            open_tb[key] = r.n
            exceptions.append(add(r, vw.group("msg")[:200], "V0 worker exception wording", r.n))
            continue
        if _ASGI.match(r.msg):   # uvicorn: one request's handler raised; the server lives on
            request_tb.add(key)
            continue
        if r.level is not None and key in request_tb:
            request_tb.discard(key)
        if _TRACEBACK.match(r.msg):
            open_tb[key] = r.n
            placed.add(r.n)
            prev = last_rec.get(key)
            if prev is not None and r.level in ("ERROR", "CRITICAL") and prev.level == r.level \
                    and prev.n not in placed and prev.fact is None and prev.msg and not announced(prev.msg) \
                    and prev.n not in death_lines:
                prev = msg_start.get(prev.n, prev)   # a message of several lines: its first says what failed
                # logger.exception(msg): the ERROR line just before its traceback says what failed (the only
                # "why" when the paste cuts the traceback before its exception line)
                add(prev, "exception", "the ERROR line announcing the traceback at line %d" % r.n, prev.n,
                    kind="announce")
            last_rec[key] = r
            continue
        if _FRAME.match(r.msg):
            open_tb.setdefault(key, r.n)
            placed.add(r.n)
            continue
        if _CHAINED.match(r.msg):
            placed.add(r.n)
            continue
        exc = _exception(r)
        rep = _REPR_EXC.match(r.msg) if exc is None else None
        if rep:   # "RuntimeError('Engine loop has died')" logged before its traceback: it announces that exception
            if not quiet and (r.level in ("ERROR", "CRITICAL") or r.level is None):
                add(r, rep.group("exc"), "exception repr logged at %s" % (r.level or "no level"), r.n, kind="announce")
            continue
        if not quiet and r.level in ("ERROR", "CRITICAL", None) and announced(r.msg):
            add(r, "exception", "the line announcing a traceback", r.n, f if fatal_fmt else None, kind="announce")
            continue
        if exc is not None and not exc[0].endswith("Warning"):
            if r.msg.startswith("FAILED ") and exc[0] == "AssertionError":
                continue   # pytest's summary of the test's own assert: the test's verdict, not a process dying
            start = open_tb.pop(key, None)
            if start is not None and key in request_tb:   # a request's error, not a process's death
                placed.add(r.n)
                fact = Fact(r.n, r.text, "request_error", exc[0], "", "", [], r.tags[-1] if r.tags else None)
                fact.rule, fact.lines = "a request handler's exception (uvicorn's 'Exception in ASGI application')", \
                    [start, r.n]
                out.facts.append(fact)
                continue
            if start is not None or _PYTEST.match(r.msg):
                placed.add(r.n)
                if quiet and not fatal_fmt:
                    continue
                rule = ("pytest short form" if _PYTEST.match(r.msg) else
                        "traceback from line %d ending in its exception line" % start)
                exceptions.append(add(r, exc[0], rule, start if start is not None else r.n, f if fatal_fmt else None))
                continue
            if fatal_fmt or (not quiet and (r.level in ("ERROR", "CRITICAL") or r.level is None)):
                why = ("raised format" if fatal_fmt else "exception logged at %s" % r.level if r.level
                       else "uncaught exception printed on stderr")
                exceptions.append(add(r, exc[0], why, r.n, f if fatal_fmt else None))
                continue
        km = KERNEL_OOM_KILL.match(r.msg) if not quiet else None
        if km:   # the kernel's OOM killer (dmesg pasted with the log): one kill, however many lines report it
            placed.add(r.n)
            victim = int(km.group("pid") or km.group("pid2"))
            prior = next((d for d in found if d.victim == victim), None)
            if prior is None:
                add(r, "oom_kill", "the kernel's OOM killer killed pid %d (%s)" % (
                    victim, km.group("name") or km.group("task")), r.n, kind="oom")
                found[-1].victim = victim
            elif km.group("pid") and prior.fact.text.find("Killed process") < 0:
                # "Out of memory: Killed process N" says why in words; the "oom-kill:" summary before it is context
                prior.fact.n, prior.fact.text, prior.fact.lines = r.n, r.text, sorted({prior.start, r.n})
                death_lines.add(r.n)
            continue
        if KERNEL_OOM_REPORT.match(r.msg):
            placed.add(r.n)
            continue
        if not quiet and SIGNAL_DEATH.match(r.msg):
            placed.add(r.n)
            add(r, "signal", "death by signal", r.n, f, kind="signal")
            continue
        if fatal_fmt or r.level == "CRITICAL":   # vLLM logs CRITICAL only as a process gives up
            add(r, (f.value if f is not None else None) or "fatal",
                "fatal format line" if fatal_fmt else "logged at CRITICAL", r.n, f, kind="message")
            continue
        if (r.level in ("ERROR", "CRITICAL", None) or "unexpectedly" in r.msg and r.level in ("WARNING", "WARN")) \
                and markers["_death_wording"].search(r.msg):   # 0.32's "[shutdown] MPClient: engine core exited
            # unexpectedly" is a WARNING: the API server saw its engine core die
            add(r, "died", "death wording", r.n, f, kind="message")
            continue
        if f is None and ("EngineDeadError" in r.msg or "CUDA out of memory" in r.msg
                          or "torch.OutOfMemoryError" in r.msg) and not quiet:
            add(r, "engine_dead" if "EngineDead" in r.msg else "cuda_oom", "fatal wording", r.n,
                kind="message" if "EngineDead" in r.msg else "oom")
    at = {(x.n, x.tags, x.pid): x for x in recs} if open_tb else {}
    started = {e.n for e in exceptions}
    for key, start in open_tb.items():   # a traceback cut before its exception line: shown, not fatal
        r = at[(start,) + tuple(key)]
        if start in started:
            continue
        fact = Fact(r.n, r.text, "traceback", None, "", "", [], r.tags[-1] if r.tags else None)
        fact.rule = "traceback without its exception line (the paste ends first): not read as fatal"
        out.facts.append(fact)
        if r.level in ("ERROR", "CRITICAL", None) and key not in request_tb:   # a process printed its traceback:
            # it died, the paste cut why
            fact.rule = ("traceback %s without its exception line (the paste ends first): a death whose cause is "
                         "not in the paste" % ("logged at %s" % r.level if r.level else "printed on stderr"))
            found.append(Death(fact, r.n, key, False, "cut"))
    life = read_life(recs, found)
    out.life = life
    gone = {id(f) for f in life.teardown}
    out.fatal = [x for x in out.fatal if id(x) not in gone]
    for f in life.teardown:   # errors after a requested shutdown: the server going down, not a death
        f.kind, f.rule = "teardown", "after the requested shutdown (line %s): teardown, not a death (%s)" % (
            life.shutdown_line, f.rule)
    out.fatal.sort(key=lambda x: x.n)
    still = {id(x) for x in out.fatal}
    ended = sorted((d.fact for d in found if id(d.fact) in still and d.kind != "message"), key=lambda x: x.n) \
        or sorted((d.fact for d in found if id(d.fact) in still), key=lambda x: x.n)
    if ended:
        last = ended[-1]
        out.fatal_error = last
        out.fatal_cause = life.cause or last
        cause = out.fatal_cause
        out.decided["fatal"] = Decision(cause.value, "the line that says why: %s (%s)%s" % (
            "the first failure that is not a wrapper" if life.wrapper is not None or cause is not last
            else "the failure", cause.rule,
            "; wrapped as line %d" % life.wrapper.n if life.wrapper is not None else ""),
            list(cause.lines or [cause.n]), cause.text)
        out.decided["died"] = Decision(life.died, life.died_rule, list(cause.lines or [cause.n]), cause.text)
    if life.shutdown:
        out.decided["shutdown"] = Decision(True, "requested shutdown%s, before anything died" % (
            " (%s)" % life.shutdown_signal if life.shutdown_signal else ""),
            [life.shutdown_line] if life.shutdown_line else [], life.shutdown_text)
    return placed
