"""Live-evidence fixtures (tests/fixtures/evidence/*.yaml): cases a CPU server cannot show.

Log lines are never written by hand: an item names a log format id of the release's knowledge and
its arguments, and the loader renders ``format % args`` (or fills the f-string ``{expr}``
placeholders) behind the prefix that release prints. An id the release does not know is an error,
so a fixture cannot drift away from the knowledge. Crash lines name a knowledge ``fatal_patterns``
id and give the text, which must match that pattern.

Probe records may be compact: ``{role: prefill, layers: 2, q_rows: 300, repeat: 1}`` becomes one
``call`` record per layer (per step, per TP rank), with the function and class the probe would
report for that release and backend.

Schema (top level): name, description, version, backend (selected decode backend: record defaults),
gpu {name, compute_cap} | null, server {...}, model_config {...}, static {...}, method, settings,
configuration, expectations ("prefill=mha,..."), server_started, start_error, restored,
restore_detail, engine_process ("EngineCore_DP0 pid=77"), rank_processes {rank: "Worker_TP0 pid=101"},
log [items], armed [processes] | true, startup [compact records], prompts [{name, prompt_tokens,
max_tokens, completion_tokens, configuration, steps [compact records]}], expect {...}.
"""
from __future__ import annotations

import re
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from mla_doctor.diagnosis.evidence import LiveEvidence, PromptObservation
from mla_doctor.diagnosis.evidence_build import build_live_evidence, text_config
from mla_doctor.diagnosis.knowledge import LogFormat, ReleaseFacts, load_knowledge, parse_version
from mla_doctor.diagnosis.live_verdict import parse_expect

FIXTURES_DIR = Path(__file__).resolve().parent.parent / "fixtures" / "evidence"
_PLACEHOLDER = re.compile(r"\{([^{}]*)\}")
_PERCENT = re.compile(r"%%|%[-+ #0]*\d*(?:\.\d+)?[sdifrx]")
_PROC = re.compile(r"^\s*(?P<name>.+?)\s+pid=(?P<pid>\d+)\s*$")


class FixtureError(Exception):
    pass


@dataclass
class EvidenceFixture:
    name: str
    path: Path
    version: str
    facts: ReleaseFacts
    kwargs: dict[str, Any]
    expect: dict[str, Any] = field(default_factory=dict)
    description: str = ""


def fixture_paths() -> list[Path]:
    return sorted(FIXTURES_DIR.glob("*.yaml"))


# --------------------------------------------------------------------------- log lines

def log_format(facts: ReleaseFacts, fmt_id: str) -> LogFormat:
    found = [lf for lf in facts.logs if lf.id == fmt_id]
    if not found:
        known = ", ".join(sorted({lf.id for lf in facts.logs}))
        raise FixtureError(f"log format id {fmt_id!r} is not in the knowledge of vLLM {facts.version} "
                           f"(known there: {known})")
    return found[0]


def render_message(lf: LogFormat, args: Any = None, suffix: str = "") -> str:
    """``format % args`` for %-style formats; ``{expr}`` placeholders filled in order or by name."""
    args = [] if args is None else args
    fmt = lf.format
    if _PERCENT.search(fmt.replace("%%", "")) or "%%" in fmt:
        if isinstance(args, dict):
            raise FixtureError(f"{lf.id}: %-style format takes a list of args, not a mapping")
        try:
            msg = fmt % tuple(args)
        except (TypeError, ValueError) as e:
            raise FixtureError(f"{lf.id}: {fmt!r} % {args!r}: {e}") from e
    else:
        names = _PLACEHOLDER.findall(fmt)
        if isinstance(args, dict):
            missing = [n for n in names if n not in args]
            if missing:
                raise FixtureError(f"{lf.id}: no value for placeholder(s) {missing}")
            values = [args[n] for n in names]
        else:
            if len(args) != len(names):
                raise FixtureError(f"{lf.id}: {len(names)} placeholder(s) {names}, {len(args)} arg(s)")
            values = list(args)
        it = iter(values)
        msg = _PLACEHOLDER.sub(lambda m: str(next(it)), fmt)
    if suffix:
        if not lf.prefix:
            raise FixtureError(f"{lf.id}: a suffix is only allowed for formats that are the start of a message")
        msg += suffix
    if not lf.regex.match(msg):
        raise FixtureError(f"{lf.id}: rendered message does not match its own format: {msg!r}")
    return msg


def _proc_prefix(version, proc: str | None, color: bool) -> str:
    """The process prefix vLLM puts before a line: none before 0.8; given processes from 0.8."""
    if not proc or version is None or version < parse_version("0.8"):
        return ""
    text = f"({proc})"
    return (f"\x1b[1;36m{text}\x1b[0;0m " if color else text + " ")


def render_log_line(facts: ReleaseFacts, item: dict, n: int) -> str:
    """One log line, with the prefix the release prints (level, time, [file:line], process)."""
    version = parse_version(facts.version)
    ts = "%02d-%02d %02d:%02d:%02d" % (3, 14, 9, (n // 60) % 60, n % 60)
    if "fatal" in item:
        pats = dict(facts.fatal_patterns)
        fid = item["fatal"]
        if fid not in pats:
            raise FixtureError(f"fatal pattern id {fid!r} is not in the knowledge ({', '.join(pats)})")
        text = str(item.get("text") or "")
        if not re.search(pats[fid], text):
            raise FixtureError(f"fatal {fid}: {text!r} does not match {pats[fid]!r}")
        pre = _proc_prefix(version, item.get("proc"), bool(item.get("color")))
        # raw stderr: decorated with the process prefix only while decorate_logs wraps it (0.10.2-0.30)
        decorated = version is not None and parse_version("0.10.2") <= version < parse_version("0.31")
        return (pre if decorated else "") + text
    if "fmt" not in item:
        raise FixtureError(f"log item without fmt/fatal: {item!r} (log lines are rendered from the knowledge)")
    lf = log_format(facts, item["fmt"])
    msg = render_message(lf, item.get("args"), item.get("suffix", ""))
    level = item.get("level") or lf.level
    if lf.level == "DEBUG" and level != "DEBUG":
        raise FixtureError(f"{lf.id} is logged at DEBUG in vLLM, not {level}")
    fname = lf.file.rsplit("/", 1)[-1]
    line = item.get("line") or 40 + zlib.crc32(f"{lf.file}:{lf.id}".encode()) % 900
    if version is not None and version < parse_version("0.8"):
        return f"{level} {ts} {fname}:{line}] {msg}"  # <= 0.7: "%(filename)s:%(lineno)d]" with no "["
    return f"{_proc_prefix(version, item.get('proc'), bool(item.get('color')))}{level} {ts} [{fname}:{line}] {msg}"


def render_log(facts: ReleaseFacts, items: list[dict], default_proc: str | None = None) -> list[str]:
    out = []
    for n, item in enumerate(items or [], 1):
        if not isinstance(item, dict):
            raise FixtureError(f"log item {n} is not a mapping: {item!r} (hand-written lines are not allowed)")
        if default_proc and "proc" not in item:
            item = dict(item, proc=default_proc)
        out.append(render_log_line(facts, item, n))
    return out


# --------------------------------------------------------------------------- records

def _proc(text: str | None) -> tuple[str | None, int | None]:
    m = _PROC.match(text or "")
    return (m.group("name"), int(m.group("pid"))) if m else (text, None)


def _class_of(symbol: str | None) -> str | None:
    return symbol.rsplit(".", 1)[0] if symbol and "." in symbol else None


def default_target(facts: ReleaseFacts, role: str, backend: str | None) -> tuple[str | None, str | None]:
    """(function, class) the probe would report for ``role`` with ``backend`` in this release."""
    b = facts.backend(backend) if backend else None
    impl = _class_of(b.decode[0].symbol) if b else None
    if role == "decode" or role == "sparse":
        sym = b.decode[0].symbol if b else (facts.decode_common.symbol if facts.decode_common else None)
        return sym, _class_of(sym) if b else impl
    if role == "prefill":
        sym = (b.prefill.symbol if b and b.prefill else None) or (facts.prefill.symbol if facts.prefill else None)
        return sym, impl or _class_of(sym)
    if role == "dispatch":
        sym = facts.dispatch.symbol if facts.dispatch else None
        cls = "MLAAttention" if sym and sym.startswith("MLAAttention") else impl or _class_of(sym)
        return sym, cls
    if role == "builder":
        cls = impl.replace("Impl", "MetadataBuilder") if impl else "MLACommonMetadataBuilder"
        return "MLACommonMetadataBuilder.build", cls
    raise FixtureError(f"unknown role {role!r}")


def expand_records(facts: ReleaseFacts, item: dict, *, backend: str | None, num_layers: int,
                   engine_process: str | None, rank_processes: dict) -> list[dict]:
    role = item.get("role")
    if role not in ("prefill", "decode", "sparse", "dispatch", "builder"):
        raise FixtureError(f"record item role must be prefill/decode/sparse/dispatch/builder: {item!r}")
    function, cls = default_target(facts, role, item.get("backend", backend))
    function, cls = item.get("function", function), item.get("class", cls)
    layers = item.get("layers", num_layers)
    first = int(item.get("first_layer", 0))
    idxs = list(layers) if isinstance(layers, list) else list(range(first, first + int(layers)))
    ranks = item.get("tp_ranks", [0])
    out = []
    for _ in range(int(item.get("repeat", 1))):
        for rank in ranks:
            pname, pid = _proc(rank_processes.get(rank) or rank_processes.get(str(rank)) or engine_process)
            base = {"event": "call", "role": role, "function": function, "class": cls, "process": pname,
                    "pid": pid, "tp_rank": rank, "capturing": item.get("capturing"), "nested": False}
            tokens = dict(item.get("tokens") or {})
            if role == "builder":
                out.append(dict(base, layer=None, tokens=tokens))
                continue
            if "q_rows" in item:
                tokens["q_rows"] = item["q_rows"]
            for i in idxs:
                out.append(dict(base, layer=f"model.layers.{i}.self_attn.attn", tokens=dict(tokens)))
    return out


def _armed(spec: Any, engine_process: str | None, rank_processes: dict) -> list[dict]:
    if spec is True:
        procs = list(rank_processes.values()) or [engine_process]
    elif spec in (None, False):
        procs = []
    else:
        procs = list(spec)
    out = []
    for p in procs:
        name, pid = _proc(p)
        out.append({"event": "armed", "process": name, "comm": "python3", "pid": pid,
                    "python": "/opt/venv/bin/python3"})
    return out


# --------------------------------------------------------------------------- fixtures

def fixture_from_dict(doc: dict, path: Path | None = None) -> EvidenceFixture:
    kb = load_knowledge()
    version = str(doc.get("version") or "")
    facts = kb.for_version(version)
    if not facts.known:
        raise FixtureError(f"vLLM {version!r} is outside the knowledge")
    backend = doc.get("backend")
    if backend and facts.backend(backend) is None:
        raise FixtureError(f"backend {backend!r} does not exist in vLLM {version} (knowledge)")
    model_config = doc.get("model_config")
    n_layers = text_config(model_config).get("num_hidden_layers") or 1
    engine_process = doc.get("engine_process")
    rank_processes = doc.get("rank_processes") or {}
    log = render_log(facts, doc.get("log") or [], engine_process)

    def rec(items):
        out = []
        for it in items or []:
            out += expand_records(facts, it, backend=backend, num_layers=n_layers, engine_process=engine_process,
                                  rank_processes=rank_processes)
        return out

    armed = _armed(doc.get("armed", True), engine_process, rank_processes) + rec(doc.get("startup"))
    prompts = []
    for p in doc.get("prompts") or []:
        obs = PromptObservation(name=p["name"], prompt_tokens=int(p["prompt_tokens"]),
                                max_tokens=int(p.get("max_tokens", 1)), purpose=p.get("purpose", ""),
                                configuration=p.get("configuration", doc.get("configuration", "production")),
                                completion_tokens=p.get("completion_tokens"), error=p.get("error"),
                                foreign_traffic=p.get("foreign_traffic"))
        prompts.append((obs, rec(p.get("steps"))))
    expectations = doc.get("expectations")
    kwargs = dict(facts=facts, version=version, model_config=model_config, static=doc.get("static"),
                  server=doc.get("server"), gpu=doc.get("gpu"), log_lines=log, records_armed=armed,
                  prompts=prompts, configuration=doc.get("configuration", "production"),
                  settings=doc.get("settings"), method=doc.get("method", "patch"),
                  expectations=(dict(expectations) if isinstance(expectations, dict)
                                else parse_expect(expectations) if expectations else None),
                  server_started=doc.get("server_started", True), start_error=doc.get("start_error"),
                  restored=doc.get("restored", True), restore_detail=doc.get("restore_detail"))
    name = doc.get("name") or (path.stem if path else "inline")
    return EvidenceFixture(name=name, path=path or Path("<inline>"), version=version, facts=facts, kwargs=kwargs,
                           expect=doc.get("expect") or {}, description=doc.get("description", ""))


def load_fixture(path: Path | str) -> EvidenceFixture:
    path = Path(path)
    with open(path, encoding="utf-8") as f:
        doc = yaml.safe_load(f)
    if not isinstance(doc, dict):
        raise FixtureError(f"{path}: a fixture is a mapping")
    return fixture_from_dict(doc, path)


def build(fx: EvidenceFixture) -> LiveEvidence:
    return build_live_evidence(**fx.kwargs)
